"""Telemetry of a step: the record schema (defined once), the clocks that fill it, and the
writers (metrics.jsonl and the experiment trackers, a progress bar or plain lines) on
rank 0.

The stages are the ones the planner and the report speak in: data wait, compute
(forward + backward), the pipeline's bubble, exposed gradient sync, optimizer, checkpoint
stall.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import queue
import resource
import sys
import threading
import time
from dataclasses import fields
from pathlib import Path
from typing import Any

import torch

from trainwise.jsonl import cut_torn_tail, read_objects
from trainwise.records import StepRecord  # the record's schema: one place, beside its readers
from trainwise.run.observe.trackers import Trackers

STAGES = ("data_s", "compute_s", "bubble_s", "sync_s", "optim_s", "ckpt_s")


RECORD_FIELDS = tuple(f.name for f in fields(StepRecord))


_rss_baseline: list[int] = []  # this process's resident set before the model was built


def mark_memory_baseline() -> int | None:
    """Note the resident set now, before the model is built: on CPU the step records count
    the memory the job adds over it, what the plan's tensors are compared with. Linux only
    (/proc); elsewhere the records keep the whole peak resident set. Returns the baseline
    in bytes (None where unknown)."""
    # The first tensor materialised from the meta device (as the model build does) imports
    # sympy and torch.fx: tens of MB of Python objects that are the interpreter's, not the
    # job's. Import them before the baseline.
    torch.empty_like(torch.empty(0, device="meta"), device="cpu")
    try:
        Path("/proc/self/clear_refs").write_text("5")  # the peak (VmHWM) restarts from now
        _rss_baseline[:] = [_status_bytes("VmRSS")]
    except (OSError, ValueError):
        _rss_baseline.clear()
    return _rss_baseline[0] if _rss_baseline else None


def restart_memory_peak() -> int | None:
    """The peak resident set restarts from now, and the resident set now (Linux; None
    elsewhere): the peak of what follows less it is what that work added. Memory freed
    before goes back to the system first (glibc's malloc_trim), so that the work's new
    pages are counted, not reused from what the allocator kept of earlier work."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return _status_bytes("VmRSS")
    except (OSError, ValueError):
        return None


def resident_peak() -> int:
    """The peak resident set since the last restart (Linux)."""
    return _status_bytes("VmHWM")


def _status_bytes(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024  # in kB
    raise ValueError(f"no {key} in /proc/self/status")


def peak_reserved(device: torch.device) -> int | None:
    return int(torch.cuda.max_memory_reserved(device)) if device.type == "cuda" else None


def peak_memory(device: torch.device) -> tuple[int, str]:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device)), "cuda_peak"
    if _rss_baseline:
        return max(0, _status_bytes("VmHWM") - _rss_baseline[0]), "rss_added"
    # ru_maxrss is in KiB on Linux.
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024), "rss_peak"


Marks = list[tuple[str, object]]


class StageClock:
    """Times stages of a step: CUDA events on GPU, perf_counter on CPU. Marks are taken
    per step and resolved later, when the recorder flushes (on GPU that waits only for
    events already long done), so timing adds no synchronisation to a step."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._marks: list[tuple[str, object]] = []

    def mark(self, name: str) -> None:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self._marks.append((name, ev))
        else:
            self._marks.append((name, time.perf_counter()))

    def take(self) -> Marks:
        """This step's marks; the clock starts empty for the next step."""
        marks, self._marks = self._marks, []
        return marks

    def spans(self) -> dict[str, float]:
        return resolve_spans(self.take())


class Spans:
    """Time spans on this rank, summed: CUDA events on GPU (recorded on the current
    stream, read once the device has passed them, so timing adds no synchronisation to
    the work), host clocks on CPU. The pipeline's compute and wall time, the
    tensor-parallel collectives (comm_timer), the expert all-to-alls (each step's taken
    with `take`; a pass that is not the step's, the probe's, is left out while `paused`)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.spans: list[tuple[Any, Any]] = []
        self.paused = False

    def mark(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def add(self, start: Any, end: Any) -> None:
        if not self.paused:
            self.spans.append((start, end))

    def take(self) -> Spans:
        """The spans so far in a Spans of their own (resolved later); this one empty."""
        taken = Spans(torch.device("cuda" if self.cuda else "cpu"))
        taken.spans, self.spans = self.spans, []
        return taken

    def seconds(self) -> float:
        """The spans' total, in seconds; the list starts again empty."""
        spans, self.spans = self.spans, []
        if not self.cuda:
            return sum(end - start for start, end in spans)
        total = 0.0
        for start, end in spans:
            end.synchronize()
            total += start.elapsed_time(end) / 1000.0
        return total


def resolve_spans(marks: Marks) -> dict[str, float]:
    """Seconds from each mark to the next, summed by the later mark's name."""
    out: dict[str, float] = {}
    for (_, a), (name, b) in zip(marks, marks[1:], strict=False):
        if isinstance(b, float):
            dt = b - a  # type: ignore[operator]
        else:
            b.synchronize()  # type: ignore[union-attr]
            dt = a.elapsed_time(b) / 1000.0  # type: ignore[union-attr]
        out[name] = out.get(name, 0.0) + dt
    return out


class MetricsWriter:
    """metrics.jsonl (every record, one per line) and the experiment trackers, written by a
    background thread: a tracker's record costs protobuf or file work (bench/overhead.py
    measured TensorBoard at 4 % of a step on 2 cores), so it stays off the loop's thread,
    and so does a tracker's start (an import, a server)."""

    def __init__(self, run_dir: Path, trackers: Trackers | None = None, append: bool = False):
        self.path = run_dir / "metrics.jsonl"
        # A resumed run continues the record (after its last whole line: an attempt that
        # died mid-write tore it); a fresh one starts a new one.
        if append:
            cut_torn_tail(self.path)
        flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if append else os.O_TRUNC)
        self._fd = os.open(self.path, flags, 0o644)
        self.trackers = trackers
        self._queue: queue.Queue[list[StepRecord] | None] = queue.Queue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._drain, name="trainwise-metrics", daemon=True)
        self._thread.start()

    def write(self, *records: StepRecord) -> None:
        if self._error is not None:
            raise RuntimeError(f"writing {self.path} failed: {self._error}") from self._error
        self._queue.put(list(records))

    def _drain(self) -> None:
        if self.trackers is not None:
            self.trackers.open()  # guarded: a tracker that fails is dropped with a warning
        while (batch := self._queue.get()) is not None:
            try:
                # Its fields as they are (JSON types all): asdict's deep copy cost 40 us a
                # record, with the GIL the loop's thread takes back after each operation.
                rows = [{name: getattr(rec, name) for name in RECORD_FIELDS} for rec in batch]
                # On disk batch by batch: a crash loses only the queue.
                append_whole(self._fd, "".join(json.dumps(row) + "\n" for row in rows))
                if self.trackers is not None:
                    self.trackers.records(rows)
            except BaseException as err:  # reported to the loop at its next write
                self._error = err
            finally:
                self._queue.task_done()

    def sync(self) -> None:
        """Wait until every record written so far is in the file; raise when one could
        not be written."""
        self._queue.join()
        if self._error is not None:
            raise RuntimeError(f"writing {self.path} failed: {self._error}") from self._error

    def close(self) -> None:
        """Write what is queued, then close the file (the trackers stay open: the run's
        end gives them its events and files)."""
        self._queue.put(None)
        self._thread.join()
        os.close(self._fd)
        if self._error is not None:
            raise RuntimeError(f"writing {self.path} failed: {self._error}") from self._error


def append_whole(fd: int, text: str) -> None:
    """`text` appended whole or not at all: a write that fails part-way (a full disk) is
    cut back off, so the file keeps ending on a whole record."""
    data = text.encode("utf-8")
    start = os.fstat(fd).st_size
    try:
        written = 0
        while written < len(data):
            written += os.write(fd, data[written:])
    except OSError:
        with contextlib.suppress(OSError):
            os.ftruncate(fd, start)
        raise


def read_metrics(run_dir: Path) -> list[dict]:
    """The records of metrics.jsonl as written ([] without the file); a torn last line is
    skipped with a warning (see trainwise.jsonl)."""
    rows = read_objects(Path(run_dir) / "metrics.jsonl")
    return [row for row in rows if isinstance(row.get("step"), int)]


class Progress:
    """A progress bar with ETA in a terminal, plain lines every `every` steps otherwise."""

    def __init__(self, total: int, mode: str, every: int):
        self.total = total
        self.every = every
        if mode == "auto":
            mode = "bar" if sys.stdout.isatty() else "lines"
        self.mode = mode
        self._bar = None
        if mode == "bar":
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )
            from rich.progress import (
                Progress as RichProgress,
            )

            self._bar = RichProgress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[info]}"),
                TimeElapsedColumn(),
                TextColumn("eta"),
                TimeRemainingColumn(),
            )
            self._task = self._bar.add_task("train", total=total, info="")
            self._bar.start()

    def update(self, rec: StepRecord) -> None:
        info = f"loss {rec.loss:.4f}  {rec.tokens_per_s:,.0f} tok/s"
        if self._bar is not None:
            self._bar.update(self._task, completed=rec.step, info=info)
        elif self.mode == "lines" and (rec.step % self.every == 0 or rec.step == self.total):
            eta = (self.total - rec.step) * rec.elapsed_s / rec.step
            extra = f"  eval {rec.eval_loss:.4f}" if rec.eval_loss is not None else ""
            print(f"step {rec.step}/{self.total}  {info}{extra}  eta {eta:.0f}s", flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
