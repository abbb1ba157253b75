"""How a model's blocks divide into pipeline stages, which stages each rank holds and how
many micro-batches a step is cut into by default: the one place for these facts, which the runtime (models.pipeline cuts the stages) and the
planner (plan.model.pipeline prices them) both read. Plain data, no torch.

Blocks over the p x v stages (v virtual stages per rank): as torchtitan splits them
(torchtitan/distributed/pipeline_parallel.py, generate_llm_fqn_per_model_part with
input_weight = output_weight = 1) the embeddings and the head each weigh one block, so
when the blocks + 2 divide into the stages the first and the last stage take one block
fewer (Llama 3 405B: 126 blocks on 16 stages, 7 + 14 x 8 + 7, as Dubey et al., 2024,
section 3.3.2 split them); else the blocks divide evenly; else the layout is refused.

Placement, as torch.distributed.pipelining's `generate_stage_to_rank_mapping`: "loop"
(rank r holds stages r, r + p, r + 2p, ...) for every schedule but ZBVZeroBubble, "v" for
ZBVZeroBubble (rank r holds stages r and 2p - 1 - r: the first and last share rank 0).
"""

from __future__ import annotations

# torch.distributed.pipelining's schedules (config.schema.PIPELINE_SCHEDULES) by the
# virtual stages they run per rank: None for any v >= 2, else exactly that.
SCHEDULE_VIRTUAL = {
    "GPipe": 1, "1F1B": 1, "Interleaved1F1B": None, "InterleavedZeroBubble": None,
    "ZBVZeroBubble": 2,
}
SINGLE_STAGE = tuple(s for s, v in SCHEDULE_VIRTUAL.items() if v == 1)  # pp_virtual = 1
V_SHAPED = ("ZBVZeroBubble",)  # exactly two stages per rank, in a V
# Split the backward into input and weight parts: torch runs them without torch.compile.
ZERO_BUBBLE = ("InterleavedZeroBubble", "ZBVZeroBubble")


def default_microbatches(micro_batch: int, grad_accum: int) -> int:
    """parallel.pp_microbatches when unset: the rank's batch in micro-batches of one sample."""
    return micro_batch * grad_accum


def stage_blocks(n_layer: int, stages: int) -> list[int] | None:
    """Blocks per stage, or None when neither the blocks + 2 nor the blocks divide into
    `stages` stages of at least one block each."""
    if stages == 1:
        return [n_layer]
    k, rest = divmod(n_layer + 2, stages)
    if rest == 0 and k >= 2:
        return [k - 1] + [k] * (stages - 2) + [k - 1]
    if n_layer % stages == 0:
        return [n_layer // stages] * stages
    return None


def stage_range(n_layer: int, stages: int, stage: int) -> range:
    """The blocks of stage `stage` of `stages` (a split stage_blocks accepts)."""
    split = stage_blocks(n_layer, stages)
    if split is None:
        raise ValueError(f"{n_layer} blocks do not split into {stages} stages")
    start = sum(split[:stage])
    return range(start, start + split[stage])


def placement(schedule: str) -> str:
    """'v' for the V-shaped schedules, 'loop' for the others."""
    return "v" if schedule in V_SHAPED else "loop"


def rank_stages(pp_rank: int, pp: int, virtual: int, schedule: str) -> list[int]:
    """The stage indices rank `pp_rank` of the pipeline holds, in order."""
    if placement(schedule) == "v":
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + k * pp for k in range(virtual)]
