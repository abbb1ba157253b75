"""What a check returns and what the doctor writes: one schema (pydantic) for doctor.json,
`--json` and the README. `trainwise plan --calibrate` reads the `bandwidth` block, the
loader's rate and the checkpoint latency.

Pure data: no torch.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

SCHEMA_VERSION = 1
Status = Literal["pass", "warn", "fail", "skip"]
SYMBOLS: dict[str, str] = {"pass": "✓", "warn": "!", "fail": "✗", "skip": "–"}


class CheckResult(BaseModel):
    """One line of the checklist, with the figures behind it."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(description="The check's key, as --only takes it.")
    title: str = Field(description="What was checked, in words.")
    status: Status
    measured: str = Field("", description="The figure measured here, with its unit.")
    expected: str = Field("", description="The figure the plan assumed, or the criterion.")
    detail: str = Field("", description="One sentence: what the figures mean.")
    fix: str | None = Field(None, description="What to do, on warn or fail.")
    seconds: float = Field(0.0, ge=0, description="How long the check took.")
    data: dict[str, Any] = Field(
        default_factory=dict, description="The measurements behind the line (tables, rows)."
    )

    @classmethod
    def skipped(cls, name: str, title: str, why: str) -> CheckResult:
        """A check that did not run here, and why."""
        return cls(name=name, title=title, status="skip", detail=why)


class Bandwidth(BaseModel):
    """Large-message bus bandwidth (nccl-tests' definition) per GPU, for the planner: the
    all-reduce's (the links' speed) and the all-to-all's."""

    model_config = ConfigDict(extra="forbid")

    intra_node_busbw_bytes_per_s: float | None = None
    inter_node_busbw_bytes_per_s: float | None = None
    # The all-to-all's (expert parallelism's dispatch and combine), nccl-tests' alltoall.
    intra_node_all_to_all_busbw_bytes_per_s: float | None = None
    inter_node_all_to_all_busbw_bytes_per_s: float | None = None


class MachineFigures(BaseModel):
    """What the doctor measured of this machine for the planner's calibrated model (the
    calibration file holds them too)."""

    model_config = ConfigDict(extra="forbid")

    step_s: float | None = Field(None, description="The job's step on every worker (scaling).")
    efficiency: float | None = Field(
        None, description="The share of peak FLOP/s that makes the plan's step the measured one."
    )
    cpu_runtime_bytes: float | None = Field(
        None, description="CPU: a worker's resident set added beyond the plan's tensors."
    )
    worker_baseline_bytes: float | None = Field(
        None, description="A worker's resident set before any model is built."
    )
    checkpoint_write_bytes_per_s: float | None = Field(
        None, description="The slowest rank's write speed (disk check)."
    )
    save_s: float | None = Field(None, description="A save of the job's state (smoke check).")
    save_latency_s: float | None = Field(
        None, description="That save less its bytes at the write speed: a save's fixed cost."
    )
    launch_s: float | None = Field(
        None, description="From the command's start to every worker joined."
    )
    gemm: dict[str, Any] | None = Field(
        None, description="CUDA: achieved efficiency per GEMM shape (a GEMM sweep's table)."
    )


class DoctorRecord(BaseModel):
    """doctor.json."""

    model_config = ConfigDict(extra="forbid")

    schema_version: Literal[1] = SCHEMA_VERSION
    created: float = Field(description="Unix time the doctor finished.")
    run_dir: str
    world: int = Field(ge=1, description="Workers the checks ran on.")
    device: str
    strategy: str = Field(
        description="The job's layout at this world size, as people read it (ParallelDims.name: "
        "fsdp, pp 2 x fsdp 2)."
    )
    elapsed_s: float = Field(ge=0)
    checks: list[CheckResult]
    bandwidth: Bandwidth = Field(default_factory=Bandwidth)
    data_samples_per_s_per_worker: float | None = Field(
        None, description="The configured loader's rate (data check), for the planner."
    )
    checkpoint_latency_s: float | None = Field(
        None,
        description="Seconds of a checkpoint save of a few bytes on every rank (disk check): "
        "a save's fixed cost, for the planner.",
    )
    machine: MachineFigures = Field(default_factory=MachineFigures)
    calibration_file: str | None = Field(
        None, description="Where the doctor wrote this machine kind's calibration."
    )

    @property
    def failed(self) -> bool:
        return any(c.status == "fail" for c in self.checks)


def schema() -> dict[str, Any]:
    """The JSON Schema of doctor.json (what the README documents)."""
    return DoctorRecord.model_json_schema()
