"""A training worker, top to bottom: process group -> job -> model -> parallelize ->
optimizer -> data -> loop -> summary. Started by the elastic agent (`python -m
trainwise.run.worker RUN_DIR`), by torchrun / srun through the CLI, or in-process for
one worker."""

from __future__ import annotations

import json
import logging
import sys
from datetime import datetime
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from trainwise.config import JobConfig, dump_toml, load_config
from trainwise.data import build_loader
from trainwise.errors import ConfigError
from trainwise.hardware import detect_device
from trainwise.models import build_model
from trainwise.run.distributed import (
    DistEnv,
    destroy_process_group,
    dist_env_from,
    get_logger,
    init_process_group,
)
from trainwise.run.job import Job, prepare_job
from trainwise.run.loop import Stepper, evaluate
from trainwise.run.optim import build_optimizer, build_scheduler
from trainwise.run.parallelize import parallelize
from trainwise.run.precision import autocast_context, build_grad_scaler
from trainwise.run.recorder import Recorder


def default_run_dir(cfg: JobConfig, strategy: str) -> Path:
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    model = cfg.model.name.replace(":", "-").replace("/", "-").replace(".", "-")[-40:]
    return Path("runs") / f"{stamp}-{model}-{strategy}"


def write_run_files(run_dir: Path, cfg: JobConfig, job: Job) -> None:
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.toml").write_text(dump_toml(cfg))
        (run_dir / "job.json").write_text(json.dumps(job.summary_dict(), indent=2) + "\n")
    except OSError as err:
        raise ConfigError(
            f"logging.run_dir = '{run_dir}' cannot be used ({err.strerror or err}): "
            "choose a writable directory"
        ) from None


def train(cfg: JobConfig, run_dir: Path | None = None) -> dict[str, Any] | None:
    """Train as one worker of the job; returns the run summary on rank 0."""
    env = dist_env_from()
    log = get_logger(env)
    info = detect_device(cfg.cluster.device)
    device = torch.device("cuda", env.local_rank) if info.kind == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    job = prepare_job(cfg, env.world, info, env.local_world)
    if job.strategy != "single" or env.world > 1:
        init_process_group(env, job.backend, device)
    run_dir = _agree_run_dir(env, cfg, job, run_dir)
    summary = _train(cfg, job, env, device, run_dir, log)
    # Only after success, and together: destroying the group while a peer is failing or
    # still in a collective can deadlock (torchtitan learned the same); a failing worker
    # just exits and the agent stops the others.
    destroy_process_group()
    return summary


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


def _train(
    cfg: JobConfig,
    job: Job,
    env: DistEnv,
    device: torch.device,
    run_dir: Path,
    log: logging.Logger,
) -> dict[str, Any] | None:
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
    # Every rank evaluates the same number of distinct held-out samples; none repeats.
    eval_mb = min(c.data.micro_batch, max(1, len(val_ds) // (dp_size * c.train.eval_batches)))
    eval_steps = max(1, min(c.train.eval_batches, len(val_ds) // (dp_size * eval_mb)))

    def eval_batches():
        return build_loader(
            val_ds,
            micro_batch=eval_mb,
            grad_accum=1,
            dp_rank=dp_rank,
            dp_size=dp_size,
            seed=c.train.seed,
            num_steps=eval_steps,
            shuffle=False,
        )

    stepper = Stepper(
        model, bundle.loss_fn, optimizer, scheduler, scaler, autocast,
        c.data.grad_accum, c.train.grad_clip, device,
    )  # fmt: skip
    peak = job.device.peak_flops(c.precision.dtype)
    recorder = Recorder(
        steps=c.train.steps, cfg=c.logging, is_main=env.is_main, run_dir=run_dir,
        distributed=job.strategy != "single" and env.world > 1,
        tokens_per_step=job.tokens_per_step,
        tokens_per_sample=job.data.tokens_per_sample, flops_per_token=job.flops_per_token,
        peak_flops_total=peak * env.world if peak else None, device=device,
    )  # fmt: skip

    batches = iter(loader)
    for step in range(1, c.train.steps + 1):
        every = c.train.eval_every
        is_eval = every > 0 and (step % every == 0 or step == c.train.steps)
        res = stepper.step(batches, probe=recorder.probe_now(step))
        lr = scheduler.get_last_lr()[0]
        eval_loss = None
        if is_eval:
            eval_loss = evaluate(model, bundle.loss_fn, eval_batches(), autocast, device)
        recorder.add(step, res, lr, eval_loss)
    figures = recorder.finish()
    if not env.is_main:
        return None
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
        "tokens": c.train.steps * job.tokens_per_step,
        **figures,
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
