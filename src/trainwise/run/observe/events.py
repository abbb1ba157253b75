"""The fault and event log of a run: ``runs/<name>/events.jsonl``.

One JSON object per line, ``{"time": <unix seconds>, "kind": <one of KINDS>, ...fields}``.
The launcher and rank 0 both append to it, so each line goes out in one ``os.write`` on a
descriptor opened with ``O_APPEND``: the kernel places every such write at the end of the
file atomically with respect to other appenders, so small lines never interleave. A process
killed mid-write can leave a truncated last line; ``read_events`` skips it.

Fields per kind, as the runtime writes them:

- ``start`` {pid, nproc, nodes}: a launcher began a launch (one per machine and launch).
- ``ready`` {attempt, step, world, nodes}: workers are about to train (built, any checkpoint
  loaded); ``step`` is the step the run continues from (0 when fresh). One per attempt,
  from rank 0.
- ``membership`` {attempt, step, from_world, world, from_nodes, nodes}: this attempt runs on
  a different number of workers than the previous one (an elastic range lost or gained
  machines); written just before its ``ready``.
- ``resume`` {step, path}: a checkpoint was loaded.
- ``failure`` {rank, exit_code, signal, pid}: the launcher saw a worker die (``signal`` is a
  name or null). One incident can log several (one per rank).
- ``checkpoint`` {step, step_time, stall_s, save_s, bytes, path, async}: a committed
  checkpoint; ``step_time`` is when that step finished training (the state it holds).
- ``checkpoint_failed`` {step, message}: a save that did not commit (the previous stays valid).
- ``checkpoint_skipped`` {path, problems}: an invalid checkpoint passed over on resume.
- ``preempted`` {step, signal}: a planned stop after a synchronous checkpoint (not a failure).
- ``nonfinite`` / ``rollback``: a non-finite loss, and the rollback to a checkpoint it caused.
- ``finish``: the run ended normally.
- ``fatal`` {rank, message, exit_status}: an error no restart can fix ended the launch.
- ``lineage`` {lineage, moved_to}: ``checkpoint.resume = 'never'`` started a new lineage
  (moved_to None when there was nothing to move) and moved the earlier
  checkpoints aside; a new lineage starts.
- ``peer_failure`` {step, stage, rank, cause, absent, detail, message, traceback, dump}: a
  collective timed out or lost its peer; written by each rank that saw it, before it exits
  for a restart. ``absent``: the ranks that did not reach the monitored barrier (known on
  rank 0); ``dump``: that rank's stacks, RUN/hang/rank-N.txt.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainwise.jsonl import read_objects

EVENTS_FILE = "events.jsonl"
KINDS = (
    "start",
    "ready",
    "resume",
    "failure",
    "checkpoint",
    "checkpoint_failed",
    "checkpoint_skipped",
    "preempted",
    "nonfinite",
    "rollback",
    "finish",
    "fatal",  # an error a restart cannot fix (disk full, no valid checkpoint, the guard)
    "peer_failure",
    "membership",
    "lineage",  # resume = 'never' started a new lineage {lineage, moved_to (or None)}
)


def append_event(run_dir: Path, kind: str, **fields: Any) -> dict[str, Any]:
    """Append one event to ``run_dir/events.jsonl`` and return it as written.

    ``time`` is ``time.time()`` unless ``fields`` gives one. An unknown ``kind`` raises
    ValueError. The line is written with a single ``os.write`` on an ``O_APPEND`` descriptor,
    so lines from several processes never interleave. ``run_dir`` is created if missing.
    """
    if kind not in KINDS:
        raise ValueError(f"unknown event kind {kind!r}; expected one of {', '.join(KINDS)}")
    t = fields.pop("time", None)
    event: dict[str, Any] = {"time": time.time() if t is None else t, "kind": kind, **fields}
    data = (json.dumps(event, default=str) + "\n").encode("utf-8")
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(run_dir / EVENTS_FILE, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        written = os.write(fd, data)
        if written < len(data):  # not expected for a regular file; finish rather than lose it
            os.write(fd, data[written:])
    finally:
        os.close(fd)
    return event


def read_events(run_dir: Path) -> list[dict[str, Any]]:
    """Every event of ``run_dir/events.jsonl`` in file order; ``[]`` when there is no file.
    A torn last line (a crash mid-write) is skipped with a warning; a damaged line in the
    middle raises JsonlError (see trainwise.jsonl)."""
    return read_objects(Path(run_dir) / EVENTS_FILE)


@dataclass
class RetryCost:
    """What failures cost a run, from its event log.

    failures: incidents (a death of one or more ranks, and the restart it caused).
    downtime_s: seconds from each failure until training resumed (restart, rendezvous,
        rebuilding, loading the checkpoint).
    recomputed_s: seconds of training lost because they came after the last checkpoint, and
        so had to be done again.
    total_s: downtime_s + recomputed_s.
    gpu_hours: total_s times the number of GPUs, in hours.
    """

    failures: int
    downtime_s: float
    recomputed_s: float
    total_s: float
    gpu_hours: float

    def summary_line(self) -> str:
        """One line for a report, e.g. ``2 failures cost 41.2 s (12.0 s restarting, 29.2 s
        recomputing) = 0.0229 GPU-h``."""
        noun = "failure" if self.failures == 1 else "failures"
        return (
            f"{self.failures} {noun} cost {self.total_s:.1f} s "
            f"({self.downtime_s:.1f} s restarting, {self.recomputed_s:.1f} s recomputing) "
            f"= {self.gpu_hours:.4f} GPU-h"
        )


def _time(event: dict[str, Any]) -> float | None:
    t = event.get("time")
    if isinstance(t, bool) or not isinstance(t, (int, float)):
        return None
    return float(t)


def _num(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def retry_cost(events: list[dict[str, Any]], gpus: int) -> RetryCost:
    """Downtime and recomputation that failures cost, from a run's events (any order).

    Events are sorted by time and split into windows at each ``ready``; the failures in one
    window are one incident, at F = the earliest of them (several ranks dying together, or a
    second death during the restart, count once). For each incident:

    - recomputed = F − max(the window's ready time, the newest ``step_time`` of a
      ``checkpoint`` committed at or before F whose step_time is at or after that ready time):
      the work since the last checkpoint of that attempt, which is redone.
    - downtime = the next ``ready`` time − F; 0 when there is none (the run died for good).

    A window with no failure event that is followed by a ``ready`` of a higher attempt (the
    launcher died before it could log, say) is an incident too, at F = its last event: its
    recomputed time is then an underestimate (work after the last logged event counts as
    downtime instead; their sum is right). ``preempted`` and ``finish`` are planned stops:
    failures logged after one in the same window are part of that stop, and a restart after
    one costs nothing here. Failures before the first ``ready`` (an attempt that died while building) cost
    downtime only, since no step had trained.
    """
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
        raise ValueError(f"gpus must be an integer >= 1, got {gpus!r}")
    timed = [(t, e) for e in events if (t := _time(e)) is not None]
    timed.sort(key=lambda te: te[0])  # stable: ties keep their log order
    ready_idx = [i for i, (_, e) in enumerate(timed) if e.get("kind") == "ready"]
    checkpoints = [
        (t, st)
        for t, e in timed
        if e.get("kind") == "checkpoint" and (st := _num(e.get("step_time"))) is not None
    ]

    # Windows: [start of log, first ready), then [ready_k, ready_k+1), ..., [last ready, end).
    bounds = [0, *ready_idx, len(timed)]
    incidents = 0
    downtime = 0.0
    recomputed = 0.0
    for w in range(len(bounds) - 1):
        lo, hi = bounds[w], bounds[w + 1]
        if lo == hi:
            continue
        window = timed[lo:hi]
        ready_t: float | None = None
        attempt: float | None = None
        if window[0][1].get("kind") == "ready":
            ready_t = window[0][0]
            attempt = _num(window[0][1].get("attempt"))
        next_ready = timed[hi] if hi < len(timed) else None

        fail_times: list[float] = []
        stopped = False  # a planned stop ("preempted" or "finish") came first
        for t, e in window:
            kind = e.get("kind")
            if kind in ("preempted", "finish"):
                stopped = True
            elif kind == "failure" and not stopped:
                fail_times.append(t)

        if fail_times:
            f = fail_times[0]
        elif (
            not stopped
            and ready_t is not None
            and next_ready is not None
            and attempt is not None
            and (next_attempt := _num(next_ready[1].get("attempt"))) is not None
            and next_attempt > attempt
        ):
            f = window[-1][0]  # an unlogged failure: the last sign of life (underestimate)
        else:
            continue

        incidents += 1
        if ready_t is not None:
            saved = [st for ct, st in checkpoints if ct <= f and st >= ready_t]
            base = max([ready_t, *saved])
            recomputed += max(0.0, f - base)
        if next_ready is not None:
            downtime += max(0.0, next_ready[0] - f)

    total = downtime + recomputed
    return RetryCost(
        failures=incidents,
        downtime_s=downtime,
        recomputed_s=recomputed,
        total_s=total,
        gpu_hours=total * gpus / 3600.0,
    )


@dataclass(frozen=True)
class Resumption:
    """A planned stop (a `preempted` event) and the launch that continued the run: a Slurm
    requeue, a rerun after Ctrl-C. `waited_s` is from the stop to that launch's `start`
    (the time in the scheduler's queue); None while no launch has followed."""

    signal: str
    stopped_step: int
    resumed_step: int | None = None
    waited_s: float | None = None
    new_lineage: bool = False  # the next launch started over (checkpoint.resume = 'never')

    @property
    def redone_steps(self) -> int | None:
        """Steps trained again: those after the checkpoint the next launch resumed from."""
        if self.resumed_step is None or self.new_lineage:
            return None
        return self.stopped_step - self.resumed_step

    def line(self) -> str:
        said = f"stopped by {self.signal} after step {self.stopped_step}"
        if self.waited_s is None:
            return f"{said}; not resumed"
        if self.new_lineage:
            return (
                f"{said}; not resumed: a new lineage started {self.waited_s:.0f} s later "
                "(checkpoint.resume = 'never')"
            )
        resumed = "" if self.resumed_step is None else f" from step {self.resumed_step}"
        redone = "" if self.redone_steps is None else f", {self.redone_steps} step(s) redone"
        return f"{said}; resumed{resumed} {self.waited_s:.0f} s later{redone}"


def resumptions(events: list[dict[str, Any]]) -> list[Resumption]:
    """Every planned stop of a run, each with the launch that followed it (if any)."""
    timed = sorted(
        ((t, e) for e in events if (t := _time(e)) is not None), key=lambda te: te[0]
    )
    found = []
    for i, (t, e) in enumerate(timed):
        if e.get("kind") != "preempted":
            continue
        later = timed[i + 1 :]
        start = next(((ts, s) for ts, s in later if s.get("kind") == "start"), None)
        resumed = None
        new_lineage = False
        if start is not None:
            after = [x for ts, x in later if ts >= start[0]]
            kinds = ("resume", "ready", "lineage")
            resume = next((x for x in after if x.get("kind") in kinds), None)
            new_lineage = resume is not None and resume.get("kind") == "lineage"
            resumed = int(resume.get("step") or 0) if resume and not new_lineage else None
        found.append(
            Resumption(
                signal=str(e.get("signal")),
                stopped_step=int(e.get("step") or 0),
                resumed_step=resumed,
                waited_s=None if start is None else start[0] - t,
                new_lineage=new_lineage,
            )
        )
    return found
