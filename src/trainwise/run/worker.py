"""A training worker, top to bottom: process group -> job -> model -> parallelize ->
optimizer -> data -> loop -> summary. Started by the elastic agent (`python -m
trainwise.run.worker RUN_DIR`), by torchrun / srun through the CLI, or in-process for
one worker."""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from trainwise.config import JobConfig, config_from_toml, job_hash, load_config
from trainwise.data import build_eval_loader, build_loader
from trainwise.errors import TrainwiseError
from trainwise.hardware import detect_device
from trainwise.run import checkpoint_store as store
from trainwise.run.checkpoint import Checkpointer, Resumed
from trainwise.run.checkpoint_store import CheckpointError
from trainwise.run.control import Control, catch_early_signals
from trainwise.run.distributed import (
    DistEnv,
    destroy_process_group,
    dist_env_from,
    get_logger,
    init_process_group,
    network_line,
    side_group,
)
from trainwise.run.events import append_event, read_events, retry_cost
from trainwise.run.faults import Faults
from trainwise.run.job import Job, prepare_job
from trainwise.run.lifeline import CONFIG_ENV, Launch, die_with_launcher, this_launch
from trainwise.run.loop import evaluate
from trainwise.run.peers import (
    BARRIER_S,
    PeerFailure,
    absent_ranks,
    classify,
    last_line,
    nested_errors,
)
from trainwise.run.recorder import Recorder
from trainwise.run.run_files import default_run_dir, write_run_files
from trainwise.run.run_lock import hold_as_worker, machines_share
from trainwise.run.trainer import build_checkpointer, build_trainer
from trainwise.run.versions import require_same_versions

MAX_ROLLBACKS = 3


class GuardError(TrainwiseError):
    """The non-finite guard stopped the run (policy stop, or too many skips/rollbacks)."""


def join_job(cfg: JobConfig) -> tuple[DistEnv, logging.Logger, torch.device, Job]:
    """This process as a worker of the job: its place, logger, device, the job at this
    world size, and the process group (DDP and FSDP need one even on a single worker)."""
    env = dist_env_from()
    log = get_logger(env)
    info = detect_device(cfg.cluster.device)
    device = torch.device("cuda", env.local_rank) if info.kind == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    job = prepare_job(cfg, env.world, info, env.local_world)
    if job.strategy != "single" or env.world > 1:
        init_process_group(env, job.backend, device, cfg.parallel.timeout_s)
    return env, log, device, job


class FatalError(TrainwiseError):
    """An error no restart can fix, met while training (a full disk)."""


DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS)


def train(cfg: JobConfig, run_dir: Path | None = None) -> dict[str, Any] | None:
    """Train as one worker of the job; returns the run summary on rank 0. A full or
    read-only disk is a FatalError: a restart would meet it again."""
    try:
        return _join_and_train(cfg, run_dir)
    except Exception as err:
        disk = next(
            (e for e in nested_errors(err) if isinstance(e, OSError) and e.errno in DISK_FULL_ERRNOS),
            None,
        )
        if disk is None or isinstance(err, TrainwiseError):
            raise
        what = f"{disk.strerror}: {disk.filename}" if disk.filename else last_line(err)
        raise FatalError(
            f"the disk is full or read-only ({what}): free space or choose another "
            "logging.run_dir / checkpoint.dir, then run again to resume from the last checkpoint"
        ) from None


def _join_and_train(cfg: JobConfig, run_dir: Path | None) -> dict[str, Any] | None:
    env, log, device, job = join_job(cfg)
    if env.world > 1 and not cfg.cluster.allow_version_mismatch:
        # Cheap, and it turns a hang in the first collective into one line.
        # Over gloo: NCCL itself may be what differs.
        host = side_group(cfg.parallel.timeout_s)
        require_same_versions(job_hash(cfg), env.local_rank, host)
        dist.destroy_process_group(host)
    run_dir = agree_run_dir(env, cfg, job, run_dir)
    summary = _train(cfg, job, env, device, run_dir, log)
    # Only after success, and together: destroying the group while a peer is failing or
    # still in a collective can deadlock (torchtitan learned the same); a failing worker
    # just exits and the agent stops the others.
    destroy_process_group()
    return summary


def agree_run_dir(
    env: DistEnv, cfg: JobConfig, job: Job, run_dir: Path | None, label: str | None = None
) -> Path:
    """Rank 0 names the run directory (timestamps differ between processes; `label` ends
    the default name, the strategy by default) and writes the resolved config; every rank
    gets the same path."""
    if run_dir is None:
        default = default_run_dir(cfg, label or job.strategy)
        chosen = Path(cfg.logging.run_dir) if cfg.logging.run_dir else default
        box = [str(chosen)]
        if dist.is_initialized():
            dist.broadcast_object_list(box, src=0)
        run_dir = Path(box[0])
        if env.is_main:
            write_run_files(run_dir, cfg, job)
    if dist.is_initialized():
        dist.barrier()
    return run_dir


def record_membership(run_dir: Path, env: DistEnv, attempt: int, step: int) -> None:
    """The `ready` event of this attempt, after a `membership` event when the job now runs
    on a different number of workers than its previous attempt (an elastic range lost or
    gained machines)."""
    nodes = env.world // max(env.local_world, 1)
    before = [e for e in read_events(run_dir) if e["kind"] == "ready"]
    if before and before[-1].get("world") not in (None, env.world):
        last = before[-1]
        append_event(
            run_dir, "membership", attempt=attempt, step=step, from_world=last["world"],
            world=env.world, from_nodes=last.get("nodes"), nodes=nodes,
        )  # fmt: skip
    append_event(run_dir, "ready", attempt=attempt, step=step, world=env.world, nodes=nodes)


def _train(
    cfg: JobConfig,
    job: Job,
    env: DistEnv,
    device: torch.device,
    run_dir: Path,
    log: logging.Logger,
) -> dict[str, Any] | None:
    c = cfg

    t = build_trainer(c, job, device)
    model, scheduler = t.model, t.scheduler
    dp_rank, dp_size, stepper = t.dp_rank, t.dp_size, t.stepper
    train_ds, val_ds = job.datasets

    def eval_batches():
        return build_eval_loader(
            val_ds, micro_batch=c.data.micro_batch, max_batches=c.train.eval_batches,
            dp_rank=dp_rank, dp_size=dp_size, seed=c.train.seed,
        )  # fmt: skip

    distributed = dist.is_initialized()
    ckpt = build_checkpointer(c, job, env, device, run_dir, t, log)
    control = Control(distributed, c.parallel.timeout_s)
    # Kept idle for diagnosis: after a failed collective the survivors meet here to find
    # which ranks are missing (the default group may be wedged by then).
    health = side_group(c.parallel.timeout_s) if distributed else None
    faults = Faults(env.rank, run_dir)
    ckpt.before_commit = lambda step: faults.pause("pause_in_save", step)

    # Resume: the newest valid checkpoint (or none), the same on every rank.
    path, skipped = ckpt.find()
    resumed = ckpt.load(path) if path else Resumed()
    resumed.skipped = skipped
    log.info("trainwise: %s", resumed.line())  # first: where this run continues from
    log.info(
        "trainwise: %s on %d x %s, %s", c.model.name, env.world, job.device.name,
        job.decision.reason,
    )  # fmt: skip
    if env.world > 1:
        log.info(
            "trainwise: %d machine(s) x %d workers, %s", env.world // max(env.local_world, 1),
            env.local_world, network_line(),
        )  # fmt: skip
    if env.is_main and path:
        append_event(
            run_dir, "resume", attempt=faults.attempt, step=resumed.step, path=str(path),
            rng=resumed.rng, skipped=skipped, from_world=resumed.trainer.get("world_size"),
            from_strategy=resumed.trainer.get("strategy"),
        )  # fmt: skip
    data_state = {"global_batch": job.global_batch, "seed": c.train.seed}
    if not resumed.other and resumed.trainer.get("data", data_state) != data_state:
        raise CheckpointError(
            f"the checkpoint at {path} was written with data {resumed.trainer['data']} but this "
            f"run has {data_state}; resume with the same global batch and seed, or set "
            "checkpoint.resume = 'never'"
        )

    peak = job.device.peak_flops(c.precision.dtype)
    recorder = Recorder(
        steps=c.train.steps, cfg=c.logging, is_main=env.is_main, run_dir=run_dir,
        distributed=job.strategy != "single" and env.world > 1,
        tokens_per_step=job.tokens_per_step,
        tokens_per_sample=job.data.tokens_per_sample, flops_per_token=job.flops_per_token,
        peak_flops_total=peak * env.world if peak else None, device=device,
        start_step=resumed.step, attempt=faults.attempt, num_workers=c.data.num_workers,
    )  # fmt: skip

    def batches_from(step: int):
        # The sampler's stream depends on (seed, global batch, step) only: the same samples
        # follow step `step` whatever the number of ranks (resharding skips and repeats none).
        return iter(
            build_loader(
                train_ds, micro_batch=c.data.micro_batch, grad_accum=job.grad_accum,
                dp_rank=dp_rank, dp_size=dp_size, seed=c.train.seed, start_step=step,
                num_steps=c.train.steps - step, num_workers=c.data.num_workers,
                pin_memory=c.data.pin_memory and device.type == "cuda",
                prefetch_factor=c.data.prefetch_factor,
            )
        )  # fmt: skip

    step = resumed.step
    batches = batches_from(step)
    skips_in_a_row = 0
    rollbacks = 0
    preempted = None
    if env.is_main:
        record_membership(run_dir, env, faults.attempt, step)
    control.install()
    stage = "start-up"
    failed = False
    try:
        while step < c.train.steps:
            step += 1
            stage = "the training step"
            faults.hang(step, until=lambda: control.signal is not None)
            stepper.poison = faults.nan(step)
            res = stepper.step(batches, probe=recorder.probe_now(step))
            if not res.finite:
                policy = c.train.nonfinite
                skips_in_a_row += 1
                if env.is_main:
                    append_event(run_dir, "nonfinite", step=step, policy=policy)
                log.warning(
                    "trainwise: step %d: non-finite loss or gradient norm (%s)", step, policy
                )
                if policy == "stop" or skips_in_a_row > c.train.max_skips:
                    raise GuardError(
                        f"step {step}: non-finite loss or gradient norm"
                        + (f" {skips_in_a_row} steps in a row" if policy != "stop" else "")
                        + f" (train.nonfinite = '{policy}'): lower optim.lr, raise "
                        "train.grad_clip or check the data; the last checkpoint is intact"
                    )
                if policy == "rollback":
                    stage = "the rollback"
                    step, batches = _rollback(ckpt, step, rollbacks, log), None
                    rollbacks += 1
                    batches = batches_from(step)
                    if env.is_main:
                        append_event(run_dir, "rollback", to_step=step)
                    continue
            else:
                skips_in_a_row = 0
            lr = scheduler.get_last_lr()[0]
            every = c.train.eval_every
            eval_loss = None
            if every > 0 and (step % every == 0 or step == c.train.steps):
                stage = "evaluation"
                eval_loss = evaluate(model, t.loss_fn, eval_batches(), t.autocast, device)
            if env.is_main and ckpt.wanted(step):
                control.request_save()
            stage = "the exchange of control flags"
            stop, save_now = control.exchange()
            stall = 0.0
            if stop or save_now or ckpt.due(step):
                stage = "the checkpoint save"
                tokens = step * job.tokens_per_step
                stall = ckpt.save(
                    step, tokens, time.time(), data_state, sync=stop
                ) if ckpt.cfg.enabled or stop else 0.0  # fmt: skip
            stage = "the metrics reduction"
            recorder.add(step, res, lr, eval_loss, ckpt_s=stall)
            faults.pause("pause", step, until=lambda: control.signal is not None)
            if stop:
                preempted = control.signal_name or "signal"
                break
        stage = "the last checkpoint save"
        ckpt.close()
    except RuntimeError as err:
        kind = classify(err)
        if kind is None or not distributed:
            raise
        failed = True
        launch = this_launch()
        if launch is not None and launch.fatal():
            raise SystemExit(0) from None  # a peer stopped the run for good: it reports why
        where = stepper.stage if stage == "the training step" else stage
        # A hang needs the diagnosis; a lost peer exited, and the agent reports which (no
        # need to hold up the restart by a barrier).
        absent = (
            absent_ranks(health, min(BARRIER_S, c.parallel.timeout_s))
            if kind == "timeout"
            else None
        )
        failure = PeerFailure(step, where, env.rank, kind, absent, last_line(err))
        line = failure.line(c.parallel.timeout_s)
        log.error("trainwise: %s", line)
        trace = "".join(traceback.format_exception(err))  # kept for a post-mortem
        append_event(run_dir, "peer_failure", **asdict(failure), message=line, traceback=trace)
        raise SystemExit(1) from None  # no traceback: the line says it; the agent restarts
    finally:
        if failed:
            control.uninstall()  # the groups may be wedged: no drain, no destroy
        else:
            control.close()
    figures = recorder.finish()
    if preempted:
        log.info("trainwise: preempted (%s) after step %d; checkpoint saved", preempted, step)
        if env.is_main:
            saved = store.final_dir(ckpt.root, ckpt.last_save_step)
            append_event(run_dir, "preempted", step=step, signal=preempted, checkpoint=str(saved))
    elif env.is_main:
        append_event(run_dir, "finish", step=step)
    if not env.is_main:
        return None
    cost = retry_cost(read_events(run_dir), env.world)
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
        "last_step": step,
        "preempted": preempted,
        "resumed_from": resumed.step if path else None,
        "resume": resumed.line(),
        "global_batch": job.global_batch,
        "tokens": step * job.tokens_per_step,
        "retry_cost": asdict(cost),
        "retry_line": cost.summary_line(),
        **figures,
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def _rollback(ckpt: Checkpointer, step: int, rollbacks: int, log: logging.Logger) -> int:
    """Reload the newest valid checkpoint in place; returns the step to continue from."""
    if rollbacks >= MAX_ROLLBACKS:
        raise GuardError(
            f"step {step}: still non-finite after {rollbacks} rollbacks: the fault repeats from "
            "the checkpoint; lower optim.lr or check the data"
        )
    path, _ = ckpt.find()
    if path is None:
        raise GuardError(
            f"step {step}: non-finite loss and no checkpoint to roll back to: save earlier "
            "(checkpoint.interval) or use train.nonfinite = 'skip'"
        )
    resumed = ckpt.load(path)
    log.warning("trainwise: step %d: rolled back to step %d (%s)", step, resumed.step, path)
    return resumed.step


def run_worker(target: Callable[[JobConfig, Path], object], argv: list[str] | None) -> int:
    """The body of a worker the elastic agent starts (`python -m MODULE RUN_DIR`): the
    launch's config, then `target(cfg, run_dir)`. The worker dies with its launcher and
    holds the run directory's workers' lock while it lives. An error no restart can fix
    (bad input, disk full, no valid checkpoint, the guard, a version mismatch) is recorded
    for the launch and the worker exits 0, so that the agent does not restart the group;
    the launcher reports the message and its exit status. A worker that starts after such
    an error (the agent restarted the group anyway) exits at once."""
    catch_early_signals()
    args = sys.argv[1:] if argv is None else argv
    run_dir = Path(args[0])
    launch = this_launch()
    if launch is not None:
        die_with_launcher(launch)
        if launch.fatal():
            return 0
    cfg = worker_config(run_dir)
    hold_as_worker(run_dir, machines_share(cfg))  # released by the kernel when we exit
    try:
        target(cfg, run_dir)
    except TrainwiseError as err:
        if launch is None:
            raise
        record_fatal(launch, run_dir, err)
    return 0


def worker_config(run_dir: Path) -> JobConfig:
    """The config the launcher handed over; a worker started by hand reads the run's."""
    text = os.environ.get(CONFIG_ENV)
    return config_from_toml(text) if text else load_config(run_dir / "config.toml")


def record_fatal(launch: Launch, run_dir: Path, err: TrainwiseError) -> None:
    """For the launcher (in the launch's scratch folder, which a full run disk does not
    stop) and for the report (the run's events, when they can still be written)."""
    message = str(err).replace("\n", "; ")
    rank = dist_env_from().rank
    launch.record_fatal(message, err.exit_status, rank)
    with contextlib.suppress(OSError):  # a full disk: the launcher has the message all the same
        append_event(run_dir, "fatal", rank=rank, message=message, exit_status=err.exit_status)


@record
def main(argv: list[str] | None = None) -> int:
    """Entry of a worker started by the elastic agent: `python -m trainwise.run.worker DIR`."""
    return run_worker(train, argv)


if __name__ == "__main__":
    sys.exit(main())
