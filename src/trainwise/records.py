"""The measurements a run leaves, as types: job.json (`JobRecord`) and the figures of a
run's plan.json that are compared with what ran (`RunPlanFigures`). The writer builds the
record and writes `to_dict()`; readers (the calibration, the report) take `from_dict()`
instead of reading keys back by name. A field a file lacks (an older run, a hand-made
one) reads as None: each reader says what it cannot do without it.

Pure data: no torch.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any


def _known(cls: type, data: dict[str, Any]) -> dict[str, Any]:
    names = {f.name for f in fields(cls)}
    return {k: v for k, v in data.items() if k in names}


@dataclass(frozen=True)
class JobRecord:
    """job.json: the job as it was resolved on its machines (run.job.Job.summary_dict)."""

    world: int = 1
    device: str | None = None
    device_kind: str | None = None
    backend: str | None = None
    strategy: str | None = None  # the data-parallel part's shortcut
    layout: str | None = None  # every degree: ParallelDims.describe()
    layout_name: str | None = None  # as people read it: ParallelDims.name (pp 2 x fsdp 2)
    plan_name: str | None = None
    requested_strategy: str | None = None
    cpu_offload: bool = False
    replicate: int = 1
    grad_accum: int = 1
    accumulate: str | None = None
    reason: str = ""
    params: int | None = None
    # LoRA: the parameters that train (adapters, and embeddings / head when they train)
    # and the model's with its adapters; None when every parameter trains.
    trainable_params: int | None = None
    total_params: int | None = None
    global_batch: int | None = None
    tokens_per_step: int | None = None
    flops_per_token: float | None = None
    # Hardware FLOPs per model FLOP (activation recomputation), and the device's peak that
    # the MFU is measured against: what a calibration needs.
    recompute_factor: float = 1.0
    peak_flops_per_device: float | None = None
    precision: str | None = None
    memory_estimate: dict[str, float] = field(default_factory=dict)
    device_budget_bytes: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> JobRecord:
        return cls(**_known(cls, data))


@dataclass(frozen=True)
class StepFigures:
    """A planned step, in seconds (plan.json `step`)."""

    compute: float = 0.0
    comm: float = 0.0
    exposed_comm: float = 0.0
    data: float = 0.0
    total: float = 0.0


@dataclass(frozen=True)
class RunPlanFigures:
    """What a run's plan.json assumed and predicted, where the run measures the same:
    the step, the memory per worker, a save, and the assumptions behind them."""

    gpus: int = 1
    step: StepFigures = field(default_factory=StepFigures)
    memory_total: float | None = None  # bytes per worker, overhead included
    memory_overhead: float = 0.0
    save_s: float | None = None
    efficiency: float | None = None
    intra_node_gbps: float | None = None
    checkpoint_write_gbps: float | None = None
    calibrated: bool | None = None  # None: a plan.json older than the calibrated model

    @classmethod
    def from_dict(cls, plan: dict[str, Any]) -> RunPlanFigures:
        memory = plan.get("memory_per_gpu") or {}
        return cls(
            gpus=int(plan.get("gpus") or 1),
            step=StepFigures(**_known(StepFigures, plan.get("step") or {})),
            memory_total=memory.get("total"),
            memory_overhead=memory.get("overhead") or 0.0,
            save_s=(plan.get("checkpoint") or {}).get("save_s"),
            efficiency=plan.get("efficiency"),
            intra_node_gbps=plan.get("intra_node_gbps"),
            checkpoint_write_gbps=plan.get("checkpoint_write_gbps"),
            calibrated=plan.get("calibrated"),
        )
