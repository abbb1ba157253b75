"""Does the job scale on these workers? The configured job timed on 1, 2, 4, ... ranks
inside one launch: ranks 0..k-1 form a process group and train together while the others
wait, so no relaunch is needed. Batches are held in memory (the data check judges the
loader). Beside each row, the plan's prediction for the same strategy and world size."""

from __future__ import annotations

import gc
import itertools

import torch.distributed as dist

from trainwise.doctor.context import Context, plan_name, timed_steps
from trainwise.doctor.gap import JobTerms, short_of, threshold
from trainwise.doctor.result import CheckResult
from trainwise.plan.planner import KNEE_SHARE
from trainwise.run.engine.trainer import build_trainer
from trainwise.run.job.resolve import Job, prepare_job
from trainwise.run.observe.telemetry import resident_peak, restart_memory_peak


def worker_counts(world: int) -> list[int]:
    counts, k = [], 1
    while k < world:
        counts.append(k)
        k *= 2
    return counts + [world]


def _time_world(ctx: Context, k: int) -> tuple[float, Job]:
    """Seconds per step of the job on ranks 0..k-1 (on those ranks; others get 0), and the
    job as it ran at that size. Every rank must call it: group creation is collective."""
    ranks = list(range(k))
    group = dist.new_group(ranks)  # the job's backend: what training would use
    gloo = dist.get_backend() == "gloo"  # (a rank outside `group` cannot ask the group)
    host = group if gloo else dist.new_group(ranks, backend="gloo")
    local = min(k, ctx.env.local_world)
    job = prepare_job(ctx.cfg, k, ctx.job.device, local, lambda *_: ctx.job.base_weights)
    seconds = 0.0
    measure = k == ctx.world and ctx.device.type == "cpu"
    if measure:
        gc.collect()
        restart_memory_peak()  # the peak of the job's own build and steps
    if ctx.env.rank < k:
        try:
            trainer = build_trainer(ctx.cfg, job, ctx.device, group=group, faults=ctx.faults)
            batches = ctx.batches(trainer)
            seconds = timed_steps(trainer, batches, ctx.cfg.doctor.timed_steps, ctx, host)
            del trainer, batches
        finally:
            for g in [group] if gloo else [group, host]:
                dist.destroy_process_group(g)
    if measure and "baseline_rss_bytes" in ctx.measured:
        # What the job added over a worker's baseline, as a training worker measures it:
        # on the rank that built no model before (the smaller rows ran on the first ranks),
        # so its library pages are first touched here, as in a fresh worker.
        added = float(resident_peak() - ctx.measured["baseline_rss_bytes"])
        ctx.measured["rss_added_bytes"] = ctx.reduce(added, dist.ReduceOp.MIN)
    dist.barrier(group=ctx.host)
    return seconds, job


def check_scaling(ctx: Context) -> CheckResult:
    title = "scaling over workers"
    if ctx.world == 1:
        why = "one worker: nothing to compare (run with --nproc 2 or more)"
        return CheckResult.skipped("scaling", title, why)
    if ctx.job.dims.ep > 1:  # before hsdp: ddp with ep runs as FSDP2's replication
        why = ("expert parallelism needs its ep workers: fewer workers would be another "
               "layout")
        return CheckResult.skipped("scaling", title, why)
    if ctx.job.dims.hybrid:
        why = "hsdp needs whole nodes: fewer workers would be another strategy"
        return CheckResult.skipped("scaling", title, why)
    if ctx.job.dims.tp > 1:
        why = "tensor parallelism needs its tp workers: fewer workers would be another layout"
        return CheckResult.skipped("scaling", title, why)
    if ctx.job.dims.pp > 1:
        why = "pipeline stages need their pp workers: fewer workers would be another layout"
        return CheckResult.skipped("scaling", title, why)
    c = ctx.cfg
    tokens = c.data.micro_batch * ctx.job.grad_accum * ctx.job.data.tokens_per_sample
    rows: list[dict] = []
    for k in worker_counts(ctx.world):
        seconds, job = _time_world(ctx, k)
        seconds = ctx.slowest(seconds)  # rank 0 of the k ranks has it; share it
        predicted = ctx.planned(k, job)
        rows.append(
            {"workers": k, "strategy": plan_name(job), "step_s": seconds,
             "tokens_per_s": k * tokens / seconds, "plan_tokens_per_s": predicted.tokens_per_s}
        )
    if rows[-1]["workers"] == ctx.world:  # the job itself: what calibrates the compute rate
        ctx.measured["job_step_s"] = rows[-1]["step_s"]
    return judge_scaling(rows, ctx.job_terms())


def judge_scaling(rows: list[dict], terms: JobTerms) -> CheckResult:
    """The checklist line of timed `rows` (workers, step_s, tokens_per_s and the plan's
    plan_tokens_per_s, from one worker up): the efficiency on the most workers passes only
    within the plan's tolerance of the plan's; short of it, the line says what it costs."""
    base, plan_base = rows[0]["tokens_per_s"], rows[0]["plan_tokens_per_s"]
    for row in rows:
        k = row["workers"]
        row["efficiency"] = row["tokens_per_s"] / (k * base)
        row["plan_efficiency"] = row["plan_tokens_per_s"] / (k * plan_base)
    slower = [
        b["workers"] for a, b in itertools.pairwise(rows) if b["tokens_per_s"] < a["tokens_per_s"]
    ]
    last = rows[-1]
    measured, planned = last["efficiency"], last["plan_efficiency"]
    # Each worker's share of the work is the plan's: its step is longer by planned/measured.
    cost = terms.cost_of(terms.step_s * planned / measured) if measured > 0 else None
    status, fix = "pass", None
    if slower:
        status = "warn"
        fix = (
            f"adding workers made it slower at {', '.join(map(str, slower))} workers: the step "
            "is too small for its communication; raise data.micro_batch, prefer ddp or "
            "fsdp with shard = 'grad_op', or use fewer workers"
        )
    elif short_of(measured, planned):
        status = "warn"
        fix = (
            f"{cost} against the plan's scaling: run `trainwise doctor --only bandwidth` "
            "to see whether the links are slower than planned, or use a larger micro-batch"
        )
    elif measured < KNEE_SHARE:
        status = "warn"
        fix = "each added worker buys less than half of its share: use fewer workers or a " \
              "larger micro-batch"
    return CheckResult(
        name="scaling", title="scaling over workers", status=status,
        measured=f"{measured:.0%} efficiency on {last['workers']} workers "
        f"({last['tokens_per_s']:,.0f} against {base:,.0f} tokens/s on one)",
        expected=f"{planned:.0%} (plan; {threshold(planned, '.0%')})",
        detail="; ".join(
            f"{r['workers']}: {r['tokens_per_s']:,.0f} tokens/s ({r['efficiency']:.0%})"
            for r in rows
        ),
        fix=fix, data={"rows": rows, "slower_at": slower, "gap_cost": cost},
    )
