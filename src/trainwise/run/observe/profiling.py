"""A traced window of steps (logging.profile_steps) on every rank: torch.profiler's Chrome
trace (RUN/profile/trace-rank-N.json), a summary the report reads (summary-rank-N.json:
the top operators by self time, grouped into compute / communication / memory copies /
data), and on CUDA a memory snapshot of the window (memory-rank-N.pickle, which
https://pytorch.org/memory_viz opens). An out-of-memory error on CUDA dumps the snapshot
too (with the allocation history when inside the window, the allocator's state else)."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import torch

PROFILE_DIR = "profile"
STEP_SPAN = "trainwise.step#"
TOP = 15  # operators named in the summary
MEMORY_ENTRIES = 100_000  # allocation events the CUDA history keeps

# Operator names, lower-cased, by the group they count in; the first match wins, the rest
# is compute. Communication: c10d's ops and the backends' own (gloo:, nccl:, record_param_
# comms); copies: host/device transfers and dtype/layout copies; data: the DataLoader.
GROUPS = (
    ("communication", ("c10d", "gloo", "nccl", "all_reduce", "allreduce", "all_gather",
                       "allgather", "reduce_scatter", "broadcast", "record_param_comms")),
    ("data", ("dataloader", "enumerate(")),
    ("copies", ("copy_", "memcpy", "_to_copy", "aten::to", "memset", "contiguous")),
)


def group_of(name: str) -> str:
    low = name.lower()
    for group, marks in GROUPS:
        if any(m in low for m in marks):
            return group
    return "compute"


class Profiler:
    """Starts torch.profiler before the window's first step and stops it after its last."""

    def __init__(self, window: list[int], run_dir: Path, rank: int, device: torch.device):
        self.window, self.rank, self.device = window, rank, device
        self.folder = Path(run_dir) / PROFILE_DIR
        self.prof: Any = None
        self.span: Any = None
        self.started = 0.0
        self.cuda = device.type == "cuda"

    def before_step(self, step: int) -> None:
        """Start the profiler at the window's first step; open the step's span."""
        if self.window and step == self.window[0] and self.prof is None:
            self._start()
        if self.prof is not None:
            from torch.profiler import record_function

            self.span = record_function(f"{STEP_SPAN}{step}")
            self.span.__enter__()

    def end_step(self) -> None:
        """Close the step's span: the stepper's work (data, forward, backward, optimizer),
        what the loop's timers time too."""
        if self.span is not None:
            self.span.__exit__(None, None, None)
            self.span = None

    def after_step(self, step: int) -> None:
        if self.prof is not None and step >= self.window[1]:
            self.stop()

    def _start(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        if self.cuda:
            torch.cuda.memory._record_memory_history(max_entries=MEMORY_ENTRIES)
        self.prof = profile(activities=activities, record_shapes=True, profile_memory=True)
        self.prof.start()
        self.started = time.perf_counter()

    def stop(self) -> None:
        """End the window (also at a run's end inside it): the trace, the summary."""
        if self.prof is None:
            return
        self.end_step()
        if self.cuda:
            torch.cuda.synchronize(self.device)
        self.prof.stop()
        wall_s = time.perf_counter() - self.started
        prof, self.prof = self.prof, None
        self.folder.mkdir(parents=True, exist_ok=True)
        trace = self.folder / f"trace-rank-{self.rank}.json"
        prof.export_chrome_trace(str(trace))
        summary = summarise(prof.events(), wall_s, self.window, self.cuda)
        summary.update(rank=self.rank, trace=trace.name)
        if self.cuda:
            summary["memory_snapshot"] = self.dump_memory().name
            torch.cuda.memory._record_memory_history(enabled=None)
        path = self.folder / f"summary-rank-{self.rank}.json"
        path.write_text(json.dumps(summary, indent=1) + "\n")

    def dump_memory(self) -> Path:
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / f"memory-rank-{self.rank}.pickle"
        torch.cuda.memory._dump_snapshot(str(path))
        return path

    def on_oom(self) -> None:
        """An out-of-memory error: the memory snapshot of what held it, when recording."""
        if not self.cuda:
            return
        try:
            path = self.dump_memory()
        except Exception as err:  # the OOM's own error is what the user must see
            logging.getLogger("trainwise").warning("trainwise: no memory snapshot: %s", err)
            return
        logging.getLogger("trainwise").error("trainwise: memory snapshot at the OOM: %s", path)


def summarise(events: Any, wall_s: float, window: list[int], cuda: bool) -> dict[str, Any]:
    """Top operators by self time and the time by group, from the profiler's events on the
    step's thread inside the steps' spans (the stepper: forward, backward, optimizer). The
    window's time is those spans; what no operator covers in them (Python between
    operators, waiting) is `other`, so the groups add up to the window."""
    spans = [e for e in events if e.name.startswith(STEP_SPAN)]
    main = spans[0].thread if spans else None
    bounds = _merge([_span(e) for e in spans])
    groups = dict.fromkeys(("compute", "communication", "copies", "data", "other"), 0.0)
    ops: dict[str, dict[str, Any]] = {}
    for e in events:
        if e.thread != main or not _within(_span(e), bounds):
            continue
        host = e.self_cpu_time_total / 1e6
        if e.name.startswith(STEP_SPAN):
            groups["other"] += host
            continue
        group = group_of(e.name)
        groups[group] += host
        op = ops.setdefault(e.name, {"name": e.name, "group": group, "calls": 0,
                                     "self_s": 0.0, "device_s": 0.0})
        op["calls"] += 1
        op["self_s"] += host
        op["device_s"] += getattr(e, "self_device_time_total", 0.0) / 1e6 if cuda else 0.0
    window_s = _length(bounds) / 1e6
    top = sorted(ops.values(), key=lambda op: op["device_s" if cuda else "self_s"], reverse=True)
    return {
        "steps": window,
        "window_s": window_s,  # the steps' spans (the profiler's clock)
        "wall_s": wall_s,  # start to stop, the loop between steps and start-up included
        "clock": "device" if cuda else "host",
        "groups_s": groups,  # host self time by group
        "stages_s": stages_per_step(events, groups, window_s, window[1] - window[0] + 1),
        "top": top[:TOP],
    }


def stages_per_step(
    events: Any, groups: dict[str, float], window_s: float, steps: int
) -> dict[str, float]:
    """One traced step split the way the planner and the loop's timers split it: data wait
    (the DataLoader's spans), optimizer (the optimizer's spans), exposed communication
    (this thread inside communication operators, plus the time a backend's thread
    communicated while this one ran no operator: it waited), compute (the rest, Python
    included). Host time: on CUDA the kernels run behind it."""

    def spans(prefixes: tuple[str, ...]) -> float:
        return _length(_merge([_span(e) for e in events if e.name.startswith(prefixes)])) / 1e6

    data = spans(("enumerate(DataLoader)",))
    optim = spans(("Optimizer.step#", "Optimizer.zero_grad#"))
    comm = groups["communication"] + waited_for_communication(events)
    compute = max(window_s - data - optim - comm, 0.0)
    split = {"data": data, "compute": compute, "exposed_comm": comm, "optimizer": optim}
    return {k: v / max(steps, 1) for k, v in split.items()}


def _within(span: tuple[float, float], bounds: list[tuple[float, float]]) -> bool:
    return any(a <= span[0] and span[1] <= b for a, b in bounds)


def waited_for_communication(events: Any) -> float:
    """Seconds inside the step spans when another thread ran a communication operator
    (gloo's, NCCL's) and the step's thread ran none of its own."""
    steps = [e for e in events if e.name.startswith(STEP_SPAN)]
    if not steps:
        return 0.0
    main = steps[0].thread
    busy = [_span(e) for e in events if e.thread == main and not e.name.startswith(STEP_SPAN)]
    comm = [_span(e) for e in events if e.thread != main and group_of(e.name) == "communication"]
    inside = _intersect(_merge(comm), _merge([_span(e) for e in steps]))
    return (_length(inside) - _length(_intersect(inside, _merge(busy)))) / 1e6


def _span(e: Any) -> tuple[float, float]:
    return (e.time_range.start, e.time_range.end)


def _merge(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _intersect(xs: list[tuple[float, float]], ys: list[tuple[float, float]]):
    """The overlap of two merged, sorted lists of spans."""
    out, i, j = [], 0, 0
    while i < len(xs) and j < len(ys):
        a, b = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        if a < b:
            out.append((a, b))
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return out


def _length(spans: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in spans)
