"""`trainwise train`: plan (strategy auto), check, launch the workers, summarise."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from trainwise.config import JobConfig, dump_toml, load_config
from trainwise.errors import ConfigError, TrainwiseError
from trainwise.report import render_summary

if TYPE_CHECKING:
    from trainwise.run.job import Job


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train",
        help="train a model with single, DDP or FSDP2 on torch.distributed",
        description="Train on the embedded default (tiny GPT, synthetic corpus, 2 workers) "
        "or on a TOML job. Precedence: defaults < --config < flags < --set.",
    )
    add_job_arguments(p)
    p.add_argument(
        "--allow-version-mismatch",
        action="store_true",
        default=None,
        help="train even when ranks run different versions (cluster.allow_version_mismatch)",
    )
    p.add_argument("--print-config", action="store_true", help="print the resolved TOML and exit")
    p.set_defaults(run=run)


def add_job_arguments(p: argparse.ArgumentParser) -> None:
    """The job's flags, shared by train and doctor (the same job, checked or run)."""
    p.add_argument("--config", metavar="TOML", help="job file")
    p.add_argument(
        "--set",
        metavar="KEY=VALUE",
        action="append",
        default=[],
        help="override any key, e.g. --set optim.lr=3e-4 (repeatable)",
    )
    p.add_argument("--nproc", type=int, help="workers on this machine (cluster.nproc)")
    p.add_argument(
        "--nnodes",
        metavar="N|MIN:MAX",
        help="machines in the job, or an elastic range (cluster.nodes, cluster.min_nodes)",
    )
    p.add_argument(
        "--rdzv-endpoint",
        metavar="HOST:PORT",
        help="c10d rendezvous, the same on every machine (cluster.rdzv_endpoint)",
    )
    p.add_argument("--rdzv-id", help="the job's id at the rendezvous (cluster.rdzv_id)")
    p.add_argument(
        "--local-addr",
        metavar="ADDR",
        help="this machine's address as the others reach it (cluster.local_addr)",
    )
    p.add_argument(
        "--node-rank",
        type=int,
        help="0 on the machine of --rdzv-endpoint, which hosts the rendezvous (cluster.node_rank)",
    )
    p.add_argument("--strategy", help="auto, single, ddp, fsdp or hsdp (parallel.strategy)")
    p.add_argument("--precision", help="fp32, bf16 or fp16 (precision.dtype)")
    p.add_argument("--steps", type=int, help="optimizer steps (train.steps)")
    p.add_argument("--model", help="preset, 'mlp', 'module:factory' or 'hf:config.json'")
    p.add_argument("--run-dir", help="run directory (logging.run_dir)")


def parse_nnodes(text: str | None) -> tuple[int | None, int | None]:
    """`--nnodes N` or `MIN:MAX` -> (nodes, min_nodes)."""
    if text is None:
        return None, None
    low, _, high = text.partition(":")
    try:
        lo, hi = int(low), int(high or low)
    except ValueError:
        raise ConfigError(
            f"--nnodes {text!r}: give a machine count (2) or an elastic range (1:4)"
        ) from None
    if lo < 1 or hi < lo:
        raise ConfigError(f"--nnodes {text!r}: need 1 <= MIN <= MAX")
    return hi, (lo if high else None)


# The key each job flag sets: error messages name the flag a user typed, not a guess.
JOB_FLAGS = {
    "cluster.nodes": "--nnodes",
    "cluster.min_nodes": "--nnodes",
    "cluster.rdzv_endpoint": "--rdzv-endpoint",
    "cluster.rdzv_id": "--rdzv-id",
    "cluster.node_rank": "--node-rank",
    "cluster.local_addr": "--local-addr",
    "cluster.nproc": "--nproc",
    "parallel.strategy": "--strategy",
    "precision.dtype": "--precision",
    "train.steps": "--steps",
    "model.name": "--model",
    "logging.run_dir": "--run-dir",
}


def job_flags(args: argparse.Namespace) -> dict[str, object]:
    nodes, min_nodes = parse_nnodes(args.nnodes)
    flags: dict[str, object] = {"cluster.nodes": nodes, "cluster.min_nodes": min_nodes}
    for key, flag in JOB_FLAGS.items():
        if flag != "--nnodes":
            flags[key] = getattr(args, flag.removeprefix("--").replace("-", "_"))
    return flags


def add_import_roots(config: str | None) -> None:
    """Let `model.name = "module:factory"` find modules beside the job file and in the
    current directory, here and in the workers (which inherit PYTHONPATH)."""
    roots = [os.getcwd()] + ([str(Path(config).resolve().parent)] if config else [])
    for root in reversed(roots):
        if root not in sys.path:
            sys.path.insert(0, root)
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(roots + ([old] if old else []))


def run(args: argparse.Namespace) -> int:
    flags = {
        **job_flags(args),
        "cluster.allow_version_mismatch": args.allow_version_mismatch,
    }
    add_import_roots(args.config)
    names = {**JOB_FLAGS, "cluster.allow_version_mismatch": "--allow-version-mismatch"}
    cfg = load_config(args.config, flags, args.set, flag_names=names)
    if args.print_config:
        print(dump_toml(cfg), end="")
        return 0

    # Imported here so that --print-config and config errors stay instant.
    from trainwise.run.launch import Preempted

    if is_worker(cfg):
        from trainwise.run.worker import train

        summary = train(cfg)
        if summary:
            print(render_summary(summary))
            finish_report(cfg, Path(summary["run_dir"]))
        return 0

    try:
        run_dir = start_job(
            cfg, train_here, "trainwise.run.worker", max_restarts=cfg.checkpoint.max_restarts
        )
    except Preempted as stop:
        print(f"trainwise: {stop}; {resume_hint(cfg, stop.event)}")
        return 0
    path = run_dir / "summary.json"
    if not path.is_file():  # rank 0 runs on another machine and writes its own disk
        print(f"trainwise: this machine's workers finished; rank 0's machine has {path}")
        return 0
    print(render_summary(json.loads(path.read_text())))
    finish_report(cfg, run_dir)
    return 0


def resume_hint(cfg: JobConfig, event: dict) -> str:
    """How to go on after a stop that saved."""
    saved = f"checkpoint {event['checkpoint']} saved" if event.get("checkpoint") else "saved"
    if cfg.checkpoint.resume == "never":
        return (
            f"{saved}: run again with checkpoint.resume = 'auto' to resume from it "
            "('never' would start a new lineage)"
        )
    return f"{saved}: run the same command again to resume"


def train_here(cfg: JobConfig, run_dir: Path) -> object:
    """One worker in this process. The worker's modules are imported only here: a launcher
    that starts worker processes does without them (seconds of DCP and DTensor imports).
    Ctrl-C and the other stop signals save, as they do in worker processes."""
    import signal

    from trainwise.run.control import PREEMPT_SIGNALS, catch_early_signals
    from trainwise.run.launch import Preempted
    from trainwise.run.worker import train

    previous = {sig: signal.getsignal(sig) for sig in PREEMPT_SIGNALS}
    catch_early_signals()
    try:
        summary = train(cfg, run_dir)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if summary and summary.get("preempted"):
        from trainwise.run.events import read_events

        raise Preempted([e for e in read_events(run_dir) if e["kind"] == "preempted"][-1])
    return summary


def finish_report(cfg: JobConfig, run_dir: Path) -> None:
    """RUN/report.html on rank 0's machine, when the run has finished (logging.report)."""
    if not cfg.logging.report:
        return
    from trainwise.cli.report import write_page
    from trainwise.report.analysis import analyse
    from trainwise.report.rundir import load_run

    page = run_dir / "report.html"
    try:
        write_page([analyse(load_run(run_dir))], page)
    except Exception as err:  # any failure: the run's results stand without the page
        print(
            f"trainwise: the report was not written ({type(err).__name__}: {err}); "
            f"`trainwise report {run_dir}` tries again",
            file=sys.stderr,
        )
        return
    print(f"  report     {page}")


def is_worker(cfg: JobConfig) -> bool:
    """Whether this process is one of the workers, its rank set by torchrun or by srun (one
    task per worker). Under srun with a rendezvous endpoint the tasks are one launcher per
    machine instead (what `trainwise launch slurm` writes)."""
    from trainwise.run.distributed import dist_env_from

    env = dist_env_from()
    return env.launched and ("RANK" in os.environ or not cfg.cluster.rdzv_endpoint)


def start_job(
    cfg: JobConfig,
    target: Callable[[JobConfig, Path], object],
    module: str,
    label: str | None = None,
    max_restarts: int = 0,
) -> Path:
    """Check the job against this machine (every check before any worker starts), write
    its run files, then run it: `target(cfg, run_dir)` in this process for one worker on
    one machine, else `python -m MODULE RUN_DIR` workers under the elastic agent. The run
    directory's default name ends with `label` (default: the strategy); it is returned."""
    from trainwise.hardware import detect_device
    from trainwise.hardware.detect import usable_cores
    from trainwise.run.events import append_event
    from trainwise.run.job import prepare_job, resolve_nproc, start_lines
    from trainwise.run.launch import launch_workers
    from trainwise.run.lifeline import end_launch, start_launch
    from trainwise.run.run_files import default_run_dir, write_run_files
    from trainwise.run.run_lock import hold_run_dir, machines_share

    device = detect_device(cfg.cluster.device)
    nproc = resolve_nproc(cfg, device)
    nodes = cfg.cluster.nodes
    check_multi_node(cfg)
    # Planned at the most machines of the range.
    job = prepare_job(cfg, nproc * nodes, device, nproc)
    default = default_run_dir(cfg, label or job.strategy)
    run_dir = Path(cfg.logging.run_dir) if cfg.logging.run_dir else default
    with hold_run_dir(run_dir, machines_share(cfg)):
        check_run_dir(cfg, job, run_dir)
        write_run_files(run_dir, cfg, job)
        append_event(run_dir, "start", pid=os.getpid(), nproc=nproc, nodes=nodes)
        for line in start_lines(job, nproc, usable_cores()):
            print(line, file=sys.stderr)  # beside the workers' start-up lines
        if nproc == 1 and nodes == 1:
            target(cfg, run_dir)
            return run_dir
        launch = start_launch(dump_toml(cfg))
        try:
            launch_workers(
                run_dir, nproc, launch, cfg.cluster.master_port, max_restarts, module=module,
                cluster=cfg.cluster, checkpoints=checkpoint_root(cfg, run_dir),
            )  # fmt: skip
        finally:
            end_launch(launch)
    return run_dir


def checkpoint_root(cfg: JobConfig, run_dir: Path) -> Path:
    from trainwise.run.checkpoint_store import root_for

    return root_for(run_dir, cfg.checkpoint.dir)


def check_run_dir(cfg: JobConfig, job: Job, run_dir: Path) -> None:
    """Before any worker starts: the checkpoints it would resume from are of this run's
    lineage (else one line, exit 2), and a finished run is not run again."""
    from trainwise.config.lineage import lineage_keys
    from trainwise.run.events import read_events
    from trainwise.run.resume_rules import check_before_launch

    check_before_launch(
        cfg.checkpoint, checkpoint_root(cfg, run_dir), lineage_keys(cfg, job.global_batch)
    )
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
        )  # fmt: skip
