"""Pipeline stages (parallel.pp): which stages a rank holds, which blocks a stage holds,
what a schedule asks of the layout, and the stages themselves, cut from the meta model as
torchtitan's `pipeline_module_split` cuts its models. Every parameter of a stage keeps the
whole model's name (so a checkpoint is the same whatever the split), and every stage
carries a `StageInfo` (stage_info) that tells the engine what it holds.

The built-in GPT and the MoE family (split_blocks; split_gpt): the blocks of its range in
a ModuleDict keyed by their index, the embeddings on the first stage only, the final norm
and head on the last only; its forward skips what a stage lacks. A tied head
(tie_embeddings) becomes a copy of the token embedding on the last stage, under the same
name.

Your own module (split_module; docs/parallelism.md, "Your own model in stages"), cut by
torchtitan's convention: its repeated blocks in one ModuleList, ModuleDict or Sequential
named `layers` or `blocks` (models.custom.blocks_container), each stage holding its run of
them under their own keys; the children with parameters registered before the blocks go
to the first stage, those after them to the last, and are None on the other stages (the
forward skips them: `h = self.tok_emb(x) if self.tok_emb is not None else x`); children
without parameters (dropout, rotary tables) and the model's own buffers stay on every
stage. A parameter the modules before and after the blocks share (a head tied to the
embedding) is a copy on the last stage, in a copy of its modules: the engine keeps the
copies equal, as Megatron-LM does for its word embeddings (the first stage's values at
the start, the sum of both gradients after each backward), and the checkpoint names the
copy's optimizer state by the whole model's name. `module_problems` refuses, one line
each, a module that does not follow the convention, checked on the meta device.

Which blocks a stage holds and which stages a rank holds: models.stage_split (the rules
the planner prices too).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from torch import nn

from trainwise.errors import ModelError
from trainwise.models.custom import blocks_container
from trainwise.models.gpt import GPT
from trainwise.models.stage_split import (
    SINGLE_STAGE,
    V_SHAPED,
    ZERO_BUBBLE,
    default_microbatches,
    placement,
    rank_stages,
    stage_blocks,
    stage_range,
)
from trainwise.objects import first_line

__all__ = [
    "SINGLE_STAGE", "V_SHAPED", "ZERO_BUBBLE", "ModuleCut", "StageInfo", "default_microbatches",
    "module_cut", "module_problems", "placement", "rank_stages", "schedule_problems",
    "split_blocks", "split_gpt", "split_module", "split_stage", "stage_info", "stage_layers",
    "stage_range",
]

M = TypeVar("M", bound=nn.Module)
_STAGE = "_trainwise_stage"  # the attribute of a stage that holds its StageInfo
_FIX = '(docs/parallelism.md, "Your own model in stages"), or use parallel.pp = 1'


@dataclass(frozen=True)
class StageInfo:
    """What the engine needs to know of a stage cut here."""

    container: str  # the child holding the stage's blocks
    # Parameters the first and the last stage both hold: {name on the last stage: the whole
    # model's name, the first stage's}. The model's, so the same on every stage.
    ties: Mapping[str, str] = field(default_factory=dict)


def stage_info(part: nn.Module) -> StageInfo | None:
    """The StageInfo of a stage cut by split_stage (kept through wrapping: FSDP swaps the
    class, not the object); None for a model that is no stage."""
    return part.__dict__.get(_STAGE)


def stage_layers(part: nn.Module) -> list[nn.Module]:
    """The blocks a stage holds, in order (its FSDP and activation-checkpointing units)."""
    return list(part._modules[part.__dict__[_STAGE].container].children())


def split_stage(model: nn.Module, stage: int, stages: int) -> nn.Module:
    """Stage `stage` of `stages` of `model` (built on the meta device): the GPT's split,
    the MoE model's (the same: split_blocks), or your own module's by the convention (the
    job's checks refused one that does not follow it)."""
    if isinstance(model, GPT):
        return split_gpt(model, stage, stages)
    from trainwise.models.moe.model import MoEModel

    if isinstance(model, MoEModel):
        return split_blocks(model, stage, stages)
    return split_module(model, stage, stages, module_cut(model, "the model"))


def schedule_problems(
    schedule: str, pp: int, virtual: int, n_layer: int, microbatches: int, batch: int,
    accum: int = 1,
) -> list[str]:
    """Why the layout cannot run `schedule`, one line each: the stages must divide the
    layers, the schedule fixes the stages per rank, the micro-batches must cut the rank's
    `batch` (`accum` loader micro-batches) evenly, each inside one loader micro-batch, and
    meet the schedule's own rule (torch's: Schedule1F1B needs at least
    one per stage; the interleaved ones a multiple of max(1, microbatches // pp))."""
    problems = []
    stages = pp * virtual
    if stage_blocks(n_layer, stages) is None:
        problems.append(
            f"parallel.pp x parallel.pp_virtual = {pp} x {virtual} = {stages} stages divide "
            f"neither the model's {n_layer} layers nor {n_layer} + 2 (the embeddings and the "
            f"head weigh a layer each): choose degrees whose product divides {n_layer} or "
            f"{n_layer + 2}"
        )
    if schedule in SINGLE_STAGE and virtual != 1:
        problems.append(
            f"parallel.pp_schedule = '{schedule}' runs one stage per rank but "
            f"parallel.pp_virtual = {virtual}: use pp_virtual = 1, or Interleaved1F1B, "
            "InterleavedZeroBubble or ZBVZeroBubble"
        )
    elif schedule in V_SHAPED and virtual != 2:
        problems.append(
            f"parallel.pp_schedule = '{schedule}' runs exactly two stages per rank but "
            f"parallel.pp_virtual = {virtual}: set pp_virtual = 2"
        )
    elif schedule not in SINGLE_STAGE + V_SHAPED and virtual < 2:
        problems.append(
            f"parallel.pp_schedule = '{schedule}' interleaves several stages per rank but "
            f"parallel.pp_virtual = {virtual}: set pp_virtual = 2 or more, or use 1F1B"
        )
    where = f"parallel.pp_microbatches = {microbatches}"
    if microbatches % accum:
        problems.append(
            f"{where} is not a multiple of data.grad_accum = {accum}: each pipeline "
            "micro-batch must lie inside one of the loader's micro-batches (their losses are "
            "averaged as without stages); use a multiple of it"
        )
    elif batch % microbatches:
        problems.append(
            f"{where} does not cut the {batch} samples of a rank's step (data.micro_batch x "
            "data.grad_accum) evenly: choose a divisor of it"
        )
    elif schedule == "1F1B" and microbatches < pp:
        problems.append(
            f"{where} is fewer than the {pp} stages 1F1B keeps in flight: use at least {pp} "
            "(raise data.micro_batch or data.grad_accum), or GPipe"
        )
    elif schedule not in SINGLE_STAGE + V_SHAPED and microbatches % max(1, microbatches // pp):
        rounds = microbatches // pp
        problems.append(
            f"{where}: {schedule} runs them in rounds of {pp} (the pipeline degree) and "
            f"{microbatches} is not a multiple of its {rounds} rounds: use a multiple of {pp}"
        )
    return problems


def split_gpt(model: GPT, stage: int, stages: int) -> GPT:
    """Stage `stage` of `stages` of `model` (built on the meta device): split_blocks, the
    learned position embedding (if any) on the first stage with the token embedding."""
    return split_blocks(model, stage, stages, first_only=("pos_emb",))


def split_blocks(model: M, stage: int, stages: int, first_only: tuple[str, ...] = ()) -> M:
    """Stage `stage` of `stages` of a blocks model (the GPT, the MoE family's; built on
    the meta device): a model of its class that shares the blocks of its range with
    `model` and holds the whole model's parameter names; the token embedding (and the
    modules named in `first_only`) on the first stage, the final norm and the head on the
    last, where a tied head is a copy of the embedding."""
    first, last = stage == 0, stage == stages - 1
    part = type(model).__new__(type(model))
    nn.Module.__init__(part)
    # Its plain attributes (shape, training, the parts a shape lacks as None), then its
    # modules: the same objects, so the blocks are the bundle's (FSDP and AC units).
    part.__dict__.update({k: v for k, v in vars(model).items() if not k.startswith("_")})
    part._modules.update(model._modules)
    part.blocks = nn.ModuleDict(
        {str(i): model.blocks[i] for i in stage_range(len(model.blocks), stages, stage)}
    )
    part.embeds = first
    if not first:
        for name in first_only:
            setattr(part, name, None)
        tied_head = last and model.lm_head is None
        part.tok_emb = copy.deepcopy(model.tok_emb) if tied_head else None
    if not last:
        part.norm = None
        part.lm_head = None
    ties = {"tok_emb.weight": "tok_emb.weight"} if model.lm_head is None else {}
    part.__dict__[_STAGE] = StageInfo("blocks", ties)
    return part



# -- your own module ------------------------------------------------------------------------


@dataclass(frozen=True)
class ModuleCut:
    """Where your own module is cut: its blocks' container, the children the first stage
    keeps (with parameters, registered before the blocks) and those the last keeps (after
    them), and the parameters both hold (StageInfo.ties)."""

    container: str
    keys: tuple[str, ...]  # the blocks' names in the container, in order
    first: tuple[str, ...]
    last: tuple[str, ...]
    ties: dict[str, str]


def module_cut(model: nn.Module, where: str) -> ModuleCut:
    """The cut of `model` by the convention; ModelError (one line, starting with `where`)
    when it has no blocks to cut, parameters of its own outside any child, or a parameter
    shared across its blocks."""
    container = blocks_container(model)
    if container is None:
        raise ModelError(
            f"{where} has no blocks to cut into stages: keep its repeated blocks in a "
            f"ModuleList, ModuleDict or Sequential named `layers` or `blocks` {_FIX}"
        )
    keys = tuple(model._modules[container]._modules)
    if not keys:
        raise ModelError(f"{where}: its `{container}` holds no blocks to cut into stages {_FIX}")
    own = [n for n, p in model._parameters.items() if p is not None]
    if own:
        raise ModelError(
            f"{where}: parameter '{own[0]}' belongs to the model itself, outside its "
            f"modules, so no stage holds it: move it into a module registered before "
            f"`{container}` (the first stage's) or after it (the last stage's) {_FIX}"
        )
    names = list(model._modules)
    at = names.index(container)
    weighs = [n for n in names if n != container and _has_parameters(model._modules[n])]
    first = tuple(n for n in weighs if names.index(n) < at)
    last = tuple(n for n in weighs if names.index(n) > at)
    return ModuleCut(container, keys, first, last, _ties(model, container, first, where))


def _has_parameters(module: nn.Module | None) -> bool:
    return module is not None and next(module.parameters(), None) is not None


def _ties(model: nn.Module, container: str, first: tuple[str, ...], where: str) -> dict[str, str]:
    """{name on the last stage: the whole model's name} of each parameter shared by modules
    before and after the blocks; ModelError for one shared across blocks."""

    def side(name: str) -> str:
        top, _, rest = name.partition(".")
        if top == container:
            return f"{container}.{rest.partition('.')[0]}"  # its block
        return "first" if top in first else "last"

    groups: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(name)
    ties = {}
    for names in groups.values():
        sides = {side(n) for n in names}
        if len(sides) == 1:
            continue  # in one block, or on one side: one stage holds it
        if sides != {"first", "last"}:
            raise ModelError(
                f"{where}: parameter '{names[0]}' is also '{names[1]}': stages can share a "
                "parameter only between a module before the blocks and one after them (a "
                f"head tied to the embedding); untie it {_FIX}"
            )
        # The last stage's copy goes by the name its named_parameters() gives (the first).
        ties[next(n for n in names if side(n) == "last")] = names[0]
    return ties


def split_module(model: nn.Module, stage: int, stages: int, cut: ModuleCut) -> nn.Module:
    """Stage `stage` of `stages` of your own `model` cut at `cut`: an instance of its
    class (not initialised again) sharing the model's modules, with the blocks of its
    range in a container of the same kind under their own keys and None for the children
    of the other stages; on the last stage, copies of the modules that share a parameter
    with the first stage."""
    first, last = stage == 0, stage == stages - 1
    part = type(model).__new__(type(model))
    # Its plain attributes, and its own dicts of modules, parameters, buffers and hooks.
    part.__dict__.update(
        {k: copy.copy(v) if isinstance(v, (dict, set)) else v for k, v in vars(model).items()}
    )
    blocks = model._modules[cut.container]
    held = [cut.keys[i] for i in stage_range(len(cut.keys), stages, stage)]
    part._modules[cut.container] = _subset(blocks, held)
    for name in (() if first else cut.first) + (() if last else cut.last):
        part._modules[name] = None
    if last and not first:
        memo: dict[int, Any] = {}  # one memo: the copies keep sharing what they shared
        for top in dict.fromkeys(name.partition(".")[0] for name in cut.ties):
            part._modules[top] = copy.deepcopy(model._modules[top], memo)
    part.__dict__[_STAGE] = StageInfo(cut.container, cut.ties)
    return part


def _subset(blocks: nn.Module, keys: list[str]) -> nn.Module:
    """The blocks under `keys`, in a container of `blocks`' kind (torch's, not a subclass
    of it) that keeps their keys: iterated (or called, a Sequential) as the whole one."""
    if isinstance(blocks, nn.ModuleDict):
        kind: type[nn.Module] = nn.ModuleDict
    else:
        kind = nn.Sequential if isinstance(blocks, nn.Sequential) else nn.ModuleList
    subset = kind()
    for key in keys:
        subset.add_module(key, blocks._modules[key])
    return subset


def example_input(batch: Any) -> Any:
    """The input of a batch as the step takes it ((input, target, ...) tensors), to run a
    model on; None when there is none (no batch, or its input is not a tensor)."""
    first = batch[0] if isinstance(batch, (tuple, list)) and batch else None
    return first if isinstance(first, torch.Tensor) else None


def extra_inputs_problem(batch: Any, where: str, source: str) -> list[str]:
    """A batch that gives your own module more inputs than one ((input, target, *more):
    `model(input, *more)`, a dict batch's attention mask, say): refused in stages, one
    line. A stage after the first takes only what the one before it returns, so `more`
    could reach the first stage alone (the GPT's packed-example ids go to every stage by a
    keyword of its own, which your module has not)."""
    more = len(batch) - 2 if isinstance(batch, (tuple, list)) else 0
    if more <= 0:
        return []
    return [
        f"{where}: the batches of {source} give the model {more} more input(s) beside its "
        "input and target, and a stage after the first takes only what the one before it "
        "returns: give the model one input (fold the others into it in data.collate, or "
        "leave them out), or use parallel.pp = 1"
    ]


def module_problems(
    model: nn.Module, cut: ModuleCut, stages: int, example: Any, where: str
) -> list[str]:
    """Why your own `model` (built on the meta device, cut at `cut` into `stages` that
    divide its blocks) fails in stages, found by running it on `example` (a batch of its
    input; None: not run) on the meta device: a forward that calls a module on the other
    side of the blocks than it is registered, or a stage that fails or hands on what the
    next cannot take. A model whose whole forward does not run on the meta device (data-
    dependent code) is not run in stages either: there is nothing to compare them with."""
    if example is None:
        return []
    example = _to_meta(example)
    calls: list[str] = []
    whole = _traced(model, cut, example, calls)
    if whole is None:
        return []
    order = _order_problem(cut, calls, where)
    if order:
        return [order]
    out = example
    for s in range(stages):
        part = split_module(model, s, stages, cut)
        try:
            with torch.no_grad():
                out = part(*out) if isinstance(out, tuple) else part(out)
        except Exception as exc:  # noqa: BLE001 (the user's forward: reported in one line)
            return [
                f"{where}: stage {s} of {stages} fails on the meta device "
                f"({first_line(exc)}): a stage holds its run of the blocks, the modules "
                "before them only on the first stage and those after them only on the last, "
                "the others None; let the forward skip what is None "
                f"(`h = self.tok_emb(x) if self.tok_emb is not None else x`) {_FIX}"
            ]
        if s < stages - 1 and _shapes(out) is None:
            return [
                f"{where}: stage {s} of {stages} returns a {type(out).__name__}, which "
                "cannot go to the next stage: a stage before the last returns a tensor or "
                f"a tuple of tensors {_FIX}"
            ]
    if _shapes(out) != _shapes(whole):
        return [
            f"{where}: its {stages} stages chained give {_shapes(out)} where the whole "
            f"model gives {_shapes(whole)}: the last stage must return the model's output "
            f"and the others what the next takes {_FIX}"
        ]
    return []


def _to_meta(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to("meta")
    return tuple(_to_meta(v) for v in value) if isinstance(value, (tuple, list)) else value


def _shapes(value: Any) -> list[list[int]] | None:
    """The shapes of a tensor or a tuple of tensors; None for anything else."""
    if isinstance(value, torch.Tensor):
        return [list(value.shape)]
    if isinstance(value, tuple) and all(isinstance(v, torch.Tensor) for v in value):
        return [list(v.shape) for v in value]
    return None


def _traced(model: nn.Module, cut: ModuleCut, example: Any, calls: list[str]) -> Any:
    """The whole model's output on `example`, with the order in which its forward called
    the cut's children and its blocks (each block as the container's name) in `calls`;
    None when it does not run on the meta device."""
    hooks = []
    for name in cut.first + cut.last:
        hooks.append(model._modules[name].register_forward_pre_hook(
            lambda _m, _a, name=name: calls.append(name)))
    for block in model._modules[cut.container].children():
        hooks.append(block.register_forward_pre_hook(
            lambda _m, _a: calls.append(cut.container)))
    try:
        with torch.no_grad():
            return model(*example) if isinstance(example, tuple) else model(example)
    except Exception:  # noqa: BLE001 (data-dependent code, say: nothing to check here)
        return None
    finally:
        for hook in hooks:
            hook.remove()


def _order_problem(cut: ModuleCut, calls: list[str], where: str) -> str | None:
    """A child called on the other side of the blocks than it is registered (so cut)."""
    if cut.container not in calls:
        return (
            f"{where}: its forward never calls the blocks in `{cut.container}`, which the "
            f"stages are cut along {_FIX}"
        )
    start = calls.index(cut.container)
    end = len(calls) - 1 - calls[::-1].index(cut.container)
    for i, name in enumerate(calls):
        before, after = name in cut.first and i > start, name in cut.last and i < end
        if before or after:
            registered, called = ("before", "after") if before else ("after", "before")
            return (
                f"{where} registers `{name}` {registered} `{cut.container}` but its forward "
                f"calls it {called} them: stages are cut by the order of registration (the "
                "modules before the blocks go to the first stage, those after them to the "
                f"last): register it {called} `{cut.container}` {_FIX}"
            )
    return None
