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
)  # fmt: skip


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
        if not self.window or step != self.window[0] or self.prof is not None:
            return
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        if self.cuda:
            torch.cuda.memory._record_memory_history(max_entries=MEMORY_ENTRIES)
        self.prof = profile(activities=activities, record_shapes=True, profile_memory=True)
        self.prof.start()
        self.started = time.perf_counter()
        self._mark(step)

    def _mark(self, step: int) -> None:
        """A span per step (its self time: Python between the operators)."""
        from torch.profiler import record_function

        self.span = record_function(f"{STEP_SPAN}{step}")
        self.span.__enter__()

    def after_step(self, step: int) -> None:
        if self.prof is None:
            return
        self.span.__exit__(None, None, None)
        self.span = None
        if step >= self.window[1]:
            self.stop()
        else:
            self._mark(step + 1)

    def stop(self) -> None:
        """End the window (also at a run's end inside it): the trace, the summary."""
        if self.prof is None:
            return
        if self.span is not None:
            self.span.__exit__(None, None, None)
        if self.cuda:
            torch.cuda.synchronize(self.device)
        self.prof.stop()
        wall_s = time.perf_counter() - self.started
        prof, self.prof = self.prof, None
        self.folder.mkdir(parents=True, exist_ok=True)
        trace = self.folder / f"trace-rank-{self.rank}.json"
        prof.export_chrome_trace(str(trace))
        summary = summarise(prof.key_averages(), wall_s, self.window, self.cuda)
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


def summarise(averages: Any, wall_s: float, window: list[int], cuda: bool) -> dict[str, Any]:
    """Top operators by self time and the time by group, from the profiler's key_averages.
    The window's time is its steps' spans; what no operator covers inside them (Python
    between operators) is `other`. On one thread, the groups add up to the window."""
    ops, window_s = [], 0.0
    groups = dict.fromkeys(("compute", "communication", "copies", "data", "other"), 0.0)
    for avg in averages:
        host = avg.self_cpu_time_total / 1e6
        device = getattr(avg, "self_device_time_total", 0.0) / 1e6 if cuda else 0.0
        if avg.key.startswith(STEP_SPAN):
            window_s += avg.cpu_time_total / 1e6
            groups["other"] += host
            continue
        if host <= 0 and device <= 0:
            continue
        group = group_of(avg.key)
        groups[group] += host
        ops.append({"name": avg.key, "group": group, "calls": avg.count, "self_s": host,
                    "device_s": device})  # fmt: skip
    ops.sort(key=lambda op: op["device_s"] if cuda else op["self_s"], reverse=True)
    return {
        "steps": window,
        "window_s": window_s,  # the steps' spans (profiler's clock)
        "wall_s": wall_s,  # start to stop, the profiler's own start-up included
        "clock": "device" if cuda else "host",
        "groups_s": groups,  # host self time by group
        "top": ops[:TOP],
    }
