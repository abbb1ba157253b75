"""What the user set constrains the planner's search; what is unset is searched.

`user_allowed` is the one place a job's settings become the search's `Allowed`: `trainwise
plan` passes the keys the user gave (a flag, --set or the job file), `train --strategy
auto` passes none and keeps what the runtime cannot vary (it runs its own micro-batch,
accumulation steps, checkpointing, tensor parallelism and parallel.shard). A job file that
sets all of them is planned as exactly that configuration by both.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from trainwise.config import JobConfig
from trainwise.config.load import toml_value
from trainwise.config.parallel_dims import LayoutRequest, read_strategy
from trainwise.errors import ConfigError
from trainwise.models.stage_split import SCHEDULE_VIRTUAL, default_microbatches, stage_blocks
from trainwise.plan.inputs import PlanInputs
from trainwise.plan.space import EVERYTHING, Allowed

# What the runtime's auto cannot vary: it runs the job's values of these, given or not.
RUNTIME_FIXED = ("parallel.shard", "parallel.tp", "parallel.ac", "data.micro_batch",
                 "data.grad_accum", "parallel.pp", "parallel.pp_schedule", "parallel.pp_virtual",
                 "parallel.ep")


def user_allowed(cfg: JobConfig, given: Mapping[str, str] | None = None) -> Allowed:
    """The search's Allowed for `cfg`: each key in `given` (key -> where it came from: a
    flag, --set, the file) fixes its part of the space. None: the runtime's auto
    (RUNTIME_FIXED fixed; the micro-batch, accumulation and checkpointing are the job's own,
    as the planner's inputs carry them, since an elastic job scales its accumulation).
    A strategy fsdp or hsdp fixes parallel.shard and parallel.cpu_offload as the job has
    them (what `train` runs); a row name (fsdp-grad-op, ...) sets them itself."""
    runtime = given is None
    given = dict.fromkeys(RUNTIME_FIXED, "the job") if runtime else dict(given)
    p, d = cfg.parallel, cfg.data
    fixed: dict[str, object] = {}
    words: list[tuple[tuple[str, ...], str]] = []

    def fix(key: str, value: object, source: str | None = None, **fields: object) -> None:
        fixed.update(fields)
        words.append((tuple(fields), f"{key} = {toml_value(value)} ({source or given[key]})"))

    shard = p.shard if "parallel.shard" in given else None
    offload = p.cpu_offload if "parallel.cpu_offload" in given else None
    key = next((k for k in ("plan.strategy", "parallel.strategy") if _asked(cfg, k, given)), None)
    if key is not None:
        word = str(cfg.plan.strategy if key == "plan.strategy" else p.strategy)
        kind, shard, offload = read_strategy(word, shard, offload)
        fix(key, word, strategy=kind)
        if LayoutRequest(kind).sharded:
            shard = shard or p.shard
            offload = p.cpu_offload if offload is None else offload
    source = given[key] if key else None
    if shard is not None:
        fix("parallel.shard", shard, given.get("parallel.shard", source),
            reshard_after_forward=shard == "full")
    if offload is not None:
        fix("parallel.cpu_offload", offload, given.get("parallel.cpu_offload", source),
            cpu_offload=offload)
    for name, value, field in (
        ("parallel.tp", p.tp, "tp_degree"),
        ("parallel.pp", p.pp, "pp_degree"),
        ("parallel.pp_schedule", p.pp_schedule, "pp_schedule"),
        ("parallel.pp_virtual", p.pp_virtual, "pp_virtual"),
        ("parallel.pp_microbatches", runtime_microbatches(cfg) if runtime else p.pp_microbatches,
         "pp_microbatches"),
        ("parallel.ep", p.ep, "ep_degree"),
        ("parallel.dp_shard", p.dp_shard, "shard_group"),
        ("parallel.replicate", p.replicate, "replicas"),
        ("parallel.accumulate", p.accumulate, "accumulate"),
        ("parallel.ac", p.ac, "ac"),
        ("data.micro_batch", d.micro_batch, "micro_batch"),
        ("data.grad_accum", d.grad_accum, "grad_accum"),
    ):
        free = value is None or value == "auto" or (runtime and field in KNOBS)
        if not free and (name in given or field in ALWAYS):
            fix(name, value, given.get(name, "the job"), **{field: value})
    return replace(
        EVERYTHING, knobs=not runtime, given=tuple(words), max_pp=cfg.plan.max_pp,
        **fixed,  # type: ignore[arg-type]
    )


# Fixed whenever set (they have no default but "searched"); the knobs the runtime's inputs
# carry themselves (see user_allowed).
ALWAYS = ("shard_group", "replicas", "accumulate", "pp_microbatches")


def runtime_microbatches(cfg: JobConfig) -> int | None:
    """The pipeline's micro-batches a job runs (parallel.pp_microbatches, else the
    runtime's default); None without stages."""
    p, d = cfg.parallel, cfg.data
    if p.pp == 1:
        return None
    return p.pp_microbatches or default_microbatches(d.micro_batch, d.grad_accum)
KNOBS = ("ac", "micro_batch", "grad_accum")


def _asked(cfg: JobConfig, key: str, given: Mapping[str, str]) -> bool:
    strategy = cfg.plan.strategy if key == "plan.strategy" else cfg.parallel.strategy
    return key in given and strategy is not None and not LayoutRequest(strategy).auto


def check_allowed(inputs: PlanInputs, allowed: Allowed) -> None:
    """A setting no layout of these GPUs can meet: one line (ConfigError, exit 2)."""
    tp, profile = allowed.tp_degree, inputs.workload.profile
    shape = inputs.workload.shape or inputs.workload.moe  # a MoE model's: its layers' shape
    problems = []
    if tp is not None and tp > 1:
        if profile is not None and not profile.tp_plan:
            problems.append(
                f"parallel.tp = {tp}: model {profile.source} has no tensor-parallel plan: give "
                "the module a `tp_plan(sequence_parallel)` method (docs/parallelism.md) or use "
                "parallel.tp = 1"
            )
        elif shape is None:
            problems.append(
                f"parallel.tp = {tp}: tensor parallelism needs a model shape; give a preset "
                "(--model) or a shape (--layers --hidden --heads ...) instead of --params"
            )
        elif inputs.gpus % tp or shape.n_head % tp or shape.n_kv_head % tp:
            problems.append(
                f"parallel.tp = {tp} does not divide the {inputs.gpus} GPUs, the "
                f"{shape.n_head} heads and the {shape.n_kv_head} key/value heads: choose a "
                "common divisor"
            )
    if allowed.strategy and LayoutRequest(allowed.strategy).single and inputs.gpus > 1:
        problems.append(
            f"strategy 'single' runs one GPU but the plan has {inputs.gpus}: give --gpus 1 "
            "or another strategy"
        )
    problems += pipeline_problems(inputs, allowed) + expert_problems(inputs, allowed)
    if allowed.replicas is not None and (inputs.gpus // (tp or 1)) % allowed.replicas:
        problems.append(
            f"parallel.replicate = {allowed.replicas} does not divide the data-parallel "
            f"ranks of {inputs.gpus} GPUs: choose a divisor"
        )
    if problems:
        raise ConfigError(problems)


def expert_problems(inputs: PlanInputs, allowed: Allowed) -> list[str]:
    """What no expert-parallel layout can meet: an ep that does not divide a pipeline
    stage's data- and tensor-parallel ranks (it is borrowed from them: ParallelDims.
    expert_ranks; the model's experts are checked with its shape, plan.inputs.moe_problems)."""
    ep = allowed.ep_degree
    if ep is None or ep == 1 or inputs.workload.moe is None:
        return []
    ranks = inputs.gpus // (allowed.pp_degree or 1)
    if ranks % ep:
        return [f"parallel.ep = {ep} does not divide the {ranks} data- and tensor-parallel "
                f"ranks of {inputs.gpus} GPUs it is borrowed from: choose a divisor of them"]
    return []


def pipeline_problems(inputs: PlanInputs, allowed: Allowed) -> list[str]:
    """What no pipeline layout can meet: stages that do not divide the GPUs or split the
    blocks, a schedule at virtual stages it does not run, fewer micro-batches than stages."""
    pp, v, name = allowed.pp_degree or 1, allowed.pp_virtual, allowed.pp_schedule
    shape, tp = inputs.workload.shape or inputs.workload.moe, allowed.tp_degree or 1
    if pp == 1:
        return []
    profile = inputs.workload.profile
    if profile is not None and not profile.stages:
        return [f"parallel.pp = {pp}: model {profile.source} cannot be cut into pipeline "
                "stages (trainwise's GPT presets and hf: Llama models with model.impl = "
                "'trainwise' can): use parallel.pp = 1"]
    if shape is None:
        return [f"parallel.pp = {pp}: pipeline stages need a model shape; give a preset "
                "(--model) or a shape (--layers --hidden --heads ...) instead of --params"]
    if inputs.gpus % (pp * tp):
        return [f"parallel.pp x parallel.tp = {pp} x {tp} does not divide the {inputs.gpus} "
                "GPUs: choose degrees whose product divides them"]
    wanted = SCHEDULE_VIRTUAL.get(name or "")
    if name and v is not None and (v != wanted if wanted else v < 2):
        need = f"pp_virtual = {wanted}" if wanted else "pp_virtual >= 2"
        return [f"parallel.pp_schedule = '{name}' runs {need}, not {v}: change one of them"]
    first = 2 if name else 1  # a named schedule without a fixed degree is interleaved
    virtuals = [v] if v is not None else [wanted] if wanted else range(first, shape.n_layer + 1)
    if not any(stage_blocks(shape.n_layer, pp * k) for k in virtuals):
        stages = f"{pp} x {v} stages" if v is not None else f"{pp} stages"
        return [f"parallel.pp = {pp}: {stages} do not split the {shape.n_layer} blocks (the "
                "blocks, or the blocks + 2 with the embeddings and head as one each, must "
                "divide into them): choose another pp or pp_virtual"]
    m = allowed.pp_microbatches
    if m is not None and m < pp and name != "GPipe":
        return [f"parallel.pp_microbatches = {m} is fewer than the {pp} stages, which "
                f"{name or 'every schedule but GPipe'} needs: give at least {pp}"]
    return []


def relaxed(allowed: Allowed, fields: tuple[str, ...]) -> Allowed:
    """`allowed` with the setting that fixed `fields` searched again."""
    rest = tuple(g for g in allowed.given if g[0] != fields)
    return replace(allowed, given=rest, **dict.fromkeys(fields))  # type: ignore[arg-type]
