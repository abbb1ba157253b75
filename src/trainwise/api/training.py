"""`train()`: the job planned, checked and run under torchrun's elastic agent (one worker:
in this process), its end as a `RunResult`; a stop signal saves and returns "stopped"."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from trainwise.api.job import (
    JOB_KEYWORDS,
    JobSource,
    JobSpec,
    by_value_names,
    data_key,
    function_key,
    import_roots,
    job_spec,
    model_key,
    named_objects,
)
from trainwise.api.reporting import report, write_report
from trainwise.errors import LaunchError
from trainwise.records import RunSummary, StepRecord, StopEvent

if TYPE_CHECKING:
    from trainwise.config import JobConfig


@dataclass(frozen=True)
class RunResult:
    """What train() returns when the run ends.

    status: "finished" (it ran its steps), "stopped" (a signal, Ctrl-C included, made it
    save and stop: the same call again resumes it) or "elsewhere" (this process is not
    where the summary is: a worker other than rank 0, or a machine other than rank 0's).
    run_dir: the run directory (None for a worker that is not rank 0).
    summary: summary.json (None where this machine has none).
    stop: the `preempted` event of a stop: its signal, step and checkpoint.
    report: RUN/report.html when written (logging.report).
    message: how the run ended when it did not simply finish here, as one line.
    exit_status: what `trainwise train` exits with (a stop: 128 + the signal).
    """

    status: Literal["finished", "stopped", "elsewhere"]
    run_dir: Path | None
    summary: RunSummary | None = None
    stop: StopEvent | None = None
    report: Path | None = None
    message: str = ""
    exit_status: int = 0

    @property
    def stopped(self) -> bool:
        """Whether a signal stopped the run after a save."""
        return self.status == "stopped"

    def steps(self) -> list[StepRecord]:
        """metrics.jsonl's records, as written (an elastic restart's repeated steps too)."""
        from trainwise.jsonl import read_objects

        path = self.run_dir / "metrics.jsonl" if self.run_dir else None
        if path is None or not path.is_file():
            return []
        return [StepRecord.from_dict(row) for row in read_objects(path)]


def train(
    config: JobSource = None,
    *,
    model: Any = None,
    data: Any = None,
    collate: Callable[..., Any] | str | None = None,
    loss: Callable[..., Any] | str | None = None,
    steps: int | None = None,
    nproc: int | None = None,
    strategy: str | None = None,
    precision: str | None = None,
    run_dir: str | Path | None = None,
    oversubscribe: bool | None = None,
    overrides: Mapping[str, Any] | None = None,
    progress: bool | None = None,
    **sections: Mapping[str, Any],
) -> RunResult:
    """Train the job: plan it (strategy auto), check it, then start its workers under
    torchrun's elastic agent (one worker: in this process) and return when the run ends.
    `model`: a preset, 'hf:DIR', an import path, an nn.Module class or a function
    returning a module (called in every worker); `data`: a built-in dataset word, an
    import path, a Dataset or a function returning one; `collate`, `loss`: functions or
    import paths. Objects no import path names (defined in a script's __main__ or a
    notebook) go to the workers by value. `progress`: a bar that follows the run's
    metrics (default: when a terminal or a notebook is attached). Ctrl-C (any stop
    signal) saves a checkpoint and returns a "stopped" result; the same call resumes it.
    A failure raises LaunchError; bad input a ConfigError, before any worker starts."""
    shortcuts = {
        "model": model_key(model), "data": data_key(data),
        "collate": function_key(collate, "collate"), "loss": function_key(loss, "loss"),
        "steps": steps, "nproc": nproc, "strategy": strategy, "precision": precision,
        "run_dir": None if run_dir is None else str(run_dir), "oversubscribe": oversubscribe,
    }
    spec = job_spec(config, shortcuts, JOB_KEYWORDS, sections, overrides)
    objects = {"model": model, "data": data, "collate": collate, "loss": loss}
    with named_objects(by_value_names(objects, shortcuts)):
        return train_job(spec, progress)


def train_job(spec: JobSpec, progress: bool | None = None) -> RunResult:
    """train() of a JobSpec (what the CLI gives, its flags named)."""
    from trainwise.report.progress import Follower, attached
    from trainwise.run.launch.start import is_worker

    cfg, given = spec.load()
    import_roots(spec, cfg)
    if is_worker(cfg):  # started by torchrun or srun: one of the workers
        return _train_as_worker(cfg)
    follower = Follower(cfg.train.steps) if (attached() if progress is None else progress) else None
    if follower is not None and "logging.progress" not in given:
        # One bar: the workers' own would draw over it (or go to a terminal nobody sees).
        logging_ = cfg.logging.model_copy(update={"progress": "none"})
        cfg = cfg.model_copy(update={"logging": logging_})
    return _launch(cfg, follower)


def _launch(cfg: JobConfig, follower: Any) -> RunResult:
    from trainwise.run.launch.start import start_job, train_here
    from trainwise.run.launch.torchrun import Preempted

    try:
        run_dir = start_job(
            cfg, train_here, "trainwise.run.engine.worker",
            max_restarts=cfg.checkpoint.max_restarts,
            on_start=follower.start if follower is not None else None,
        )
    except Preempted as stop:
        return _stopped(cfg, stop)
    except LaunchError as failed:
        if failed.run_dir is not None:
            failed.report = finish_report(cfg, failed.run_dir, after_failure=True)
        raise
    finally:
        if follower is not None:
            follower.stop()
    path = run_dir / "summary.json"
    if not path.is_file():  # rank 0 runs on another machine and writes its own disk
        return RunResult(
            "elsewhere", run_dir,
            message=f"this machine's workers finished; rank 0's machine has {path}",
        )
    summary = RunSummary.from_dict(json.loads(path.read_text()))
    return RunResult("finished", run_dir, summary, report=finish_report(cfg, run_dir))


def _stopped(cfg: JobConfig, stop: Any) -> RunResult:
    """The result of a run a signal stopped after a save (run.launch's Preempted)."""
    run_dir = stop.run_dir
    path = run_dir / "summary.json" if run_dir else None
    summary = (
        RunSummary.from_dict(json.loads(path.read_text())) if path and path.is_file() else None
    )
    return RunResult(
        "stopped", run_dir, summary, StopEvent.from_dict(stop.event),
        message=f"{stop}; {resume_hint(cfg, stop.event)}", exit_status=stop.exit_status,
    )


def _train_as_worker(cfg: JobConfig) -> RunResult:
    """One worker of a launch started by hand (torchrun, srun): train; rank 0 returns the
    run's summary, the others `elsewhere`."""
    from trainwise.run.engine.control import stop_status
    from trainwise.run.engine.worker import train as train_worker

    raw = train_worker(cfg)
    if not raw:
        return RunResult("elsewhere", None)
    summary = RunSummary.from_dict(raw)
    run_dir = Path(raw["run_dir"])
    report = finish_report(cfg, run_dir)
    if summary.preempted:
        return RunResult(
            "stopped", run_dir, summary, report=report,
            exit_status=stop_status(summary.preempted),
        )
    return RunResult("finished", run_dir, summary, report=report)


def resume_hint(cfg: JobConfig, event: Mapping[str, Any]) -> str:
    """How to go on after a stop that saved."""
    saved = f"checkpoint {event['checkpoint']} saved" if event.get("checkpoint") else "saved"
    if cfg.checkpoint.resume == "never":
        return (
            f"{saved}: run again with checkpoint.resume = 'auto' to resume from it "
            "('never' would start a new lineage)"
        )
    return f"{saved}: run the same command again to resume"


def finish_report(cfg: JobConfig, run_dir: Path, after_failure: bool = False) -> Path | None:
    """RUN/report.html on rank 0's machine, when the run has finished or failed for good
    (logging.report): after a failure, of what the run recorded, and quietly when even
    that cannot be written (the failure's own line is what matters then). The page, or
    None."""
    if not cfg.logging.report or not (run_dir / "metrics.jsonl").is_file():
        return None
    page = run_dir / "report.html"
    try:
        write_report(report(run_dir), page)
    except Exception as err:  # any failure: the run's results stand without the page
        if not after_failure:
            print(
                f"trainwise: the report was not written ({type(err).__name__}: {err}); "
                f"`trainwise report {run_dir}` tries again",
                file=sys.stderr,
            )
        return None
    from trainwise.run.observe.trackers import add_report

    add_report(run_dir, cfg.logging.trackers, cfg.logging.mlflow_uri)
    if after_failure:
        print(f"trainwise: report of what the run recorded: {page}", file=sys.stderr)
    return page


