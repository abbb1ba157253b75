"""Pipeline stages of the GPT (parallel.pp): which stages a rank holds, which blocks a stage
holds, what a schedule asks of the layout, and the stage itself, cut from the meta model
as torchtitan's `pipeline_llm` cuts its models.

A stage is the GPT with the blocks of its range in a ModuleDict keyed by their index (so
every parameter keeps the whole model's name, and a checkpoint is the same whatever the
split), the embeddings on the first stage only, the final norm and head on the last only;
the forward skips what a stage lacks. A tied head (tie_embeddings) becomes a copy of the
token embedding on the last stage, under the same name: the engine sums its gradient
with the first stage's after each backward, as Megatron-LM does for its word embeddings.

Which blocks a stage holds and which stages a rank holds: models.stage_split (the rules
the planner prices too).
"""

from __future__ import annotations

import copy

from torch import nn

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

__all__ = [
    "SINGLE_STAGE", "V_SHAPED", "ZERO_BUBBLE", "default_microbatches", "placement",
    "rank_stages", "schedule_problems", "split_gpt", "stage_range",
]

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
        {str(i): model.blocks[i] for i in stage_range(len(model.blocks), stages, stage)}
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

