"""The doctor as a worker: join the group, run the checklist on every rank, and on rank 0
write `doctor.json` (started by the elastic agent as `python -m trainwise.doctor.runner
RUN_DIR`, or in-process for one worker)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from trainwise.config import JobConfig
from trainwise.doctor.calibration import (
    LAUNCH_ENV,
    launch_seconds,
    machine_figures,
    write_machine_calibration,
)
from trainwise.doctor.checklist import run_checks
from trainwise.doctor.context import Context
from trainwise.doctor.result import Bandwidth, DoctorRecord
from trainwise.faults import Faults
from trainwise.run.engine.worker import agree_run_dir, join_job, run_worker
from trainwise.run.job.distributed import (
    destroy_process_group,
    side_group,
)
from trainwise.run.observe.telemetry import mark_memory_baseline
from trainwise.whole_file import write_whole

RECORD_FILE = "doctor.json"


def run_doctor(cfg: JobConfig, run_dir: Path | None = None) -> DoctorRecord | None:
    """Every selected check on this rank; the record on rank 0 (None elsewhere). Without
    `run_dir` (started by torchrun or srun) rank 0 names it for all."""
    env, _, device, job = join_job(cfg)
    # Where the training worker takes it (joined, data built, no model yet): what the
    # job's steps add over it is the job's.
    baseline = mark_memory_baseline()
    launch_s = launch_seconds(os.environ.get(LAUNCH_ENV))
    run_dir = agree_run_dir(env, cfg, job, run_dir, label="doctor")
    start = time.perf_counter()
    host = side_group(cfg.parallel.timeout_s) if dist.is_initialized() else None
    faults = Faults.from_env(env.rank, run_dir, env.attempt)
    ctx = Context(cfg, job, env, device, run_dir, host, faults)
    if launch_s is not None:
        launch_s = ctx.slowest(launch_s)
    if baseline is not None:
        ctx.measured["baseline_rss_bytes"] = baseline
    results = run_checks(ctx, cfg.doctor.checks)
    machine = machine_figures(ctx, launch_s) if env.is_main else None
    if host is not None:
        dist.destroy_process_group(host)
    destroy_process_group()
    if not env.is_main:
        return None
    record = DoctorRecord(
        created=time.time(), run_dir=str(run_dir), world=env.world, device=job.device.name,
        strategy=job.dims.name, elapsed_s=time.perf_counter() - start, checks=results,
        bandwidth=Bandwidth(
            intra_node_busbw_bytes_per_s=ctx.measured.get("intra_node_busbw_bytes_per_s"),
            inter_node_busbw_bytes_per_s=ctx.measured.get("inter_node_busbw_bytes_per_s"),
            **{key: ctx.measured.get(key) for key in (
                "intra_node_all_to_all_busbw_bytes_per_s",
                "inter_node_all_to_all_busbw_bytes_per_s")},
        ),
        data_samples_per_s_per_worker=ctx.measured.get("data_samples_per_s"),
        checkpoint_latency_s=ctx.measured.get("checkpoint_latency_s"),
        machine=machine,
    )
    write_record(run_dir, record)
    path = write_machine_calibration(record, run_dir)
    if path is not None:  # doctor.json names it, for the checklist's last line
        record = record.model_copy(update={"calibration_file": str(path)})
        write_record(run_dir, record)
    return record


def write_record(run_dir: Path, record: DoctorRecord) -> None:
    """doctor.json, whole or not at all."""
    write_whole(run_dir / RECORD_FILE, record.model_dump_json(indent=1) + "\n")


def read_record(run_dir: Path) -> DoctorRecord:
    return DoctorRecord.model_validate_json((run_dir / RECORD_FILE).read_text())


@record
def main(argv: list[str] | None = None) -> int:
    """Entry of a doctor worker: `python -m trainwise.doctor.runner RUN_DIR`."""
    return run_worker(run_doctor, argv)


if __name__ == "__main__":
    from trainwise.process_exit import exit_process

    exit_process(main())
