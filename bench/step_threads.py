"""Where a step's wall time goes on each worker, in figures a loaded machine changes little:
trainwise's loop and the hand-written one (bench/raw_loop.py) run under torchrun, and over
the same whole loop iterations (from the draw of batch START to the draw of batch END)
each rank reads from Linux's /proc/<pid>/task/<tid>/schedstat, per step:

- its main thread's CPU time, its wait for a core (runnable, not running: other threads
  or processes had the cores) and the rest of the wall time, asleep (waiting for a peer
  in a collective, or for a lock);
- every other thread of the process: the times it ran (each wake-up takes a core from
  the step on a machine the workers fill) and its CPU time;
- the process's page faults, and each thread's: a page the kernel maps and zeroes each
  time glibc's malloc gave a freed buffer back (run/engine/host_allocator.py);
- with --ops, rank 0's aten operations per step (torch.profiler): any operation one loop
  runs and the other does not is different work, whatever the clock says; and the
  operations whose CPU time differs most.

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


def threads() -> dict[str, tuple[float, float, int, int]]:
    """Per live thread ("name/tid"): (CPU seconds, seconds waiting for a core, times run,
    minor page faults)."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    found = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            ran, waited, slices = map(int, Path(f"/proc/self/task/{tid}/schedstat").read_text().split())
            comm = Path(f"/proc/self/task/{tid}/comm").read_text().strip()
            stat = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # ended meanwhile
            continue
        # stat's 10th field: the thread's minor page faults
        found[f"{names.get(int(tid), comm)}/{tid}"] = (ran / 1e9, waited / 1e9, slices, int(stat[7]))
    return found


def faults() -> tuple[int, int]:
    """This process's (minor, major) page faults so far (/proc/self/stat)."""
    fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[7]), int(fields[9])


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
        state["faults0"] = faults()

    def finish() -> None:
        w0, t0 = state["t0"]
        wall, t1 = time.perf_counter() - w0, threads()
        main = f"MainThread/{threading.get_native_id()}"
        record = {
            "wall": wall, "main": main,
            "faults": [b - a for a, b in zip(state["faults0"], faults(), strict=True)],
            "threads": {k: [b - a for a, b in zip(t0.get(k, (0, 0, 0, 0)), v, strict=True)]
                        for k, v in t1.items()},
        }
        if "prof" in state:
            state["prof"].__exit__(None, None, None)
            averages = state["prof"].key_averages()
            record["ops"] = {e.key: e.count for e in averages}
            record["op_us"] = {e.key: e.self_cpu_time_total for e in averages}
        Path(f"{out}.{rank}").write_text(json.dumps(record))

    run_in_window(kind, rest, start, end, begin, finish)


# -- the driver -----------------------------------------------------------------------


def run(kind: str, layout: str, args: argparse.Namespace, tmp: Path) -> list[dict]:
    return launch_ranks(HERE, kind, layout, args, tmp, str(int(args.ops)))


def report(name: str, ranks: list[dict], steps: int) -> None:
    for rank, rec in enumerate(ranks):
        ms = {k: [1000 * v[0] / steps, 1000 * v[1] / steps, v[2] / steps, v[3] / steps]
              for k, v in rec["threads"].items()}
        cpu, runq, _, main_faults = ms.pop(rec["main"])
        wall = 1000 * rec["wall"] / steps
        others = sum(v[2] for v in ms.values())
        print(f"  {name:9s} rank {rank}: wall {wall:6.2f} ms/step = main thread's CPU "
              f"{cpu:6.2f} + wait for a core {runq:5.2f} + asleep {wall - cpu - runq:5.2f}; "
              f"other threads ran {others:5.1f} times/step, CPU "
              f"{sum(v[0] for v in ms.values()):.2f} ms/step; page faults "
              f"{rec['faults'][0] / steps:.1f} minor, {rec['faults'][1] / steps:.1f} major a step")
        if rank == 0:
            print(f"      main thread's page faults {main_faults:.1f} a step")
            for key, (t_cpu, _, runs, flt) in sorted(ms.items(), key=lambda kv: -kv[1][2]):
                if runs >= 0.05:
                    print(f"      {key:34s} ran {runs:5.2f} times/step, CPU {t_cpu:.3f} ms/step, "
                          f"{flt:.1f} page faults")


def print_op_times(mine: dict[str, float], theirs: dict[str, float], steps: int,
                   top: int = 15) -> None:
    """Rank 0's self CPU time per step of each operation (torch.profiler, which adds its
    own cost to each alike): the `top` largest differences."""
    per_step = {k: (mine.get(k, 0) - theirs.get(k, 0)) / 1000 / steps for k in mine | theirs}
    print(f"  self CPU ms per step (rank 0): trainwise {sum(mine.values()) / 1000 / steps:.2f}, "
          f"raw {sum(theirs.values()) / 1000 / steps:.2f}; the largest differences:")
    for key in sorted(per_step, key=lambda k: -abs(per_step[k]))[:top]:
        print(f"    {per_step[key]:+8.3f}  {key}")


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
                print_op_times(found["tw"][0]["op_us"], found["raw"][0]["op_us"], steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
