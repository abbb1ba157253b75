"""What a step asks of the other ranks and of the host, counted: trainwise's loop and the
hand-written one (bench/raw_loop.py) run under torchrun, and over the same whole loop
iterations (from the draw of batch START to the draw of batch END) each rank records with
torch.profiler, per step:

- every collective and point-to-point operation torch dispatches (`c10d::*`, DTensor's
  `_c10d_functional::*`: DDP's reducer, FSDP's all-gathers and reduce-scatters, the
  pipeline's sends and receives, the loop's own all-reduces), with whether it was issued
  blocking (async_op False) or not, and where it was issued from;
- the sizes gloo ran them at (`gloo:*`, element counts);
- the waits on a collective's Work, by where they were made;
- the host reads of a tensor's value (`aten::_local_scalar_dense`: .item(), bool(),
  float(), indexing by a 0-d tensor): on a GPU each is a synchronisation;
- the aten operations run, nested ones included (bench/step_threads.py --ops names them).

"Where" is the innermost Python frame that is not torch's plumbing (torch/distributed's
c10d wrappers, Tensor's methods): a trainwise or bench function, or torch's FSDP, optimizer
or pipelining code. Counts a loaded machine does not change; no time is claimed.

    .venv/bin/python bench/step_comms.py                      # tiny, fsdp and pp
    .venv/bin/python bench/step_comms.py --layouts ddp,tp --model small --micro-batch 4

(`.tolist()` and `.numpy()` read without dispatching an operation: not counted here;
bench/step_profile.py counts them as Python calls.)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
from collections import Counter
from pathlib import Path

from step_profile import launch_ranks, run_in_window, window_args, window_parser

HERE = Path(__file__).resolve()
# Frames that only pass a call on: the site is the first frame above them.
PLUMBING = ("torch/distributed/distributed_c10d.py", "torch/distributed/c10d_logger.py",
            "torch/_tensor.py", "torch/overrides.py", "torch/utils/_contextlib.py",
            "torch/distributed/_functional_collectives.py", "torch/_ops.py",
            "torch/distributed/tensor/_", "<built-in")
# Python frame events as torch.profiler names them: "path/file.py(line): function".
FRAME = re.compile(r"^(.*\.py)\((\d+)\): (.*)$")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = window_parser(__doc__, "fsdp,pp", 40, "11:31", "counted")
    return window_args(p, argv)


# -- in the workers -------------------------------------------------------------------


def site(event) -> str:
    """The innermost caller of `event` that is not plumbing, as "file.py:function"."""
    frame = event.cpu_parent
    while frame is not None:
        found = FRAME.match(frame.name)
        if found and not any(p in found[1] for p in PLUMBING):
            path = found[1]
            for marker in ("site-packages/", "src/", "bench/"):
                if marker in path:
                    path = path.split(marker, 1)[1]
                    break
            return f"{path}:{found[3]}"
        frame = frame.cpu_parent
    return "(C++: no Python caller)"


def issued(event) -> str:
    """How a dispatched collective was issued: its async_op argument where it has one;
    sends and receives by their Python function (isend / irecv: not waited on)."""
    if event.name.startswith("_c10d_functional::"):
        return "async"  # waited on by wait_tensor, counted with the waits
    flags = [v for v in event.concrete_inputs if isinstance(v, bool)]
    if flags:
        return "async" if flags[-1] else "blocking"
    caller = event.cpu_parent
    while caller is not None and not FRAME.match(caller.name):
        caller = caller.cpu_parent
    name = FRAME.match(caller.name)[3] if caller is not None else ""
    return "async" if name in ("isend", "irecv", "batch_isend_irecv") else "blocking"


def count(events) -> Counter:
    """Rows ("kind | what | where") counted over the profile's events."""
    rows: Counter = Counter()
    for e in events:
        name = e.name
        if name.startswith(("c10d::", "_c10d_functional::")) and not name.endswith(
            ("wait_tensor", "_wrap_tensor_autograd")
        ):
            shapes = " ".join(str(s) for s in e.input_shapes if s) or ""
            rows[f"collective | {name} {issued(e)} {shapes} | {site(e)}"] += 1
        elif name.startswith("gloo:"):
            rows[f"gloo ran | {name} {e.input_shapes[0] if e.input_shapes else ''} | "] += 1
        elif name.startswith("<built-in method wait of") or name.endswith("wait_tensor"):
            rows[f"wait | Work.wait | {site(e)}"] += 1
        elif name == "aten::_local_scalar_dense":
            rows[f"host read | {name} | {site(e)}"] += 1
        if name.startswith("aten::"):
            rows["ops | aten ops, nested ones included | "] += 1
    return rows


def worker(out: str, start: int, end: int, kind: str, rest: list[str]) -> None:
    """Count each rank's rows over loader batches [start, end) of either loop."""
    import torch
    import torch.distributed as dist

    rank = os.environ.get("RANK", "0")
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                  record_shapes=True, with_stack=True)

    def finish() -> None:
        prof.__exit__(None, None, None)
        rows = count(prof.events())
        alive = {"process groups": len(dist.distributed_c10d._world.pg_map),
                 "threads": len(os.listdir("/proc/self/task"))}  # Linux
        Path(f"{out}.{rank}").write_text(json.dumps({"rows": rows, "alive": alive}))

    run_in_window(kind, rest, start, end, prof.__enter__, finish)


# -- the driver -----------------------------------------------------------------------


def run(kind: str, layout: str, args: argparse.Namespace, tmp: Path) -> list[dict]:
    return launch_ranks(HERE, kind, layout, args, tmp)


def table(found: dict[str, list[dict]], steps: int) -> list[str]:
    """One line per row: per step on trainwise's ranks 0 and 1, then the raw loop's; rows
    where the two loops differ by 0.05 a step or more on a rank are marked with *. Then
    what each rank held at the window's end: its process groups (each a gloo thread
    that wakes every 10 ms) and threads."""
    counts = {k: [Counter(rank["rows"]) for rank in ranks] for k, ranks in found.items()}
    keys = sorted(set().union(*(c for ranks in counts.values() for c in ranks)))
    lines = [f"  {'tw r0':>6} {'tw r1':>6} {'raw r0':>6} {'raw r1':>6}   kind | what | where"]
    for key in keys:
        per = [counts[k][r][key] / steps for k in ("tw", "raw") for r in (0, 1)]
        differs = abs(per[0] - per[2]) >= 0.05 or abs(per[1] - per[3]) >= 0.05
        cells = " ".join(f"{v:6.2f}" for v in per)
        lines.append(f"{'*' if differs else ' '} {cells}   {key}")
    for what in found["tw"][0]["alive"]:
        per = [found[k][r]["alive"][what] for k in ("tw", "raw") for r in (0, 1)]
        mark = "*" if per[:2] != per[2:] else " "
        lines.append(f"{mark} {' '.join(f'{v:6d}' for v in per)}   alive | {what} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    if argv is None and sys.argv[1:2] == ["--worker"]:
        out, start, end, kind, *rest = sys.argv[2:]
        worker(out, int(start), int(end), kind, rest)
        return 0
    args = parse_args(argv)
    steps = args.end - args.start
    print(f"per step, batches {args.start}..{args.end - 1} of {args.steps}: {args.model}, "
          f"micro batch {args.micro_batch}, 2 workers, fp32; * where the loops differ")
    with tempfile.TemporaryDirectory(prefix="trainwise-step-comms-") as tmp:
        for layout in args.layouts:
            found = {kind: run(kind, layout, args, Path(tmp)) for kind in ("tw", "raw")}
            print(f"\n{layout}:")
            print("\n".join(table(found, steps)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
