"""Where a step's wall time goes on each worker, in figures a loaded machine changes little:
trainwise's loop and the hand-written one (bench/raw_loop.py) run under torchrun, and over
the same whole loop iterations (from the draw of batch START to the draw of batch END)
each rank reads from Linux's /proc/<pid>/task/<tid>/schedstat, per step:

- its main thread's CPU time, its wait for a core (runnable, not running: other threads
  or processes had the cores) and the rest of the wall time, asleep (waiting for a peer
  in a collective, or for a lock);
- every other thread of the process: the times it ran (each wake-up takes a core from
  the step on a machine the workers fill) and its CPU time;
- with --ops, rank 0's aten operations per step (torch.profiler): any operation one loop
  runs and the other does not is different work, whatever the clock says.

    .venv/bin/python bench/step_threads.py                    # tiny, ddp
    .venv/bin/python bench/step_threads.py --layouts ddp,fsdp --ops

Linux only. The main thread's CPU time still grows when other work crowds the caches, so
compare the two loops run one after the other, a few times.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

from step_profile import launch_ranks, run_in_window, window_args, window_parser

HERE = Path(__file__).resolve()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = window_parser(__doc__, "ddp", 150, "11:141", "read")
    p.add_argument("--ops", action="store_true", help="also count rank 0's aten ops per step")
    return window_args(p, argv)


# -- in the workers -------------------------------------------------------------------


def threads() -> dict[str, tuple[float, float, int]]:
    """Per live thread ("name/tid"): (CPU seconds, seconds waiting for a core, times run)."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    found = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            ran, waited, slices = map(int, Path(f"/proc/self/task/{tid}/schedstat").read_text().split())
            comm = Path(f"/proc/self/task/{tid}/comm").read_text().strip()
        except OSError:  # ended meanwhile
            continue
        found[f"{names.get(int(tid), comm)}/{tid}"] = (ran / 1e9, waited / 1e9, slices)
    return found


def worker(out: str, start: int, end: int, ops: bool, kind: str, rest: list[str]) -> None:
    """Read rank-local figures over loader batches [start, end) of either loop
    (step_profile.run_in_window)."""
    import torch

    rank = os.environ.get("RANK", "0")
    state: dict = {}

    def begin() -> None:
        if ops and rank == "0":
            state["prof"] = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            state["prof"].__enter__()
        state["t0"] = (time.perf_counter(), threads())

    def finish() -> None:
        w0, t0 = state["t0"]
        wall, t1 = time.perf_counter() - w0, threads()
        main = f"MainThread/{threading.get_native_id()}"
        record = {"wall": wall, "main": main, "threads": {
            k: [b - a for a, b in zip(t0.get(k, (0, 0, 0)), v, strict=True)]
            for k, v in t1.items()}}
        if "prof" in state:
            state["prof"].__exit__(None, None, None)
            record["ops"] = {e.key: e.count for e in state["prof"].key_averages()}
        Path(f"{out}.{rank}").write_text(json.dumps(record))

    run_in_window(kind, rest, start, end, begin, finish)


# -- the driver -----------------------------------------------------------------------


def run(kind: str, layout: str, args: argparse.Namespace, tmp: Path) -> list[dict]:
    return launch_ranks(HERE, kind, layout, args, tmp, str(int(args.ops)))


def report(name: str, ranks: list[dict], steps: int) -> None:
    for rank, rec in enumerate(ranks):
        ms = {k: [1000 * v[0] / steps, 1000 * v[1] / steps, v[2] / steps]
              for k, v in rec["threads"].items()}
        cpu, runq, _ = ms.pop(rec["main"])
        wall = 1000 * rec["wall"] / steps
        others = sum(v[2] for v in ms.values())
        print(f"  {name:9s} rank {rank}: wall {wall:6.2f} ms/step = main thread's CPU "
              f"{cpu:6.2f} + wait for a core {runq:5.2f} + asleep {wall - cpu - runq:5.2f}; "
              f"other threads ran {others:5.1f} times/step, CPU {sum(v[0] for v in ms.values()):.2f} ms/step")
        if rank == 0:
            for key, (t_cpu, _, runs) in sorted(ms.items(), key=lambda kv: -kv[1][2]):
                if runs >= 0.05:
                    print(f"      {key:34s} ran {runs:5.2f} times/step, CPU {t_cpu:.3f} ms/step")


def main(argv: list[str] | None = None) -> int:
    if argv is None and sys.argv[1:2] == ["--worker"]:
        out, start, end, ops, kind, *rest = sys.argv[2:]
        worker(out, int(start), int(end), ops == "1", kind, rest)
        return 0
    args = parse_args(argv)
    steps = args.end - args.start
    print(f"per step, batches {args.start}..{args.end - 1} of {args.steps}: {args.model}, "
          f"micro batch {args.micro_batch}, 2 workers, fp32, OMP_NUM_THREADS=1")
    with tempfile.TemporaryDirectory(prefix="trainwise-step-threads-") as tmp:
        for layout in args.layouts:
            print(f"\n{layout}:")
            found = {kind: run(kind, layout, args, Path(tmp)) for kind in ("tw", "raw")}
            for kind, name in (("tw", "trainwise"), ("raw", "raw")):
                report(name, found[kind], steps)
            if args.ops:
                mine, theirs = found["tw"][0]["ops"], found["raw"][0]["ops"]
                print(f"  aten ops per step (rank 0): trainwise {sum(mine.values()) / steps:.1f}, "
                      f"raw {sum(theirs.values()) / steps:.1f}; differing by 0.5 or more:")
                for key in sorted(set(mine) | set(theirs)):
                    diff = (mine.get(key, 0) - theirs.get(key, 0)) / steps
                    if abs(diff) >= 0.5:
                        print(f"    {diff:+7.2f}  {key}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
