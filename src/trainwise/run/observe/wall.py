"""The run's wall time, one definition for the terminal summary and the report: the spans
of its launches into the run directory, summed, each from its first item (the launcher's
`start`, start-up included) to its last (the `finish` event). A rerun into the same
directory is a new launch, and the idle time before it is not the run's; the downtime
between a failure and the restart inside one launch is (the failures' cost)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

# What a launch writes while it starts (a loop start is the loop's clock, which starts
# just before `ready`): trailing the previous launch's items, they are the next launch's.
_STARTUP = ("loop start", "checkpoint_skipped")
# Events that carry the attempt (the elastic restart count, from 0 in each launch).
_ATTEMPT_KINDS = ("resume", "membership", "ready")
# Events after which a launch does nothing more (no restart follows them).
LAUNCH_ENDS = ("finish", "preempted", "fatal")


def run_wall_s(records: list[dict[str, Any]], events: list[dict[str, Any]]) -> float:
    """Seconds of the run's launches, summed, from its step records (as written, repeated
    steps included) and its events."""
    return sum(end - start for start, end in launch_spans(records, events))


def wall_of(run_dir: Path) -> float:
    """run_wall_s of the files in `run_dir` (metrics.jsonl, events.jsonl)."""
    from trainwise.run.observe.events import read_events
    from trainwise.run.observe.telemetry import read_metrics

    return run_wall_s(read_metrics(run_dir), read_events(run_dir))


def launch_spans(
    records: list[dict[str, Any]], events: list[dict[str, Any]]
) -> list[tuple[float, float]]:
    """(first, last) time of each launch into the run directory, in order. A launch begins
    with a `start`, after the previous one ended, or where the attempts count from 0 again;
    splitting a launch in two by mistake loses only the time between two of its items."""
    items: list[tuple[float, str, Any]] = []
    for r in records:
        since = r.get("elapsed_s")  # None in a record that lacks it: its step at least
        loop_start = r["time"] - (since if since is not None else r.get("step_s") or 0.0)
        items += [(float(loop_start), "loop start", None), (float(r["time"]), "step", None)]
    # A step is recorded before the events of the same instant (the finish after the last).
    items += [(float(e["time"]), str(e.get("kind")), e.get("attempt")) for e in events]
    items.sort(key=lambda item: item[0])
    launches: list[list[float]] = [[]]
    pending: list[float] = []  # start-up items not yet followed by anything else
    last: tuple[int, bool] | None = None  # the latest attempt, and whether it became ready
    ended = False
    for t, kind, attempt in items:
        if kind in _STARTUP:
            pending.append(t)
            continue
        restart = _attempts_restart(kind, attempt, last)
        if restart:
            last = None  # the new launch counts its attempts afresh
        if (ended or restart) and launches[-1]:
            launches.append([])
        if kind in _ATTEMPT_KINDS and isinstance(attempt, int):
            seen = last is not None and last[0] == attempt and last[1]
            last = (attempt, seen or kind == "ready")
        launches[-1] += [*pending, t]
        pending, ended = [], kind in LAUNCH_ENDS
    if ended and pending:
        launches.append([])
    launches[-1] += pending
    return [(min(times), max(times)) for times in launches if times]


def _attempts_restart(kind: str, attempt: Any, last: tuple[int, bool] | None) -> bool:
    """Whether this event is a new launch's: a `start`, or an attempt counted from 0 again
    (below the latest, or equal to one that was already ready)."""
    if kind == "start":
        return True
    if kind not in _ATTEMPT_KINDS or not isinstance(attempt, int) or last is None:
        return False
    return attempt < last[0] or (attempt == last[0] and last[1])
