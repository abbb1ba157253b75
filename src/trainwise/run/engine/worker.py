"""A training worker, top to bottom: job -> process group -> versions -> model ->
parallelize -> optimizer -> data -> loop -> summary. The job comes first: its layout
chooses the backend and whether a process group is needed at all. Started by the elastic
agent (`python -m trainwise.run.engine.worker RUN_DIR`), by torchrun / srun through the
CLI, or in-process for one worker."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import sys
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from trainwise.config import JobConfig, config_from_toml, job_hash, load_config
from trainwise.errors import TrainwiseError
from trainwise.hardware import detect_device
from trainwise.run.engine.control import catch_early_signals
from trainwise.run.engine.training import Training
from trainwise.run.job.distributed import (
    DistEnv,
    destroy_process_group,
    dist_env_from,
    get_logger,
    init_process_group,
    side_group,
)
from trainwise.run.job.lifeline import CONFIG_ENV, Launch, die_with_launcher, this_launch
from trainwise.run.job.resolve import Job, prepare_job
from trainwise.run.job.run_files import default_run_dir, write_run_files
from trainwise.run.job.run_lock import hold_as_worker
from trainwise.run.job.versions import require_same_versions
from trainwise.run.observe.events import append_event
from trainwise.run.observe.peers import classify, last_line, nested_errors


def join_job(cfg: JobConfig) -> tuple[DistEnv, logging.Logger, torch.device, Job]:
    """This process as a worker of the job: its place, logger, device, the job at this
    world size, and the process group (DDP and FSDP need one even on a single worker)."""
    env = dist_env_from()
    log = get_logger(env)
    info = detect_device(cfg.cluster.device)
    device = torch.device("cuda", env.local_rank) if info.kind == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    launch = this_launch()
    given = launch.base_weights if launch else None  # the launcher's: nothing to read here
    job = prepare_job(cfg, env.world, info, env.local_world, lambda *_: given)
    if not job.dims.single or env.world > 1:
        init_process_group(env, job.backend, device, cfg.parallel.timeout_s)
    if cfg.lora.rank and job.base_weights is None:
        job.base_weights = first_rank_base_weights(job)
    return env, log, device, job


# Rank 0 may read a whole base (a 140 GB one takes minutes from a network file system)
# while the others wait for its id: longer than a training collective's timeout.
BASE_READ_TIMEOUT_S = 3 * 3600


def first_rank_base_weights(job: Job) -> str | None:
    """The frozen base's id for workers started without trainwise's launcher (torchrun or
    srun by hand, or the in-process worker, whose launcher's reads are cached): rank 0
    reads the weights and hands the id to the others: one read for the job, not one per
    worker."""
    from trainwise.models import base_weights_id

    seed = job.cfg.train.seed
    if not dist.is_initialized():
        return base_weights_id(job.model_spec, seed)
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=BASE_READ_TIMEOUT_S))
    box = [base_weights_id(job.model_spec, seed) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0, group=group)
    dist.destroy_process_group(group)
    return box[0]


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
            (
                e
                for e in nested_errors(err)
                if isinstance(e, OSError) and e.errno in DISK_FULL_ERRNOS
            ),
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
        check_versions(cfg, env.local_rank)
    run_dir = agree_run_dir(env, cfg, job, run_dir)
    summary = Training(cfg, job, env, device, run_dir, log).run()
    # Only after success, and together: destroying the group while a peer is failing or
    # still in a collective can deadlock (torchtitan learned the same); a failing worker
    # just exits and the agent stops the others.
    destroy_process_group()
    return summary


def check_versions(cfg: JobConfig, local_rank: int) -> None:
    """Every rank runs the same versions (VersionMismatch otherwise): cheap, and it turns a
    hang in the first collective into one line. Over a gloo group of its own (NCCL itself
    may be what differs), destroyed and dropped on return: a destroyed group still
    referenced keeps its gloo thread, which wakes every 10 ms for the whole run."""
    host = side_group(cfg.parallel.timeout_s)
    require_same_versions(job_hash(cfg), local_rank, host)
    dist.destroy_process_group(host)


def agree_run_dir(
    env: DistEnv, cfg: JobConfig, job: Job, run_dir: Path | None, label: str | None = None
) -> Path:
    """Rank 0 names the run directory (timestamps differ between processes; `label` ends
    the default name, the layout's name by default) and writes the resolved config; every rank
    gets the same path."""
    if run_dir is None:
        default = default_run_dir(cfg, label or job.dims.name)
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
    hold_as_worker(run_dir)  # released by the kernel when we exit
    try:
        target(cfg, run_dir)
    except TrainwiseError as err:
        if launch is None:
            raise
        record_fatal(launch, run_dir, err)
    except Exception as err:
        # A peer that recorded a fatal error and exited breaks this rank's next collective
        # (its last barrier, say): the launcher reports the peer's line, not this traceback.
        if launch is None or classify(err) is None or not launch.fatal():
            raise
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
    """Entry of a worker started by the elastic agent: `python -m trainwise.run.engine.worker DIR`."""
    return run_worker(train, argv)


if __name__ == "__main__":
    from trainwise.process_exit import exit_process

    exit_process(main())
