"""Starting a job on this machine: every check before any worker starts (the machine, the
run directory's lock and lineage), the run files, then the workers — in this process for
one worker, else under torchrun's elastic agent. Shared by `trainwise train` and
`trainwise doctor` (the same job, run or checked)."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from trainwise.config import JobConfig, dump_toml
from trainwise.errors import ConfigError, TrainwiseError

if TYPE_CHECKING:
    from trainwise.run.job.resolve import Job


def is_worker(cfg: JobConfig) -> bool:
    """Whether this process is one of the workers, its rank set by torchrun or by srun (one
    task per worker). Under srun with a rendezvous endpoint the tasks are one launcher per
    machine instead (what `trainwise launch slurm` writes)."""
    from trainwise.run.job.distributed import dist_env_from

    env = dist_env_from()
    return env.launched and ("RANK" in os.environ or not cfg.cluster.rdzv_endpoint)


def start_job(
    cfg: JobConfig,
    target: Callable[[JobConfig, Path], object],
    module: str,
    label: str | None = None,
    max_restarts: int = 0,
    on_start: Callable[[Path], object] | None = None,
    environment: Mapping[str, str] | None = None,
) -> Path:
    """Check the job against this machine (every check before any worker starts), write
    its run files, then run it: `target(cfg, run_dir)` in this process for one worker on
    one machine, else `python -m MODULE RUN_DIR` workers under the elastic agent. The run
    directory's default name ends with `label` (default: the layout's name); it is returned.
    `on_start(run_dir)` is called once the run files are written, before the workers start
    (trainwise.train's progress follows the run from there). A stop or a failure
    (Preempted, LaunchError) carries the run directory as `run_dir`. `environment`: more
    variables for the workers. Whatever the job sets in this process's environment (those,
    the workers' share of the cores, the launch record, a process group's address) is
    undone when it returns: a second job from the same process (a notebook calling
    trainwise.train twice) starts from the environment the first one found."""
    with kept_environment():
        os.environ.update(environment or {})
        return _start_job(cfg, target, module, label, max_restarts, on_start)


@contextlib.contextmanager
def kept_environment() -> Iterator[None]:
    """os.environ after the block as it was before it: the variables added are removed,
    those changed or removed get their values back."""
    before = dict(os.environ)
    try:
        yield
    finally:
        for name in set(os.environ) - set(before):
            del os.environ[name]
        for name, value in before.items():
            if os.environ.get(name) != value:
                os.environ[name] = value


def _start_job(
    cfg: JobConfig,
    target: Callable[[JobConfig, Path], object],
    module: str,
    label: str | None,
    max_restarts: int,
    on_start: Callable[[Path], object] | None,
) -> Path:
    from trainwise.hardware import detect_device
    from trainwise.hardware.detect import usable_cores
    from trainwise.jsonl import cut_torn_files
    from trainwise.run.job.lifeline import end_launch, start_launch
    from trainwise.run.job.resolve import check_cores, prepare_job, resolve_nproc, start_lines
    from trainwise.run.job.run_files import default_run_dir, write_run_files
    from trainwise.run.job.run_lock import hold_run_dir, job_identity, unusable_run_dir
    from trainwise.run.launch.data_checks import check_data
    from trainwise.run.launch.torchrun import LaunchError, Preempted, launch_workers
    from trainwise.run.observe.events import append_event
    from trainwise.run.observe.hang import enable_flight_recorder

    device = detect_device(cfg.cluster.device)
    nproc = resolve_nproc(cfg, device)
    check_cores(cfg, device, nproc, usable_cores())
    nodes = cfg.cluster.nodes
    check_multi_node(cfg)
    # Planned at the most machines of the range.
    job = prepare_job(cfg, nproc * nodes, device, nproc)
    check_data(cfg)  # once, here: every worker would meet a bad corpus
    default = default_run_dir(cfg, label or job.dims.name)
    run_dir = Path(cfg.logging.run_dir) if cfg.logging.run_dir else default
    with hold_run_dir(run_dir, job_identity(cfg)):
        try:
            for line in cut_torn_files(run_dir):  # a rerun appends after whole records only
                print(line, file=sys.stderr)
        except OSError as err:
            raise unusable_run_dir(run_dir, err) from None
        check_run_dir(cfg, job, run_dir)
        write_run_files(run_dir, cfg, job)
        try:
            append_event(run_dir, "start", pid=os.getpid(), nproc=nproc, nodes=nodes)
        except OSError as err:  # a full disk
            raise unusable_run_dir(run_dir, err) from None
        for line in start_lines(job, nproc, usable_cores()):
            print(line, file=sys.stderr)  # beside the workers' start-up lines
        if on_start is not None:
            on_start(run_dir)
        try:
            if nproc == 1 and nodes == 1:
                if device.kind == "cuda":  # as launch_workers does for the workers it starts
                    enable_flight_recorder(run_dir)
                target(cfg, run_dir)
                return run_dir
            launch = start_launch(dump_toml(cfg), job.base_weights)  # read once, here
            try:
                launch_workers(
                    run_dir, nproc, launch, cfg.cluster.master_port, max_restarts,
                    module=module, cluster=cfg.cluster,
                    checkpoints=checkpoint_root(cfg, run_dir), device_kind=device.kind,
                )
            finally:
                end_launch(launch)
        except (LaunchError, Preempted) as err:
            err.run_dir = run_dir  # for the result, and a report of what the run recorded
            raise
    return run_dir


def checkpoint_root(cfg: JobConfig, run_dir: Path) -> Path:
    from trainwise.run.checkpoint.store import root_for

    return root_for(run_dir, cfg.checkpoint.dir)


def check_run_dir(cfg: JobConfig, job: Job, run_dir: Path) -> None:
    """Before any worker starts: the checkpoints it would resume from are of this run's
    lineage (else one line, exit 2), and a finished run is not run again."""
    from trainwise.config.lineage import lineage_keys
    from trainwise.run.checkpoint.resume_rules import check_before_launch
    from trainwise.run.launch.compat import check_other_fits
    from trainwise.run.observe.events import read_events

    root, keys = checkpoint_root(cfg, run_dir), lineage_keys(cfg, job.global_batch, job.base_weights)
    check_before_launch(cfg.checkpoint, root, keys)
    check_other_fits(cfg, job, root, keys)
    if cfg.checkpoint.resume == "never" or not (run_dir / "events.jsonl").is_file():
        return
    lifecycle = [e for e in read_events(run_dir) if e["kind"] in ("ready", "finish")]
    if lifecycle and lifecycle[-1]["kind"] == "finish":
        done = lifecycle[-1].get("step") or 0
        if cfg.train.steps <= done:
            raise AlreadyFinished(
                f"{run_dir} finished at step {done} (train.steps = {cfg.train.steps}); its "
                "summary, metrics and report are kept: raise --steps to continue it, or "
                "choose another --run-dir"
            )


class AlreadyFinished(TrainwiseError):
    """A rerun of a finished run: said once, exit 0, nothing touched."""

    exit_status = 0


def check_multi_node(cfg: JobConfig) -> None:
    """A job on several machines needs the same rendezvous and run directory on each."""
    c = cfg.cluster
    if c.nodes == 1 and c.min_nodes is None:
        return
    missing = [
        flag
        for flag, value in (
            ("--rdzv-endpoint HOST:PORT (cluster.rdzv_endpoint)", c.rdzv_endpoint),
            ("--rdzv-id ID (cluster.rdzv_id)", c.rdzv_id),
            ("--run-dir DIR (logging.run_dir)", cfg.logging.run_dir),
        )
        if not value
    ]
    if missing:
        raise ConfigError(
            f"--nnodes {c.min_nodes or c.nodes}:{c.nodes} runs on several machines: give "
            + ", ".join(missing) + ", the same on every machine"
        )


def train_here(cfg: JobConfig, run_dir: Path) -> object:
    """One worker in this process. The worker's modules are imported only here: a launcher
    that starts worker processes does without them (seconds of DCP and DTensor imports).
    Ctrl-C and the other stop signals save, as they do in worker processes."""
    import signal

    from trainwise.run.engine.control import PREEMPT_SIGNALS, catch_early_signals
    from trainwise.run.engine.worker import train
    from trainwise.run.launch.torchrun import Preempted

    previous = {sig: signal.getsignal(sig) for sig in PREEMPT_SIGNALS}
    catch_early_signals()
    try:
        summary = train(cfg, run_dir)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if summary and summary.get("preempted"):
        from trainwise.run.observe.events import read_events

        raise Preempted([e for e in read_events(run_dir) if e["kind"] == "preempted"][-1])
    return summary
