"""The layout of a job: one checked value that holds every parallel degree.

`ParallelDims` is pure data (no torch), so the planner prices layouts with it and the
runtime builds its device mesh from it (`run.engine.parallelize.build_mesh`). Every other
part asks it — how many data-parallel ranks, which rank reads which samples, whether FSDP
shards, what the planner calls the layout — instead of comparing strategy words
(tests/unit/test_layout_words.py fails on such a comparison outside config/). Modelled on torchtitan's
`distributed/parallel_dims.py`: the product of the degrees is the world size.

The ranks are laid out row-major over (pp, dp_replicate, dp_shard, tp): a tensor-parallel
group is `tp` consecutive ranks (inside one machine), an FSDP shard group the next level
out, replicas next (one machine or more each), pipeline stages outermost (the slowest
links carry only activations between neighbouring stages).

The strategy words are read in this module only: the user's shortcuts
(`parallel.strategy` single, ddp, fsdp with `parallel.shard`, hsdp, auto) become a
`LayoutRequest` (what the job set-up asks before the world size is known) and then, on the
workers, a `ParallelDims` (`from_strategy`; `auto` resolves through the planner's chooser
first); the planner's row names (`PLAN_ROWS`, written once) become one with
`from_plan_name`.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING

from trainwise.errors import ConfigError

if TYPE_CHECKING:
    from trainwise.config.schema import ParallelConfig

# The planner's data-parallel layouts, simplest first (its rows, and the order its search
# breaks ties in): row name -> (parallel.strategy, parallel.shard, parallel.cpu_offload).
# The one list of them: the rows, the config's words and the search's order derive from it.
PLAN_ROWS = {
    "single": ("single", "full", False),
    "ddp": ("ddp", "full", False),
    "fsdp-grad-op": ("fsdp", "grad_op", False),
    "fsdp-full": ("fsdp", "full", False),
    "hsdp": ("hsdp", "full", False),
    "fsdp-offload": ("fsdp", "full", True),
}
PLAN_NAMES = tuple(PLAN_ROWS)
# The user's shortcuts (parallel.strategy); the planner's other row names are accepted too,
# as fsdp with their options.
SHORTCUTS = ("auto", "single", "ddp", "fsdp", "hsdp")
ALIASES = {name: row for name, row in PLAN_ROWS.items() if name not in SHORTCUTS}
STRATEGY_WORDS = (*SHORTCUTS, *sorted(ALIASES))


def read_strategy(
    word: str, shard: str | None = None, cpu_offload: bool | None = None
) -> tuple[str, str | None, bool | None]:
    """A strategy word as (shortcut, parallel.shard, parallel.cpu_offload): a row name
    (fsdp-full, ...) sets the two options, which must then agree with those given (None:
    not given). The one place the words are read."""
    if word not in ALIASES:
        return word, shard, cpu_offload
    kind, its_shard, its_offload = ALIASES[word]
    if shard not in (None, its_shard) or cpu_offload not in (None, its_offload):
        given = f"parallel.shard = '{shard}'" if shard not in (None, its_shard) else (
            f"parallel.cpu_offload = {str(cpu_offload).lower()}"
        )
        raise ConfigError(
            f"strategy '{word}' is fsdp with parallel.shard = '{its_shard}' and "
            f"parallel.cpu_offload = {str(its_offload).lower()}, but {given}: remove one, or "
            f"use 'fsdp' with the options"
        )
    return kind, its_shard, its_offload


def plan_name(word: str, shard: str = "full", cpu_offload: bool = False) -> str | None:
    """The planner's row name of a strategy word (None for auto): fsdp with grad_op is
    fsdp-grad-op, with offload fsdp-offload."""
    kind, shard_, offload = read_strategy(word)
    if kind == "auto":
        return None
    if kind != "fsdp":
        return kind
    if offload if offload is not None else cpu_offload:
        return "fsdp-offload"
    return "fsdp-grad-op" if (shard_ or shard) == "grad_op" else "fsdp-full"


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of one job. `fsdp` says whether the data-parallel dims are sharded by FSDP2
    (fully_shard) or replicated by DDP; `reshard_after_forward` (FSDP's ZeRO-3 versus
    ZeRO-2) and `cpu_offload` are FSDP's options. `pp` is the number of pipeline stages
    (outermost in the mesh); `cp` is reserved: context parallelism is not supported yet
    and must be 1. `ep` (expert parallelism, a Mixture-of-Experts model's) is borrowed
    from the data-parallel ranks, as torchtitan borrows it: each group of `ep` of them
    holds the experts split `ep` ways and exchanges tokens by all-to-all, the rest of the
    data parallelism (dp_size / ep) replicating or sharding each slice (`expert_dims`); it
    adds no ranks to the world. Under tensor parallelism each tp rank routes 1 / tp of
    its group's tokens (models.moe.parallel), so the MoE layer sees dp_size x tp ranks of
    different tokens (`expert_ranks`) and ep is borrowed from them all, tp innermost
    (Megatron's expert group over tp x dp; torchtitan's "ETP 1"): the rule is that ep
    divides dp_size x tp, and an ep that crosses shard groups or replicas is run with the
    experts replicated beside it (`expert_dims`: the one statement of that split).

    Under pipeline stages (pp > 1) FSDP keeps each stage's parameters gathered through the
    step, whatever `reshard_after_forward` asked (`__post_init__` sets it False: the one
    place this rule lives), as torchtitan's default reshard_after_forward_policy does with
    pp ("to avoid per-microbatch all-gathers"): every schedule runs a stage's micro-batches
    one after another, and pipelining's backward_maybe_with_nosync keeps the parameters
    gathered after each backward but the last, so resharding after forward would gather
    once more per micro-batch; torch's zero-bubble weight pass, moreover, finds the
    weights in the autograd graph and misses resharded ones' gradients. The run, the
    planner's comm, compute and memory and the layout's names all read this one value."""

    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    fsdp: bool = False
    reshard_after_forward: bool = True
    cpu_offload: bool = False

    def __post_init__(self) -> None:
        if self.stages_gathered and self.reshard_after_forward:
            object.__setattr__(self, "reshard_after_forward", False)
        problems = [
            f"parallel.{name} = {value}: a degree is a whole number >= 1"
            for name, value in self.degrees().items()
            if not isinstance(value, int) or value < 1
        ]
        problems += [
            f"parallel.{name} = {getattr(self, name)}: not supported yet; use 1"
            for name in ("cp",)
            if getattr(self, name) != 1
        ]
        if self.cpu_offload and not self.fsdp:
            problems.append("parallel.cpu_offload = true needs FSDP: use 'fsdp' or 'hsdp'")
        if not self.fsdp and self.dp_shard > 1:
            problems.append(f"parallel.dp_shard = {self.dp_shard} needs FSDP (sharding)")
        if isinstance(self.ep, int) and self.ep > 1 and self.expert_ranks % self.ep:
            problems.append(
                f"parallel.ep = {self.ep} does not divide the {self.expert_ranks} data- and "
                "tensor-parallel ranks it is borrowed from (world / pp): choose a divisor of them"
            )
        elif isinstance(self.ep, int) and not self.experts_summed(self.ep):
            problems.append(
                f"parallel.ep = {self.ep} leaves the experts replicated over tp / ep ranks "
                "with no data-parallel wrapper to sum their gradients: use ep = tp, ep = 1, "
                "or 'fsdp'"
            )
        if problems:
            raise ConfigError(problems)

    # -- sizes ------------------------------------------------------------------------

    def degrees(self) -> dict[str, int]:
        return {
            "dp_replicate": self.dp_replicate, "dp_shard": self.dp_shard, "tp": self.tp,
            "pp": self.pp, "cp": self.cp, "ep": self.ep,
        }

    @property
    def world(self) -> int:
        """Ranks in all (ep is borrowed from the data-parallel ones: it adds none)."""
        return self.dp_replicate * self.dp_shard * self.tp * self.pp * self.cp

    @property
    def dp_size(self) -> int:
        """Ranks that read different samples (each tensor-parallel group reads the same)."""
        return self.dp_replicate * self.dp_shard

    @property
    def expert_ranks(self) -> int:
        """The ranks of one pipeline stage, over which the MoE layer's tokens are split
        (each tensor-parallel rank routes 1 / tp of its group's: models.moe.parallel) and
        the experts' ep groups are borrowed from: dp_size x tp."""
        return self.dp_size * self.tp

    def experts_summed(self, ep: int) -> bool:
        """Whether something sums the gradients of routed experts split `ep` ways: each
        slice replicated over expert_ranks / ep ranks of different tokens needs a
        data-parallel wrapper (FSDP, or DDP's replicas) to sum them; a tp group alone has
        none (ep 1 and ep = tp need none: the slices' tp replicas are summed by DTensor)."""
        return ep in (1, self.expert_ranks) or self.fsdp or self.dp_size > 1

    def expert_dims(self) -> tuple[int, int]:
        """The routed experts' own data parallelism beside `ep`: (replicas, shards), with
        replicas x shards x ep = expert_ranks (dp_size x tp: every rank of a stage routes
        its own tokens). Under FSDP with ep dividing dp_shard x tp, each ep group is ep
        consecutive ranks of a shard group's ranks (tp innermost), and each slice of the
        experts is sharded over the dp_shard x tp / ep ranks that hold it (torchtitan's
        efsdp: ep apart) and replicated over the replica groups; otherwise (DDP's
        replicas, or ep spanning shard groups) every slice is replicated over
        expert_ranks / ep ranks."""
        if self.fsdp and (self.dp_shard * self.tp) % self.ep == 0:
            return self.dp_replicate, self.dp_shard * self.tp // self.ep
        return self.expert_ranks // self.ep, 1

    # -- what it is -------------------------------------------------------------------

    @property
    def single(self) -> bool:
        """One process, no wrapper at all."""
        return self.world == 1 and not self.fsdp

    @property
    def hybrid(self) -> bool:
        """FSDP shard groups replicated across `dp_replicate` groups (HSDP)."""
        return self.fsdp and self.dp_replicate > 1

    @property
    def strategy(self) -> str:
        """The user's shortcut for the data-parallel part: single, ddp, fsdp or hsdp."""
        if self.fsdp:
            return "hsdp" if self.hybrid else "fsdp"
        return "ddp" if self.dp_size > 1 else "single"

    @property
    def name(self) -> str:
        """The layout as people read it (the run's reason line, summary, report, doctor,
        checkpoint listing): the shortcut alone when that is the whole layout (single,
        ddp, fsdp, hsdp); with pipeline stages or tensor parallelism each part there is,
        outermost first, with its degree: `pp 2 x fsdp 2`, `fsdp 2 x tp 2`, `pp 2` (one
        data-parallel rank). Replicas alone there (FSDP2's replication, dp_shard 1, which
        `runnable` gives ddp under tp or pp) read as ddp: what they do. `strategy` names
        the data-parallel part only; code decides on the degrees, never on this name."""
        if self.pp == 1 and self.tp == 1 and self.ep == 1:
            return self.strategy
        parts = [f"pp {self.pp}"] if self.pp > 1 else []
        if self.dp_size > 1:
            word = "ddp" if self.dp_shard == 1 else self.strategy
            parts.append(f"{word} {self.dp_size}")
        if self.tp > 1:
            parts.append(f"tp {self.tp}")
        if self.ep > 1:
            parts.append(f"ep {self.ep}")
        return " x ".join(parts)

    @property
    def stages_gathered(self) -> bool:
        """Whether FSDP keeps pipeline stages' parameters gathered through the step
        (pp > 1 under FSDP: the class's rule), so that parallel.shard = 'full' runs as
        'grad_op'."""
        return isinstance(self.pp, int) and self.pp > 1 and self.fsdp

    def shard_note(self, shard: str) -> str:
        """What parallel.shard = `shard` means in this layout, when it is not what it says
        (full under pipeline stages); empty otherwise."""
        if shard != "full" or not self.stages_gathered or self.dp_shard == 1:
            return ""
        return (
            "Under pipeline stages parallel.shard = 'full' keeps each stage's parameters "
            "gathered from its first forward to its last backward (torchtitan's default "
            "with pp): priced and run as grad_op"
        )

    @property
    def shard(self) -> str:
        """parallel.shard's word for reshard_after_forward."""
        return "full" if self.reshard_after_forward else "grad_op"

    @property
    def plan_name(self) -> str:
        """The planner's name of the data-parallel layout (its rows and records)."""
        if not self.fsdp:
            return self.strategy
        if self.cpu_offload:
            return "fsdp-offload"
        if self.hybrid:
            return "hsdp"
        return "fsdp-full" if self.reshard_after_forward else "fsdp-grad-op"

    def mesh_dims(self) -> tuple[tuple[str, ...], tuple[int, ...]]:
        """Names and sizes of the device mesh: pp when used (outermost: a stage's ranks are
        one block of consecutive ranks, so stages may be whole machines), the data-parallel
        dims FSDP shards over (a 2-D (dp_replicate, dp_shard) mesh for HSDP), then tp."""
        names: list[str] = []
        sizes: list[int] = []
        if self.pp > 1:
            names.append("pp")
            sizes.append(self.pp)
        if self.hybrid:
            names.append("dp_replicate")
            sizes.append(self.dp_replicate)
        if self.fsdp:
            names.append("dp_shard")
            sizes.append(self.dp_shard)
        elif self.dp_replicate > 1:
            names.append("dp_replicate")
            sizes.append(self.dp_replicate)
        if self.tp > 1:
            names.append("tp")
            sizes.append(self.tp)
        return tuple(names), tuple(sizes)

    def regathered_blocks(self, blocks: int) -> int:
        """How many of a model's `blocks` FSDP block units free their gathered parameters
        after forward and gather them again for backward: all but the last under
        reshard_after_forward, none without it (grad_op, pipeline stages). Backward begins
        with the last block, which FSDP would gather again at once, so it stays gathered
        (torchtitan's default reshard_after_forward_policy); the root unit never reshards
        after forward either. The run (run.engine.parallelize) and the planner's comm and
        memory read this one rule."""
        return max(0, blocks - 1) if self.reshard_after_forward else 0

    def accumulates_sharded(self, accumulate: str, grad_accum: int) -> bool:
        """Whether gradients are reduce-scattered after every micro-batch (FSDP keeps only
        sharded gradients) rather than once per step (full gradients kept in between).
        `parallel.accumulate` sharded / unsharded decide; auto: sharded when FSDP shards
        parameters after forward (ZeRO-3: memory is what the layout was chosen for) over
        more than one rank and the step accumulates; unsharded otherwise (ZeRO-2 keeps
        full parameters anyway, and one reduce-scatter per step moves less)."""
        if not self.fsdp or grad_accum == 1:
            return False
        if accumulate != "auto":
            return accumulate == "sharded"
        return self.reshard_after_forward and self.dp_shard > 1

    def runnable(self) -> ParallelDims:
        """The layout the runtime builds: DDP cannot hold DTensor shards (tensor- or
        expert-parallel ones), and its reducer does not follow a pipeline schedule's
        micro-batches, so replicas of a tensor-parallel, expert-parallel or pipelined
        model are FSDP2's replication (dp_shard 1) on the same mesh, with the same memory
        and an all-reduce of the same bytes."""
        split = self.tp > 1 or self.pp > 1 or self.ep > 1
        if split and self.dp_replicate > 1 and not self.fsdp:
            return ParallelDims(self.dp_replicate, 1, self.tp, self.pp, ep=self.ep, fsdp=True)
        return self

    def describe(self) -> str:
        """`dp_replicate 2 x dp_shard 4 x tp 1` (`pp 4 x ...` with pipeline stages, `... x
        ep 2` with experts split), as the summary and plan.json name it."""
        stages = f"pp {self.pp} x " if self.pp > 1 else ""
        experts = f" x ep {self.ep}" if self.ep > 1 else ""
        return (
            f"{stages}dp_replicate {self.dp_replicate} x dp_shard {self.dp_shard} x tp {self.tp}"
            f"{experts}"
        )

    def config_keys(self) -> dict[str, object]:
        """The config keys that run this layout, as a user writes them."""
        keys: dict[str, object] = {"parallel.strategy": self.strategy}
        if self.fsdp and not self.reshard_after_forward:
            keys["parallel.shard"] = "grad_op"
        if self.cpu_offload:
            keys["parallel.cpu_offload"] = True
        if self.hybrid:
            keys["parallel.replicate"] = self.dp_replicate
        if self.tp > 1:
            keys["parallel.tp"] = self.tp
        if self.pp > 1:
            keys["parallel.pp"] = self.pp
        if self.ep > 1:
            keys["parallel.ep"] = self.ep
        return keys

    # -- from the user's words -------------------------------------------------------

    @classmethod
    def from_strategy(
        cls,
        strategy: str,
        world: int,
        *,
        replicate: int | None = None,
        shard: str = "full",
        cpu_offload: bool = False,
        tp: int = 1,
        pp: int = 1,
        ep: int = 1,
    ) -> ParallelDims:
        """The layout of a resolved shortcut on `world` workers (`replicate`: hsdp's
        replica groups), with `tp`-way tensor parallelism inside each data-parallel rank,
        `pp` pipeline stages around them and the experts split `ep` ways over the
        data-parallel ranks. With tp > 1 the data-parallel part is always
        FSDP2 (DDP cannot hold DTensor shards): ddp becomes FSDP's replication (dp_shard =
        1) on the same mesh."""
        if world % (tp * pp):
            raise ConfigError(
                f"parallel.tp x parallel.pp = {tp} x {pp} does not divide the {world} workers: "
                "choose degrees whose product divides cluster.nproc x cluster.nodes"
            )
        dp = world // (tp * pp)
        if strategy == "single":
            return cls(tp=tp, pp=pp, ep=ep)
        if strategy == "ddp":
            return cls(dp_replicate=dp, tp=tp, pp=pp, ep=ep).runnable()
        if strategy not in ("fsdp", "hsdp"):
            raise ConfigError(f"parallel.strategy = '{strategy}' has no layout; resolve auto first")
        groups = (replicate or 1) if strategy == "hsdp" else 1
        if dp % groups:
            raise ConfigError(
                f"parallel.replicate = {groups} does not divide the {dp} data-parallel ranks "
                "(workers / (tp x pp)): choose a divisor of cluster.nproc x cluster.nodes / "
                "(tp x pp)"
            )
        return cls(
            dp_replicate=groups, dp_shard=dp // groups, tp=tp, pp=pp, ep=ep, fsdp=True,
            reshard_after_forward=shard == "full", cpu_offload=cpu_offload,
        )

    @classmethod
    def from_plan_name(cls, name: str, world: int, gpus_per_node: int) -> ParallelDims:
        """The layout of one of the planner's data-parallel rows (PLAN_ROWS) on `world`
        GPUs: single on one whatever the world; hsdp replicates across nodes with one
        shard group per node."""
        kind, shard, offload = PLAN_ROWS[name]
        if kind == "single":
            return cls()
        replicate = max(1, world // gpus_per_node) if kind == "hsdp" else None
        return cls.from_strategy(kind, world, replicate=replicate, shard=shard, cpu_offload=offload)


@cache
def row_layout(name: str) -> ParallelDims:
    """What kind of layout the planner's row `name` is, asked before it has a world size:
    the row on a mesh of 2 nodes x 2 GPUs (single on one)."""
    return ParallelDims.from_plan_name(name, 4, 2)


@dataclass(frozen=True)
class LayoutRequest:
    """parallel.* as a job sets it, before the world size is known: the shortcut (a row
    name already read into its options, config.schema), FSDP's options and the degrees
    given. The job set-up and the planner's constraints ask it their questions; `layout`
    resolves it on the workers."""

    strategy: str = "auto"
    shard: str = "full"
    cpu_offload: bool = False
    tp: int = 1
    replicate: int | None = None
    dp_shard: int | None = None
    pp: int = 1
    ep: int = 1

    @classmethod
    def of(cls, p: ParallelConfig) -> LayoutRequest:
        """The request of the job's parallel.* section."""
        return cls(
            p.strategy, p.shard, p.cpu_offload, p.tp, p.replicate, p.dp_shard, p.pp, p.ep
        )

    @property
    def auto(self) -> bool:
        """The planner's chooser decides the layout."""
        return self.strategy == "auto"

    @property
    def single(self) -> bool:
        """One worker, no wrapper."""
        return self.strategy == "single"

    @property
    def sharded(self) -> bool:
        """FSDP, as asked (fsdp or hsdp; auto may choose it too)."""
        return self.strategy in ("fsdp", "hsdp")

    @property
    def may_shard(self) -> bool:
        """Whether a shard group (parallel.dp_shard) applies: fsdp, hsdp or auto."""
        return self.sharded or self.auto

    def replica_groups(self, world: int, nodes: int) -> int:
        """HSDP's replica groups on `world` workers over `nodes` machines:
        parallel.replicate, else world / (parallel.dp_shard x tp) when the shard group is
        given, else one per machine for hsdp (one group of the whole world would be fsdp);
        1 for the other strategies."""
        if self.replicate:
            return self.replicate
        if self.dp_shard and self.may_shard:
            return max(1, world // (self.dp_shard * self.tp * self.pp))
        return nodes if self.strategy == "hsdp" else 1

    def kind(self, replicate: int) -> str:
        """The shortcut that runs with `replicate` replica groups: fsdp over shard groups
        smaller than the world is hsdp."""
        return "hsdp" if self.strategy == "fsdp" and replicate > 1 else self.strategy

    def layout(self, world: int, replicate: int) -> ParallelDims:
        """The layout an explicit strategy runs on `world` workers in `replicate` replica
        groups (auto has none before the planner chooses: ConfigError)."""
        return ParallelDims.from_strategy(
            self.kind(replicate), world, replicate=replicate, shard=self.shard,
            cpu_offload=self.cpu_offload, tp=self.tp, pp=self.pp, ep=self.ep,
        )
