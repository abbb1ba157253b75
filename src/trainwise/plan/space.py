"""The configurations the planner's search may choose from: layouts (dp_replicate x
dp_shard x tp, FSDP's options) and knobs (activation checkpointing, micro-batch,
accumulation), and what a caller allows of them (`Allowed`: everything the planner can
price, or what the runtime can run today).

The space is enumerated per layout; the knobs are searched inside one (plan.search), where
dominated options are pruned: at a fixed layout, checkpointing mode and accumulation mode,
a larger micro-batch is never slower (the same compute, fewer gathers and host copies, a
longer window to hide the reductions), so only the largest that fits is priced.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from trainwise.config.parallel_dims import ParallelDims
from trainwise.models.moe.shapes import moe_tp_problems
from trainwise.models.stage_split import SCHEDULE_VIRTUAL, stage_blocks
from trainwise.plan.inputs import PlanInputs

# Checkpointing modes, simplest first (a tie within plan.search's SIMPLER_WITHIN goes to
# the earlier): none; the whole-block wrappers, every other block then every block;
# selective-op's per-operation policy.
AC_MODES = ("none", "selective", "full", "selective-op")


@dataclass(frozen=True)
class Allowed:
    """What the search may vary. `knobs`: the micro-batch and activation checkpointing
    (else the job's own); `tp`: tensor-parallel layouts; `sharded_accumulation`:
    reduce-scattering every micro-batch; `offload`: FSDP's CPU offload (never on CPU
    workers, whatever this says). The runtime runs all of it: `auto` narrows it only by
    the job's own choices below."""

    tp: bool = True
    sharded_accumulation: bool = True
    knobs: bool = True
    offload: bool = True
    # The job's own choices the runtime keeps (None: free): FSDP's resharding after forward
    # (parallel.shard) and the shard group's size (parallel.dp_shard / replicate).
    reshard_after_forward: bool | None = None
    shard_group: int | None = None
    # The tensor-parallel degree (parallel.tp): the job keeps it, as it sets how many ranks
    # read different samples and so the samples per step.
    tp_degree: int | None = None
    # Pipeline stages (parallel.pp and its schedule, virtual stages and micro-batches): the
    # job keeps those it sets; `max_pp` bounds the degrees searched (plan.max_pp; 1: none;
    # None: every degree that splits the blocks, plan.pipeline_search prices what can win).
    max_pp: int | None = None
    pp_degree: int | None = None
    pp_schedule: str | None = None
    pp_virtual: int | None = None
    pp_microbatches: int | None = None
    # The expert-parallel degree (parallel.ep) of a Mixture-of-Experts model: the job's
    # when it sets one, else searched (expert_degrees).
    ep_degree: int | None = None
    accumulate: str | None = None  # parallel.accumulate when sharded / unsharded
    # What the user set (None: searched; plan.constraints.user_allowed fills them): the
    # data-parallel shortcut (ParallelDims.strategy: single, ddp, fsdp, hsdp), cpu offload,
    # hsdp's replica groups, checkpointing, the micro-batch and the accumulation steps.
    strategy: str | None = None
    cpu_offload: bool | None = None
    replicas: int | None = None
    ac: str | None = None
    micro_batch: int | None = None
    grad_accum: int | None = None
    # The settings above as the user wrote them: (the fields one setting fixes, its words),
    # for saying which one a configuration that fits would relax.
    given: tuple[tuple[tuple[str, ...], str], ...] = ()


EVERYTHING = Allowed()


def tp_degrees(inputs: PlanInputs, allowed: Allowed) -> list[int]:
    """Tensor-parallel degrees: divisors of the heads (and key/value heads), of the GPUs
    a node holds and of the GPUs; 1 alone for a model without a shape or a user's module
    without a tensor-parallel plan."""
    w = inputs.workload
    shape, profile = w.shape or w.moe, w.profile
    if allowed.tp_degree is not None:
        return [allowed.tp_degree]  # checked against the model by the job
    if not allowed.tp or shape is None or (profile is not None and not profile.tp_plan):
        return [1]
    limit = math.gcd(shape.n_head, shape.n_kv_head, inputs.gpus_per_node, inputs.gpus)
    if w.moe is not None:  # and its vocabulary, dense and shared FFNs (the runtime's rule)
        return [t for t in divisors(limit) if not moe_tp_problems(w.moe, t, w.seq_len, False)]
    return divisors(limit)


def pp_degrees(inputs: PlanInputs, allowed: Allowed, tp: int) -> list[int]:
    """Pipeline degrees: the job's; else 1 and every divisor of the GPUs over tp (up to
    allowed.max_pp when set) whose stages split the model's blocks for some schedule
    (pipeline.stage_blocks: a block a stage at least); 1 alone for a model without a shape
    (a bare count, a Mixture-of-Experts model: neither is priced by stage) or one the
    runtime cannot cut (a user's module: models.pipeline cuts trainwise's GPT)."""
    if allowed.pp_degree is not None:
        return [allowed.pp_degree]
    shape, profile = inputs.workload.shape or inputs.workload.moe, inputs.workload.profile
    if allowed.max_pp == 1 or shape is None or (profile is not None and not profile.stages):
        return [1]
    limit = allowed.max_pp or inputs.gpus
    return [1] + [
        p for p in divisors(inputs.gpus // tp)[1:]
        if p <= limit and virtual_degrees(shape.n_layer, p)
    ]


def expert_degrees(inputs: PlanInputs, dims: ParallelDims, allowed: Allowed) -> list[int]:
    """Expert-parallel degrees of a layout of a Mixture-of-Experts model: the job's, else
    every divisor of its experts that the ranks it is borrowed from divide (the runtime's
    rule, ParallelDims.expert_dims: FSDP's shard group with its tensor-parallel ranks, or
    a stage's data- and tensor-parallel ranks without one), those the runtime refuses
    left out; 1 for a dense model."""
    moe = inputs.workload.moe
    if moe is None:
        return [1]
    sharded = dims.fsdp and dims.dp_shard > 1
    ranks = dims.dp_shard * dims.tp if sharded else dims.expert_ranks
    found = [ep for ep in divisors(math.gcd(moe.moe.experts, ranks))
             if dims.experts_summed(ep)]
    if allowed.ep_degree is not None:
        return [allowed.ep_degree] if allowed.ep_degree in found else []
    return found


def virtual_degrees(n_layer: int, p: int) -> list[int]:
    """Virtual stages per rank that split `n_layer` blocks over p ranks (1 included)."""
    return [v for v in range(1, n_layer // p + 2) if stage_blocks(n_layer, p * v) is not None]


def pipeline_runs(n_layer: int, p: int, v: int) -> bool:
    return stage_blocks(n_layer, p * v) is not None


# The schedules the search weighs, simplest first: GPipe is left to the user (1F1B's
# bubble with all m micro-batches in flight), as is Interleaved1F1B, whose bubble
# InterleavedZeroBubble shrinks at the same memory (plan.model.pipeline).
SEARCHED_SCHEDULES = ("1F1B", "InterleavedZeroBubble", "ZBVZeroBubble")
SCHEDULE_ORDER = ("1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble", "GPipe")


def schedules(inputs: PlanInputs, dims: ParallelDims, allowed: Allowed) -> list[tuple[str, int]]:
    """(schedule, virtual stages per rank) for a layout with pipeline stages: the job's,
    else SEARCHED_SCHEDULES at every virtual degree that splits the blocks."""
    shape = inputs.workload.shape or inputs.workload.moe
    assert shape is not None
    names = (allowed.pp_schedule,) if allowed.pp_schedule else SEARCHED_SCHEDULES
    out = []
    for name in names:
        fixed = SCHEDULE_VIRTUAL[name]
        for v in [fixed] if fixed else virtual_degrees(shape.n_layer, dims.pp)[1:]:
            if allowed.pp_virtual in (None, v) and pipeline_runs(shape.n_layer, dims.pp, v):
                out.append((name, v))
    return out


def pipeline_micro_batches(
    dims: ParallelDims, batch: int, schedule: str, micros: list[int], allowed: Allowed
) -> list[int]:
    """Of `micros`, the micro-batch sizes whose count m = batch / size the schedule runs
    (torch.distributed.pipelining: m >= the stages for all but GPipe; the interleaved ones
    a multiple of their rounds, m // p) and the job's parallel.pp_microbatches allows."""
    out = []
    for size in micros:
        m = batch // size
        if schedule != "GPipe" and m < dims.pp:
            continue
        if schedule != "GPipe" and m % max(1, m // dims.pp):
            continue
        if allowed.pp_microbatches in (None, m):
            out.append(size)
    return out


def divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def shortcut(dims: ParallelDims) -> str:
    """The user's word for a layout (parallel.strategy): ParallelDims.strategy, except that
    replicas of a tensor-parallel model are ddp as asked (FSDP2 runs them, see runnable)."""
    if dims.fsdp and dims.dp_shard == 1 and dims.tp > 1 and not dims.cpu_offload:
        return "ddp"
    return dims.strategy


def permitted(dims: ParallelDims, allowed: Allowed) -> bool:
    """Whether a layout keeps the user's strategy, offload and replica groups."""
    if allowed.strategy is not None and shortcut(dims) != allowed.strategy:
        return False
    if allowed.cpu_offload is not None and dims.cpu_offload != allowed.cpu_offload:
        return False
    return allowed.replicas is None or (dims.fsdp and dims.dp_replicate == allowed.replicas)


def layouts(inputs: PlanInputs, allowed: Allowed) -> list[ParallelDims]:
    """Every layout of inputs.gpus GPUs: for each tp, no data parallelism (one GPU or pure
    TP), DDP, and FSDP over shard groups of every size dividing the data-parallel ranks
    (ZeRO-3 and ZeRO-2; replicas of them when the group is smaller), plus CPU offload
    (ZeRO-3 only) where allowed; for a Mixture-of-Experts model each at every expert
    degree (expert_degrees), without offload. Simplest first."""
    moe = inputs.workload.moe is not None
    offload = allowed.offload and inputs.hardware.device == "cuda" and not moe
    resharding = (False, True)
    if allowed.reshard_after_forward is not None:
        resharding = (allowed.reshard_after_forward,)
    out: list[ParallelDims] = []
    for tp in tp_degrees(inputs, allowed):
        stages = pp_degrees(inputs, allowed, tp)
        for pp in stages:
            if pp > 1 and inputs.gpus % (tp * pp) == 0:
                out += pipeline_layouts(inputs.gpus // (tp * pp), tp, pp, allowed)
        if 1 not in stages:
            continue
        dp = inputs.gpus // tp
        if allowed.shard_group is None:
            # dp 1: no wrapper at all; replicas of a TP model are FSDP2's (as they run)
            out.append(ParallelDims(dp_replicate=dp, tp=tp).runnable())
        for shard in divisors(dp):
            if allowed.shard_group not in (None, shard):
                continue
            replicas = dp // shard
            if shard > 1:
                for full in resharding:
                    out.append(
                        ParallelDims(replicas, shard, tp, fsdp=True, reshard_after_forward=full)
                    )
            if offload and True in resharding:
                out.append(ParallelDims(replicas, shard, tp, fsdp=True, cpu_offload=True))
    if moe:
        out = [replace(d, ep=ep) for d in out for ep in expert_degrees(inputs, d, allowed)]
    return [dims for dims in out if permitted(dims, allowed)]


def pipeline_layouts(dp: int, tp: int, pp: int, allowed: Allowed) -> list[ParallelDims]:
    """The data-parallel layouts of `pp` stages of `tp` ranks: DDP, or FSDP over the whole
    data-parallel group (the shard group the job set), which keeps each stage's parameters
    gathered through the step whatever parallel.shard says (ParallelDims' rule under pp:
    each micro-batch would gather again). A job that fixes parallel.shard = 'full' gets
    such stages only when it fixes the stages too (then they are what it runs, and the
    plan says what full means there); else the search keeps its ZeRO-3 without stages."""
    shard = allowed.shard_group or dp
    out = [ParallelDims(dp_replicate=dp, tp=tp, pp=pp).runnable()]
    if shard > 1 and dp % shard == 0:
        out.append(ParallelDims(dp // shard, shard, tp, pp, fsdp=True))
    full_asked = allowed.reshard_after_forward is True and allowed.pp_degree != pp
    return [d for d in out if not full_asked or d.dp_shard == 1]


def replica_batch(inputs: PlanInputs, dims: ParallelDims) -> int:
    """Sequences each data-parallel rank runs a step: the global batch over the ranks
    (rounded up: a batch that does not divide leaves some ranks short), at least one; the
    job's micro-batch x accumulation when the global batch grows with the GPUs."""
    if inputs.global_batch is None:
        return inputs.workload.micro_batch * inputs.grad_accum
    return max(1, -(-inputs.global_batch // dims.dp_size))


def micro_batches(inputs: PlanInputs, batch: int, allowed: Allowed) -> list[int]:
    """Micro-batch sizes, ascending: the divisors of the replica's batch (so micro-batch x
    accumulation is the batch), kept to the user's micro-batch and accumulation steps; or
    the job's own (at most the batch), when the knobs are the job's (the runtime's auto)."""
    if allowed.knobs:
        return [
            m for m in divisors(batch)
            if allowed.micro_batch in (None, m) and allowed.grad_accum in (None, batch // m)
        ]
    accum = max(1, math.ceil(batch / inputs.workload.micro_batch - 1e-9))
    return [max(1, math.ceil(batch / accum - 1e-9))]


def exact(inputs: PlanInputs, dims: ParallelDims, allowed: Allowed) -> bool:
    """Whether `dims` runs the global batch exactly: micro-batch x accumulation x its
    data-parallel ranks, with the user's micro-batch and accumulation (always, when the
    global batch is the job's product)."""
    batch = inputs.global_batch
    if batch is None:
        return True
    if batch % dims.dp_size:
        return False
    micros = layout_micro_batches(inputs, dims, batch // dims.dp_size, allowed)
    if dims.pp == 1:
        return bool(micros)
    return any(  # with stages, as many micro-batches as some schedule runs
        pipeline_micro_batches(dims, batch // dims.dp_size, name, micros, allowed)
        for name, _ in schedules(inputs, dims, allowed)
    )


def layout_micro_batches(
    inputs: PlanInputs, dims: ParallelDims, batch: int, allowed: Allowed
) -> list[int]:
    """The micro-batch sizes of a layout's rank of `batch` samples: micro_batches; with
    pipeline stages under the runtime's knobs, every divisor of the batch (the job's
    parallel.pp_microbatches picks one)."""
    if dims.pp > 1 and not allowed.knobs:
        return divisors(batch)
    return micro_batches(inputs, batch, allowed)


def exact_batch(inputs: PlanInputs, allowed: Allowed) -> tuple[PlanInputs, str]:
    """The inputs with a global batch some allowed layout runs exactly: the asked one when
    one does, else the nearest multiple of the data-parallel ranks (x the user's micro-batch
    and accumulation) a job can run; and the sentence that says so ("" when unchanged)."""
    asked = inputs.global_batch
    if asked is None or any(exact(inputs, d, allowed) for d in layouts(inputs, allowed)):
        return inputs, ""
    ranks = inputs.gpus // ((allowed.tp_degree or 1) * (allowed.pp_degree or 1))
    unit = ranks * (allowed.micro_batch or 1) * (allowed.grad_accum or 1)
    size = unit if allowed.grad_accum else max(unit, round(asked / unit) * unit)
    note = (
        f"global batch {size:,} instead of {asked:,}: {asked:,} sequences do not split into "
        f"equal micro-batches over {ranks} data-parallel ranks"
        + (" at the micro-batch and accumulation set" if unit != ranks else "")
    )
    return replace(inputs, global_batch=size), note


def ac_modes(inputs: PlanInputs, allowed: Allowed) -> tuple[str, ...]:
    """Checkpointing modes: the user's; all four for a model with a shape or experts
    (without, recomputing saves no modelled memory); the job's own when the knobs are
    fixed."""
    if allowed.ac is not None:
        return (allowed.ac,)
    w = inputs.workload
    if not allowed.knobs or (w.shape is None and w.moe is None):
        return (w.ac,)
    return AC_MODES


def accumulations(dims: ParallelDims, grad_accum: int, allowed: Allowed) -> tuple[str, ...]:
    """Accumulation modes: sharded or unsharded for FSDP with several micro-batches (the
    job's, when it names one)."""
    if not (dims.fsdp and grad_accum > 1):
        return ("unsharded",)
    if allowed.accumulate is not None:
        return (allowed.accumulate,)
    return ("unsharded", "sharded") if allowed.sharded_accumulation else ("unsharded",)
