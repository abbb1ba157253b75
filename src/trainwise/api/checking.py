"""`doctor()`: the job's preflight checklist on its machines, as a `DoctorResult`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainwise.api.job import (
    JOB_KEYWORDS,
    JobSource,
    JobSpec,
    by_value_names,
    import_roots,
    job_spec,
    model_key,
    named_objects,
)

if TYPE_CHECKING:
    from trainwise.doctor.result import DoctorRecord


@dataclass(frozen=True)
class DoctorResult:
    """What doctor() returns: the checklist (doctor.json's record; None where rank 0's
    machine has it), its run directory, and `message` when the record is elsewhere."""

    run_dir: Path | None
    record: DoctorRecord | None = None
    message: str = ""

    @property
    def failed(self) -> bool:
        """Whether a check failed (`trainwise doctor` exits 1 then)."""
        return bool(self.record is not None and self.record.failed)


def doctor(
    config: JobSource = None,
    *,
    only: Sequence[str] | None = None,
    model: Any = None,
    nproc: int | None = None,
    strategy: str | None = None,
    precision: str | None = None,
    steps: int | None = None,
    run_dir: str | Path | None = None,
    oversubscribe: bool | None = None,
    overrides: Mapping[str, Any] | None = None,
    **sections: Mapping[str, Any],
) -> DoctorResult:
    """Run the job's preflight checklist on the machines it will run on, every worker
    taking part: versions, bandwidth, data pipeline, scaling, smoke test, memory, disk
    (`only`: a subset, by name). Writes RUN/doctor.json (and this machine kind's
    calibration, which later plans and runs use)."""
    shortcuts = {
        "only": None if only is None else list(only), "model": model_key(model),
        "nproc": nproc, "strategy": strategy, "precision": precision, "steps": steps,
        "run_dir": None if run_dir is None else str(run_dir), "oversubscribe": oversubscribe,
    }
    with named_objects(by_value_names({"model": model}, shortcuts)):
        return doctor_job(job_spec(config, shortcuts, JOB_KEYWORDS, sections, overrides))


def doctor_job(spec: JobSpec) -> DoctorResult:
    """doctor() of a JobSpec (what the CLI gives, its flags named)."""
    import time

    from trainwise.doctor.calibration import LAUNCH_ENV
    from trainwise.doctor.runner import read_record, run_doctor
    from trainwise.run.launch.start import is_worker, start_job

    cfg, _ = spec.load()
    import_roots(spec, cfg)
    if is_worker(cfg):  # started by torchrun or srun: one of the workers
        record = run_doctor(cfg)
        return DoctorResult(None, record)
    run_dir = start_job(
        cfg, run_doctor, "trainwise.doctor.runner", label="doctor",
        environment={LAUNCH_ENV: str(time.time())},  # the workers time their start from it
    )
    if not (run_dir / "doctor.json").is_file():  # rank 0 is on another machine
        return DoctorResult(
            run_dir, message=f"this machine's checks finished; rank 0's machine has {run_dir}"
        )
    return DoctorResult(run_dir, read_record(run_dir))
