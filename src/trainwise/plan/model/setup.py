"""One configuration the planner prices: a layout and the knobs a job file sets. The
planner's rows, its search and the runtime's decision are all setups, priced by the same
functions (plan.estimate.price; memory: plan.model.memory.estimate_memory)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from trainwise.config.parallel_dims import ParallelDims

if TYPE_CHECKING:
    from trainwise.plan.model.memory import Workload


@dataclass(frozen=True)
class Setup:
    """The layout and the knobs. `accumulate` (FSDP, grad_accum > 1): reduce-scatter once a
    step ("unsharded") or on every micro-batch ("sharded"). With pipeline stages
    (dims.pp > 1) `grad_accum` is the micro-batches the schedule `schedule` runs a step
    (parallel.pp_microbatches) over `virtual` stages per rank."""

    dims: ParallelDims
    ac: str
    micro_batch: int
    grad_accum: int
    accumulate: str = "unsharded"
    sequence_parallel: bool = True
    schedule: str = "1F1B"  # parallel.pp_schedule
    virtual: int = 1  # parallel.pp_virtual

    @classmethod
    def of(cls, dims: ParallelDims, w: Workload, grad_accum: int = 1, **knobs: object) -> Setup:
        """`dims` at the workload's own micro-batch and activation checkpointing."""
        return cls(dims, w.ac, w.micro_batch, grad_accum, **knobs)  # type: ignore[arg-type]
