"""Overhead of trainwise against a minimal hand-written torchrun loop, side by side.

For each model (the tiny preset and the ~6M-parameter `small`) and layout (ddp, fsdp,
tp 2, pp 2) it runs, in alternating order round after round (so that drift of the
machine falls on both alike):

- `trainwise train` with its defaults (telemetry every step, the loss averaged over
  ranks every logging.flush_every steps, probe steps, TensorBoard, progress lines, the
  stop/save agreement, the hang watchdog, the non-finite guard, AdamW's fused step) except
  evaluation and mid-run checkpoints, which are off because the raw loop has neither (the
  final save comes after the timed window);
- `bench/raw_loop.py` under `python -m torch.distributed.run`: the same model, data,
  optimizer hyperparameters, schedule, clipping and DDP / FSDP2 / DTensor TP / pipelining
  stages, with nothing else in the loop, and AdamW as a user writes it,
  `torch.optim.AdamW(params, lr=...)`: torch's default step (its per-tensor loop on CPU,
  foreach on CUDA).

Where trainwise chooses better than the plain loop, it keeps its choice, as a user gets it:
AdamW's fused step, DDP's gradients as views of its all-reduce buckets
(`gradient_as_bucket_view`, Accelerate's and Lightning's option) and no broadcast before
each forward of buffers the state dict does not save (the small model's rotary tables:
`broadcast_buffers`, now `forward_sync_buffers`, a collective a step), the last block kept
gathered from forward to backward under FSDP (torchtitan's default), and glibc's malloc
thresholds fixed in a CPU job's workers (run/engine/host_allocator.py). The same math
computed another way ends at the same loss within the check below. To time the
framework's own cost alone, give the raw loop trainwise's choices (`--same-choices`: its
fused AdamW, DDP's options and last block kept gathered, bench/raw_loop.py --as-trainwise,
and host_allocator's thresholds by environment, which trainwise then keeps).

Both get the same number of workers, micro batch, steps, fp32, and OMP_NUM_THREADS=1.
Throughput is steady state: the tokens of the steps after the warm-up step W, over the
wall time from the end of step W to the end of the last step (trainwise: `elapsed_s` of
metrics.jsonl, which includes everything its loop does between steps; raw: rank 0's
perf_counter at the end of each step). Process start-up, data building and wrapping are
outside the window for both. trainwise's probe passes (one more forward and backward every
logging.probe_every steps) are charged at a long run's rate, the median pass once per
probe_every steps, in place of the one or none that fall in the window. It prints the
median tokens/s of each, their min-max, and the ratio trainwise / raw per model and
layout against its target (1.0 for ddp and fsdp, 0.97 for tp and pp).

    .venv/bin/python bench/overhead.py            # 3 rounds, both models, all layouts
    .venv/bin/python bench/overhead.py --quick    # 40 steps, 1 round: a smoke run
    .venv/bin/python bench/overhead.py --cpu      # and the CPU time a step of each job

`--cpu` runs every job a second time, 30 steps long, and prints the CPU time (user and
system, every process of the job: launcher and workers) of the steps between: what the
loop costs the machine, a second view beside the wall time, which on a shared 2-core
machine moves by 20 % within minutes. Load moves the CPU figure too (gloo's event loops
and the agent's polling spend more CPU the longer a step waits), less directly.

Not part of `make test`: it takes about 20 minutes on a quiet 2-core machine and its
figures depend on the machine. It exits 1 when a pair of loops ends at different losses
(they would not be doing the same work); `--models tiny --layouts ddp --steps 6 --warmup
2 --rounds 1` is the quickest check of that.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

RAW_LOOP = Path(__file__).resolve().with_name("raw_loop.py")
SYSTEMS = ("trainwise", "raw")
# trainwise / raw to reach: the data-parallel loops have nothing to add to a step; tensor
# and pipeline parallelism leave the framework a little (DTensor's and the schedule's).
TARGETS = {"ddp": 1.0, "fsdp": 1.0, "tp": 0.97, "pp": 0.97}
# trainwise's flags of each layout (2 workers: tp and pp leave no data parallelism).
LAYOUT_FLAGS = {
    "ddp": ("--strategy", "ddp"),
    "fsdp": ("--strategy", "fsdp"),
    "tp": ("--set", "parallel.tp=2"),
    "pp": ("--set", "parallel.pp=2"),
}
# --cpu: the short run whose CPU time is taken from each long run's (start-up, data and
# model building, the final save), leaving the steps between.
CPU_SHORT_STEPS = 30
# Per model: (micro batch, steps); small's micro batch keeps its step near a quarter of a
# second on 2 cores. Whatever probe passes fall in the window, trainwise is charged a long
# run's share of them (run_trainwise).
MODELS = {"tiny": (16, 150), "small": (4, 110)}


@dataclass
class Run:
    system: str
    model: str
    layout: str
    round: int
    tokens_per_s: float
    ms_per_step: float  # steady-state wall time per step (trainwise: probes charged, below)
    final_loss: float
    wall_s: float  # the whole subprocess, start-up included
    cpu_s: float = 0.0  # CPU seconds of every process of the job, start-up included
    # trainwise only: what its own step clock saw (DataParallelStep.step) vs the wall per step; the
    # difference is spent outside the step (logging, loss all-reduce, probe pass, ...).
    step_clock_ms: float | None = None
    probe_ms: float | None = None  # the probes' extra passes, spread over the window's steps
    probe_steps: list[int] = field(default_factory=list)
    # A long run's share of the probes per step (one pass per logging.probe_every steps),
    # charged in place of probe_ms; measured_ms_per_step is the window's own wall.
    probe_charged_ms: float | None = None
    measured_ms_per_step: float | None = None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="trainwise vs a minimal torchrun loop: steady-state tokens/s ratio."
    )
    p.add_argument("--steps", type=int, default=None,
                   help="optimizer steps (default per model: tiny 150, small 110)")
    p.add_argument("--rounds", type=int, default=None, help="runs of each (default 3)")
    p.add_argument("--warmup", type=int, default=5, help="steps left out of the window")
    p.add_argument("--models", default="tiny,small", help="comma-separated: tiny, small")
    p.add_argument("--layouts", default="ddp,fsdp,tp,pp",
                   help="comma-separated: ddp, fsdp, tp (tp 2), pp (pp 2)")
    p.add_argument("--nproc", type=int, default=2, help="workers per run")
    p.add_argument("--micro-batch", type=int, default=None,
                   help="samples per data-parallel rank per step (default per model)")
    p.add_argument("--quick", action="store_true", help="40 steps, 1 round (smoke run)")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra trainwise override, e.g. logging.tensorboard=false, to attribute overhead",
    )
    p.add_argument("--same-choices", action="store_true",
                   help="give the raw loop trainwise's choices (fused AdamW, FSDP's last block "
                   "kept gathered, glibc's malloc thresholds): the framework's own cost")
    p.add_argument("--cpu", action="store_true",
                   help=f"also run each job {CPU_SHORT_STEPS} steps long and print the CPU time "
                   "a step of all its processes (the long run's CPU less the short one's, over "
                   "the steps between; about half again the bench's time)")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = p.parse_args(argv)
    args.steps = args.steps or (40 if args.quick else None)
    args.rounds = args.rounds or (1 if args.quick else 3)
    args.models = _choices(p, "--models", args.models, MODELS)
    args.layouts = _choices(p, "--layouts", args.layouts, LAYOUT_FLAGS)
    if args.nproc != 2 and {"tp", "pp"} & set(args.layouts):
        p.error("--layouts tp and pp run on exactly 2 workers (--nproc 2)")
    shortest = min(steps_of(args, m) for m in args.models)
    if not 1 <= args.warmup < shortest - 1:
        p.error(f"--warmup {args.warmup} must be >= 1 and leave steps to time (--steps)")
    if args.cpu and not args.warmup < CPU_SHORT_STEPS - 1 < shortest - 2:
        p.error(f"--cpu runs each job {CPU_SHORT_STEPS} steps long too: --steps must exceed "
                f"{CPU_SHORT_STEPS + 1} and --warmup stay under {CPU_SHORT_STEPS - 1}")
    return args


def _choices(p: argparse.ArgumentParser, flag: str, text: str, known: dict) -> list[str]:
    chosen = [s.strip() for s in text.split(",") if s.strip()]
    bad = [s for s in chosen if s not in known]
    if bad or not chosen:
        p.error(f"{flag}: unknown {', '.join(bad) or 'nothing'}; choose among {', '.join(known)}")
    return chosen


def steps_of(args: argparse.Namespace, model: str) -> int:
    return args.steps or MODELS[model][1]


def micro_of(args: argparse.Namespace, model: str) -> int:
    return args.micro_batch or MODELS[model][0]


def child_env(same_choices: bool = False) -> dict[str, str]:
    env = dict(os.environ)
    # Explicit for both: trainwise would otherwise pick cores // nproc, torchrun 1.
    env["OMP_NUM_THREADS"] = "1"
    if same_choices:  # trainwise keeps a threshold set by the environment
        from trainwise.run.engine.host_allocator import MMAP_THRESHOLD, TRIM_THRESHOLD

        env["MALLOC_MMAP_THRESHOLD_"] = str(MMAP_THRESHOLD)
        env["MALLOC_TRIM_THRESHOLD_"] = str(TRIM_THRESHOLD)
    return env


def run_child(cmd: list[str], timeout: float, same_choices: bool,
              attempts: int = 2) -> tuple[float, float]:
    """Run one job to completion and return its wall seconds and the CPU seconds of all
    its processes. A failed or hung job is retried once (a rendezvous port taken by
    another process between being picked and bound fails a start now and then; gloo's
    group destructor deadlocks on the GIL at exit now and then); a second failure exits
    with the job's output."""
    for attempt in range(1, attempts + 1):
        t0 = time.perf_counter()
        cpu0 = children_cpu_s()
        mark = f"{os.getpid()}-{attempt}-{time.monotonic_ns()}"
        proc = subprocess.Popen(
            cmd,
            env={**child_env(same_choices), JOB_MARK: mark},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        try:
            output, _ = proc.communicate(timeout=timeout)
            why = f"exit {proc.returncode}"
        except subprocess.TimeoutExpired:
            kill_job(mark)
            output, _ = proc.communicate()
            why = f"timed out after {timeout:.0f} s"
        if proc.returncode == 0:
            return time.perf_counter() - t0, children_cpu_s() - cpu0
        message = f"{why}: {' '.join(cmd)}"
        if attempt < attempts:
            print(f"  retrying, {message}", flush=True)
    sys.exit(f"failed, {message}\n{output[-4000:]}")


def children_cpu_s() -> float:
    """User and system seconds of this process's waited-for children and theirs: a job's
    launcher and its workers (the agent waits for its workers, run_child for the agent)."""
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    return used.ru_utime + used.ru_stime


# In each job's environment, so that a hung job's processes are found wherever they are:
# torchrun's workers run in sessions of their own (torch 2.13's elastic agent starts them
# so), which a kill of the agent's process group misses, and they hold the output pipe.
JOB_MARK = "TRAINWISE_OVERHEAD_JOB"


def kill_job(mark: str) -> None:
    """SIGKILL every process whose environment carries `mark` (the agent, its workers)."""
    wanted = f"{JOB_MARK}={mark}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if wanted in (entry / "environ").read_bytes().split(b"\0"):
                os.kill(int(entry.name), signal.SIGKILL)
        except OSError:
            continue  # gone meanwhile, or not ours to read


def window(ends: list[float], warmup: int) -> tuple[float, int]:
    """(seconds, steps) from the end of step `warmup` (1-based) to the end of the last."""
    return ends[-1] - ends[warmup - 1], len(ends) - warmup


def is_probe_step(step: int, every: int) -> bool:
    from trainwise.run.engine.recorder import is_probe_step as schedule

    return schedule(step, every)


def probe_every(run_dir: Path) -> int:
    """The run's probe period, from the resolved config it wrote (--set may change it)."""
    from trainwise.config import load_config

    return load_config(run_dir / "config.toml").logging.probe_every


def run_trainwise(model: str, layout: str, rnd: int, args: argparse.Namespace, tmp: Path) -> Run:
    run_dir = tmp / f"trainwise-{model}-{layout}-{rnd}"
    steps = steps_of(args, model)
    cmd = [
        sys.executable, "-m", "trainwise", "train",
        "--nproc", str(args.nproc),
        *LAYOUT_FLAGS[layout],
        "--steps", str(steps),
        "--precision", "fp32",
        "--run-dir", str(run_dir),
        "--set", f"model.name={model}",
        "--set", f"data.micro_batch={micro_of(args, model)}",
        "--set", "train.eval_every=0",  # the raw loop does not evaluate
        # Nor does it save: the one checkpoint is the final one, after the timed window.
        "--set", f"checkpoint.interval={steps}",
    ]
    for kv in args.overrides:
        cmd += ["--set", kv]
    wall, cpu = run_child(cmd, child_timeout(model, steps), args.same_choices)
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    by_step = {r["step"]: r for r in recs}
    if sorted(by_step) != list(range(1, steps + 1)):
        sys.exit(f"{run_dir}/metrics.jsonl lacks steps: the window needs a record per step")
    ends = [by_step[s]["elapsed_s"] for s in range(1, steps + 1)]
    seconds, timed_steps = window(ends, args.warmup)
    tokens = by_step[steps]["tokens"] - by_step[args.warmup]["tokens"]
    timed = [by_step[s] for s in range(args.warmup + 1, steps + 1)]
    every = probe_every(run_dir) if layout != "pp" else 0  # the pipeline step never probes
    # A probe step's step_s leaves out one of its two forward+backward passes, the one
    # without gradient sync, which is its compute_s (with one micro-batch a step, as this
    # bench runs; under tp its collectives are not in compute_s and stay uncharged).
    passes = {s: by_step[s]["compute_s"] for s in range(1, steps + 1) if is_probe_step(s, every)}
    in_window = sum(v for s, v in passes.items() if s > args.warmup)
    # As many probes as a long run has (one pass per `every` steps), not as many as fall in
    # this window (one or none): the median pass, steps 3-5's included, per `every` steps.
    charged = timed_steps * statistics.median(passes.values()) / every if passes else 0.0
    charged_seconds = seconds - in_window + charged
    return Run(
        system="trainwise",
        model=model,
        layout=layout,
        round=rnd,
        tokens_per_s=tokens / charged_seconds,
        ms_per_step=1000 * charged_seconds / timed_steps,
        final_loss=by_step[steps]["loss"],
        wall_s=wall,
        cpu_s=cpu,
        step_clock_ms=1000 * sum(r["step_s"] for r in timed) / timed_steps,
        probe_ms=1000 * in_window / timed_steps,
        probe_steps=[s for s in passes if s > args.warmup],
        probe_charged_ms=1000 * charged / timed_steps,
        measured_ms_per_step=1000 * seconds / timed_steps,
    )


def run_raw(model: str, layout: str, rnd: int, args: argparse.Namespace, tmp: Path) -> Run:
    out = tmp / f"raw-{model}-{layout}-{rnd}.json"
    steps = steps_of(args, model)
    cmd = [
        sys.executable, "-m", "torch.distributed.run",
        "--standalone",
        "--nproc-per-node", str(args.nproc),
        str(RAW_LOOP),
        "--layout", layout,
        "--model", model,
        "--steps", str(steps),
        "--micro-batch", str(micro_of(args, model)),
        "--out", str(out),
        *(["--as-trainwise"] if args.same_choices else []),
    ]
    wall, cpu = run_child(cmd, child_timeout(model, steps), args.same_choices)
    rec = json.loads(out.read_text())
    seconds, timed_steps = window(rec["step_end_s"], args.warmup)
    return Run(
        system="raw",
        model=model,
        layout=layout,
        round=rnd,
        tokens_per_s=rec["tokens_per_step"] * timed_steps / seconds,
        ms_per_step=1000 * seconds / timed_steps,
        final_loss=rec["final_loss"],
        wall_s=wall,
        cpu_s=cpu,
    )


def child_timeout(model: str, steps: int) -> float:
    """Seconds after which a run counts as hung: start-up, and a generous step."""
    return 120 + steps * (1.0 if model == "tiny" else 10.0)


def fmt_k(x: float) -> str:
    return f"{x / 1000:.1f}k"


def summarize(model: str, layout: str, runs: list[Run]) -> dict:
    mine = {
        s: [r for r in runs if (r.model, r.layout, r.system) == (model, layout, s)]
        for s in SYSTEMS
    }
    tps = {s: [r.tokens_per_s for r in mine[s]] for s in SYSTEMS}
    med = {s: statistics.median(tps[s]) for s in SYSTEMS}
    # Paired per round: both runs of a round saw the same state of the machine.
    pairs = zip(mine["trainwise"], mine["raw"], strict=True)
    paired = [t.tokens_per_s / r.tokens_per_s for t, r in pairs]
    tw = mine["trainwise"]
    ratio = med["trainwise"] / med["raw"]
    return {
        "model": model,
        "layout": layout,
        "trainwise_tokens_per_s": med["trainwise"],
        "raw_tokens_per_s": med["raw"],
        "trainwise_range": [min(tps["trainwise"]), max(tps["trainwise"])],
        "raw_range": [min(tps["raw"]), max(tps["raw"])],
        "ratio": ratio,
        "paired_ratio_range": [min(paired), max(paired)],
        "target": TARGETS[layout],
        "meets_target": ratio >= TARGETS[layout],
        "ms_per_step": {s: statistics.median(r.ms_per_step for r in mine[s]) for s in SYSTEMS},
        "trainwise_step_clock_ms": statistics.median(r.step_clock_ms or 0.0 for r in tw),
        "trainwise_probe_ms": statistics.median(r.probe_ms or 0.0 for r in tw),
        "trainwise_probe_steps": tw[-1].probe_steps,
        "trainwise_probe_charged_ms": statistics.median(r.probe_charged_ms or 0.0 for r in tw),
        "trainwise_measured_ms_per_step": statistics.median(r.measured_ms_per_step or 0.0 for r in tw),
        "final_loss": {s: mine[s][-1].final_loss for s in SYSTEMS},
    }


def print_table(rows: list[dict]) -> None:
    header = ("model", "layout", "trainwise tok/s", "raw tok/s", "ratio", "per-round", "target")
    lines = []
    for r in rows:
        tw_lo, tw_hi = r["trainwise_range"]
        raw_lo, raw_hi = r["raw_range"]
        p_lo, p_hi = r["paired_ratio_range"]
        lines.append(
            (
                r["model"],
                r["layout"],
                f"{r['trainwise_tokens_per_s']:,.0f} ({fmt_k(tw_lo)}-{fmt_k(tw_hi)})",
                f"{r['raw_tokens_per_s']:,.0f} ({fmt_k(raw_lo)}-{fmt_k(raw_hi)})",
                f"{r['ratio']:.3f}",
                f"{p_lo:.3f}-{p_hi:.3f}",
                f">= {r['target']}: {'ok' if r['meets_target'] else 'BELOW'}",
            )
        )
    widths = [max(len(row[i]) for row in (header, *lines)) for i in range(len(header))]
    for row in (header, *lines):
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())


def trains_alike(row: dict) -> bool:
    """The ratio means something only when both loops do the same work: the same initial
    weights, data, schedule and clipping end at the same loss (once 1.6896 against 1.6831,
    when the raw loop drew its weights from the global RNG)."""
    loss = row["final_loss"]
    return abs(loss["trainwise"] - loss["raw"]) <= 1e-4 * abs(loss["raw"])


def print_notes(rows: list[dict]) -> None:
    """Where the time goes, per step: what tells overhead inside trainwise's step (its
    step clock vs the raw loop) from overhead between steps (wall vs its step clock)."""
    print()
    for r in rows:
        ms = r["ms_per_step"]
        inside = r["trainwise_step_clock_ms"]
        probe = r["trainwise_probe_ms"]
        between = ms["trainwise"] - inside
        loss = r["final_loss"]
        same = trains_alike(r)
        print(
            f"{r['model']} {r['layout']}: ms/step raw {ms['raw']:.2f}, trainwise"
            f" {ms['trainwise']:.2f} = {inside:.2f} in its step clock + {probe:.2f} probe"
            f" passes (steps {r['trainwise_probe_steps']}) + {between - probe:.2f} else"
            f" between steps; final loss {loss['trainwise']:.4f} vs {loss['raw']:.4f}"
            f" ({'same' if same else 'DIFFERENT: the loops do not train alike'})"
        )


def step_cpu_ms(runner: Callable[..., Run], run: Run, args: argparse.Namespace,
                tmp: Path) -> float:
    """The CPU milliseconds a step of `run`'s job, every process of it: `run`'s CPU less that
    of the same job at CPU_SHORT_STEPS steps (run apart, right after), over the steps
    between: start-up, building and the final save cancel out."""
    short_dir = tmp / "short"
    short_dir.mkdir(exist_ok=True)
    short_args = argparse.Namespace(**{**vars(args), "steps": CPU_SHORT_STEPS})
    short = runner(run.model, run.layout, run.round, short_args, short_dir)
    steps = steps_of(args, run.model) - CPU_SHORT_STEPS
    return 1000 * (run.cpu_s - short.cpu_s) / steps


def print_cpu(cases: list[tuple[str, str]],
              cpu_ms: dict[tuple[str, str, str], list[float]]) -> None:
    print(f"\nCPU a step, every process of the job (--cpu: each run less a {CPU_SHORT_STEPS}-step"
          " run of the same job), median with the per-round range:")
    for model, layout in cases:
        tw, raw = cpu_ms[(model, layout, "trainwise")], cpu_ms[(model, layout, "raw")]
        tw_ms, raw_ms = statistics.median(tw), statistics.median(raw)
        print(f"  {model} {layout}: trainwise {tw_ms:.1f} ms ({min(tw):.1f}-{max(tw):.1f}), raw "
              f"{raw_ms:.1f} ms ({min(raw):.1f}-{max(raw):.1f}): trainwise / raw "
              f"{tw_ms / raw_ms:.3f} (below 1: trainwise's step costs less)")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sizes = ", ".join(
        f"{m}: micro batch {micro_of(args, m)}, {steps_of(args, m)} steps" for m in args.models
    )
    print(
        f"trainwise vs raw torchrun loop: {args.nproc} workers ({sizes}; window after step "
        f"{args.warmup}), {args.rounds} round(s), fp32, OMP_NUM_THREADS=1",
        flush=True,
    )
    # Anything else running on the machine shows up as noise: make it visible.
    load_before = os.getloadavg()[0]
    runners = {"trainwise": run_trainwise, "raw": run_raw}
    runs: list[Run] = []
    cases = [(m, lay) for m in args.models for lay in args.layouts]
    cpu_ms: dict[tuple[str, str, str], list[float]] = {
        (m, lay, s): [] for m, lay in cases for s in SYSTEMS}
    with tempfile.TemporaryDirectory(prefix="trainwise-overhead-") as tmp:
        for rnd in range(args.rounds):
            for model, layout in cases:
                # Alternate who goes first, so a warming or cooling machine favours neither.
                order = SYSTEMS if rnd % 2 == 0 else SYSTEMS[::-1]
                for system in order:
                    run = runners[system](model, layout, rnd, args, Path(tmp))
                    runs.append(run)
                    print(
                        f"  {model} {layout} round {rnd + 1}/{args.rounds} {system:9s} "
                        f"{run.tokens_per_s:10,.0f} tok/s  {run.ms_per_step:7.2f} ms/step  "
                        f"(process {run.wall_s:.1f} s)",
                        flush=True,
                    )
                    if args.cpu:
                        cpu_ms[(model, layout, system)].append(
                            step_cpu_ms(runners[system], run, args, Path(tmp)))
    rows = [summarize(m, lay, runs) for m, lay in cases]
    print()
    print_table(rows)
    print_notes(rows)
    if args.cpu:
        print_cpu(cases, cpu_ms)
    load_after = os.getloadavg()[0]
    print(
        f"load average (1 min) {load_before:.2f} before, {load_after:.2f} after, on "
        f"{os.cpu_count()} cores: well above {args.nproc} means other work shared the cores"
    )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
        payload = {
            "settings": settings,
            "load_average": [load_before, load_after],
            "results": rows,
            "cpu_ms_per_step": {" ".join(k): v for k, v in cpu_ms.items() if v},
            "runs": [asdict(r) for r in runs],
        }
        args.json.write_text(json.dumps(payload, indent=2) + "\n")
        print(f"\nwrote {args.json}")
    different = [f"{r['model']} {r['layout']}" for r in rows if not trains_alike(r)]
    if different:
        print(f"overhead: the loops end at different losses ({', '.join(different)}): the "
              "ratio compares unlike work; fix bench/raw_loop.py to match", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
