"""A layout's knobs and the candidates worth pricing of it: the settings the search varies
inside one layout (checkpointing, accumulation, the micro-batch; with pipeline stages the
schedule and its virtual stages), and the memory that decides whether each fits.

Without pipeline stages, at a fixed checkpointing and accumulation mode a larger
micro-batch is never slower in the models (plan.space), so only the largest that fits is
priced, found by bisection. With stages every micro-batch is a candidate of its own (a
larger one runs fewer of them: a larger bubble); plan.pipeline_search chooses which to
price.
"""

from __future__ import annotations

from typing import NamedTuple

from trainwise.config.parallel_dims import ParallelDims
from trainwise.plan.estimate import Setup, knob_workload
from trainwise.plan.inputs import PlanInputs
from trainwise.plan.model.memory import MemoryEstimate
from trainwise.plan.model.pipeline import setup_memory
from trainwise.plan.space import (
    Allowed,
    ac_modes,
    accumulations,
    layout_micro_batches,
    pipeline_micro_batches,
    replica_batch,
    schedules,
)

# A candidate the device's memory admits, with that memory.
Candidate = tuple[Setup, MemoryEstimate]


class Knob(NamedTuple):
    """One setting of a layout's knobs: checkpointing, accumulation mode, the micro-batch
    sizes it runs (ascending), and with pipeline stages the schedule and virtual stages."""

    ac: str
    accumulate: str
    micros: list[int]
    schedule: str = "1F1B"
    virtual: int = 1

    def setup(self, dims: ParallelDims, micro: int, batch: int) -> Setup:
        """The Setup of micro-batch size `micro` for a rank's `batch` samples."""
        return Setup(
            dims, self.ac, micro, -(-batch // micro), self.accumulate,
            schedule=self.schedule, virtual=self.virtual,
        )


def layout_knobs(inputs: PlanInputs, dims: ParallelDims, allowed: Allowed) -> list[Knob]:
    """The knobs of one layout, as Knobs; empty when no micro-batch the user allows splits
    the batch. With pipeline stages, one per schedule and virtual degree, unsharded
    (plan.space.pipeline_layouts)."""
    batch = replica_batch(inputs, dims)
    micros = layout_micro_batches(inputs, dims, batch, allowed)
    out = []
    for ac in ac_modes(inputs, allowed):
        if dims.pp > 1:
            for name, v in schedules(inputs, dims, allowed):
                runs = pipeline_micro_batches(dims, batch, name, micros, allowed)
                if runs:
                    out.append(Knob(ac, "unsharded", runs, name, v))
            continue
        for accumulate in ("unsharded", "sharded"):
            runs = [m for m in micros if accumulate in accumulations(dims, -(-batch // m), allowed)]
            if runs:
                out.append(Knob(ac, accumulate, runs))
    return out


def layout_candidates(
    inputs: PlanInputs, dims: ParallelDims, knobs: list[Knob]
) -> list[Candidate]:
    """The candidates worth pricing for one layout without pipeline stages, of its `knobs`
    (layout_knobs): for each checkpointing and accumulation mode, the largest micro-batch
    whose memory fits the device (larger is never slower, plan.space)."""
    found = (largest_fitting(inputs, dims, knob) for knob in knobs)
    return [candidate for candidate in found if candidate is not None]


def largest_fitting(inputs: PlanInputs, dims: ParallelDims, knob: Knob) -> Candidate | None:
    """The largest of the knob's micro-batches whose memory fits the device, or None. A
    smaller micro-batch never needs more memory while micro-batches accumulate (only the
    activations shrink), so it is found by bisection, after the whole batch in one
    micro-batch (which keeps no gradients between micro-batches)."""
    batch = replica_batch(inputs, dims)
    budget = inputs.hardware.memory_bytes * (1.0 - inputs.headroom)
    micros = knob.micros

    def priced(micro: int) -> Candidate:
        setup = knob.setup(dims, micro, batch)
        return setup, knob_memory(inputs, setup)

    whole = micros[-1] >= batch
    if whole and (candidate := priced(micros[-1]))[1].total <= budget:
        return candidate
    found = None
    lo, hi = 0, len(micros) - int(whole)  # micros[:lo] fit, micros[hi:] do not
    while lo < hi:
        mid = (lo + hi) // 2
        candidate = priced(micros[mid])
        if candidate[1].total <= budget:
            found, lo = candidate, mid + 1
        else:
            hi = mid
    return found


def knob_memory(inputs: PlanInputs, setup: Setup) -> MemoryEstimate:
    """estimate_memory of `setup` on the inputs' device, with the runtime's measured bytes."""
    w = knob_workload(inputs.workload, setup.micro_batch, setup.ac)
    return setup_memory(w, setup, inputs.hardware.device, inputs.memory_overhead_bytes)
