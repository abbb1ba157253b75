"""Is the job data-bound? The configured loader's rate with 0, 1, 2, ... worker processes
against the rate the training step consumes batches (timed on batches held in memory).

With no worker process the loader runs inside the step: its time adds to the step's.
With workers it prefetches beside the step: the step waits only for what the loader is
slower than the step."""

from __future__ import annotations

import time

import torch.distributed as dist

from trainwise.data import build_loader
from trainwise.doctor.context import Context, timed_steps
from trainwise.doctor.result import CheckResult
from trainwise.hardware.detect import usable_cores
from trainwise.plan.advisor import loader_fixes
from trainwise.plan.planner import DATA_BOUND_SHARE
from trainwise.run.engine.trainer import build_trainer

MAX_WORKERS = 4  # worker counts tried: 0 .. min(this, the cores per rank)


def wait_seconds(data_s: float, compute_s: float, workers: int) -> float:
    """Seconds a step waits for data: all of the loading in line, what outlasts the step
    with workers."""
    return data_s if workers == 0 else max(0.0, data_s - compute_s)


def wait_share(data_s: float, compute_s: float, workers: int) -> float:
    """The share of a step spent waiting for data."""
    if workers == 0:
        return data_s / (data_s + compute_s) if data_s + compute_s > 0 else 0.0
    return max(0.0, data_s - compute_s) / max(data_s, compute_s, 1e-12)


def loader_seconds_per_step(ctx: Context, workers: int, dp_rank: int, dp_size: int) -> float:
    """Seconds the loader takes for one step's micro-batches (its start-up excluded)."""
    c = ctx.cfg
    batches = ctx.cfg.doctor.data_batches
    # Worker start-up and what the workers prefetch meanwhile are paid once per run: read
    # them before the clock starts.
    ahead = 1 + workers * c.data.prefetch_factor
    loader = build_loader(
        ctx.faults.data(ctx.job.datasets[0]), micro_batch=c.data.micro_batch, grad_accum=1,
        dp_rank=dp_rank,
        dp_size=dp_size, seed=c.train.seed, num_steps=batches + ahead, num_workers=workers,
        pin_memory=c.data.pin_memory and ctx.device.type == "cuda",
        prefetch_factor=c.data.prefetch_factor,
    )
    it = iter(loader)
    for _ in range(ahead):
        next(it)
    start = time.perf_counter()
    n = sum(1 for _ in it)
    per_batch = (time.perf_counter() - start) / max(n, 1)
    del it, loader
    return ctx.slowest(per_batch * ctx.job.grad_accum)


def check_data(ctx: Context) -> CheckResult:
    c = ctx.cfg
    trainer = build_trainer(c, ctx.job, ctx.device, faults=ctx.faults)
    compute_s = timed_steps(trainer, ctx.batches(trainer), c.doctor.timed_steps, ctx)
    dp = (trainer.dp_rank, trainer.dp_size)  # asked of the job's mesh
    del trainer
    # The same counts on every rank (each count is a collective): the fewest cores any
    # rank has.
    cores = int(ctx.reduce(max(1, usable_cores() // ctx.env.local_world), dist.ReduceOp.MIN))
    counts = sorted({0, *range(1, min(MAX_WORKERS, cores) + 1), c.data.num_workers})
    rows = []
    for workers in counts:
        data_s = loader_seconds_per_step(ctx, workers, *dp)
        rows.append(
            {"workers": workers, "data_s": data_s,
             "wait_share": wait_share(data_s, compute_s, workers)}
        )
    mine = next(r for r in rows if r["workers"] == c.data.num_workers)
    share = mine["wait_share"]
    samples = c.data.micro_batch * ctx.job.grad_accum
    ctx.measured["data_samples_per_s"] = samples / mine["data_s"]
    status, fix, cost = "pass", None, None
    if share > DATA_BOUND_SHARE:
        status = "warn"
        better = [r for r in rows if r["wait_share"] <= DATA_BOUND_SHARE]
        fix = loader_fixes(c.data.num_workers, ctx.device.type == "cuda")
        if better:
            fix = (
                f"set data.num_workers = {better[0]['workers']}: the wait measured with it is "
                f"{better[0]['wait_share']:.0%}"
            )
        # The plan's step assumes the loader keeps up: the wait comes on top of it.
        terms = ctx.job_terms()
        wait = wait_seconds(mine["data_s"], compute_s, c.data.num_workers)
        cost = terms.cost_of(terms.step_s * (1 + wait / max(compute_s, 1e-12)))
        fix = f"{cost}: {fix}"
    return CheckResult(
        name="data", title="data pipeline", status=status,
        measured=f"{mine['data_s'] * 1e3:.3g} ms of loading per step "
        f"({samples / mine['data_s']:.4g} samples/s per worker with "
        f"data.num_workers = {c.data.num_workers}); the step computes in "
        f"{compute_s * 1e3:.3g} ms",
        expected=f"waiting under {DATA_BOUND_SHARE:.0%} of a step",
        detail=f"the {'GPUs' if ctx.device.type == 'cuda' else 'workers'} would wait for data "
        f"{share:.0%} of the time" + (" (data-bound)" if status == "warn" else ""),
        fix=fix,
        data={"compute_s": compute_s, "rows": rows, "wait_share": share, "gap_cost": cost,
              "data_s": mine["data_s"], "num_workers": c.data.num_workers},
    )
