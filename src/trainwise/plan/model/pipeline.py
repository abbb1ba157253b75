"""Pipeline parallelism: what `pp` stages of a model cost. The one place for its formulas.

Stages: the blocks split over the p x v stages and placed on the ranks as the runtime
does (models.stage_split: torchtitan's split, loop or V placement).

Bubble: the share of the ideal step (m micro-batches with no idle time) a rank waits while
the pipeline fills and drains:
- GPipe (Huang et al., 2019) and 1F1B (Narayanan et al., SC'21, "Efficient Large-Scale
  Language Model Training on GPU Clusters Using Megatron-LM", section 2.2.1): (p-1)/m;
- Interleaved1F1B (same paper, section 2.2.2): (p-1)/(v m);
- the zero-bubble schedules (Qi et al., ICLR 2024, "Zero Bubble Pipeline Parallelism")
  split the backward into the input gradient B and the weight gradient W and fill the
  bubble with W: ZB-H1 leaves (p-1)(T_F + T_B - T_W) of 1F1B's (p-1)(T_F + T_B + T_W)
  (section 2.1; InterleavedZeroBubble runs it on interleaved stages), ZB-V (section 6,
  ZBVZeroBubble: two stages per rank in a V) leaves ZB-H2's (p-1)(T_F + T_B - 2 T_W),
  zero when the three are equal. T_F, T_B, T_W from the FLOPs (zb_passes).

Memory: the activations of the micro-batches a rank keeps in flight: GPipe all m; 1F1B
p - r on rank r (the first stage p, the last one); interleaved (Megatron-LM's warm-up,
Korthikanti et al., 2022, section 4.2.3) 2(p - r - 1) + (v - 1)N + 1 stage micro-batches,
N = p when m is a multiple of p (round_size; the first rank: p + (p - 1)/v micro-batches
of all its blocks), never more than m v. The zero-bubble schedules as torch runs them
(zb_held, zb_moments): a micro-batch's activations live until its weight-gradient pass W;
InterleavedZeroBubble holds (v - 1) N + p stage micro-batches on every rank (its W lags r
backwards behind its input gradient I on rank r), more than ZB-H1's 1F1B peak (Qi et al.,
section 2.1); ZB-V 2p, the p micro-batches of all its blocks of the paper's section 6, but
unevenly: (2p - 1 - r, r + 1) of its two stages at its first W, so rank 0 holds one of the
head's. The micro-batches past I keep their output gradients until W as well
(memory.weight_grad_bytes_per_token), a third count per moment. Interleaved1F1B, stage by stage: the
warm-up runs the rank's stages in order, a round of N micro-batches each (Narayanan et
al., section 2.2.2; torch's Interleaved1F1B), so its last stage holds the fewest: on the
last rank the head's stage holds one micro-batch, its backward following its forward at
once (chunk_held). The backward then visits the stages last to first, and a stage's
accumulated gradients (FSDP keeps them unsharded, in the reduce dtype, until the step's
last backward: torch.distributed.pipelining's backward_maybe_with_nosync) exist from its
first backward on. With one round the rank's
forwards are all done by then, so its activations drain while its gradients grow: the
peak is the largest of "stage k's first backward" (gradients of stages k..v-1, activations
of stages 0..k) over k; with more rounds the steady state's 1F1B pairs keep the warm-up's
activations until every stage has its gradients.

Traffic: each stage sends its output activations (micro-batch x sequence x hidden in the
compute dtype; 1/tp of it with sequence parallelism, which leaves the residual stream
split) to the next stage for every micro-batch, and their gradients back: 2 m v messages a
rank a step. Ranks are row-major with pp outermost (config.parallel_dims), so neighbours
are world/pp ranks apart: across the network once a stage fills a machine.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from functools import lru_cache
from operator import ge

from trainwise.config.parallel_dims import ParallelDims
from trainwise.models.moe.shapes import MoEShape
from trainwise.models.shapes import GPTShape
from trainwise.models.stage_split import rank_stages, stage_blocks
from trainwise.plan.model.comm import Collective, Layout
from trainwise.plan.model.memory import MemoryEstimate, Workload, block_params, estimate_memory
from trainwise.plan.model.precision import BYTES
from trainwise.plan.model.setup import Setup


@lru_cache(maxsize=256)
def zb_passes(shape: GPTShape | MoEShape | None, seq_len: int) -> tuple[float, float, float]:
    """(T_F, T_B, T_W) of a block in FLOPs per token: 2N forward, the input gradient 2N
    and the weight gradient 2N (Qi et al., Table 1), attention's score and value matmuls
    4 s h forward and 2.5 times that backward (FlashAttention-2, section 3) in T_B. A
    Mixture-of-Experts layer's N: its active parameters (plan.moe.parallel.zb_passes)."""
    if shape is None:
        return 1.0, 1.0, 1.0
    if isinstance(shape, MoEShape):
        from trainwise.plan.moe.parallel import zb_passes as moe_passes  # builds on this

        return moe_passes(shape, seq_len)
    n, _ = block_params(Workload(shape.num_params(), shape, seq_len, 1))
    attention = 4.0 * seq_len * shape.n_head * shape.head_dim
    return 2 * n + attention, 2 * n + 2.5 * attention, 2 * n


def bubble_fraction(
    schedule: str, p: int, v: int, m: int, passes: tuple[float, float, float] = (1, 1, 1)
) -> float:
    """The bubble over the ideal step (see the module's docstring); `passes`: (T_F, T_B,
    T_W) in any unit."""
    if p == 1:
        return 0.0
    f, b, w = passes
    if schedule in ("GPipe", "1F1B"):
        return (p - 1) / m
    if schedule == "Interleaved1F1B":
        return (p - 1) / (v * m)
    if schedule == "InterleavedZeroBubble":
        return (p - 1) / (v * m) * (f + b - w) / (f + b + w)
    if schedule == "ZBVZeroBubble":
        return (p - 1) / (v * m) * max(0.0, f + b - 2 * w) / (f + b + w)
    raise ValueError(f"unknown pipeline schedule {schedule!r}")


def in_flight(schedule: str, p: int, v: int, m: int, rank: int) -> float:
    """Micro-batches of the rank's blocks whose activations it holds at its peak."""
    if schedule == "GPipe":
        held = float(m)
    elif schedule == "1F1B":
        held = float(p - rank)
    elif schedule in ZERO_BUBBLE:
        return _weighted((1,) * v, zb_held(schedule, p, v, m, rank))
    else:  # interleaved: Megatron-LM's warm-up, in stage micro-batches of 1/v the blocks
        held = (2 * (p - rank - 1) + (v - 1) * round_size(p, m) + 1) / v
    return min(held, float(m))


def round_size(p: int, m: int) -> int:
    """Micro-batches an interleaved schedule runs through a stage before the next: torch's
    Interleaved1F1B rounds (max(1, m // p) of them), p when m is a multiple of p as
    Megatron-LM requires."""
    return m // max(1, m // p)


# The stage-by-stage accounting below, checked against torch's op lists
# (tests/unit/test_pipeline_plan.py): Interleaved1F1B's, and the zero-bubble schedules',
# whose activations live until the weight-gradient pass W.
INTERLEAVED = ("Interleaved1F1B",)
ZERO_BUBBLE = ("InterleavedZeroBubble", "ZBVZeroBubble")
# A moment a rank can peak at: (micro-batches each of its stages holds, the first of its
# stages that has gradients: stages k..v-1 have them, micro-batches each of its stages
# holds past I: their output gradients kept until W, zero-bubble only).
Moment = tuple[tuple[float, ...], int, tuple[float, ...]]


@lru_cache(maxsize=4096)
def zb_held(schedule: str, p: int, v: int, m: int, rank: int) -> tuple[float, ...]:
    """Micro-batches each of the rank's stages (in order) holds at its first W (one of
    zb_moments): a micro-batch's activations live from its forward F to its weight-gradient
    pass W (torch's stage_backward_input keeps the graph for stage_backward_weight: a
    Linear's W needs its input and its output's gradient, kept between I and W: the
    moments' third count)."""
    if schedule == "ZBVZeroBubble":  # ScheduleZBVZeroBubble: 2(p - r) - 1 + r forwards of
        return _zbv_steady(p, m, rank, 1)[0]  # stage 0, then r + 1 of stage 1, its first W
    return _zb_window(p, v, m, 0, rank)[0]


def _zb_forwards(p: int, v: int, m: int) -> int:
    """Forwards an InterleavedZeroBubble rank has run at its first W, on every rank: torch's
    warm-up (_get_warmup_ops, multiply_factor 1: (v - 1) N + p - 1 - r) and r + 1 steady
    forwards, W lagging r backwards behind (num_1f1b_microbatches = rank)."""
    return min(m * v, (v - 1) * round_size(p, m) + p)


def _zb_window(p: int, v: int, m: int, s: int, rank: int) -> Moment:
    """The rank's stage micro-batches held, its first stage with gradients, and its stage
    micro-batches past I, at its W number s: forwards run stage by stage in rounds of N
    (forward_stage_index), Is and Ws from the last stage down (backward_stage_index), the
    Is r + 1 ahead of the Ws on rank r (its own W's included); per stage, forwards run - Ws
    done, and Is done - Ws done."""
    n = round_size(p, m)
    forwards = min(m * v, _zb_forwards(p, v, m) + s)
    inputs = min(m * v, s + rank + 1)
    done = _dealt_all(s, v, n)[::-1]  # Ws and Is from the last stage down
    held = tuple(float(f - w) for f, w in zip(_dealt_all(forwards, v, n), done, strict=True))
    past = tuple(
        float(i - w) for i, w in zip(_dealt_all(inputs, v, n)[::-1], done, strict=True)
    )
    first = v - 1 - min(v - 1, s // n)  # the stage of W number s has its gradients too
    return held, first, past


@lru_cache(maxsize=1024)
def zb_moments(schedule: str, p: int, v: int, m: int, rank: int) -> tuple[Moment, ...]:
    """The moments a zero-bubble rank can peak at, as interleaved_moments: (micro-batches
    each of its stages holds, the first of its stages that has gradients), none covered by
    another. InterleavedZeroBubble: at each of its Ws."""
    if schedule == "ZBVZeroBubble":
        return _zbv_moments(p, m, rank)
    return _frontier([_zb_window(p, v, m, s, rank) for s in _zb_passes(p, v, m, rank)])


def _zb_passes(p: int, v: int, m: int, rank: int) -> list[int]:
    """The W numbers whose windows (_zb_window) are all of a rank's: once every stage has
    its gradients (s >= (v - 1) N) and while neither its forwards nor its Is have run out,
    W number s + v N holds what W number s held (each count grows by N a round of v N),
    so the windows repeat and one round of them stands for all."""
    n = round_size(p, m)
    start = (v - 1) * n  # from here every stage has gradients
    end = m * v - max(_zb_forwards(p, v, m), rank + 1)  # the last s with s + v N uncapped
    if end - start < v * n:
        return list(range(m * v))
    return [*range(start + v * n), *range(end + 1, m * v)]


def _zbv_moments(p: int, m: int, rank: int) -> tuple[Moment, ...]:
    """ScheduleZBVZeroBubble's rank r: its steady state holds 2p stage micro-batches,
    (2p - r, r) at a W of stage 0 or (2p - 1 - r, r + 1) at one of stage 1, both stages
    with gradients, the W's own micro-batch past I; its cool-down (r > 0) holds (p, r),
    all past I. Fewer micro-batches than 2p cap them (then an upper bound: the first W,
    with only stage 1's gradients, counted with both's)."""
    steady = [_zbv_steady(p, m, rank, k) for k in (0, 1)]
    cool = [(_capped(m, p, rank), 0, _capped(m, rank + 1, rank))] if rank > 0 else []
    return _frontier(steady + cool)


def _zbv_steady(p: int, m: int, rank: int, k: int) -> Moment:
    """A ZB-V steady-state moment: at a W of stage k (see _zbv_moments)."""
    return _capped(m, 2 * p - rank - k, rank + k), 0, _capped(m, 1 - k, k)


def _capped(m: int, *counts: int) -> tuple[float, ...]:
    return tuple(float(min(m, c)) for c in counts)


def _frontier(moments: list[Moment]) -> tuple[Moment, ...]:
    """The moments no other one covers (as many micro-batches held and past I on every
    stage, and the gradients of as many stages)."""
    unique = list(dict.fromkeys(moments))
    counts = {x: x[0] + x[2] for x in unique}
    # A moment that covers another holds as much or more in all, so it comes first in
    # this order; what it covers is covered by a kept one: only those need comparing.
    kept: list[tuple[tuple[float, ...], int]] = []
    frontier = set()
    for x in sorted(unique, key=lambda x: (-sum(counts[x]), x[1])):
        mine, first = counts[x], x[1]
        if not any(k <= first and all(map(ge, more, mine)) for more, k in kept):
            kept.append((mine, first))
            frontier.add(x)
    return tuple(x for x in unique if x in frontier)


def chunk_held(schedule: str, p: int, v: int, m: int, rank: int) -> tuple[float, ...]:
    """Micro-batches each of the rank's v stages (in order) holds at its first backward:
    interleaved, the warm-up's in_flight x v stage micro-batches dealt out in rounds of
    round_size a stage (see the module's docstring); otherwise every stage in_flight."""
    if schedule in ZERO_BUBBLE:
        return zb_held(schedule, p, v, m, rank)
    held = in_flight(schedule, p, v, m, rank)
    if schedule not in INTERLEAVED or v == 1:
        return (held,) * v
    total, size = round(held * v), round_size(p, m)
    return tuple(float(_dealt(total, j, v, size)) for j in range(v))


def _dealt_all(ops: int, v: int, size: int) -> list[int]:
    """_dealt of each of the v stages, in order."""
    return [_dealt(ops, j, v, size) for j in range(v)]


def _dealt(ops: int, stage: int, v: int, size: int) -> int:
    """Of a rank's first `ops` stage micro-batches, dealt to its v stages in order in
    rounds of `size` a stage, those of `stage`."""
    rounds, rest = divmod(ops, v * size)
    return rounds * size + min(max(rest - stage * size, 0), size)


@dataclass(frozen=True)
class Stage:
    """What pipeline rank `rank` holds: its blocks (`chunks`: per stage it runs), the
    embeddings, the head and loss, and the micro-batches in flight (`held`: per stage;
    `in_flight`: of its blocks on average, `head_in_flight`: of the head's stage); `name`
    says which rank for the plan."""

    name: str
    blocks: int
    embeddings: bool
    head: bool
    in_flight: float
    rank: int
    chunks: tuple[int, ...] = ()
    held: tuple[float, ...] = ()
    head_in_flight: float | None = None


def rank_stage(w: Workload, dims: ParallelDims, schedule: str, v: int, m: int, rank: int) -> Stage:
    """Rank `rank`'s Stage (`w`'s shape, or its MoE model's, split by stage_blocks; valid
    degrees assumed)."""
    shape = w.shape or w.moe
    assert shape is not None
    p = dims.pp
    split = stage_blocks(shape.n_layer, p * v)
    assert split is not None, "pipeline degrees checked by the caller"
    mine = rank_stages(rank, p, v, schedule)
    name = "the first stage" if rank == 0 else "the last stage" if rank == p - 1 else f"stage {rank}"
    chunks = tuple(split[s] for s in mine)
    held = chunk_held(schedule, p, v, m, rank)
    head = p * v - 1 in mine
    return Stage(
        name, sum(chunks), 0 in mine, head, _weighted(chunks, held), rank, chunks, held,
        held[mine.index(p * v - 1)] if head else None,
    )


def _weighted(chunks: tuple[int, ...], held: tuple[float, ...]) -> float:
    """Micro-batches of all the rank's blocks that `held` of its stages amount to."""
    return sum(b * h for b, h in zip(chunks, held, strict=True)) / sum(chunks)


@lru_cache(maxsize=4096)
def stage_workload(w: Workload, stage: Stage) -> Workload:
    """`w` as one pipeline rank trains it: its blocks, the embeddings and head it holds
    (their parameters), the loss only on the head's rank, its micro-batches in flight.
    (Cached: the search asks for the same stages often.)"""
    part = stage_part(w, stage.blocks, stage.embeddings, stage.head)
    return replace(part, in_flight=stage.in_flight, head_in_flight=stage.head_in_flight)


@lru_cache(maxsize=4096)
def stage_part(w: Workload, blocks: int, embeddings: bool, head: bool) -> Workload:
    """`w` as a pipeline rank that holds `blocks` blocks (and the embeddings, the head)
    computes it, whatever it holds in flight: what its compute depends on, so the
    schedules that split the blocks alike share it. A Mixture-of-Experts model's:
    plan.moe.parallel.stage_part."""
    if w.moe is not None:
        from trainwise.plan.moe.parallel import stage_part as moe_part  # builds on this

        return moe_part(w, blocks, embeddings, head)
    assert w.shape is not None
    block, embedding_params, head_params = _parts(w)
    params = blocks * block + (embedding_params if embeddings else 0)
    params += head_params if head else 0
    return replace(
        w, params=int(params), shape=replace(w.shape, n_layer=max(1, blocks)), head=head
    )


def _parts(w: Workload) -> tuple[float, float, float]:
    """Parameters of (a block, the embeddings' stage's extra, the head's stage's extra:
    the head and final norm, and a tied head's copy of the embeddings)."""
    if w.moe is not None:
        from trainwise.plan.moe.parallel import parts  # builds on this module

        return parts(w)
    assert w.shape is not None
    shape = w.shape
    block, root = block_params(w)
    head = shape.vocab_size * shape.d_model if not shape.tie_embeddings else 0
    head += shape.d_model * (2 if shape.norm == "layernorm" and shape.bias else 1)
    embeddings = root - head  # tied: the one matrix, which the head's rank holds too
    tied = shape.vocab_size * shape.d_model if shape.tie_embeddings else 0
    return block, embeddings, head + tied


def rank_chunks(p: int, v: int, schedule: str) -> int:
    """The stages each rank of a `p`-stage pipeline holds (rank_stages: `v`, two on a V),
    each run forward apart from the others."""
    return len(rank_stages(0, p, v, schedule))


@lru_cache(maxsize=4096)
def stage_parts(n_layer: int, p: int, v: int, schedule: str) -> tuple[tuple[int, bool, bool], ...]:
    """(blocks, the embeddings, the head) of pipeline_stages' ranks, the first and the
    last: all their compute depends on, whatever they hold in flight (rank_stage's)."""
    split = stage_blocks(n_layer, p * v)
    assert split is not None, "pipeline degrees checked by the caller"
    out = []
    for rank in (0, p - 1):
        mine = rank_stages(rank, p, v, schedule)
        out.append((sum(split[s] for s in mine), 0 in mine, p * v - 1 in mine))
    return tuple(out)


@lru_cache(maxsize=65536)
def pipeline_stages(
    w: Workload, dims: ParallelDims, schedule: str, v: int, m: int
) -> tuple[Stage, Stage]:
    """The ranks that can be the worst: the first and the last (they hold the
    embeddings, the head, the most micro-batches in flight)."""
    return rank_stage(w, dims, schedule, v, m, 0), rank_stage(w, dims, schedule, v, m, dims.pp - 1)


def activation_message_bytes(w: Workload, tp: int, sequence_parallel: bool) -> float:
    """Bytes of one stage's output for one micro-batch, as one rank sends it."""
    shape = w.shape or w.moe
    assert shape is not None
    size = w.micro_batch * w.seq_len * shape.d_model * BYTES[w.precision]
    return size / tp if sequence_parallel and tp > 1 else size


def p2p_collective(
    w: Workload, dims: ParallelDims, layout: Layout, v: int, m: int, sequence_parallel: bool
) -> Collective:
    """The step's point-to-point traffic of one rank: m v activations forward and as many
    gradients back, to ranks world/pp away (across nodes once a stage fills one)."""
    one = activation_message_bytes(w, dims.tp, sequence_parallel)
    stride = layout.gpus // dims.pp
    messages = 2 * m * v
    return layout.collective(
        "pipeline send/recv activations", "send_recv", messages * one, (2, stride), messages,
        per_micro_batch=True,
    )


def p2p_exposed_seconds(p2p: Collective, p: int, v: int, m: int, compute_s: float) -> float:
    """The seconds the step waits for the point-to-point traffic: the sends along the
    fill and the drain (2(p v - 1) messages in a row, nothing to overlap them with), and
    what the steady state's sends take beyond its compute (torch.distributed.pipelining
    posts them asynchronously, beside the next micro-batch's compute)."""
    messages = 2 * m * v
    one = p2p.seconds / messages if messages else 0.0
    critical = 2 * (p * v - 1) * one
    return min(p2p.seconds, critical + max(0.0, p2p.seconds - critical - compute_s))


def setup_memory(w: Workload, setup: Setup, device: str, runtime_bytes: float = 0.0) -> MemoryEstimate:
    """estimate_memory of `setup`; with pipeline stages, of its worst stage (the first or
    the last), whose name leads the phase."""
    if setup.dims.pp == 1:
        return estimate_memory(w, setup, device, runtime_bytes)
    stage, est = worst_stage(w, setup, device, runtime_bytes)
    return replace(est, phase=f"{stage.name}, {est.phase}")


def worst_stage(
    w: Workload, setup: Setup, device: str, runtime_bytes: float = 0.0
) -> tuple[Stage, MemoryEstimate]:
    """The pipeline rank of `setup` that needs the most memory (of the first and the last),
    and its estimate_memory."""
    if (w.micro_batch, w.ac) != (setup.micro_batch, setup.ac):
        w = replace(w, micro_batch=setup.micro_batch, ac=setup.ac)
    stages = pipeline_stages(w, setup.dims, setup.schedule, setup.virtual, setup.grad_accum)
    priced = [(s, stage_memory(w, s, setup, device, runtime_bytes)) for s in stages]
    return max(priced, key=lambda pair: pair[1].total)


def stage_memory(
    w: Workload, stage: Stage, setup: Setup, device: str, runtime_bytes: float = 0.0
) -> MemoryEstimate:
    """estimate_memory of one pipeline rank. Interleaved1F1B and the zero-bubble
    schedules: the largest of its interleaved_moments or zb_moments. Otherwise a rank that runs every forward before its first
    backward (GPipe; 1F1B with no more micro-batches than the stages after it) holds all m
    micro-batches' activations before any gradient exists, and from the second backward
    on, which has the gradients, m - 1 at most."""
    if setup.schedule in ZERO_BUBBLE:
        p, v, m = setup.dims.pp, setup.virtual, setup.grad_accum
        moments = zb_moments(setup.schedule, p, v, m, stage.rank)
        return _moments_memory(w, stage, moments, setup, device, runtime_bytes)
    if len(stage.chunks) > 1 and setup.schedule in INTERLEAVED and setup.grad_accum > 1:
        moments = interleaved_moments(stage.held, setup.dims.pp, setup.grad_accum)
        return _moments_memory(w, stage, moments, setup, device, runtime_bytes)
    est = estimate_memory(stage_workload(w, stage), setup, device, runtime_bytes)
    if stage.in_flight < setup.grad_accum or setup.grad_accum == 1:
        return est
    first = estimate_memory(stage_workload(w, stage), replace(setup, grad_accum=1), device,
                            runtime_bytes)
    second = replace(stage, in_flight=stage.in_flight - 1)
    later = estimate_memory(stage_workload(w, second), setup, device, runtime_bytes)
    return max(first, later, key=lambda e: e.total)


@lru_cache(maxsize=65536)
def memory_floor(w: Workload, setup: Setup, device: str, runtime_bytes: float = 0.0) -> float:
    """Bytes at most setup_memory's total, for a fraction of its work: an
    InterleavedZeroBubble rank at one of its moments (floor_window) instead of the largest
    of all (zb_moments walks the step's weight-gradient passes to find them); setup_memory's
    own for the other schedules, which have a few. The search asks it first whether a
    setup can fit (cached: it asks again of a knob's smallest micro-batch as a candidate)."""
    if setup.dims.pp == 1 or setup.schedule != "InterleavedZeroBubble":
        return setup_memory(w, setup, device, runtime_bytes).total
    if (w.micro_batch, w.ac) != (setup.micro_batch, setup.ac):
        w = replace(w, micro_batch=setup.micro_batch, ac=setup.ac)
    p, v, m = setup.dims.pp, setup.virtual, setup.grad_accum
    most = 0.0
    for stage in pipeline_stages(w, setup.dims, setup.schedule, v, m):
        moment = [floor_window(p, v, m, stage.rank)]
        most = max(most, _moments_memory(w, stage, moment, setup, device, runtime_bytes).total)
    return most


@lru_cache(maxsize=4096)
def floor_window(p: int, v: int, m: int, rank: int) -> Moment:
    """One of an InterleavedZeroBubble rank's moments (_zb_window; zb_moments keeps those
    no other covers, and a covered one needs no more memory), its likeliest peak: at the W
    by which its last forward has run, holding as many stage micro-batches as at its
    first, with more stages' gradients."""
    return _zb_window(p, v, m, min(m * v - 1, max(0, m * v - _zb_forwards(p, v, m))), rank)


def interleaved_moments(held: tuple[float, ...], p: int, m: int) -> list[Moment]:
    """The moments an Interleaved1F1B rank can peak at, as (micro-batches each of its
    stages holds, the first of its stages that has gradients: stages k..v-1 have them);
    `held`: chunk_held. With one round, stage k's first backward for each k (stages above
    it drained); with more, the warm-up's activations beside every stage's gradients."""
    v = len(held)
    pairs = m * v - sum(held)  # the steady state's forward-backward pairs
    none = (0.0,) * v  # its backward runs whole: nothing waits for a W
    if pairs >= (v - 1) * round_size(p, m) + 1:  # every stage backs before the drain
        return [(held, 0, none)]
    return [(held[: k + 1] + (0.0,) * (v - 1 - k), k, none) for k in range(v - 1, -1, -1)]


def _moments_memory(
    w: Workload, stage: Stage, moments: Iterable[Moment], setup: Setup,
    device: str, runtime_bytes: float,
) -> MemoryEstimate:
    """The largest estimate_memory of a rank's `moments` (interleaved_moments, zb_moments)."""
    sw = stage_workload(w, stage)
    shares = _chunk_shares(w, stage)
    last = len(stage.chunks) - 1
    estimates = []
    for held, k, past in moments:
        head = stage.head and held[last] > 0
        moment = replace(
            sw, in_flight=_weighted(stage.chunks, held), head=head,
            head_in_flight=held[last] if head else None, grads_held=sum(shares[k:]),
            past_i=_past_i(stage, past),
        )
        estimates.append(estimate_memory(moment, setup, device, runtime_bytes))
    return max(estimates, key=lambda e: e.total)


def _past_i(stage: Stage, past: tuple[float, ...]) -> tuple[float, float, float]:
    """Workload.past_i of a rank whose stages hold `past` micro-batches past I: the blocks
    of its stages but the first pipeline stage (which skips I, stage.py), the head's
    stage, and every stage's received output gradient but the head's (its output is
    the loss)."""
    last = len(stage.chunks) - 1
    ran_i = [b * n for j, (b, n) in enumerate(zip(stage.chunks, past, strict=True))
             if not (j == 0 and stage.embeddings)]
    heads = past[last] if stage.head else 0.0
    return float(sum(ran_i)), heads, sum(past) - heads


def _chunk_shares(w: Workload, stage: Stage) -> list[float]:
    """Each of the rank's stages' share of its parameters: its blocks, and the embeddings
    or the head on the stage that holds them (LoRA's adapters taken as spread alike)."""
    block, embeddings, head = _parts(w)
    sizes = [b * block for b in stage.chunks]
    if stage.embeddings:
        sizes[0] += embeddings
    if stage.head:
        sizes[-1] += head
    return [x / sum(sizes) for x in sizes]
