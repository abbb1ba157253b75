"""A run directory read back for the report: the files `trainwise train` writes, checked
once here so that everything after works on typed records (trainwise.records): the job
(`JobRecord`), the steps (`StepRecord`), the summary (`RunSummary`) and the plan (`RunPlan`).

Needed: job.json (what ran), metrics.jsonl (a record per step). Read when present:
config.toml, events.jsonl, summary.json, plan.json (the planner's figures for the job as
it ran), doctor.json (a doctor run in the same directory). A missing or unreadable needed
file is one line (ReportError, exit status 2) naming the file and what to do.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainwise.config import read_toml
from trainwise.errors import ConfigError
from trainwise.jsonl import JsonlError, read_objects
from trainwise.records import JobRecord, RunPlan, RunSummary, StepRecord
from trainwise.run.observe.events import read_events


class ReportError(ConfigError):
    """The run directory cannot be reported on (exit status 2)."""


@dataclass
class RunFiles:
    path: Path
    job: JobRecord
    records: list[StepRecord]  # one per step: the last attempt's (what the model kept)
    all_records: list[StepRecord]  # as written, repeated steps included
    events: list[dict[str, Any]] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)  # config.toml as written
    summary: RunSummary | None = None
    plan: RunPlan | None = None  # None without plan.json (the planner had no figures)
    doctor: dict[str, Any] | None = None
    profiles: list[dict[str, Any]] = field(default_factory=list)  # profile/summary-rank-N
    traces: list[str] = field(default_factory=list)  # profile/ and hang/ files, run-relative
    hang_dumps: dict[int, str] = field(default_factory=dict)  # rank: hang/rank-N.txt

    @property
    def name(self) -> str:
        return self.path.name or str(self.path)

    @property
    def typed(self) -> str:
        """The run directory as a user types it here (in a command the report suggests)."""
        return typed_path(self.path)


def typed_path(path: Path) -> str:
    """`path` relative to the current directory when it lies inside it, else absolute."""
    full = Path(os.path.abspath(path))
    try:
        return str(full.relative_to(Path.cwd()))
    except ValueError:
        return str(full)


def load_run(path: str | Path) -> RunFiles:
    run = Path(path)
    if not run.is_dir():
        raise ReportError(f"{path}: no such run directory; give one that trainwise train wrote")
    job = _json(run, "job.json", needed="not a trainwise run directory (trainwise train writes it "
                "before the first step)")
    metrics = run / "metrics.jsonl"
    if not metrics.is_file():
        raise ReportError(
            f"{run}: no metrics.jsonl: the run never recorded a step (see its events.jsonl); "
            "report on it after it has trained"
        )
    written = _records(metrics)
    if not written:
        raise ReportError(
            f"{metrics}: no step recorded yet; report on the run after it has trained"
        )
    by_step: dict[int, StepRecord] = {}
    for rec in written:  # a later attempt redoes the steps since its checkpoint: keep the last
        by_step[rec.step] = rec
    config: dict[str, Any] = {}
    if (run / "config.toml").is_file():
        try:
            config = read_toml(run / "config.toml")
        except ConfigError as err:
            raise ReportError(str(err)) from None
    summary, plan = _json(run, "summary.json"), _json(run, "plan.json")
    return RunFiles(
        path=run,
        job=JobRecord.from_dict(job),
        records=[by_step[s] for s in sorted(by_step)],
        all_records=written,
        events=read_events(run),
        config=config,
        summary=RunSummary.from_dict(summary) if summary else None,
        plan=RunPlan.from_dict(plan) if plan else None,
        doctor=_json(run, "doctor.json"),
        **_drill_down_files(run),
    )


def _drill_down_files(run: Path) -> dict[str, Any]:
    """The profiler's summaries, the trace and snapshot files, the hang dumps. A damaged
    one is passed over: they help an investigation, the report stands without them."""
    profiles = []
    for path in sorted((run / "profile").glob("summary-rank-*.json")):
        try:
            profiles.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    traces = [
        str(p.relative_to(run))
        for folder in ("profile", "hang")
        for p in sorted((run / folder).glob("*"))
        if p.is_file() and p.suffix in (".json", ".pickle", "") and "summary-" not in p.name
    ]
    dumps = {}
    for path in (run / "hang").glob("rank-*.txt"):
        try:
            dumps[int(path.stem.removeprefix("rank-"))] = path.read_text(errors="replace")
        except (OSError, ValueError):
            continue
    return {"profiles": profiles, "traces": traces, "hang_dumps": dict(sorted(dumps.items()))}


def _json(run: Path, name: str, needed: str | None = None) -> Any:
    path = run / name
    if not path.is_file():
        if needed:
            raise ReportError(f"{run}: no {name}: {needed}")
        return None
    try:
        return json.loads(path.read_text())
    except ValueError:
        if needed:
            raise ReportError(f"{path}: not JSON (half-written?); run the job again") from None
        raise ReportError(f"{path}: not JSON (half-written?); remove it or run again") from None


def _records(path: Path) -> list[StepRecord]:
    """The step records; a torn last line is skipped (read_objects warns)."""
    try:
        rows = read_objects(path)
    except JsonlError as err:
        raise ReportError(str(err)) from None
    for n, rec in enumerate(rows, 1):
        if not isinstance(rec.get("step"), int):
            raise ReportError(f"{path} record {n}: not a step record (no integer 'step')")
    return [StepRecord.from_dict(rec) for rec in rows]
