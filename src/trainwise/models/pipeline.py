"""Pipeline stages of the GPT (parallel.pp): which stages a rank holds, which blocks a stage
holds, what a schedule asks of the layout, and the stage itself, cut from the meta model
as torchtitan's `pipeline_llm` cuts its models.

A stage is the GPT with the blocks of its range in a ModuleDict keyed by their index (so
every parameter keeps the whole model's name, and a checkpoint is the same whatever the
split), the embeddings on the first stage only, the final norm and head on the last only;
the forward skips what a stage lacks. A tied head (tie_embeddings) becomes a copy of the
token embedding on the last stage, under the same name: the engine sums its gradient
with the first stage's after each backward, as Megatron-LM does for its word embeddings.

Placement, as torch.distributed.pipelining's `generate_stage_to_rank_mapping`: "loop" for
every schedule but ZBVZeroBubble (rank r holds stages r, r + pp, r + 2 pp, ...), "v" for
ZBVZeroBubble (rank r holds stages r and 2 pp - 1 - r: the first and last share rank 0).
"""

from __future__ import annotations

import copy

from torch import nn

from trainwise.models.gpt import GPT

SINGLE_STAGE = ("GPipe", "1F1B")  # one stage per rank (pp_virtual = 1)
V_SHAPED = ("ZBVZeroBubble",)  # exactly two stages per rank, in a V
# Split the backward into input and weight parts: torch runs them without torch.compile.
ZERO_BUBBLE = ("InterleavedZeroBubble", "ZBVZeroBubble")


def placement(schedule: str) -> str:
    """'v' for the V-shaped schedules, 'loop' for the others."""
    return "v" if schedule in V_SHAPED else "loop"


def rank_stages(pp_rank: int, pp: int, virtual: int, schedule: str) -> list[int]:
    """The stage indices rank `pp_rank` of the pipeline holds, in order."""
    if placement(schedule) == "v":
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + k * pp for k in range(virtual)]


def stage_blocks(n_layer: int, stages: int, stage: int) -> range:
    """The blocks of stage `stage` of `stages`: an equal run of consecutive layers."""
    per = n_layer // stages
    return range(stage * per, (stage + 1) * per)


def default_microbatches(micro_batch: int, grad_accum: int) -> int:
    """parallel.pp_microbatches when unset: the rank's batch in micro-batches of one sample."""
    return micro_batch * grad_accum


def schedule_problems(
    schedule: str, pp: int, virtual: int, n_layer: int, microbatches: int, batch: int
) -> list[str]:
    """Why the layout cannot run `schedule`, one line each: the stages must divide the
    layers, the schedule fixes the stages per rank, the micro-batches must cut the rank's
    `batch` evenly and meet the schedule's own rule (torch's: Schedule1F1B needs at least
    one per stage; the interleaved ones a multiple of max(1, microbatches // pp))."""
    problems = []
    stages = pp * virtual
    if n_layer % stages:
        problems.append(
            f"parallel.pp x parallel.pp_virtual = {pp} x {virtual} = {stages} stages do not "
            f"divide the model's {n_layer} layers: choose degrees whose product divides {n_layer}"
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
    if batch % microbatches:
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
    """Stage `stage` of `stages` of `model` (built on the meta device): a GPT that shares
    the blocks of its range with `model` and holds the whole model's parameter names."""
    first, last = stage == 0, stage == stages - 1
    part = GPT.__new__(GPT)
    nn.Module.__init__(part)
    # Its plain attributes (shape, training, the parts a shape lacks as None), then its
    # modules: the same objects, so the blocks are the bundle's (FSDP and AC units).
    part.__dict__.update({k: v for k, v in vars(model).items() if not k.startswith("_")})
    part._modules.update(model._modules)
    part.blocks = nn.ModuleDict(
        {str(i): model.blocks[i] for i in stage_blocks(len(model.blocks), stages, stage)}
    )
    part.embeds = first
    if not first:
        part.pos_emb = None
        tied_head = last and model.lm_head is None
        part.tok_emb = copy.deepcopy(model.tok_emb) if tied_head else None
    if not last:
        part.norm = None
        part.lm_head = None
    return part


def splits(module: nn.Module) -> bool:
    """Whether the model can be cut into pipeline stages (the built-in GPT, which the Llama
    family builds with model.impl = 'trainwise')."""
    return isinstance(module, GPT)
