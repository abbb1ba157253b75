"""Where a step's time goes, in counts a loaded machine does not change: trainwise's loop
and the hand-written one (bench/raw_loop.py) each run under cProfile on rank 0 for the
same whole loop iterations (from the draw of batch START to the draw of batch END, so
that everything between two steps is in), and the profiles are compared per step:

- Python calls per step (every function the interpreter entered, torch's included);
- collectives issued outside torch's own wrappers (all-reduce, broadcast, barrier, ...),
  point-to-point sends and receives, and waits on them: the control exchange, the loss
  reduction and the pipeline's transfers show up here (DDP's and FSDP's gradient
  collectives run in C++ and DTensor's through functional collectives: not counted);
- host reads of tensors (.item, bool, float, tolist): on a GPU each is a synchronisation;
- faulthandler re-arms and module walks (named_modules);
- the functions trainwise calls more often than the raw loop, per step.

    .venv/bin/python bench/step_profile.py                  # tiny, ddp fsdp tp pp
    .venv/bin/python bench/step_profile.py --layouts ddp --top 40

The profiled milliseconds are printed too, for what they are worth: the profiler slows
Python calls several times over, and other work on the machine shows up in them.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import runpy
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve()
RAW_LOOP = HERE.with_name("raw_loop.py")
TRAINWISE_FLAGS = {
    "ddp": "parallel.strategy=ddp",
    "fsdp": "parallel.strategy=fsdp",
    "tp": "parallel.tp=2",
    "pp": "parallel.pp=2",
}
# (what, how to tell it from a profile's function key (file, line, name)).
COUNTED = (
    ("collectives", lambda f: f[0] == "~" and any(
        f"_distributed_c10d.{op}" in f[2]
        for op in ("allreduce", "broadcast", "allgather", "reduce_scatter", "barrier", "gather")
    )),
    ("send/recv", lambda f: f[0] == "~" and any(
        f"_distributed_c10d.{op}" in f[2] for op in ("send", "recv")
    )),
    ("waits", lambda f: f[0] == "~" and "_distributed_c10d.wait" in f[2]),
    ("host reads", lambda f: f[0] == "~" and any(
        f"'{m}'" in f[2] for m in ("item", "tolist", "__bool__", "__float__")
    )),
    ("watchdog arms", lambda f: "dump_traceback_later" in f[2]),
    ("module walks", lambda f: f[2] == "named_modules"),
)


def window_parser(doc: str, layouts: str, steps: int, window: str, what: str
                  ) -> argparse.ArgumentParser:
    """The options every step bench takes (this one, step_threads, step_comms): the
    layouts, the model and micro-batch, each run's steps and the window of batches `what`
    (profiled, read, counted); window_args checks them."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--layouts", default=layouts, help="comma-separated: ddp, fsdp, tp, pp")
    p.add_argument("--model", default="tiny")
    p.add_argument("--micro-batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=steps, help="steps of each run")
    p.add_argument("--window", default=window, help=f"START:END batches {what} (END excluded)")
    return p


def window_args(p: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """window_parser's options parsed: the layouts as a list of known ones, the window as
    args.start and args.end within the run's steps."""
    args = p.parse_args(argv)
    args.layouts = [s.strip() for s in args.layouts.split(",") if s.strip()]
    bad = [s for s in args.layouts if s not in TRAINWISE_FLAGS]
    if bad:
        p.error(f"--layouts: unknown {', '.join(bad)}; choose among {', '.join(TRAINWISE_FLAGS)}")
    start, _, end = args.window.partition(":")
    args.start, args.end = int(start), int(end)
    if not 1 <= args.start < args.end <= args.steps:
        p.error(f"--window {args.window}: 1 <= START < END <= --steps {args.steps}")
    return args


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = window_parser(__doc__, "ddp,fsdp,tp,pp", 90, "11:81", "profiled")
    p.add_argument("--top", type=int, default=25, help="functions listed by calls per step")
    return window_args(p, argv)


# -- in the workers -------------------------------------------------------------------


def run_in_window(kind: str, rest: list[str], start: int, end: int,
                  on_start: Callable[[], None], on_end: Callable[[], None]) -> None:
    """Run trainwise's worker (`kind` tw: `rest` are config overrides) or the raw loop
    (`kind` raw: `rest` its arguments), calling `on_start` as loader batch `start` is drawn
    and `on_end` as batch `end` is (so the window holds whole loop iterations)."""
    import trainwise.data as data

    build = data.build_loader

    class Drawn:
        def __init__(self, loader):
            self.it, self.n = iter(loader), 0

        def __iter__(self):
            return self

        def __next__(self):
            self.n += 1
            if self.n == start:
                on_start()
            if self.n == end:
                on_end()
            return next(self.it)

    def counted_loader(*args, **kwargs):
        return Drawn(build(*args, **kwargs))

    data.build_loader = counted_loader
    if kind == "raw":
        sys.argv = [str(RAW_LOOP), *rest]
        runpy.run_path(str(RAW_LOOP), run_name="__main__")
        return
    import trainwise.run.engine.training as training
    from trainwise.config import load_config
    from trainwise.run.engine import worker as trainwise_worker

    training.build_loader = counted_loader
    trainwise_worker.train(load_config(None, overrides=rest))


def worker(out: str, start: int, end: int, kind: str, rest: list[str]) -> None:
    """Profile rank 0 over loader batches [start, end) of either loop (run_in_window)."""
    rank0 = os.environ.get("RANK", "0") == "0"
    prof = cProfile.Profile()

    def stop() -> None:
        prof.disable()
        prof.dump_stats(out)

    run_in_window(kind, rest, start, end, prof.enable if rank0 else lambda: None,
                  stop if rank0 else lambda: None)


# -- the driver -----------------------------------------------------------------------


def launch(script: Path, kind: str, layout: str, args: argparse.Namespace, tmp: Path,
           worker_args: list[str]) -> None:
    """Run `script --worker WORKER_ARGS kind ...` under torchrun on 2 workers: trainwise's
    worker (`kind` tw) or the raw loop (raw) on `layout`, args.steps steps of args.model at
    args.micro_batch; exits with the workers' stderr when they fail."""
    if kind == "raw":
        rest = ["--layout", layout, "--model", args.model, "--steps", str(args.steps),
                "--micro-batch", str(args.micro_batch), "--out", str(tmp / "raw.json")]
    else:
        rest = [
            TRAINWISE_FLAGS[layout], f"train.steps={args.steps}", "precision.dtype=fp32",
            f"model.name={args.model}", f"data.micro_batch={args.micro_batch}",
            "train.eval_every=0", f"checkpoint.interval={args.steps}",
            f"logging.run_dir={tmp / f'run-{layout}'}", "cluster.nproc=2",
        ]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", str(script), "--worker", *worker_args, kind, *rest]
    done = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=600 + 10 * args.steps)
    if done.returncode != 0:
        sys.exit(f"{kind} {layout} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")


def launch_ranks(script: Path, kind: str, layout: str, args: argparse.Namespace, tmp: Path,
                 *extra: str) -> list[dict]:
    """launch's run of a worker that writes its rank's JSON to OUT.RANK (step_threads,
    step_comms: worker args OUT START END EXTRA...): the two ranks' records."""
    out = tmp / f"{kind}-{layout}"
    launch(script, kind, layout, args, tmp, [str(out), str(args.start), str(args.end), *extra])
    return [json.loads(Path(f"{out}.{rank}").read_text()) for rank in (0, 1)]


def profile(kind: str, layout: str, args: argparse.Namespace, tmp: Path) -> pstats.Stats:
    out = tmp / f"{kind}-{layout}.prof"
    launch(HERE, kind, layout, args, tmp, [str(out), str(args.start), str(args.end)])
    if not out.exists():
        sys.exit(f"{kind} {layout}: no profile written ({out})")
    return pstats.Stats(str(out))


def per_step(stats: pstats.Stats, steps: int) -> dict[tuple, float]:
    return {f: v[1] / steps for f, v in stats.stats.items()}  # primitive calls


def summary_line(name: str, stats: pstats.Stats, steps: int) -> str:
    calls = per_step(stats, steps)
    ms = 1000 * sum(v[2] for v in stats.stats.values()) / steps
    counted = "  ".join(
        f"{what} {sum(n for f, n in calls.items() if match(f)):.2f}" for what, match in COUNTED
    )
    return f"  {name:9s} calls {sum(calls.values()):8.0f}  {counted}  (profiled {ms:.1f} ms)"


def short(f: tuple) -> str:
    path, line, name = f
    if path == "~":
        return name
    for marker in ("site-packages/", "src/", "lib/python"):
        if marker in path:
            path = path.split(marker, 1)[1]
            break
    return f"{path}:{line}({name})"


def main(argv: list[str] | None = None) -> int:
    if argv is None and sys.argv[1:2] == ["--worker"]:
        out, start, end, kind, *rest = sys.argv[2:]
        worker(out, int(start), int(end), kind, rest)
        return 0
    args = parse_args(argv)
    steps = args.end - args.start
    print(f"per step, rank 0, batches {args.start}..{args.end - 1} of {args.steps}: "
          f"{args.model}, micro batch {args.micro_batch}, 2 workers, fp32")
    with tempfile.TemporaryDirectory(prefix="trainwise-step-profile-") as tmp:
        for layout in args.layouts:
            tw = profile("tw", layout, args, Path(tmp))
            raw = profile("raw", layout, args, Path(tmp))
            print(f"\n{layout}:")
            print(summary_line("trainwise", tw, steps))
            print(summary_line("raw", raw, steps))
            mine, theirs = per_step(tw, steps), per_step(raw, steps)
            more = sorted(
                ((mine.get(f, 0.0) - theirs.get(f, 0.0), f) for f in set(mine) | set(theirs)),
                reverse=True,
            )
            print(f"  calls per step, trainwise - raw (top {args.top}):")
            for diff, f in more[: args.top]:
                if diff < 0.05:
                    break
                print(f"    {diff:+7.2f}  {short(f)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
