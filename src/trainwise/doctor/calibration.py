"""What the doctor's checks measured, turned into the planner's terms (doctor.json's
`machine` block), and the machine kind's calibration file written from doctor.json.

The checks leave their figures in `Context.measured`: the job's step on every worker
and the resident set its build and steps added (scaling, `job_step_s`,
`rss_added_bytes`), the smoke save (`smoke_save_s`), the write speed
(`write_bytes_per_s`), and on CUDA a
GEMM sweep's table (`gemm`, stored by the check that measures it). Here they become an
efficiency, a runtime memory and a save latency against the analytic plan of the same job.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

from trainwise.doctor.context import Context
from trainwise.doctor.result import DoctorRecord, MachineFigures
from trainwise.hardware.catalog import find_gpu
from trainwise.plan.calibrate import (
    Calibration,
    apply_calibration,
    calibration_path,
    read_calibration,
    write_calibration,
)
from trainwise.plan.estimate import Setup, StrategyPlan, price
from trainwise.plan.model.compute import achieved_share
from trainwise.plan.model.performance import ANALYTIC

LAUNCH_ENV = "TRAINWISE_LAUNCH_TIME"  # the command's start (Unix time), for the workers


def job_plan(ctx: Context) -> StrategyPlan:
    """The analytic plan of the job as it runs here, on the links the doctor measured
    (the data term left out: the timed steps hold their batches in memory)."""
    inputs = replace(ctx.plan_inputs(), data_samples_per_s=None)
    links = Calibration(
        source="doctor",
        intra_bps=ctx.measured.get("intra_node_busbw_bytes_per_s"),
        inter_bps=ctx.measured.get("inter_node_busbw_bytes_per_s"),
    )
    inputs, _ = apply_calibration(inputs, links)
    c, job = ctx.cfg, ctx.job
    setup = Setup(job.dims, c.parallel.ac, c.data.micro_batch, job.grad_accum, job.accumulate)
    return price(inputs, setup, model=ANALYTIC)


def machine_figures(ctx: Context, launch_s: float | None) -> MachineFigures:
    """The measured figures in the planner's terms (rank 0's view of the job)."""
    m, plan = ctx.measured, job_plan(ctx)
    efficiency = None
    step_s = m.get("job_step_s")
    if step_s:
        # The step less what the plan does not spend computing is the measured compute;
        # the efficiency scales by the miss (compute is FLOPs over the efficiency).
        compute_s = step_s - (plan.step.total - plan.step.compute)
        if compute_s > 0:
            efficiency = min(1.0, achieved_share(ctx.plan_inputs(), plan, compute_s))
    runtime = None
    if ctx.device.type == "cpu" and m.get("rss_added_bytes") is not None:
        runtime = max(0.0, m["rss_added_bytes"] - plan.memory.total)
    speed, save_s = m.get("write_bytes_per_s"), m.get("smoke_save_s")
    latency = None
    if speed and save_s is not None:
        latency = max(0.0, save_s - plan.checkpoint.size_bytes / speed)
    return MachineFigures(
        step_s=step_s, efficiency=efficiency, cpu_runtime_bytes=runtime,
        worker_baseline_bytes=m.get("baseline_rss_bytes"), checkpoint_write_bytes_per_s=speed,
        save_s=save_s, save_latency_s=latency, launch_s=launch_s, gemm=m.get("gemm"),
    )


def launch_seconds(start: str | None) -> float | None:
    """Seconds since the command started (`start`: LAUNCH_ENV's value), when it is known."""
    try:
        return max(0.0, time.time() - float(start)) if start else None
    except ValueError:
        return None


def write_machine_calibration(record: DoctorRecord, run_dir: Path) -> Path | None:
    """This machine kind's calibration file, from the doctor.json in `run_dir`; None when
    the catalog does not know the device (no kind to file it under)."""
    spec = find_gpu(record.device)
    if spec is None:
        return None
    measured = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(record.created))
    cal = replace(
        read_calibration(run_dir, where=str(run_dir)),
        source=f"trainwise doctor {run_dir}", kind=spec.name, measured=measured,
    )
    path = calibration_path(spec.name)
    write_calibration(cal, path)
    return path
