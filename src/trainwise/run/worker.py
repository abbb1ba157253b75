"""A training worker, top to bottom: process group -> job -> model -> parallelize ->
optimizer -> data -> loop -> summary. Started by the elastic agent (`python -m
trainwise.run.worker RUN_DIR`), by torchrun / srun through the CLI, or in-process for
one worker."""

from __future__ import annotations

import json
import statistics
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from trainwise.config import JobConfig, dump_toml, load_config
from trainwise.data import build_loader
from trainwise.hardware import detect_device
from trainwise.models import build_model
from trainwise.plan.flops import mfu
from trainwise.run.distributed import (
    DistEnv,
    destroy_process_group,
    dist_env_from,
    get_logger,
    init_process_group,
)
from trainwise.run.job import Job, prepare_job
from trainwise.run.loop import Stepper, evaluate, mean_over_ranks
from trainwise.run.optim import build_optimizer, build_scheduler
from trainwise.run.parallelize import parallelize
from trainwise.run.precision import autocast_context, build_grad_scaler
from trainwise.run.telemetry import (
    STAGES,
    MetricsWriter,
    Progress,
    StepRecord,
    peak_memory,
)

FIRST_PROBE_STEP = 3  # after the first steps' one-off costs (allocations, warm caches)
PROBE_WINDOW = 5  # exposed sync = median of the latest probes: one probe is noisy on CPU


def default_run_dir(cfg: JobConfig, strategy: str) -> Path:
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    model = cfg.model.name.replace(":", "-").replace("/", "-").replace(".", "-")[-40:]
    return Path("runs") / f"{stamp}-{model}-{strategy}"


def write_run_files(run_dir: Path, cfg: JobConfig, job: Job) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.toml").write_text(dump_toml(cfg))
    (run_dir / "job.json").write_text(json.dumps(job.summary_dict(), indent=2) + "\n")


def train(cfg: JobConfig, run_dir: Path | None = None) -> dict[str, Any] | None:
    """Train as one worker of the job; returns the run summary on rank 0."""
    env = dist_env_from()
    log = get_logger(env)
    info = detect_device(cfg.cluster.device)
    device = torch.device("cuda", env.local_rank) if info.kind == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    job = prepare_job(cfg, env.world, info)
    if job.strategy != "single" or env.world > 1:
        init_process_group(env, job.backend, device)
    try:
        run_dir = _agree_run_dir(env, cfg, job, run_dir)
        return _train(cfg, job, env, device, run_dir, log)
    finally:
        destroy_process_group()


def _agree_run_dir(env: DistEnv, cfg: JobConfig, job: Job, run_dir: Path | None) -> Path:
    """Rank 0 names the run directory (timestamps differ between processes) and writes the
    resolved config; every rank gets the same path."""
    if run_dir is None:
        chosen = (
            Path(cfg.logging.run_dir) if cfg.logging.run_dir else default_run_dir(cfg, job.strategy)
        )
        box = [str(chosen)]
        if dist.is_initialized():
            dist.broadcast_object_list(box, src=0)
        run_dir = Path(box[0])
        if env.is_main:
            write_run_files(run_dir, cfg, job)
    if dist.is_initialized():
        dist.barrier()
    return run_dir


def _train(cfg: JobConfig, job: Job, env: DistEnv, device: torch.device, run_dir: Path, log):
    c = cfg
    log.info(
        "trainwise: %s on %d x %s, %s",
        c.model.name,
        env.world,
        job.device.name,
        job.decision.reason,
    )

    # Same seed on every rank: identical initial weights whatever the strategy.
    torch.manual_seed(c.train.seed)
    bundle = build_model(job.model_spec)
    bundle.module.to(device)
    model = parallelize(
        bundle.module,
        bundle.blocks,
        strategy=job.strategy,
        device=device,
        world=env.world,
        replicate=job.replicate,
        shard=c.parallel.shard,
        precision=c.precision.dtype,
        reduce_dtype=c.precision.reduce_dtype,
        cpu_offload=job.cpu_offload,
        ac=c.parallel.ac,
        compile=c.train.compile,
    )
    dp_rank, dp_size = (0, 1) if job.strategy == "single" else (env.rank, env.world)
    torch.manual_seed(c.train.seed + 1 + dp_rank)  # dropout differs between ranks

    optimizer = build_optimizer(model, c.optim)
    scheduler = build_scheduler(optimizer, c.train.steps, c.schedule)
    scaler = build_grad_scaler(job.strategy, c.precision.dtype, device, c.precision.init_scale)

    def autocast():
        return autocast_context(job.strategy, c.precision.dtype, device)

    train_ds, val_ds = job.datasets
    loader = build_loader(
        train_ds,
        micro_batch=c.data.micro_batch,
        grad_accum=c.data.grad_accum,
        dp_rank=dp_rank,
        dp_size=dp_size,
        seed=c.train.seed,
        num_steps=c.train.steps,
        num_workers=c.data.num_workers,
        pin_memory=c.data.pin_memory and device.type == "cuda",
    )
    eval_mb = min(c.data.micro_batch, max(1, len(val_ds) // (dp_size * c.train.eval_batches)))

    def eval_batches():
        return build_loader(
            val_ds,
            micro_batch=eval_mb,
            grad_accum=1,
            dp_rank=dp_rank,
            dp_size=dp_size,
            seed=c.train.seed,
            num_steps=c.train.eval_batches,
            shuffle=False,
        )

    stepper = Stepper(
        model,
        bundle.loss_fn,
        optimizer,
        scheduler,
        scaler,
        autocast,
        c.data.grad_accum,
        c.train.grad_clip,
        device,
    )
    distributed = job.strategy != "single" and env.world > 1
    probe_every = c.logging.probe_every if distributed else 0
    tokens_per_step = job.global_batch * job.data.tokens_per_sample
    peak = job.device.peak_flops(c.precision.dtype)
    fpt = job.flops_per_token

    writer = MetricsWriter(run_dir, c.logging.tensorboard) if env.is_main else None
    progress = (
        Progress(c.train.steps, c.logging.progress, c.logging.print_every)
        if env.is_main and c.logging.progress != "none"
        else None
    )
    probe_sync: float | None = None if distributed else 0.0
    probes: list[float] = []
    totals = dict.fromkeys(("step_s", *STAGES), 0.0)  # steady steps only
    steady_steps = 0
    first_loss = last_loss = last_eval = None
    batches = iter(loader)
    start = time.perf_counter()
    for step in range(1, c.train.steps + 1):
        probe = probe_every > 0 and (
            FIRST_PROBE_STEP <= step < FIRST_PROBE_STEP + 3 or step % probe_every == 0
        )
        is_eval = c.train.eval_every > 0 and (
            step % c.train.eval_every == 0 or step == c.train.steps
        )
        write = step % c.logging.every == 0 or step == c.train.steps or is_eval or step == 1
        res = stepper.step(batches, probe=probe, read_clock=write)
        if res.probe_sync_s is not None:
            probes = (probes + [res.probe_sync_s])[-PROBE_WINDOW:]
            probe_sync = statistics.median(probes)
        if not write:
            continue
        loss = mean_over_ranks(res.loss)
        spans = res.spans or {}
        compute = spans.get("compute", 0.0)
        if res.probe_sync_s is not None:
            sync = res.probe_sync_s  # compute above ran without communication
        else:
            sync = None if probe_sync is None else min(probe_sync, compute)
            compute -= sync or 0.0
        data_s, optim_s = spans.get("data", 0.0), spans.get("optim", 0.0)
        step_s = data_s + compute + (sync or 0.0) + optim_s
        eval_loss = None
        if is_eval:
            eval_loss = evaluate(model, bundle.loss_fn, eval_batches(), autocast, device)
            last_eval = eval_loss
        first_loss = loss if first_loss is None else first_loss
        last_loss = loss
        if step >= FIRST_PROBE_STEP or c.train.steps < FIRST_PROBE_STEP:
            steady_steps += 1
            stage_values = (step_s, data_s, compute, sync or 0.0, optim_s)
            for k, v in zip(("step_s", *STAGES), stage_values, strict=True):
                totals[k] += v
        if env.is_main:
            mem, kind = peak_memory(device)
            tps = tokens_per_step / step_s if step_s > 0 else 0.0
            rec = StepRecord(
                step=step,
                loss=loss,
                eval_loss=eval_loss,
                lr=scheduler.get_last_lr()[0],
                grad_norm=float(res.grad_norm),
                step_s=step_s,
                data_s=data_s,
                compute_s=compute,
                sync_s=sync,
                optim_s=optim_s,
                tokens=step * tokens_per_step,
                tokens_per_s=tps,
                samples_per_s=tps / job.data.tokens_per_sample,
                mfu=mfu(tps, fpt, peak * env.world) if peak and fpt else None,
                mem_bytes=mem,
                mem_kind=kind,
                elapsed_s=time.perf_counter() - start,
                time=time.time(),
            )
            writer.write(rec)
            if progress:
                progress.update(rec)
    wall = time.perf_counter() - start
    if progress:
        progress.close()
    if writer:
        writer.close()
    if not env.is_main:
        return None
    timed = totals["step_s"] or 1.0
    summary = {
        "run_dir": str(run_dir),
        "model": c.model.name,
        "params": job.params,
        "strategy": job.strategy,
        "cpu_offload": job.cpu_offload,
        "reason": job.decision.reason,
        "world": env.world,
        "device": job.device.name,
        "precision": c.precision.dtype,
        "steps": c.train.steps,
        "global_batch": job.global_batch,
        "first_loss": first_loss,
        "final_loss": last_loss,
        "final_eval_loss": last_eval,
        "tokens": c.train.steps * tokens_per_step,
        "tokens_per_s": steady_steps * tokens_per_step / timed,
        "tokens_per_sample": job.data.tokens_per_sample,
        "wall_s": wall,
        "stage_share": {k.removesuffix("_s"): totals[k] / timed for k in STAGES},
        "sync_measured": distributed and probe_every > 0,
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


@record
def main(argv: list[str] | None = None) -> int:
    """Entry of a worker started by the elastic agent: `python -m trainwise.run.worker DIR`."""
    args = sys.argv[1:] if argv is None else argv
    run_dir = Path(args[0])
    cfg = load_config(run_dir / "config.toml")
    train(cfg, run_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
