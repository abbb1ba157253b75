"""The plan's answer as a job: its settings as config keys, and the job file that
`trainwise train --config` runs (`trainwise plan --emit FILE`)."""

from __future__ import annotations

from trainwise.config import JobConfig, dump_toml
from trainwise.config.load import toml_value
from trainwise.plan.inputs import PlanInputs
from trainwise.plan.search import Choice


def keys_toml(keys: dict[str, object]) -> list[str]:
    """Dotted keys as TOML lines, a [section] header before each section's keys."""
    out: list[str] = []
    section = None
    for key, value in keys.items():
        head, _, name = key.partition(".")
        if head != section:
            out.append(f"[{head}]")
            section = head
        out.append(f"{name} = {toml_value(value)}")
    return out


def job_config(cfg: JobConfig, choice: Choice, inputs: PlanInputs) -> JobConfig:
    """`cfg` (the job the plan read) set to run `choice` on the plan's machines: the
    choice's keys, and cluster.nproc x cluster.nodes = its GPUs (fewer than the plan's
    when a deadline or a budget chose fewer)."""
    inputs = inputs.with_gpus(choice.plan.gpus)
    sections: dict[str, dict[str, object]] = {}
    for key, value in choice.config_keys().items():
        head, _, name = key.partition(".")
        sections.setdefault(head, {})[name] = value
    cluster = sections.setdefault("cluster", {})
    cluster.update(nproc=inputs.gpus_per_node, nodes=inputs.nodes)
    if inputs.hardware.device == "cpu":  # planned for CPU workers: run on them
        cluster["device"] = "cpu"
    if not choice.dims.hybrid:
        sections["parallel"]["replicate"] = None
    updated = {
        head: getattr(cfg, head).model_copy(update=values) for head, values in sections.items()
    }
    return cfg.model_copy(update=updated)


def job_toml(cfg: JobConfig, choice: Choice, inputs: PlanInputs) -> str:
    """The job file of job_config, as `trainwise train --print-config` writes one."""
    return dump_toml(job_config(cfg, choice, inputs))
