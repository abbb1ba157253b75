"""Which of the pipeline layouts' candidates the search prices (plan.search weighs pipeline
stages by default; plan.max_pp only limits them).

A pipeline candidate (a layout of pp > 1 stages, a schedule and its virtual stages, a
checkpointing mode, a micro-batch) is simpler than none of the plans without stages, so
rank() can put it first only if it scores below the best of those that meets the goal,
and within SIMPLER_WITHIN of the best found. So candidates are taken in the order of a
bound under their score, and the search stops at the first bound past min(the best
without stages, the best found x (1 + SIMPLER_WITHIN)): every one left scores at least as
much, and no bound ever rises. The bounds, each under the next:
- a slot (a layout's schedule and virtual degree): its knob without recomputation;
- a knob (a slot's checkpointing mode): its largest micro-batch's compute with the bubble
  of its most micro-batches (estimate.micro_batch_floor: a larger micro-batch never
  computes longer in the models, plan.space; the bubble's share shrinks with more);
- a candidate's floor: its own compute and bubble (estimate.step_floor; the collectives,
  the host's work and the loader only add to a step);
- its score (price's, with its memory unestimated: the memory decides only whether it
  fits).
Memory, the dearest to price (each rank's stages at each moment it can peak), is asked
last: a knob is dropped whole when its smallest micro-batch does not fit (a smaller
micro-batch never needs more memory while micro-batches accumulate, which with stages
they always do: plan.knobs), and once a micro-batch does not fit the larger ones of its
knob are passed over; a knob and a candidate are first asked of a floor under their
memory (pipeline.memory_floor). What fits at its score is priced as recommend prices any,
so the choice is the exhaustive search's (tests/unit/test_search.py holds it against a
brute force).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable

from trainwise.config.parallel_dims import ParallelDims
from trainwise.plan.estimate import (
    SIMPLER_WITHIN,
    Setup,
    StrategyPlan,
    job_figures,
    knob_workload,
    micro_batch_floor,
    price,
    step_floor,
)
from trainwise.plan.inputs import PlanInputs
from trainwise.plan.knobs import Candidate, knob_memory, layout_knobs
from trainwise.plan.model.cost import Cost
from trainwise.plan.model.memory import MemoryEstimate
from trainwise.plan.model.pipeline import memory_floor
from trainwise.plan.space import Allowed, replica_batch

# The memory a setup is scored with before its own is estimated (price reads the memory
# only for whether it fits).
UNESTIMATED = MemoryEstimate(0.0, 0.0, 0.0, None, 0.0, phase="not estimated")

# The checkpointing mode that recomputes nothing: at a slot's largest micro-batch its compute
# is under every other mode's (recomputation only adds work), so its knob's floor bounds
# the slot's.
NO_RECOMPUTATION = "none"

# Rounding between a floor and the price it bounds (the same formulas, summed differently).
FLOOR_SLACK = 1e-9


# What a bound in the search's heap is: a slot's (a layout's schedule and virtual degree:
# its knobs, one a checkpointing mode), a knob's (its micro-batches, as setups), a setup's
# floor, its score.
SLOT, KNOB, FLOOR, SCORE = 0, 1, 2, 3


def pipeline_plans(
    inputs: PlanInputs,
    layouts: list[ParallelDims],
    allowed: Allowed,
    scored: Callable[[Cost], float],
    admitted: Callable[[StrategyPlan], bool],
    flat_best: float,
) -> list[StrategyPlan]:
    """The fitting plans of the pipeline `layouts` that could be chosen, and those priced
    on the way. `scored`: the goal's score of a cost (lower is better); `admitted`:
    whether a plan meets the goal's limits; `flat_best`: the best score of the plans
    without stages that meet them (inf: none)."""
    budget = inputs.hardware.memory_bytes * (1.0 - inputs.headroom)

    def floor(figures: tuple[float, float]) -> float:
        return scored(job_figures(inputs, figures[0], figures[1], 0.0)[1])

    def knob_floor(runs: tuple[Setup, ...]) -> float:
        return floor(micro_batch_floor(inputs, runs[-1], runs[0]))

    order = itertools.count()
    heap: list[tuple[float, int, int, tuple]] = []

    def push(bound: float, kind: int, item: tuple) -> None:
        heapq.heappush(heap, (bound, next(order), kind, item))

    for knobs in slots(inputs, layouts, allowed):
        if knobs[0][0].ac == NO_RECOMPUTATION:  # under every other mode's (see above)
            push(knob_floor(knobs[0]), SLOT, knobs)
        else:  # the checkpointing the job set: one knob
            for runs in knobs:
                push(knob_floor(runs), KNOB, runs)

    best, found = math.inf, []
    too_large: dict[tuple, int] = {}  # the smallest micro-batch of a knob that does not fit
    while heap:
        bound, _, kind, item = heapq.heappop(heap)
        if bound > min(flat_best, best * (1 + SIMPLER_WITHIN)) * (1 + FLOOR_SLACK):
            break
        if kind == SLOT:
            push(bound, KNOB, item[0])
            for runs in item[1:]:
                push(knob_floor(runs), KNOB, runs)
            continue
        setup = item[0]  # a knob's least memory: its smallest micro-batch
        knob = (setup.dims, setup.ac, setup.schedule, setup.virtual)
        if setup.micro_batch >= too_large.get(knob, math.inf):
            continue
        if kind != SCORE and not floor_fits(inputs, setup, budget):
            too_large[knob] = setup.micro_batch
        elif kind == KNOB:
            for each in item:
                push(floor(step_floor(inputs, each)), FLOOR, (each,))
        elif kind == FLOOR:  # its score: price's, whose memory decides only whether it fits
            push(scored(price(inputs, setup, memory=UNESTIMATED).cost), SCORE, item)
        elif (memory := knob_memory(inputs, setup)).total > budget:
            too_large[knob] = setup.micro_batch
        elif (plan := price(inputs, setup, memory=memory)).fits:  # the host's memory too
            found.append(plan)
            if admitted(plan):
                best = min(best, bound)
    return found


def slots(
    inputs: PlanInputs, layouts: list[ParallelDims], allowed: Allowed
) -> list[tuple[tuple[Setup, ...], ...]]:
    """The knobs (plan.knobs.layout_knobs) of the pipeline `layouts` by slot: a layout's
    schedule and virtual degree, its knobs in the order of space.AC_MODES (the least
    recomputation first), each its micro-batches as setups, ascending."""
    out: list[tuple[tuple[Setup, ...], ...]] = []
    for dims in layouts:
        batch = replica_batch(inputs, dims)
        found: dict[tuple[str, int], list[tuple[Setup, ...]]] = {}
        for knob in layout_knobs(inputs, dims, allowed):  # checkpointing outermost
            runs = tuple(knob.setup(dims, micro, batch) for micro in knob.micros)
            found.setdefault((knob.schedule, knob.virtual), []).append(runs)
        out += [tuple(knobs) for knobs in found.values()]
    return out


def floor_fits(inputs: PlanInputs, setup: Setup, budget: float) -> bool:
    """Whether the memory floor of `setup` (pipeline.memory_floor) fits `budget`."""
    w = knob_workload(inputs.workload, setup.micro_batch, setup.ac)
    device, overhead = inputs.hardware.device, inputs.memory_overhead_bytes
    return memory_floor(w, setup, device, overhead) <= budget


def least_memory(
    inputs: PlanInputs, layouts: list[ParallelDims], allowed: Allowed, below: float = math.inf
) -> list[Candidate]:
    """The candidates of the pipeline `layouts` that can need the least memory, with their
    memory: of each knob's smallest micro-batch (a larger one never needs less, as above),
    those whose memory floor (pipeline.memory_floor) is at most the least found, in the
    order of their floors, and at most `below` (the least of the plans without stages):
    every other one needs more."""
    device, overhead = inputs.hardware.device, inputs.memory_overhead_bytes
    floors = []
    for dims in layouts:
        batch = replica_batch(inputs, dims)
        for knob in layout_knobs(inputs, dims, allowed):
            setup = knob.setup(dims, knob.micros[0], batch)
            w = knob_workload(inputs.workload, setup.micro_batch, setup.ac)
            floors.append((memory_floor(w, setup, device, overhead), len(floors), setup))
    out: list[Candidate] = []
    for floor, _, setup in sorted(floors):
        if floor > below:
            break
        memory = knob_memory(inputs, setup)
        out.append((setup, memory))
        below = min(below, memory.total)
    return out
