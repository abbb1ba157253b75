"""The plan's answer as a job that runs unchanged (`trainwise plan --emit FILE`): a short
file with the planned keys only (the rest keeps its defaults), which `trainwise train
--config` reads: micro-batch x accumulation x data-parallel size is the global batch, the
workers x machines are the planned GPUs, the steps train the planned tokens, and the
checkpoint interval is the Young/Daly one in steps."""

from __future__ import annotations

import math
from collections.abc import Mapping

from trainwise.config import JobConfig
from trainwise.config.load import config_from_toml, toml_value
from trainwise.plan.inputs import PlanInputs
from trainwise.plan.search import Choice, describe_setup
from trainwise.plan.units import fmt_hours, fmt_usd

# Sections of the plan's own inputs: `train` does not read them, so the job leaves them out.
PLAN_ONLY = ("plan.",)


def keys_toml(keys: Mapping[str, object]) -> list[str]:
    """Dotted keys as TOML lines, a [section] header before each section's keys (keys of
    one section gathered, so a section is never opened twice)."""
    out: list[str] = []
    sections: dict[str, list[str]] = {}
    for key, value in keys.items():
        head, _, name = key.partition(".")
        sections.setdefault(head, []).append(f"{name} = {toml_value(value)}")
    for head, lines in sections.items():
        out += [f"[{head}]", *lines]
    return out


def steps_for(tokens: float, global_batch: int, seq_len: int) -> int:
    """Optimizer steps that train `tokens`: tokens / (global batch x sequence), rounded up."""
    return max(1, math.ceil(tokens / (global_batch * seq_len) - 1e-9))


def job_keys(
    cfg: JobConfig, choice: Choice, inputs: PlanInputs, given: Mapping[str, str] | None = None
) -> dict[str, object]:
    """The keys of the emitted job: those the user gave (the job file, flags and --set,
    the plan's own inputs aside), then the plan's: model and sequence, the configuration,
    its global batch, steps, checkpoint interval and the workers that make its GPUs."""
    plan, setup = choice.plan, choice.setup
    sized = inputs.with_gpus(plan.gpus)  # a deadline or a budget may choose fewer
    w = sized.workload
    global_batch = setup.micro_batch * setup.grad_accum * setup.dims.dp_size
    steps = steps_for(sized.tokens, global_batch, w.seq_len)
    interval = round(plan.checkpoint.interval_min * 60.0 / plan.step.total)
    keys: dict[str, object] = {}
    for key in given or {}:
        if not key.startswith(PLAN_ONLY):
            section, _, name = key.partition(".")
            keys[key] = getattr(getattr(cfg, section), name)
    keys["model.name"] = sized.model
    shape = w.shape or w.moe
    if shape is not None:  # the planned vocabulary, not the synthetic data's
        keys["model.vocab_size"] = shape.vocab_size
    keys.update({
        "data.seq_len": w.seq_len,
        "data.global_batch": global_batch,
        **choice.config_keys(),
        "train.steps": steps,
        "checkpoint.interval": max(1, min(interval, steps)),
        "precision.dtype": w.precision,
        "optim.name": w.optimizer,
        "cluster.nproc": sized.gpus_per_node,
        "cluster.nodes": sized.gpus // sized.gpus_per_node,
    })
    if w.float8 != "none":  # as planned: `trainwise train` runs it
        keys["precision.float8"] = w.float8
        keys["precision.float8_all_gather"] = w.float8_all_gather
    if w.lora is not None:  # the planned fine-tune: its [lora] section, whole
        keys.update({f"lora.{k}": v for k, v in cfg.lora.model_dump(exclude_none=True).items()})
    if not choice.dims.hybrid:
        keys.pop("parallel.replicate", None)
    if sized.hardware.device == "cpu":  # planned for CPU workers: run on them
        keys["cluster.device"] = "cpu"
    return keys


def job_toml(
    cfg: JobConfig, choice: Choice, inputs: PlanInputs, given: Mapping[str, str] | None = None
) -> str:
    """The emitted job file: a header that says what was planned (and any global batch
    the plan changed), then job_keys."""
    plan = choice.plan
    keys = job_keys(cfg, choice, inputs, given)
    head = [
        f"# trainwise plan: {describe_setup(choice.setup)}",
        f"# on {plan.gpus} GPUs: {fmt_hours(plan.hours_to_train)}, "
        f"{fmt_usd(plan.cost.total_usd)}; train.steps = {keys['train.steps']} trains "
        f"{inputs.tokens:.3g} tokens; checkpoint.interval: the Young/Daly "
        f"{plan.checkpoint.interval_min:.0f} min in steps",
    ]
    if choice.batch_note:
        head.append(f"# {choice.batch_note}")
    return "\n".join(head + keys_toml(keys)) + "\n"


def job_config(
    cfg: JobConfig, choice: Choice, inputs: PlanInputs, given: Mapping[str, str] | None = None
) -> JobConfig:
    """The emitted job as `trainwise train` reads it."""
    return config_from_toml(job_toml(cfg, choice, inputs, given))
