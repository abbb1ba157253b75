"""The planner's performance model: the one seam through which a setup's seconds and bytes
are asked (`estimate.price` calls it). Two models:

- `AnalyticModel`: the formulas, with the catalog's figures and the plan's assumptions
  (compute from plan.compute, communication from plan.comm via estimate, memory from
  plan.memory). It adds no formula of its own.
- `CalibratedModel`: the same formulas with what a machine measured in place of the
  assumptions (a `Calibration`: a train run, a doctor run, or a doctor's calibration file).

A model travels with the inputs it priced (`PlanInputs.performance`), so every caller of
`price` (the search, the advisor, `train`'s plan.json) asks the same one.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Protocol

from trainwise.plan.model.compute import ComputeTime, compute_time
from trainwise.plan.model.pipeline import setup_memory

if TYPE_CHECKING:
    from trainwise.config.parallel_dims import ParallelDims
    from trainwise.plan.calibrate import Calibration
    from trainwise.plan.estimate import Setup
    from trainwise.plan.inputs import PlanInputs
    from trainwise.plan.model.comm import Collective
    from trainwise.plan.model.memory import MemoryEstimate, Workload


class PerformanceModel(Protocol):
    """What `estimate.price` asks of a model: a setup's compute, communication and memory."""

    name: str

    def adopt(self, inputs: PlanInputs) -> tuple[PlanInputs, list[str]]: ...

    def compute(
        self, inputs: PlanInputs, w: Workload, samples: float, tp: int,
        dims: ParallelDims | None = None, reference: bool = True, chunks: int = 1,
    ) -> ComputeTime: ...

    def communication(
        self, inputs: PlanInputs, setup: Setup, w: Workload, compute: float
    ) -> tuple[list[Collective], float, float]: ...

    def memory(self, inputs: PlanInputs, setup: Setup, w: Workload) -> MemoryEstimate: ...

    def header(self) -> str: ...


@dataclass(frozen=True)
class AnalyticModel:
    """Today's formulas on the catalog's figures and the plan's assumptions."""

    name: str = "analytic"

    def adopt(self, inputs: PlanInputs) -> tuple[PlanInputs, list[str]]:
        """`inputs` priced by this model, and one sentence per figure it replaced."""
        return replace(inputs, performance=self), []

    def compute(
        self, inputs: PlanInputs, w: Workload, samples: float, tp: int,
        dims: ParallelDims | None = None, reference: bool = True, chunks: int = 1,
    ) -> ComputeTime:
        return compute_time(inputs, w, samples, tp, dims, reference, chunks)

    def communication(
        self, inputs: PlanInputs, setup: Setup, w: Workload, compute: float
    ) -> tuple[list[Collective], float, float]:
        from trainwise.plan.estimate import _communication  # estimate imports this module

        return _communication(inputs, setup, w, compute)

    def memory(self, inputs: PlanInputs, setup: Setup, w: Workload) -> MemoryEstimate:
        return setup_memory(w, setup, inputs.hardware.device, inputs.memory_overhead_bytes)

    def header(self) -> str:
        """What the plan's figures rest on, for a plan's or a report's header."""
        return (
            "uncalibrated defaults (the catalog's figures and plan.* assumptions; "
            "`trainwise doctor` measures this machine)"
        )


@dataclass(frozen=True)
class CalibratedModel(AnalyticModel):
    """The analytic formulas on measured figures: the efficiency a run or the doctor
    achieved, the links per class, the loader's rate, the checkpoint latency and write
    speed, the runtime's memory. `calibration.gemm` (a GEMM table measured on CUDA) is
    carried for the per-operation compute model; plan.compute consumes it when it has one."""

    name: str = "calibrated"
    calibration: Calibration | None = None

    def adopt(self, inputs: PlanInputs) -> tuple[PlanInputs, list[str]]:
        from trainwise.plan.calibrate import apply_calibration

        assert self.calibration is not None
        measured, notes = apply_calibration(inputs, self.calibration)
        return replace(measured, performance=self), notes

    def header(self) -> str:
        cal = self.calibration
        assert cal is not None
        when = f", measured {cal.measured}" if cal.measured else ""
        return f"calibrated from {cal.source}{when}"


ANALYTIC = AnalyticModel()


def model_of(inputs: PlanInputs) -> PerformanceModel:
    """The model that prices `inputs` (the analytic one unless a calibration was adopted)."""
    return inputs.performance or ANALYTIC
