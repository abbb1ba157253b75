"""`trainwise train`: the flags parsed, trainwise.api's train called (plan with strategy
auto, check, launch the workers), its result printed."""

from __future__ import annotations

import argparse

from trainwise.api import JobSpec, train_job
from trainwise.config import dump_toml
from trainwise.config.load import set_layer
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


def job_spec(args: argparse.Namespace, extra: dict[str, tuple[object, str]]) -> JobSpec:
    """The job as the flags give it: --config, the job's flags (and `extra`: key ->
    (value, flag)), each key named by its flag, then --set."""
    flags = {key: (value, JOB_FLAGS[key]) for key, value in job_flags(args).items()}
    return JobSpec(args.config, ({**flags, **extra}, set_layer(args.set)))


def run(args: argparse.Namespace) -> int:
    extra = {"cluster.allow_version_mismatch": (args.allow_version_mismatch,
                                                "--allow-version-mismatch")}
    spec = job_spec(args, extra)
    if args.print_config:
        cfg, _ = spec.load()
        print(dump_toml(cfg), end="")
        return 0
    # The workers draw their own progress (in this terminal): no second bar here.
    result = train_job(spec, progress=False)
    if result.message:  # a stop that saved (exit 128 + the signal), or rank 0 elsewhere
        print(f"trainwise: {result.message}")
    elif result.summary is not None:
        print(render_summary(result.summary))
        if result.report is not None:
            print(f"  report     {result.report}")
    return result.exit_status
