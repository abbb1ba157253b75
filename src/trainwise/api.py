"""trainwise as a library: `plan()`, `train()`, `report()` and `doctor()`, each returning
a typed record. The CLI's plan, train, report and doctor commands are these functions with
their flags parsed: what one does the other does (docs/api.md).

A job is given the way a job file gives it. `config` is a JobConfig, a TOML path, a dict of
sections (`{"optim": {"lr": 3e-4}}`) or a JobSpec; on top of it, section dicts as keywords
(`optim={"lr": 3e-4}`), then the shortcuts of the CLI's flags (`steps=20`, `nproc=2`),
then `overrides` (`{"optim.lr": 3e-4}`): defaults < config < sections < shortcuts <
overrides. `model=` and `data=` take a dict (their section) or a value (model.name,
data.dataset); Python objects (a model factory or nn.Module class, a Dataset or its
factory, a collate or loss function) become job keys through `model_key`, `data_key` and
`function_key`: an import path when one names the object, else the object by value.

Bad input raises a ConfigError (trainwise.errors) naming the key and the fix, before any
worker starts; the CLI turns it into one line and exit status 2. Importing this module
costs nothing of torch, and `plan()` of a preset imports none either.

Floors: between cli/ (which calls it) and report/, run/, doctor/, plan/ (which it calls).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Union

from trainwise.errors import ConfigError, LaunchError, ModelError
from trainwise.records import Plan, RunSummary, StepRecord, StopEvent

if TYPE_CHECKING:
    from trainwise.config import JobConfig
    from trainwise.config.load import Layer
    from trainwise.doctor.result import DoctorRecord
    from trainwise.report.analysis import RunReport

# The shortcuts of `trainwise plan`'s flags: keyword -> job key (the rest: sections or
# overrides). The CLI's flags of the same name set the same keys (a test holds it).
PLAN_KEYWORDS = {
    "model": "model.name",
    "data": "data.dataset",  # your own module is measured on a sample of it
    "collate": "data.collate",
    "params": "plan.params",
    "gpus": "plan.gpus",
    "gpu": "cluster.gpu",
    "gpus_per_node": "cluster.nproc",
    "strategy": "plan.strategy",
    "precision": "precision.dtype",
    "seq": "data.seq_len",
    "micro_batch": "data.micro_batch",
    "global_batch": "data.global_batch",
    "tokens": "plan.tokens",
    "objective": "plan.objective",
    "sweep": "plan.sweep",
}
# The shortcuts of `trainwise train` and `trainwise doctor`.
JOB_KEYWORDS = {
    "model": "model.name",
    "data": "data.dataset",
    "collate": "data.collate",
    "loss": "model.loss",
    "steps": "train.steps",
    "nproc": "cluster.nproc",
    "strategy": "parallel.strategy",
    "precision": "precision.dtype",
    "run_dir": "logging.run_dir",
    "oversubscribe": "cluster.oversubscribe",
    "only": "doctor.checks",
}
OVERRIDES = "overrides"  # where keys of `overrides` come from, in messages

JobSource = Union["JobConfig", str, Path, Mapping[str, Any], "JobSpec", None]


@dataclass(frozen=True)
class JobSpec:
    """A job as given, before it is checked: `config` (a TOML path, a dict of sections, a
    JobConfig, or None for the defaults) and `layers` of dotted keys over it, a later
    layer winning; each key carries the name its messages give it (a flag, `--set`, a
    keyword). `names` says how the caller names a verb's options (the CLI: its flags;
    default: the keyword, as `emit=`). The CLI builds one from its flags; a call with
    keywords adds its own layers to it."""

    config: JobConfig | str | Path | Mapping[str, Any] | None = None
    layers: tuple[Layer, ...] = ()
    names: Mapping[str, str] = field(default_factory=dict)

    def name(self, option: str) -> str:
        """How messages name the option `option` (a keyword of plan/train/doctor)."""
        return self.names.get(option, f"{option}=")

    def load(self, base: dict[str, Any] | None = None) -> tuple[JobConfig, dict[str, str]]:
        """The checked config, and where each key the user gave came from. `base`
        (dotted keys) replaces the schema's defaults when there is no config."""
        from trainwise.config.load import load_layers

        source = dict(self.config) if isinstance(self.config, Mapping) else self.config
        return load_layers(source, self.layers, base)


def job_spec(
    config: JobSource,
    shortcuts: Mapping[str, Any],
    table: Mapping[str, str],
    sections: Mapping[str, Any],
    overrides: Mapping[str, Any] | None,
) -> JobSpec:
    """`config` with the layers of a call's keywords on top: its section dicts and
    shortcuts (in one layer, shortcuts after sections), then `overrides`."""
    spec = config if isinstance(config, JobSpec) else JobSpec(config)
    layer: dict[str, tuple[Any, str]] = {}
    for name, value in sections.items():
        _section_keys(layer, name, value)
    for name, value in shortcuts.items():
        if isinstance(value, Mapping) and name in ("model", "data"):
            _section_keys(layer, name, value)  # model={...}: the section, not model.name
        elif value is not None:
            layer[table[name]] = (value, f"{name}=")
    over = {str(k): (v, OVERRIDES) for k, v in (overrides or {}).items()}
    return replace(spec, layers=(*spec.layers, layer, over))


def _section_keys(layer: dict[str, tuple[Any, str]], name: str, value: Any) -> None:
    from trainwise.config import JobConfig

    if name not in JobConfig.model_fields:
        raise ConfigError(
            f"unknown keyword {name}=: give a section of the job as a dict "
            f"({', '.join(JobConfig.model_fields)}), a shortcut, or overrides={{'key': value}}"
        )
    if not isinstance(value, Mapping):
        raise ConfigError(
            f"{name}={value!r}: a section is a dict of its keys, e.g. "
            f"{name}={{'key': value}} (or overrides={{'{name}.key': value}})"
        )
    for key, item in value.items():
        layer[f"{name}.{key}"] = (item, f"{name}=")


# -- your own objects: one route each into a job key ---------------------------------------


def model_key(model: Any) -> Any:
    """`model=` as the value of model.name: a preset, 'mlp', 'hf:DIR' or an import path as
    given (a dict is the [model] section); a factory or an nn.Module class as its import
    path, or by value (objects.object_reference). Every model object of the API enters
    the job here."""
    if model is None or isinstance(model, (str, Mapping)):
        return model
    if _is_module_instance(model):
        raise ModelError(
            f"model={type(model).__name__}(...): an nn.Module instance; give its class or a "
            "function that builds it (every worker builds its own, on the meta device)"
        )
    if not callable(model):
        raise ModelError(
            f"model={model!r}: give a preset name, 'hf:DIR', an import path, an nn.Module "
            "class or a function returning an nn.Module"
        )
    from trainwise.objects import object_reference

    return object_reference(model, "model", ModelError, "a model factory")


def data_key(data: Any) -> Any:
    """`data=` as the value of data.dataset: a built-in word or an import path as given (a
    dict is the [data] section); a Dataset, or a function returning one, as its import
    path or by value. Every dataset object of the API enters the job here."""
    if data is None or isinstance(data, (str, Mapping)):
        return data
    from trainwise.errors import DataError
    from trainwise.objects import object_reference

    return object_reference(data, "data", DataError, "a dataset or its factory")


def function_key(fn: Any, keyword: str) -> Any:
    """`collate=` / `loss=`: an import path as given, a function as its import path or by
    value."""
    if fn is None or isinstance(fn, str):
        return fn
    if not callable(fn):
        raise ConfigError(f"{keyword}={fn!r}: give a function or an import path 'module:fn'")
    from trainwise.objects import object_reference

    return object_reference(fn, keyword, ConfigError, "a function")


def _by_value_names(objects: Mapping[str, Any], keys: Mapping[str, Any]) -> dict[str, str]:
    """How messages name the objects of a call that went by value: {"pickled:<digest>":
    "Net (by value)"} for each keyword whose job key (`keys`) is such a reference."""
    from trainwise.objects import is_pickled_reference

    names = {}
    for keyword, obj in objects.items():
        key = keys.get(keyword)
        if isinstance(key, str) and is_pickled_reference(key):
            name = getattr(obj, "__name__", None)
            names[key] = f"{name} (by value)" if name else f"a {type(obj).__name__} (by value)"
    return names


@contextmanager
def _named_objects(names: Mapping[str, str]) -> Iterator[None]:
    """A ConfigError raised inside names the objects sent by value as the caller knows
    them (_by_value_names), not by the digests of their references."""
    try:
        yield
    except ConfigError as err:
        if names:
            for reference, name in names.items():
                err.problems = [
                    p.replace(repr(reference), name).replace(reference, name)
                    for p in err.problems
                ]
            err.args = ("\n".join(err.problems),)
        raise


def _is_module_instance(obj: Any) -> bool:
    """An nn.Module instance, told without importing torch."""
    return not isinstance(obj, type) and any(
        c.__module__ == "torch.nn.modules.module" and c.__name__ == "Module"
        for c in type(obj).__mro__
    )


def _import_roots(spec: JobSpec, cfg: JobConfig) -> None:
    """Let import paths find modules beside the job file, in the current directory, and
    where this process found the objects it names: here and in the workers (which
    inherit PYTHONPATH)."""
    from trainwise.objects import import_root, is_import_path

    roots = [os.getcwd()]
    if isinstance(spec.config, (str, Path)):
        roots.append(str(Path(spec.config).resolve().parent))
    for value in (cfg.model.name, cfg.data.dataset, cfg.data.collate, cfg.model.loss):
        root = import_root(value) if value and is_import_path(value) else None
        if root is not None:
            roots.append(str(root))
    for root in reversed(roots):
        if root not in sys.path:
            sys.path.insert(0, root)
    old = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(roots + old))


# -- plan ----------------------------------------------------------------------------------


def plan(
    config: JobSource = None,
    *,
    model: Any = None,
    data: Any = None,
    collate: Callable[..., Any] | str | None = None,
    params: float | None = None,
    gpus: int | None = None,
    gpu: str | None = None,
    gpus_per_node: int | None = None,
    strategy: str | None = None,
    precision: str | None = None,
    seq: int | None = None,
    micro_batch: int | None = None,
    global_batch: int | None = None,
    tokens: float | str | None = None,
    objective: Literal["cost", "time"] | None = None,
    sweep: Sequence[int] | str | None = None,
    deadline_hours: float | None = None,
    budget_usd: float | None = None,
    calibrate: str | Path | None = None,
    simulate: bool = False,
    emit: str | Path | None = None,
    overrides: Mapping[str, Any] | None = None,
    **sections: Mapping[str, Any],
) -> Plan:
    """Plan a job before it runs: search the layouts and knobs for the cheapest (or, with
    `objective="time"`, the fastest) configuration that fits, with its memory, step time,
    time to train and cost, and the named strategies beside it. Without a config it plans
    `trainwise plan`'s default (llama-7b on 8 x H100-SXM, bf16). `sweep`: GPU counts
    ([1, 2, 4] or "1..1024"); `deadline_hours` / `budget_usd`: the cheapest within the
    time, or the fastest within the money; `calibrate`: a calibration file or a run
    directory whose measurements replace the assumptions ("none": the formulas);
    `simulate`: also measure each row's peak memory on fake tensors (imports torch);
    `emit`: write the recommendation as a job file. `model`, `data` and `collate` take
    what train() takes: your own module is read on the meta device and measured on a
    micro-batch of `data`. Returns the record `plan --json` prints. Imports no torch
    unless `simulate` or your own model."""
    shortcuts = {
        "model": model_key(model), "data": data_key(data),
        "collate": function_key(collate, "collate"), "params": params, "gpus": gpus, "gpu": gpu,
        "gpus_per_node": gpus_per_node, "strategy": strategy, "precision": precision,
        "seq": seq, "micro_batch": micro_batch, "global_batch": global_batch,
        "tokens": tokens, "objective": objective, "sweep": sweep,
    }
    spec = job_spec(config, shortcuts, PLAN_KEYWORDS, sections, overrides)
    objects = {"model": model, "data": data, "collate": collate}
    with _named_objects(_by_value_names(objects, shortcuts)):
        return plan_job(spec, deadline_hours, budget_usd, calibrate, simulate, emit)


def plan_job(
    spec: JobSpec,
    deadline_hours: float | None = None,
    budget_usd: float | None = None,
    calibrate: str | Path | None = None,
    simulate: bool = False,
    emit: str | Path | None = None,
) -> Plan:
    """plan() of a JobSpec (what the CLI gives, its flags named)."""
    from trainwise.models.moe.shapes import MOE_PRESETS
    from trainwise.models.shapes import PRESETS
    from trainwise.plan.constraints import check_allowed, user_allowed
    from trainwise.plan.inputs import PLAN_DEFAULTS
    from trainwise.plan.planner import make_plan
    from trainwise.plan.record import plan_record

    cfg, given = _sweep_counts(spec).load(base=PLAN_DEFAULTS)
    inputs = _plan_inputs(cfg)
    goal = _goal(spec, inputs.objective, deadline_hours, budget_usd)
    allowed = user_allowed(cfg, given)  # what the user set stays; the rest is searched
    check_allowed(inputs, allowed)
    if emit and inputs.model not in PRESETS and inputs.model not in MOE_PRESETS:
        raise ConfigError(
            f"{spec.name('emit')} {emit}: {inputs.model} is no model `trainwise train` "
            f"builds; give a preset (model: {', '.join([*PRESETS, *MOE_PRESETS])})"
        )
    source = str(calibrate) if calibrate else cfg.plan.calibration
    where = (
        f"{spec.name('calibrate')} {source}" if calibrate else f"plan.calibration = {source!r}"
    )
    inputs, notes = _calibrated(inputs, source, where)
    w = inputs.workload
    if simulate and w.shape is None and w.profile is None and w.moe is None:
        raise ConfigError(
            f"{spec.name('simulate')} needs a model to build: give a preset (model) or a "
            "shape (layers, hidden, heads, ...) instead of a bare parameter count"
        )
    planned = make_plan(inputs, cfg.plan.sweep, notes, goal, allowed)
    if emit:
        _emit(spec, Path(emit), cfg, planned, given)
    simulation = _simulate(planned) if simulate else None
    return replace(Plan.from_dict(plan_record(planned)), simulation=simulation, planned=planned)


def _plan_inputs(cfg: JobConfig) -> Any:
    """The planner's inputs of the job: a preset, a shape or a bare count from the
    formulas alone (no torch); your own model or hf:DIR read from its module on the meta
    device and a sample of the job's data (models.profile; imports torch), except an hf:
    Mixture-of-Experts directory built by trainwise (model.impl = 'trainwise'), priced by
    its shape as a MoE preset is."""
    from trainwise.plan.inputs import profiled, resolve_inputs

    if not profiled(cfg):
        return resolve_inputs(cfg)
    from trainwise.models.registry import resolve_moe_shape
    from trainwise.run.job.workload import job_profile, job_spec

    moe = resolve_moe_shape(job_spec(cfg))
    if moe is not None:  # an hf: Mixture-of-Experts directory trainwise builds: its shape
        return resolve_inputs(cfg, moe=moe)
    return resolve_inputs(cfg, job_profile(cfg))


def _sweep_counts(spec: JobSpec) -> JobSpec:
    """plan.sweep given as text ("1,2,4" or "1..1024") as its GPU counts; one line naming
    where it came from when the text is not one."""
    from trainwise.plan.planner import parse_sweep

    layers = []
    for layer in spec.layers:
        value, where = layer.get("plan.sweep", (None, ""))
        if isinstance(value, str):
            try:
                layer = {**layer, "plan.sweep": (parse_sweep(value), where)}
            except ValueError as err:
                text = str(err)
                detail = text if "GPU" in text or "range" in text else repr(value)
                raise ConfigError(
                    f"{where.removesuffix('=')} {detail}: expected counts like 1,2,4,8 or a "
                    "range like 1..1024"
                ) from None
        layers.append(layer)
    return replace(spec, layers=tuple(layers))


def _goal(
    spec: JobSpec, objective: str, deadline_hours: float | None, budget_usd: float | None
) -> Any:
    from trainwise.plan.search import Goal

    if deadline_hours is not None and budget_usd is not None:
        raise ConfigError(
            f"{spec.name('deadline_hours')} and {spec.name('budget_usd')} were both given: "
            "give one (the cheapest in time, or the fastest within the money)"
        )
    for option, value in (("deadline_hours", deadline_hours), ("budget_usd", budget_usd)):
        if value is not None and not value > 0:
            raise ConfigError(f"{spec.name(option)} {value!r}: expected a number > 0")
    return Goal(objective, deadline_hours, budget_usd)


def _calibrated(inputs: Any, source: str | None, where: str) -> tuple[Any, list[str]]:
    """The inputs priced by the calibrated model when `source` (a file or a run directory)
    or this machine kind's calibration file gives one; the analytic model otherwise."""
    from trainwise.plan.calibrate import machine_calibration
    from trainwise.plan.model.performance import ANALYTIC, CalibratedModel

    cal, warnings = machine_calibration(source, inputs.hardware.gpu, where)
    for line in warnings:
        print(f"trainwise: warning: {line}", file=sys.stderr)
    model = CalibratedModel(calibration=cal) if cal else ANALYTIC
    return model.adopt(inputs)


def _emit(spec: JobSpec, path: Path, cfg: JobConfig, planned: Any, given: dict) -> None:
    """Write the recommendation as a job file; one line when it cannot."""
    from trainwise.plan.emit import job_toml

    name = f"{spec.name('emit')} {path}"
    choice = planned.recommendation.choice
    if not choice.fits:
        raise ConfigError(
            f"{name}: nothing fits on these GPUs, so there is no job to write; see the "
            "plan's smallest changes (plan without emitting)"
        )
    try:
        path.write_text(job_toml(cfg, choice, planned.inputs, given), encoding="utf-8")
    except OSError as err:
        raise ConfigError(f"{name}: cannot write ({err.strerror})") from None
    print(f"trainwise: wrote the recommended job to {path}", file=sys.stderr)
    if choice.batch_note:
        print(f"trainwise: {choice.batch_note} (the job file says so)", file=sys.stderr)


def _simulate(planned: Any) -> list[dict[str, Any]]:
    """Each row the plan's tables print, measured on fake tensors (progress on stderr)."""
    from trainwise.doctor.simulate import simulate_plan
    from trainwise.report.plan_view import table_plans

    rows = [s for _, s in table_plans(planned)]
    return simulate_plan(planned, lambda line: print(line, file=sys.stderr), rows)


# -- train ---------------------------------------------------------------------------------


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
    with _named_objects(_by_value_names(objects, shortcuts)):
        return train_job(spec, progress)


def train_job(spec: JobSpec, progress: bool | None = None) -> RunResult:
    """train() of a JobSpec (what the CLI gives, its flags named)."""
    from trainwise.report.progress import Follower, attached
    from trainwise.run.launch.start import is_worker

    cfg, given = spec.load()
    _import_roots(spec, cfg)
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


# -- report --------------------------------------------------------------------------------


def report(run_dir: str | Path) -> RunReport:
    """Where a run's time and money went, from its run directory alone: the headline,
    time per stage, cost, plan versus actual, curves, advice and where to look next.
    Writes nothing (write_report draws the page). A directory that is no run, or has no
    step yet, is a ReportError (a ConfigError)."""
    from trainwise.report.analysis import analyse
    from trainwise.report.rundir import load_run

    return analyse(load_run(run_dir))


def write_report(reports: RunReport | Sequence[RunReport], path: str | Path) -> Path:
    """The HTML page of one report, or of several side by side, written whole or not at
    all (a reader never sees half a page); its path."""
    from trainwise.report.analysis import RunReport
    from trainwise.report.run_html import render_html
    from trainwise.run.job.run_files import write_whole

    page = Path(path)
    text = render_html([reports] if isinstance(reports, RunReport) else list(reports))
    page.parent.mkdir(parents=True, exist_ok=True)
    write_whole(page, text)
    return page


# -- doctor --------------------------------------------------------------------------------


@dataclass(frozen=True)
class DoctorResult:
    """What doctor() returns: the checklist (doctor.json's record; None where rank 0's
    machine has it), its run directory, and `message` when the record is elsewhere."""

    run_dir: Path | None
    record: DoctorRecord | None = None
    message: str = ""

    @property
    def failed(self) -> bool:
        """Whether a check failed (`trainwise doctor` exits 1 then)."""
        return bool(self.record is not None and self.record.failed)


def doctor(
    config: JobSource = None,
    *,
    only: Sequence[str] | None = None,
    model: Any = None,
    nproc: int | None = None,
    strategy: str | None = None,
    precision: str | None = None,
    steps: int | None = None,
    run_dir: str | Path | None = None,
    oversubscribe: bool | None = None,
    overrides: Mapping[str, Any] | None = None,
    **sections: Mapping[str, Any],
) -> DoctorResult:
    """Run the job's preflight checklist on the machines it will run on, every worker
    taking part: versions, bandwidth, data pipeline, scaling, smoke test, memory, disk
    (`only`: a subset, by name). Writes RUN/doctor.json (and this machine kind's
    calibration, which later plans and runs use)."""
    shortcuts = {
        "only": None if only is None else list(only), "model": model_key(model),
        "nproc": nproc, "strategy": strategy, "precision": precision, "steps": steps,
        "run_dir": None if run_dir is None else str(run_dir), "oversubscribe": oversubscribe,
    }
    with _named_objects(_by_value_names({"model": model}, shortcuts)):
        return doctor_job(job_spec(config, shortcuts, JOB_KEYWORDS, sections, overrides))


def doctor_job(spec: JobSpec) -> DoctorResult:
    """doctor() of a JobSpec (what the CLI gives, its flags named)."""
    import time

    from trainwise.doctor.calibration import LAUNCH_ENV
    from trainwise.doctor.runner import read_record, run_doctor
    from trainwise.run.launch.start import is_worker, start_job

    cfg, _ = spec.load()
    _import_roots(spec, cfg)
    if is_worker(cfg):  # started by torchrun or srun: one of the workers
        record = run_doctor(cfg)
        return DoctorResult(None, record)
    os.environ.setdefault(LAUNCH_ENV, str(time.time()))  # the workers time their start
    run_dir = start_job(cfg, run_doctor, "trainwise.doctor.runner", label="doctor")
    if not (run_dir / "doctor.json").is_file():  # rank 0 is on another machine
        return DoctorResult(
            run_dir, message=f"this machine's checks finished; rank 0's machine has {run_dir}"
        )
    return DoctorResult(run_dir, read_record(run_dir))
