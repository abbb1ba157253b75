"""The short checks: versions, collective bandwidth, memory, disk. Each is a function of
the Context that every rank calls together and that returns the checklist line (the
figures on rank 0 are the job's: gathered or reduced over ranks)."""

from __future__ import annotations

import math
import os
import resource
import shutil
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from trainwise.config import job_hash
from trainwise.doctor import bandwidth
from trainwise.doctor.context import Context, plan_name
from trainwise.doctor.gap import PLAN_TOLERANCE, short_of
from trainwise.doctor.result import CheckResult
from trainwise.hardware.catalog import GB
from trainwise.plan import fmt_bytes
from trainwise.plan.calibrate import Calibration, apply_calibration
from trainwise.plan.estimate import evaluate
from trainwise.plan.model.memory import MemoryEstimate
from trainwise.plan.planner import COMM_BOUND_SHARE, sharded_name
from trainwise.run.checkpoint import store as store
from trainwise.run.checkpoint.store import root_for
from trainwise.run.job import versions

WHERE = {"intra_node": "within a node", "inter_node": "between nodes"}
WRITE_PROBE_BYTES = {"cuda": 256 * 2**20, "cpu": 32 * 2**20}  # the write test, at most
MIN_WRITE_PROBE = 8 * 2**20  # and at least (a smaller write times the cache, not the disk)


def _gbps(bps: float | None) -> str:
    return "-" if bps is None else f"{bps / GB:.3g} GB/s"


def check_versions(ctx: Context) -> CheckResult:
    per_rank = versions.gather_versions(job_hash(ctx.cfg), ctx.env.local_rank, ctx.host)
    diffs = versions.differences(per_rank)
    data = {"ranks": per_rank, "differences": diffs}
    title = "versions on every rank"
    if diffs:
        lines = versions.mismatch_lines(diffs)
        return CheckResult(
            name="versions", title=title, status="fail",
            measured=f"{len(diffs)} of {len(versions.FIELDS)} fields differ",
            expected="identical on every rank", detail="; ".join(lines),
            fix="install the same Python, torch, CUDA/NCCL and trainwise on every machine and "
            "give every rank the same config (trainwise env prints a machine's versions)",
            data=data,
        )
    first = per_rank[0]
    return CheckResult(
        name="versions", title=title, status="pass",
        measured=f"identical on {len(per_rank)} rank{'s' if len(per_rank) > 1 else ''}",
        expected="identical on every rank",
        detail=f"torch {first['torch']}, python {first['python']}, CUDA {first['cuda']}, "
        f"NCCL {first['nccl']}, trainwise {first['trainwise']}, code {first['code']}",
        data=data,
    )


def check_bandwidth(ctx: Context) -> CheckResult:
    title = "collective bandwidth"
    if ctx.world == 1:
        why = "one worker: no collective to time (run with --nproc 2 or more)"
        return CheckResult.skipped("bandwidth", title, why)
    d = ctx.cfg.doctor
    max_bytes = int(d.max_message_mb * 2**20) if d.max_message_mb else None
    max_bytes = max_bytes or bandwidth.MAX_BYTES[ctx.device.type]
    nodes = ctx.gather(bandwidth.node_id())
    rows = bandwidth.sweep_links(nodes, max_bytes, d.iterations, ctx.device, ctx.host)
    inputs = ctx.plan_inputs()
    hw = inputs.hardware
    measured, all_to_all = {}, {}
    for link, assumed in (("intra_node", hw.intra_bps), ("inter_node", hw.inter_bps)):
        # The slowest group of a link (each rank knows only its own).
        slowest = _slowest(ctx, bandwidth.large_message_busbw(rows, link))
        if slowest is not None:
            measured[link] = (slowest, assumed)
            ctx.measured[f"{link}_busbw_bytes_per_s"] = slowest
        # The all-to-all of expert parallelism's dispatch and combine, on the same link.
        slowest = _slowest(ctx, bandwidth.large_message_busbw(rows, link, "all_to_all"))
        if slowest is not None:
            all_to_all[link] = slowest
            ctx.measured[f"{link}_all_to_all_busbw_bytes_per_s"] = slowest
    # The planner's own model, with the measured links: would sharding be comm-bound?
    cal = Calibration(
        source="doctor",
        intra_bps=measured.get("intra_node", (None,))[0],
        inter_bps=measured.get("inter_node", (None,))[0],
    )
    measured_inputs, _ = apply_calibration(inputs, cal)
    fsdp = evaluate(measured_inputs, sharded_name(measured_inputs))
    share = fsdp.step.exposed_comm / fsdp.step.total
    bound = share > COMM_BOUND_SHARE
    verdict = (
        f"at this model size {fsdp.name} would wait for communication {share:.0%} of a step "
        f"({'communication-bound' if bound else 'not communication-bound'}, the limit is "
        f"{COMM_BOUND_SHARE:.0%})"
    )
    slow = [link for link, (bps, assumed) in measured.items() if short_of(bps, assumed)]
    status = "warn" if (slow or bound) else "pass"
    fix = cost = None
    if slow:
        # The job's own step, re-priced with the measured links.
        terms = ctx.job_terms()
        cost = terms.cost_of(evaluate(measured_inputs, plan_name(ctx.job)).step.total)
        fix = (
            f"{cost}: the plan assumed "
            f"{', '.join(_gbps(measured[k][1]) + ' ' + WHERE[k] for k in slow)}; re-plan with "
            f"the measured figures (trainwise plan --config ... --calibrate {ctx.run_dir})"
        )
    elif bound:
        fix = "prefer ddp or fsdp with shard = 'grad_op', a larger micro-batch, or faster links"
    largest = max((r.bytes for r in rows), default=0)
    return CheckResult(
        name="bandwidth", title=title, status=status,
        measured=f"all_reduce bus at {fmt_bytes(largest)}: " + ", ".join(
            f"{_gbps(bps)} {WHERE[k]}" for k, (bps, _) in measured.items()
        ) + ("; all_to_all " + ", ".join(
            f"{_gbps(bps)} {WHERE[k]}" for k, bps in all_to_all.items()) if all_to_all else ""),
        expected=", ".join(f"{_gbps(a)} {WHERE[k]}" for k, (_, a) in measured.items())
        + f" per worker (plan; passes within {PLAN_TOLERANCE:.0%} of it)",
        detail=verdict, fix=fix,
        data={"rows": [r.as_dict() for r in rows], "fsdp_exposed_share": share,
              "gap_cost": cost},
    )


def _slowest(ctx: Context, mine: float | None) -> float | None:
    """The smallest of every rank's figure (a rank without one counts none); every rank
    calls it together."""
    slowest = ctx.reduce(mine if mine is not None else math.inf, dist.ReduceOp.MIN)
    return slowest if math.isfinite(slowest) else None


def _resident_bytes() -> float:
    """Peak resident set of this process (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0


def check_memory(ctx: Context) -> CheckResult:
    title = "memory per worker"
    estimate = ctx.job.decision.estimate
    if ctx.device.type == "cuda":
        if "smoke_peak_bytes" not in ctx.measured:
            why = "needs the smoke check's steps (run it too: --only smoke,memory)"
            return CheckResult.skipped("memory", title, why)
        return _cuda_memory(ctx, title, estimate)
    rss = ctx.slowest(_resident_bytes())
    est = estimate.total
    return CheckResult(
        name="memory", title=title, status="pass",
        measured=f"{fmt_bytes(rss)} resident (process peak)",
        expected=f"{fmt_bytes(est)} of tensors (plan)",
        detail="on CPU the resident set also holds Python, torch's libraries and the "
        "allocator's cache; the plan counts tensors only",
        data={"resident_bytes": rss, "plan_bytes": est},
    )


def _cuda_memory(ctx: Context, title: str, estimate: MemoryEstimate) -> CheckResult:
    """The smoke steps' peak allocated against the plan's tensors. The allocator counts
    tensors only: the plan's overhead (CUDA context, fragmentation) is not in it, so it is
    compared with the plan's peak, and added back to judge the fit."""
    peak = ctx.slowest(ctx.measured["smoke_peak_bytes"])
    budget = ctx.job.decision.budget_bytes
    tensors = estimate.peak
    error = peak / tensors - 1 if tensors else 0.0
    fits = peak + estimate.overhead <= budget
    status = "fail" if not fits else ("warn" if abs(error) > PLAN_TOLERANCE else "pass")
    fix = None
    if status == "fail":
        fix = "the step does not fit: shard (strategy fsdp), checkpoint activations " \
              "(parallel.ac) or lower data.micro_batch"
    elif status == "warn":
        fix = "the plan is off for this model: size the job on the measured peak"
    return CheckResult(
        name="memory", title=title, status=status,
        measured=f"{fmt_bytes(peak)} peak allocated (training step)",
        expected=f"{fmt_bytes(tensors)} of tensors (plan; "
        f"{fmt_bytes(estimate.overhead)} more for the CUDA context and fragmentation)",
        detail=f"the plan is {'over' if error < 0 else 'under'} by {abs(error):.0%}",
        fix=fix,
        data={"peak_bytes": peak, "plan_bytes": tensors, "overhead_bytes": estimate.overhead,
              "budget_bytes": budget},
    )


def _write_speed(folder, size: int) -> float:
    """Bytes/s of writing `size` bytes to a file in `folder` and syncing it to disk."""
    path = folder / f".doctor-write-{os.getpid()}"
    block = os.urandom(4 * 2**20)
    try:
        start = time.perf_counter()
        with open(path, "wb") as f:
            for _ in range(max(1, size // len(block))):
                f.write(block)
            f.flush()
            os.fsync(f.fileno())
        return max(1, size // len(block)) * len(block) / (time.perf_counter() - start)
    finally:
        path.unlink(missing_ok=True)


def _save_latency(ctx: Context, folder) -> float:
    """Seconds of a checkpoint save of a few bytes into `folder`, on every rank together
    as the job saves: torch.distributed.checkpoint's planning, metadata and writes, then
    (rank 0, as the commit) the files' checksums and syncs and the rename. The fixed cost
    of a save, whatever its size; the slowest rank's."""
    tmp = folder / f".doctor-save-{ctx.run_dir.name}"
    failed = False
    start = time.perf_counter()
    try:
        writer = FileSystemWriter(str(tmp), thread_count=1)
        dcp.save({"probe": torch.zeros(1)}, storage_writer=writer)
        ctx.slowest(0.0)  # the commit starts when every rank has written
        if ctx.env.is_main:
            files = [p for p in tmp.rglob("*") if p.is_file()]
            store.hash_files(files)
            for path in [*files, tmp]:
                fd = os.open(path, os.O_RDONLY)
                os.fsync(fd)
                os.close(fd)
            tmp.rename(tmp.with_name(tmp.name + "-done"))
    except Exception:  # noqa: BLE001 - the write speed check reports the disk's error
        failed = True
    seconds = ctx.slowest(time.perf_counter() - start)
    if ctx.env.is_main:
        for path in (tmp, tmp.with_name(tmp.name + "-done")):
            shutil.rmtree(path, ignore_errors=True)
    return math.nan if failed else seconds


def _save_gap(ctx: Context, interval_min: float, extra_s: float) -> str:
    """The cost of every planned save taking `extra_s` longer, spread over the job's steps."""
    terms = ctx.job_terms()
    saves = terms.step_s * terms.steps / max(interval_min * 60, 1e-9)
    return terms.cost_of(terms.step_s + extra_s * saves / max(terms.steps, 1))


def check_disk(ctx: Context) -> CheckResult:
    title = "disk for checkpoints"
    c = ctx.cfg.checkpoint
    folder = root_for(ctx.run_dir, c.dir)
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent  # not made yet: its nearest existing parent's filesystem
    plan = ctx.planned()
    size = plan.checkpoint.size_bytes
    kept = c.keep_last + 1  # one more is being written while the last ones are kept
    free = ctx.reduce(float(shutil.disk_usage(folder).free), dist.ReduceOp.MIN)
    probe = min(max(int(size), MIN_WRITE_PROBE), WRITE_PROBE_BYTES[ctx.device.type])
    try:
        speed = _write_speed(folder, probe)
    except OSError as err:  # still join the reduction below: the others wait in it
        speed, ctx.measured["disk_error"] = 1e-9, str(err)
    # Every rank writes its shards at once: the node's speed is what the slowest sees.
    speed = 1.0 / ctx.slowest(1.0 / speed)
    latency = _save_latency(ctx, folder)
    assumed = c.write_gbps * GB
    ctx.measured["write_bytes_per_s"] = speed
    if not math.isnan(latency):
        ctx.measured["checkpoint_latency_s"] = latency
    else:
        latency = c.save_latency_s
    save_s, assumed_s = latency + size / speed, c.save_latency_s + size / assumed
    need = size * kept
    status, fix = "pass", None
    error = ctx.gather(ctx.measured.pop("disk_error", None))
    failed = [(rank, e) for rank, e in enumerate(error) if e]
    if failed:
        rank, e = failed[0]
        status = "fail"
        fix = f"rank {rank} cannot write to {folder}: {e}; free space or set checkpoint.dir"
    elif free < need:
        status = "fail"
        fix = f"free {fmt_bytes(need - free)} or set checkpoint.dir / checkpoint.keep_last"
    elif short_of(speed, assumed):
        status = "warn"
        fix = (
            f"{_save_gap(ctx, plan.checkpoint.interval_min, save_s - assumed_s)}: set "
            f"checkpoint.write_gbps = {speed / GB:.3g} so the interval is planned on it, "
            "or write to faster storage"
        )
    return CheckResult(
        name="disk", title=title, status=status,
        measured=f"{fmt_bytes(free)} free, writes at {_gbps(speed)}",
        expected=f"{fmt_bytes(need)} for {kept} checkpoints, {_gbps(assumed)} (plan; passes "
        f"within {PLAN_TOLERANCE:.0%} of it)",
        detail=f"a checkpoint of {fmt_bytes(size)} takes {save_s:.3g} s to write here, "
        f"{latency:.3g} s of it a save's fixed cost (the plan assumed {assumed_s:.3g} s)",
        fix=fix,
        data={"free_bytes": free, "needed_bytes": need, "write_bytes_per_s": speed,
              "checkpoint_bytes": size, "save_s": save_s, "assumed_save_s": assumed_s,
              "save_latency_s": latency},
    )
