"""`trainwise train`: plan (strategy auto), check, launch the workers, summarise."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from trainwise.config import JobConfig, dump_toml, load_config
from trainwise.errors import ConfigError
from trainwise.report import render_summary


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
        "--oversubscribe",
        action="store_true",
        default=None,
        help="allow more CPU workers than cores (cluster.oversubscribe)",
    )
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
    p.add_argument(
        "--strategy",
        help="auto, single, ddp, fsdp or hsdp; also fsdp-full, fsdp-grad-op, fsdp-offload "
        "(parallel.strategy)",
    )
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
    "cluster.oversubscribe": "--oversubscribe",
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
    from trainwise.run.engine.control import stop_status
    from trainwise.run.launch.start import is_worker, start_job, train_here
    from trainwise.run.launch.torchrun import LaunchError, Preempted

    if is_worker(cfg):
        from trainwise.run.engine.worker import train

        summary = train(cfg)
        if summary:
            print(render_summary(summary))
            finish_report(cfg, Path(summary["run_dir"]))
        return stop_status(summary["preempted"]) if summary and summary.get("preempted") else 0

    try:
        run_dir = start_job(
            cfg, train_here, "trainwise.run.engine.worker", max_restarts=cfg.checkpoint.max_restarts
        )
    except Preempted as stop:
        # Saved but not finished: 128 + the signal, so that `train && export` stops here.
        print(f"trainwise: {stop}; {resume_hint(cfg, stop.event)}")
        return stop.exit_status
    except LaunchError as failed:
        if failed.run_dir is not None:
            finish_report(cfg, failed.run_dir, after_failure=True)
        raise
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


def finish_report(cfg: JobConfig, run_dir: Path, after_failure: bool = False) -> None:
    """RUN/report.html on rank 0's machine, when the run has finished or failed for good
    (logging.report): after a failure, of what the run recorded, and quietly when even
    that cannot be written (the failure's own line is what matters then)."""
    if not cfg.logging.report or not (run_dir / "metrics.jsonl").is_file():
        return
    from trainwise.cli.report import write_page
    from trainwise.report.analysis import analyse
    from trainwise.report.rundir import load_run

    page = run_dir / "report.html"
    try:
        write_page([analyse(load_run(run_dir))], page)
    except Exception as err:  # any failure: the run's results stand without the page
        if not after_failure:
            print(
                f"trainwise: the report was not written ({type(err).__name__}: {err}); "
                f"`trainwise report {run_dir}` tries again",
                file=sys.stderr,
            )
        return
    from trainwise.run.observe.trackers import add_report

    add_report(run_dir, cfg.logging.trackers, cfg.logging.mlflow_uri)
    if after_failure:
        print(f"trainwise: report of what the run recorded: {page}", file=sys.stderr)
    else:
        print(f"  report     {page}")
