"""`trainwise plan`: flags and the job TOML in, the plan out (terminal, JSON, Markdown, HTML):
the flags parsed, trainwise.api's plan called, the plan printed. Imports no torch unless
--simulate asks for a measurement."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from trainwise.api import JobSpec, plan_job
from trainwise.errors import ConfigError

# flag -> (config key, argparse type, help). One table: the parser, the key mapping and the
# flag named in error messages all come from it.
FLAGS: list[tuple[str, str, type, str]] = [
    ("--model", "model.name", str, "a GPT preset (llama-7b, gpt2-124m, tiny, ...)"),
    ("--params", "plan.params", int, "a bare parameter count (model states only)"),
    ("--layers", "plan.layers", int, "shape: layers"),
    ("--hidden", "plan.hidden", int, "shape: model width"),
    ("--heads", "plan.heads", int, "shape: attention heads"),
    ("--kv-heads", "plan.kv_heads", int, "shape: key/value heads"),
    ("--ffn", "plan.ffn", int, "shape: feed-forward width"),
    ("--vocab", "plan.vocab", int, "shape: vocabulary"),
    ("--seq", "data.seq_len", int, "tokens per sequence"),
    ("--micro-batch", "data.micro_batch", int, "sequences per GPU per forward pass"),
    ("--global-batch", "data.global_batch", int, "sequences per optimizer step, all GPUs"),
    ("--tokens", "plan.tokens", str, "tokens to train in total (e.g. 2e12), or 'chinchilla'"),
    ("--precision", "precision.dtype", str, "fp32, bf16 or fp16"),
    ("--optimizer", "optim.name", str, "adamw or sgd"),
    ("--ac", "parallel.ac", str, "activation checkpointing: none, selective, full or selective-op"),
    ("--gpu", "cluster.gpu", str, "GPU type from the hardware catalog"),
    ("--gpu-mem-gb", "cluster.device_memory_gb", float, "custom GPU: memory in GB"),
    ("--gpu-tflops", "cluster.gpu_tflops", float, "custom GPU: dense peak TFLOP/s"),
    ("--gpu-hbm-gbps", "cluster.hbm_gbps", float, "GPU memory bandwidth in GB/s"),
    ("--gpu-clock-mhz", "cluster.sustained_clock_mhz", float,
     "SM clock the GPUs hold under load (a power cap lowers it): scales GEMM rates"),
    ("--norm", "model.norm_impl", str, "RMSNorm kernels: fused or composite"),
    ("--gpus", "plan.gpus", int, "GPUs in total"),
    ("--gpus-per-node", "cluster.nproc", int, "GPUs per node"),
    ("--intra-node-gbps", "cluster.intra_node_gbps", float, "GB/s per GPU within a node"),
    ("--inter-node-gbps", "cluster.inter_node_gbps", float, "GB/s per NIC between nodes"),
    ("--nics-per-node", "cluster.nics_per_node", int, "NICs per node (default one per GPU)"),
    ("--price", "cost.price_per_gpu_hour", float, "USD per GPU-hour"),
    ("--mtbf-hours", "cluster.mtbf_hours", float, "mean time between failures of one node"),
    ("--restart-min", "cluster.restart_min", float, "minutes from a failure to training again"),
    ("--checkpoint-gbps", "checkpoint.write_gbps", float, "GB/s a node writes checkpoints at"),
    ("--headroom", "parallel.headroom", float, "share of GPU memory kept free"),
    ("--efficiency", "plan.efficiency", float, "achieved share of peak FLOP/s"),
    ("--data-rate", "plan.data_samples_per_s", float, "samples/s one GPU's loader delivers"),
    ("--strategy", "plan.strategy", str, "search only this strategy's layouts: single, ddp, "
     "fsdp, hsdp, auto (or fsdp-full, fsdp-grad-op, fsdp-offload)"),
    ("--objective", "plan.objective", str, "cost or time"),
    ("--max-pp", "plan.max_pp", int,
     "the most pipeline stages to weigh (1: none; default: as many as split the blocks)"),
]
# How the API's messages name plan's options here: by their flags.
OPTION_FLAGS = {
    "emit": "--emit", "calibrate": "--calibrate", "simulate": "--simulate",
    "deadline_hours": "--deadline", "budget_usd": "--budget",
}
# A figure for the duration units of --deadline: hours per unit.
HOURS_PER = {"h": 1.0, "d": 24.0, "w": 168.0}


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan",
        help="search the layouts and knobs for the configuration to run, with its cost",
        description="Plan a job before it runs: search every layout (dp_replicate x dp_shard "
        "x tp, cpu offload) and knob (activation checkpointing, micro-batch, accumulation) "
        "for the cheapest (or fastest) configuration that fits, priced by memory, step time, "
        "throughput, time to train and cost; the named strategies (single, ddp, fsdp "
        "grad_op and full, hsdp, cpu offload) beside it; the answer as job-file keys "
        "(--emit writes the job). Without --config it plans llama-7b on 8 x H100-SXM in "
        "bf16. Precedence: defaults < --config < flags < --set.",
    )
    p.add_argument("--config", metavar="TOML", help="the job file `trainwise train` reads")
    p.add_argument(
        "--set",
        metavar="KEY=VALUE",
        action="append",
        default=[],
        help="override any key, e.g. --set plan.efficiency=0.5 (repeatable)",
    )
    for flag, key, _, text in FLAGS:
        # Values stay text here: job_spec converts them with one-line errors.
        p.add_argument(flag, help=f"{text} ({key})")
    p.add_argument(
        "--sweep", metavar="COUNTS", help="GPU counts: 1,2,4,8 or 1..1024 (doubling) (plan.sweep)"
    )
    p.add_argument(
        "--deadline",
        metavar="TIME",
        help="the cheapest configuration that finishes within TIME (e.g. 30d, 72h, 2w)",
    )
    p.add_argument(
        "--budget",
        metavar="USD",
        help="the fastest configuration that costs at most USD (e.g. 2e6)",
    )
    p.add_argument(
        "--emit",
        metavar="FILE",
        help="write the recommended configuration as a job file `trainwise train --config` runs",
    )
    p.add_argument(
        "--calibrate",
        metavar="FILE|RUN_DIR",
        help="re-plan with what a calibration file or a finished trainwise train or doctor "
        "run measured (compute efficiency, links, loader, checkpoint latency, runtime memory; "
        "plan.calibration); default: this machine kind's file from trainwise doctor; 'none'",
    )
    p.add_argument(
        "--simulate",
        action="store_true",
        help="also measure each strategy's peak memory: the real model and strategy code on "
        "fake tensors and a fake process group, under PyTorch's memory tracker (imports torch)",
    )
    out = p.add_mutually_exclusive_group()
    out.add_argument("--json", action="store_true", help="print the plan as JSON")
    out.add_argument("--markdown", action="store_true", help="print the plan as Markdown")
    p.add_argument("--html", metavar="PATH", help="also write a self-contained HTML page")
    p.set_defaults(run=run)


def job_spec(args: argparse.Namespace) -> JobSpec:
    """The job as the flags give it: --config, the flags (each key named by its flag),
    --sweep (its text: the API reads it), then --set; or ConfigError (exit 2)."""
    from trainwise.config.load import set_layer

    flags: dict[str, tuple[object, str]] = {}
    for flag, key, kind, _ in FLAGS:
        value = getattr(args, flag.lstrip("-").replace("-", "_"))
        if value is not None and kind is not str:
            value = _number(flag, value, kind)
        if key == "plan.tokens" and value is not None and value != "chinchilla":
            value = _positive(
                flag, value, value, "a number of tokens > 0 (e.g. 2e12) or 'chinchilla'"
            )
        flags[key] = (value, flag)
    flags["plan.sweep"] = (args.sweep, "--sweep")
    return JobSpec(args.config, (flags, set_layer(args.set)), OPTION_FLAGS)


def load_goal(args: argparse.Namespace) -> tuple[float | None, float | None]:
    """--deadline and --budget as hours and US dollars; one line if they do not parse or
    both limits are given."""
    if args.deadline is not None and args.budget is not None:
        raise ConfigError(
            "--deadline and --budget were both given: give one (the cheapest in time, or "
            "the fastest within the money)"
        )
    return _deadline_hours(args.deadline), _budget_usd(args.budget)


def _deadline_hours(text: str | None) -> float | None:
    if text is None:
        return None
    body, unit = text.strip(), "h"
    if body and body[-1].lower() in HOURS_PER:
        body, unit = body[:-1], body[-1].lower()
    expected = "a duration > 0 like 30d, 72h or 2w (h: hours, d: days, w: weeks)"
    return _positive("--deadline", text, body, expected, scale=HOURS_PER[unit])


def _budget_usd(text: str | None) -> float | None:
    if text is None:
        return None
    number = text.strip().lstrip("$").replace(",", "")
    return _positive("--budget", text, number, "US dollars > 0, e.g. 2e6 or 2,000,000")


def _positive(flag: str, text: str, number: str, expected: str, scale: float = 1.0) -> float:
    """`number` (the figure in the flag's `text`) x `scale`, a finite value > 0; else one
    line naming the flag and what it expects."""
    try:
        value = float(number) * scale
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise ConfigError(f"{flag} {text!r}: expected {expected}")
    return value


def _number(flag: str, text: str, kind: type) -> int | float:
    """`text` as the flag's number: whole numbers may be written 7e9; one line if not."""
    try:
        value = float(text)
    except ValueError:
        value = None
    if kind is int and value is not None and math.isfinite(value) and value == int(value):
        return int(value)
    if kind is float and value is not None:
        return value  # the schema rejects what is out of range, naming the key
    what = "a whole number (e.g. 8 or 7e9)" if kind is int else "a number (e.g. 1.5 or 2e12)"
    raise ConfigError(f"{flag} {text!r}: expected {what}")


def run(args: argparse.Namespace) -> int:
    from trainwise.report.plan_view import render_markdown, render_terminal

    spec = job_spec(args)
    deadline_hours, budget_usd = load_goal(args)
    plan = plan_job(
        spec, deadline_hours, budget_usd, calibrate=args.calibrate, simulate=args.simulate,
        emit=args.emit,
    )
    if args.html:
        from trainwise.report.plan_html import render_html

        path = Path(args.html)
        try:
            path.write_text(render_html(plan.planned), encoding="utf-8")
        except OSError as err:
            raise ConfigError(f"--html {args.html}: cannot write ({err.strerror})") from None
    if args.json:
        json.dump(plan.to_dict(), sys.stdout, indent=2)
        print()
    elif args.markdown:
        print(render_markdown(plan.planned, plan.simulation))
    else:
        render_terminal(plan.planned, simulation=plan.simulation)
    return 0
