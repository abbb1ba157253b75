"""`plan()`: a job planned before it runs, as the record `trainwise plan --json` prints.
Imports no torch for a preset, a shape or a bare count."""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from trainwise.api.job import (
    PLAN_KEYWORDS,
    JobSource,
    JobSpec,
    by_value_names,
    data_key,
    function_key,
    job_spec,
    model_key,
    named_objects,
)
from trainwise.errors import ConfigError
from trainwise.records import Plan

if TYPE_CHECKING:
    from trainwise.config import JobConfig


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
    with named_objects(by_value_names(objects, shortcuts)):
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


