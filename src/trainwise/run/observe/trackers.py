"""Experiment trackers on rank 0: TensorBoard, MLflow and Weights & Biases behind one small
interface (open, records, events, artifacts, close).

Each gets the resolved config as parameters, every metrics.jsonl field with its step, the
run's events and, at the end, report.html / plan.json / summary.json. A tracker that fails
(package missing, server down, any exception) is one warning and is dropped: the run's
own files stay the record, and training goes on. The trackers' run ids live in
RUN/trackers.json, so a resumed run continues the same tracker run.
"""

from __future__ import annotations

import json
import logging
import os
import uuid
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

TRACKERS = ("tensorboard", "mlflow", "wandb")
IDS_FILE = "trackers.json"
ARTIFACTS = ("report.html", "plan.json", "summary.json", "events.jsonl")
EXTRA = {"mlflow": "trainwise[mlflow]", "wandb": "trainwise[wandb]"}
MLFLOW_EXPERIMENT = "trainwise"
MLFLOW_DB, MLFLOW_ARTIFACTS = "mlflow.db", "mlartifacts"  # the default store, in RUN
WANDB_PROJECT = "trainwise"


class Tracker(Protocol):
    name: str

    def open(self, run_id: str | None) -> str | None:
        """Start (or, given `run_id`, continue) the tracker's run; its id to keep."""

    def records(self, rows: list[dict[str, Any]]) -> None: ...

    def events(self, events: list[dict[str, Any]]) -> None: ...

    def artifacts(self, paths: list[Path]) -> None: ...

    def close(self, finished: bool) -> None: ...


def numeric(row: dict[str, Any]) -> dict[str, float]:
    """The fields of a record a tracker plots: numbers and flags (as 0/1), not null."""
    return {
        k: float(v)
        for k, v in row.items()
        if k != "step" and isinstance(v, (int, float)) and v is not None
    }


def event_counts(events: list[dict[str, Any]]) -> dict[str, str]:
    """The events as tags: how many of each kind, and the last one."""
    counts = Counter(e.get("kind", "?") for e in events)
    tags = {f"trainwise.events.{kind}": str(n) for kind, n in sorted(counts.items())}
    if events:
        tags["trainwise.last_event"] = str(events[-1].get("kind"))
    return tags


class TensorBoard:
    """TensorBoard events: every `every` steps (metrics.jsonl has every step) and at
    evaluations, each step's scalars in one event."""

    name = "tensorboard"

    def __init__(self, run_dir: Path, every: int):
        self.folder, self.every, self.writer = run_dir / "tensorboard", every, None

    def open(self, run_id: str | None) -> str | None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(self.folder))
        return None

    def records(self, rows: list[dict[str, Any]]) -> None:
        for row in rows:
            if points := self.points(row):
                self._write(points, row["step"])

    def points(self, row: dict[str, Any]) -> dict[str, float]:
        """A record's scalars by tag: its held-out loss when it has one, and every figure
        on every `every`-th step."""
        points = {}
        if row.get("eval_loss") is not None:
            points["eval/loss"] = row["eval_loss"]
        if row["step"] % self.every == 0:
            points.update((f"train/{key}", value) for key, value in numeric(row).items()
                          if key not in ("time", "eval_loss"))
        return points

    def _write(self, points: dict[str, float], step: int) -> None:
        """The scalars as one event (a Summary of several values, as TensorFlow's merged
        summaries): add_scalar makes an event of each, and every event is a hand-off to
        TensorBoard's writer thread, whose queue of 10 fills at once. Those hand-offs cost
        the loop's thread the GIL (bench/tracker_cost.py; docs/development.md)."""
        from tensorboard.compat.proto.summary_pb2 import Summary

        values = [Summary.Value(tag=tag, simple_value=x) for tag, x in points.items()]
        self.writer.file_writer.add_summary(Summary(value=values), step)

    def events(self, events: list[dict[str, Any]]) -> None:
        lines = [f"{e.get('kind')}: {json.dumps(e, default=str)}" for e in events]
        self.writer.add_text("events", "\n\n".join(lines) or "none")

    def artifacts(self, paths: list[Path]) -> None:
        pass  # TensorBoard keeps no files: the run directory holds them

    def close(self, finished: bool) -> None:
        self.writer.close()


class MLflow:
    """An MLflow run through MlflowClient (no global active run): by default a SQLite
    database in the run directory (RUN/mlflow.db, MLflow's recommended local backend; its
    file store is in maintenance mode since MLflow 3), or any tracking URI."""

    name = "mlflow"

    def __init__(self, run_dir: Path, uri: str, params: dict[str, str]):
        self.run_dir, self.uri, self.params = run_dir, uri, params
        self.client: Any = None
        self.run_id = ""

    def open(self, run_id: str | None) -> str | None:
        if self.uri.startswith("file:"):
            # Asked for: MLflow 3 keeps the file store in maintenance; it still works.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        if self.uri.startswith("sqlite:"):
            import sqlalchemy  # noqa: F401 - mlflow-skinny's SQL store needs it: say so

            # Not the database's creation lines in the user's terminal.
            for name in ("mlflow.store.db.utils", "alembic"):
                logging.getLogger(name).setLevel(logging.WARNING)
        # A server that is down costs seconds, not MLflow's default minutes of retries.
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=self.uri)
        if run_id:
            self.client.update_run(run_id, status="RUNNING")
            self.run_id = run_id
            return run_id
        exp = self.client.get_experiment_by_name(MLFLOW_EXPERIMENT)
        exp_id = exp.experiment_id if exp else self.client.create_experiment(
            MLFLOW_EXPERIMENT, artifact_location=artifact_location(self.uri)
        )
        run = self.client.create_run(
            exp_id, run_name=self.run_dir.name, tags={"trainwise.run_dir": str(self.run_dir)}
        )
        self.run_id = run.info.run_id
        params = [Param(k, v[:6000]) for k, v in self.params.items()]
        for i in range(0, len(params), 100):  # MLflow takes 100 parameters a batch
            self.client.log_batch(self.run_id, params=params[i : i + 100])
        return self.run_id

    def records(self, rows: list[dict[str, Any]]) -> None:
        from mlflow.entities import Metric

        metrics = [
            Metric(key, value, int(row.get("time", 0) * 1000), row["step"])
            for row in rows
            for key, value in numeric(row).items()
        ]
        for i in range(0, len(metrics), 1000):  # and 1000 metrics
            self.client.log_batch(self.run_id, metrics=metrics[i : i + 1000])

    def events(self, events: list[dict[str, Any]]) -> None:
        for key, value in event_counts(events).items():
            self.client.set_tag(self.run_id, key, value)

    def artifacts(self, paths: list[Path]) -> None:
        for path in paths:
            self.client.log_artifact(self.run_id, str(path))

    def close(self, finished: bool) -> None:
        # An unfinished run (preempted) stays RUNNING: its resume continues it.
        if finished:
            self.client.set_terminated(self.run_id, "FINISHED")


class WandB:
    """A Weights & Biases run: offline (files under RUN/wandb, `wandb sync` uploads them)
    unless WANDB_API_KEY is set or WANDB_MODE says otherwise."""

    name = "wandb"

    def __init__(self, run_dir: Path, params: dict[str, str]):
        self.run_dir, self.params, self.run = run_dir, params, None

    def open(self, run_id: str | None) -> str | None:
        import wandb

        mode = os.environ.get("WANDB_MODE") or (
            "online" if os.environ.get("WANDB_API_KEY") else "offline"
        )
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", WANDB_PROJECT), dir=str(self.run_dir),
            id=run_id or uuid.uuid4().hex[:12], resume="allow", name=self.run_dir.name,
            config=self.params, mode=mode, settings=wandb.Settings(silent=True, console="off"),
        )
        return self.run.id

    def records(self, rows: list[dict[str, Any]]) -> None:
        for row in rows:  # W&B keeps steps increasing: a resumed run's repeats are dropped
            self.run.log(numeric(row), step=row["step"])

    def events(self, events: list[dict[str, Any]]) -> None:
        import wandb

        rows = [[e.get("time"), e.get("kind"), json.dumps(e, default=str)] for e in events]
        self.run.log({"events": wandb.Table(columns=["time", "kind", "event"], data=rows)})

    def artifacts(self, paths: list[Path]) -> None:
        import wandb

        files = wandb.Artifact(f"run-{self.run.id}", type="trainwise-run")
        for path in paths:
            files.add_file(str(path))
        self.run.log_artifact(files)

    def close(self, finished: bool) -> None:
        self.run.finish(exit_code=0 if finished else 1)


class Trackers:
    """The run's trackers, each call guarded: the first failure of one is a warning and
    drops it. Built on rank 0 only; `open` runs on the metrics writer's thread so that a
    slow import or server holds up no step."""

    def __init__(self, run_dir: Path, trackers: list[Tracker]):
        self.run_dir = run_dir
        self.live = list(trackers)
        self.log = logging.getLogger("trainwise")

    def open(self) -> None:
        ids = stored_ids(self.run_dir)
        for tracker in list(self.live):
            new = self._guard(tracker, "start", lambda t=tracker: t.open(ids.get(t.name)))
            if tracker in self.live and new:
                ids[tracker.name] = new
        if ids:
            (self.run_dir / IDS_FILE).write_text(json.dumps(ids, indent=1) + "\n")

    def records(self, rows: list[dict[str, Any]]) -> None:
        self._each("log metrics", lambda t: t.records(rows))

    def finish(self, events: list[dict[str, Any]], finished: bool) -> None:
        """The events, the run's files as artifacts, and close."""
        self._each("log the events", lambda t: t.events(events))
        self.files([self.run_dir / name for name in ARTIFACTS if (self.run_dir / name).is_file()])
        self.close(finished)

    def files(self, paths: list[Path]) -> None:
        self._each("log artifacts", lambda t: t.artifacts(paths))

    def close(self, finished: bool) -> None:
        self._each("close", lambda t: t.close(finished))

    def _each(self, what: str, call: Callable[[Tracker], None]) -> None:
        for tracker in list(self.live):
            self._guard(tracker, what, lambda t=tracker: call(t))

    def _guard(self, tracker: Tracker, what: str, call: Callable[[], Any]) -> Any:
        try:
            return call()
        except ImportError as err:
            why = f"needs {err.name or 'its package'}: pip install '{EXTRA.get(tracker.name)}'"
        except Exception as err:  # any failure of a tracker is the tracker's, not the run's
            why = f"failed to {what} ({type(err).__name__}: {str(err)[:300]})"
        self.live.remove(tracker)
        self.log.warning(
            "trainwise: the %s tracker %s; it records nothing more, training goes on "
            "(metrics.jsonl has every step)", tracker.name, why,
        )
        return None


def stored_ids(run_dir: Path) -> dict[str, str]:
    try:
        ids = json.loads((Path(run_dir) / IDS_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return ids if isinstance(ids, dict) else {}


def flat_params(config: dict[str, Any]) -> dict[str, str]:
    """The resolved config as `section.key` = value strings."""
    out = {}
    for section, values in config.items():
        for key, value in (values or {}).items():
            out[f"{section}.{key}"] = json.dumps(value, default=str)
    return out


def build_trackers(
    names: list[str], run_dir: Path, config: dict[str, Any], *, mlflow_uri: str | None,
    tensorboard_every: int, wrap: Callable[[Tracker], Tracker] | None = None,
) -> Trackers:
    """The trackers of `logging.trackers` for this run (`wrap`: a test's fault seam)."""
    params = flat_params(config)
    made: dict[str, Callable[[], Tracker]] = {
        "tensorboard": lambda: TensorBoard(run_dir, tensorboard_every),
        "mlflow": lambda: MLflow(run_dir, mlflow_uri or default_mlflow_uri(run_dir), params),
        "wandb": lambda: WandB(run_dir, params),
    }
    trackers = [made[name]() for name in names]
    return Trackers(run_dir, [wrap(t) for t in trackers] if wrap else trackers)


def default_mlflow_uri(run_dir: Path) -> str:
    """RUN/mlflow.db: MLflow's recommended local backend, offline, one file per run."""
    return f"sqlite:///{(Path(run_dir).resolve() / MLFLOW_DB).as_posix()}"  # 4 slashes: absolute


def artifact_location(uri: str) -> str | None:
    """Where an experiment of a SQLite store keeps its files: beside the database (MLflow's
    own default is ./mlruns in whatever the current directory is). Others: MLflow's."""
    if not uri.startswith("sqlite:///"):
        return None
    database = Path(uri.removeprefix("sqlite:///"))
    return (database.parent / MLFLOW_ARTIFACTS).resolve().as_uri()


def add_report(run_dir: Path, names: list[str], mlflow_uri: str | None) -> None:
    """RUN/report.html, written once the workers have ended, into the trackers' runs (the
    ids in RUN/trackers.json); TensorBoard keeps no files."""
    page = Path(run_dir) / "report.html"
    names = [n for n in names if n != "tensorboard" and n in stored_ids(run_dir)]
    if not names or not page.is_file():
        return
    trackers = build_trackers(names, run_dir, {}, mlflow_uri=mlflow_uri, tensorboard_every=1)
    trackers.open()
    trackers.files([page])
    trackers.close(True)
