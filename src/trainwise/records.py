"""The records trainwise writes and returns, as types: what a run directory holds
(job.json `JobRecord`, metrics.jsonl `StepRecord`, summary.json `RunSummary`, plan.json
`RunPlan`, the `preempted` event `StopEvent`) and the plan of `trainwise plan --json` and
`trainwise.plan()` (`Plan`). The writer builds the record and writes `to_dict()`; readers
(the report, the calibration, the API) take `from_dict()` instead of reading keys back by
name. A field a file lacks (an older run, a hand-made one) reads as its default, or None
where it has none: each reader says what it cannot do without it. Keys a reader does not
know are passed over.

Pure data: no torch, nothing of trainwise's floors (this module sits below all of them).
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from dataclasses import dataclass, field, fields
from typing import Any, TypeVar

R = TypeVar("R")
# A field whose value is dropped from to_dict() when it is None (a key the writer adds
# only when it has a value: the plan's sweep, a recommendation's configuration).
OPTIONAL = {"optional": True}


def _known(cls: type, data: dict[str, Any]) -> dict[str, Any]:
    names = {f.name for f in fields(cls)}
    return {k: v for k, v in data.items() if k in names}


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def from_dict(cls: type[R], data: dict[str, Any] | None) -> R:
    """`cls` (a dataclass of this module) from its JSON form: nested records are built
    from their dicts, a missing field takes its default (None where it has none), and
    unknown keys are passed over."""
    data = data or {}
    hints = _hints(cls)
    values: dict[str, Any] = {}
    for f in fields(cls):  # type: ignore[arg-type]
        if f.name in data:
            values[f.name] = _typed(hints[f.name], data[f.name])
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            values[f.name] = None
    return cls(**values)


def _typed(hint: Any, value: Any) -> Any:
    """`value` as the record type `hint` names, where it names one (a dataclass, a list of
    them, or either or None); any other value as it is."""
    if value is None:
        return None
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if dataclasses.is_dataclass(hint) and isinstance(value, dict):
        return from_dict(hint, value)
    if origin is list and args and dataclasses.is_dataclass(args[0]):
        return [_typed(args[0], v) for v in value]
    if origin in (typing.Union, types.UnionType):
        for arg in args:
            if arg is not type(None) and (dataclasses.is_dataclass(arg) or typing.get_origin(arg)):
                return _typed(arg, value)
    return value


def to_dict(record: Any) -> Any:
    """A record as JSON types, nested records included; OPTIONAL fields that are None and
    fields marked `json=False` are left out."""
    if dataclasses.is_dataclass(record) and not isinstance(record, type):
        out = {}
        for f in fields(record):
            value = getattr(record, f.name)
            if f.metadata.get("json") is False or (f.metadata.get("optional") and value is None):
                continue
            out[f.name] = to_dict(value)
        return out
    if isinstance(record, (list, tuple)):
        return [to_dict(v) for v in record]
    if isinstance(record, dict):
        return {k: to_dict(v) for k, v in record.items()}
    return record


class Record:
    """`to_dict()` / `from_dict()` for the dataclasses below."""

    def to_dict(self) -> dict[str, Any]:
        """The record as the JSON its file holds."""
        return to_dict(self)

    @classmethod
    def from_dict(cls: type[R], data: dict[str, Any] | None) -> R:
        """The record from its file's JSON, tolerant of older files (see the module)."""
        return from_dict(cls, data)


# -- job.json ------------------------------------------------------------------------------


@dataclass(frozen=True)
class JobRecord(Record):
    """job.json: the job as it was resolved on its machines (run.job.Job.summary_dict)."""

    world: int = 1
    device: str | None = None
    device_kind: str | None = None
    backend: str | None = None
    strategy: str | None = None  # the data-parallel part's shortcut
    layout: str | None = None  # every degree: ParallelDims.describe()
    layout_name: str | None = None  # as people read it: ParallelDims.name (pp 2 x fsdp 2)
    plan_name: str | None = None
    requested_strategy: str | None = None
    cpu_offload: bool = False
    replicate: int = 1
    grad_accum: int = 1
    accumulate: str | None = None
    reason: str = ""
    params: int | None = None
    # LoRA: the parameters that train (adapters, and embeddings / head when they train)
    # and the model's with its adapters; None when every parameter trains.
    trainable_params: int | None = None
    total_params: int | None = None
    global_batch: int | None = None
    tokens_per_step: int | None = None
    flops_per_token: float | None = None
    # Hardware FLOPs per model FLOP (activation recomputation), and the device's peak that
    # the MFU is measured against: what a calibration needs.
    recompute_factor: float = 1.0
    peak_flops_per_device: float | None = None
    precision: str | None = None
    memory_estimate: dict[str, float] = field(default_factory=dict)
    device_budget_bytes: float | None = None


# -- metrics.jsonl -------------------------------------------------------------------------


@dataclass
class StepRecord(Record):
    """One line of metrics.jsonl: every field is present; null means not measured.
    Written by run.observe.telemetry.MetricsWriter (run.engine.recorder fills it)."""

    step: int  # 1-based optimizer step
    loss: float  # training loss, averaged over all data-parallel ranks
    eval_loss: float | None  # held-out loss, on evaluation steps
    lr: float
    grad_norm: float  # global norm before clipping
    step_s: float  # wall time of the step
    data_s: float  # waiting for batches
    compute_s: float  # forward + backward, less the exposed sync
    # Exposed communication: the gradient sync and, under tensor parallelism, its collectives
    # (from the latest probes); null before one.
    sync_s: float | None
    optim_s: float  # clipping, optimizer and scheduler step
    ckpt_s: float  # the loop blocked by a checkpoint save (staging only when async)
    tokens: int  # tokens processed so far, all ranks
    tokens_per_s: float
    samples_per_s: float
    mfu: float | None  # model FLOPs utilisation; null when the device's peak is unknown
    # Peak CUDA memory allocated; on CPU the peak resident set the job added over the
    # worker's baseline (taken before the model is built), else the whole peak RSS.
    mem_bytes: int
    mem_kind: str  # "cuda_peak", "rss_added" or "rss_peak"
    elapsed_s: float  # since the loop started
    time: float  # unix time
    attempt: int  # elastic restart count: a resumed run repeats the steps since its checkpoint
    profiled: bool = False  # logging.profile_steps and the step after: slowed by the profiler
    # Peak CUDA memory the caching allocator reserved (what the device really gave up);
    # null on CPU.
    mem_reserved_bytes: int | None = None
    # Of sync_s, the tensor-parallel collectives inside forward and backward (timed on the
    # latest probes, run.comm_timer); null without tensor parallelism or before a probe.
    tp_s: float | None = None
    # Pipeline parallelism: of the step, the wait on the other stages inside the schedule
    # (its fill and drain, and transfers not hidden); null without pipeline stages.
    bubble_s: float | None = None
    # Of `loss`, a Mixture-of-Experts model's load-balancing part (moe.aux_loss_coef x its
    # balancing loss), averaged as the loss; null for a model without one.
    aux_loss: float | None = None
    # Of sync_s, expert parallelism's all-to-alls on rank 0 (dispatch and combine, forward
    # and backward, the token counts' exchange included), timed every step; null without
    # parallel.ep.
    a2a_s: float | None = None
    # A Mixture-of-Experts model's routing (models.moe.load): the step's tokens per expert
    # (each token's top_k copies, over all ranks, summed over the MoE layers); the busiest
    # expert's tokens over the mean, and the busiest expert-parallel rank's (null at ep
    # 1): what the planner's moe.imbalance stands for. Both means over the MoE layers;
    # null for a dense model.
    expert_tokens: list[int] | None = None
    expert_imbalance: float | None = None
    ep_imbalance: float | None = None


# -- summary.json and the events a result names ----------------------------------------------


@dataclass(frozen=True)
class RetryFigures(Record):
    """What failures cost a run (run.observe.events.RetryCost, as summary.json holds it)."""

    failures: int = 0
    downtime_s: float = 0.0
    recomputed_s: float = 0.0
    total_s: float = 0.0
    gpu_hours: float = 0.0


@dataclass(frozen=True)
class RunSummary(Record):
    """summary.json: the run's figures as rank 0 wrote them when its last launch ended
    (run.engine.training.Training.finish). A figure the run did not measure is None."""

    run_dir: str | None = None
    model: str | None = None
    params: int | None = None
    trainable_params: int | None = None  # LoRA; None when every parameter trains
    total_params: int | None = None
    strategy: str | None = None
    layout: str | None = None  # every degree: ParallelDims.describe()
    tp: int | None = None
    pp: int | None = None
    cpu_offload: bool | None = None
    reason: str | None = None  # why this layout
    world: int | None = None
    device: str | None = None
    precision: str | None = None
    steps: int | None = None  # train.steps
    last_step: int | None = None
    preempted: str | None = None  # the signal that stopped it after a save; None: it ran out
    resumed_from: int | None = None  # the checkpoint's step this launch resumed from
    resume: str | None = None  # the resume, as one line
    global_batch: int | None = None
    tokens: int | None = None
    retry_cost: RetryFigures | None = None
    retry_line: str | None = None
    first_loss: float | None = None
    final_loss: float | None = None
    final_eval_loss: float | None = None
    tokens_per_s: float | None = None  # steady steps only
    tokens_per_sample: int | None = None
    stage_share: dict[str, float] = field(default_factory=dict)  # data, compute, sync, ...
    sync_measured: bool | None = None
    tp_comm_share: float | None = None
    # Expert parallelism's all-to-alls' share of the step (inside the exposed sync), and
    # the steady steps' median load figures (StepRecord's; ep_imbalance is what a
    # calibration takes for the planner's moe.imbalance).
    a2a_share: float | None = None
    expert_imbalance: float | None = None
    ep_imbalance: float | None = None
    wall_s: float | None = None  # the report's wall time (run.observe.wall)


@dataclass(frozen=True)
class StopEvent(Record):
    """events.jsonl's `preempted` event: a stop signal made the run save and stop."""

    time: float | None = None
    step: int | None = None
    signal: str | None = None  # SIGTERM, SIGINT, SIGUSR1...
    checkpoint: str | None = None  # the checkpoint directory it saved


# -- plan.json (a run's) and the plan of `trainwise plan --json` ----------------------------


@dataclass(frozen=True)
class StepFigures(Record):
    """A planned step, in seconds (plan.json `step`)."""

    compute: float = 0.0
    comm: float = 0.0
    exposed_comm: float = 0.0
    data: float = 0.0
    total: float = 0.0
    bubble: float | None = None  # the pipeline's fill and drain


@dataclass(frozen=True)
class MemoryFigures(Record):
    """Planned memory per GPU, in bytes, at its peak phase."""

    params: int | None = None
    grads: int | None = None
    optimizer: int | None = None
    model_states: int | None = None
    activations: int | None = None
    buffers: int | None = None
    overhead: int | None = None
    total: int | None = None
    peak_phase: str | None = None


@dataclass(frozen=True)
class CostFigures(Record):
    """Planned cost of the whole training, in GPU-hours and US dollars."""

    gpu_hours: float | None = None
    compute_usd: float | None = None
    comm_wait_usd: float | None = None
    failure_retry_usd: float | None = None
    total_usd: float | None = None


@dataclass(frozen=True)
class CheckpointFigures(Record):
    """The planned checkpoint interval, its failures and one save."""

    interval_min: float | None = None
    expected_failures: float | None = None
    save_s: float | None = None
    size_bytes: int | None = None


@dataclass(frozen=True)
class StrategyFigures(Record):
    """One priced configuration (plan.record.strategy_record): a row of the plan."""

    name: str | None = None
    gpus: int | None = None
    micro_batch: int | None = None
    grad_accum: int | None = None
    fits: bool | None = None
    memory_per_gpu: MemoryFigures = field(default_factory=MemoryFigures)
    host_memory_per_node: int | None = None
    comm_bytes_per_step_per_gpu: int | None = None
    step: StepFigures = field(default_factory=StepFigures)
    tokens_per_s: float | None = None
    mfu: float | None = None
    scaling_efficiency: float | None = None
    hours_to_train: float | None = None
    cost: CostFigures = field(default_factory=CostFigures)
    checkpoint: CheckpointFigures = field(default_factory=CheckpointFigures)


@dataclass(frozen=True)
class AlternativeFigures(Record):
    """Another strategy on the same workers, as a run's plan.json lists it."""

    name: str | None = None
    fits: bool | None = None
    step_total: float | None = None
    tokens_per_s: float | None = None


@dataclass(frozen=True)
class RunPlan(StrategyFigures):
    """A run's plan.json (run.job.resolve.job_plan): the planner's row for the job as it
    runs, and the assumptions the report names when the run disagrees."""

    layout: str | None = None
    accumulate: str | None = None
    efficiency: float | None = None
    intra_node_gbps: float | None = None
    inter_node_gbps: float | None = None
    checkpoint_write_gbps: float | None = None
    price_per_gpu_hour: float | None = None
    gpu: str | None = None
    checkpoint_latency_s: float | None = None
    calibration: list[str] = field(default_factory=list)
    figures: str | None = None  # what the figures rest on (calibrated from FILE, defaults)
    calibrated: bool | None = None  # None: a plan.json older than the calibrated model
    calibration_source: str | None = None
    calibration_step_s: float | None = None  # the calibration run's own step
    calibration_save_s: float | None = None
    # A Mixture-of-Experts model's load imbalance the plan priced (moe.imbalance), and
    # the seconds of a step it waits for expert parallelism's all-to-alls; None where the
    # plan names none (a dense model; no all-to-all at ep 1).
    moe_imbalance: float | None = None
    all_to_all_s: float | None = None
    alternatives: list[AlternativeFigures] = field(default_factory=list)


@dataclass(frozen=True)
class RunPlanFigures:
    """What a run's plan.json assumed and predicted, where the run measures the same:
    the step, the memory per worker, a save, and the assumptions behind them."""

    gpus: int = 1
    step: StepFigures = field(default_factory=StepFigures)
    memory_total: float | None = None  # bytes per worker, overhead included
    memory_overhead: float = 0.0
    save_s: float | None = None
    efficiency: float | None = None
    intra_node_gbps: float | None = None
    checkpoint_write_gbps: float | None = None
    calibrated: bool | None = None  # None: a plan.json older than the calibrated model

    @classmethod
    def from_dict(cls, plan: dict[str, Any]) -> RunPlanFigures:
        memory = plan.get("memory_per_gpu") or {}
        return cls(
            gpus=int(plan.get("gpus") or 1),
            step=StepFigures(**_known(StepFigures, plan.get("step") or {})),
            memory_total=memory.get("total"),
            memory_overhead=memory.get("overhead") or 0.0,
            save_s=(plan.get("checkpoint") or {}).get("save_s"),
            efficiency=plan.get("efficiency"),
            intra_node_gbps=plan.get("intra_node_gbps"),
            checkpoint_write_gbps=plan.get("checkpoint_write_gbps"),
            calibrated=plan.get("calibrated"),
        )


@dataclass(frozen=True)
class PlanInputsRecord(Record):
    """What a plan priced (plan.record.inputs_record). Units: bytes, seconds, hours, US
    dollars; shares in [0, 1]."""

    model: str | None = None
    params: float | None = None
    trainable_params: float | None = None  # LoRA: the adapters and what else trains
    total_params: float | None = None
    lora_rank: int = 0
    shape: dict[str, int] | None = None  # layers, hidden, heads, kv_heads, ffn, vocab
    # A Mixture-of-Experts model: its shape, total and active parameters, the imbalance
    moe: dict[str, Any] | None = None
    seq_len: int | None = None
    micro_batch: int | None = None
    global_batch: int | None = None
    tokens: float | None = None
    precision: str | None = None
    float8: str = "none"  # precision.float8: "none", "tensorwise" or "rowwise"
    float8_all_gather: bool = False  # FSDP gathered the float8 weights in float8
    optimizer: str | None = None
    ac: str | None = None
    gpu: str | None = None
    gpus: int | None = None
    gpus_per_node: int | None = None
    nodes: int | None = None
    gpu_memory_bytes: int | None = None
    gpu_peak_flops: float | None = None
    gpu_fp8_peak_flops: float | None = None  # dense fp8 peak, with float8 training
    efficiency: float | None = None
    intra_node_bytes_per_s: float | None = None
    inter_node_bytes_per_s: float | None = None
    price_per_gpu_hour: float | None = None
    mtbf_hours_per_node: float | None = None
    restart_s: float | None = None
    checkpoint_bytes_per_s_per_node: float | None = None
    checkpoint_latency_s: float | None = None
    runtime_memory_bytes: float | None = None
    data_samples_per_s_per_gpu: float | None = None
    headroom: float | None = None
    objective: str | None = None
    calibration: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class PlanAlternative(Record):
    """A configuration the recommendation was weighed against, and why it lost."""

    configuration: str | None = None
    config: dict[str, Any] = field(default_factory=dict)  # the job-file keys that run it
    why_not: str | None = None
    plan: StrategyFigures = field(default_factory=StrategyFigures)


@dataclass(frozen=True)
class Recommendation(Record):
    """The plan's answer: its row, scenario and reasons; when a configuration was chosen,
    its layout, the job-file keys that run it (`config`), its figures and alternatives."""

    strategy: str | None = None
    scenario: str | None = None
    reasons: list[str] = field(default_factory=list)
    fits: bool | None = field(default=None, metadata=OPTIONAL)
    configuration: str | None = field(default=None, metadata=OPTIONAL)
    layout: dict[str, Any] | None = field(default=None, metadata=OPTIONAL)
    config: dict[str, Any] | None = field(default=None, metadata=OPTIONAL)
    plan: StrategyFigures | None = field(default=None, metadata=OPTIONAL)
    alternatives: list[PlanAlternative] | None = field(default=None, metadata=OPTIONAL)


@dataclass(frozen=True)
class PlanQuestion(Record):
    """One of the questions a plan answers (does it fit, what does a failure cost...)."""

    question: str = ""
    answer: str = ""


@dataclass(frozen=True)
class SweepRow(Record):
    """The best configuration at one GPU count of a scaling sweep."""

    gpus: int | None = None
    strategy: str | None = None
    fits: bool | None = None
    tokens_per_s: float | None = None
    scaling_efficiency: float | None = None
    step_s: float | None = None
    hours_to_train: float | None = None
    total_usd: float | None = None
    configuration: str | None = None


@dataclass(frozen=True)
class Plan(Record):
    """The plan of `trainwise plan --json` and `trainwise.plan()`: the same record (its
    schema is plan.record's, documented in docs/planner.md). `planned` is the planner's
    own result behind it when this process made it (what the terminal, Markdown and HTML
    views draw); it is not part of the record, and None when read back from JSON."""

    schema_version: int = 1
    inputs: PlanInputsRecord = field(default_factory=PlanInputsRecord)
    strategies: list[StrategyFigures] = field(default_factory=list)
    recommendation: Recommendation = field(default_factory=Recommendation)
    questions: list[PlanQuestion] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    sweep: list[SweepRow] | None = field(default=None, metadata=OPTIONAL)
    knees: dict[str, Any] | None = field(default=None, metadata=OPTIONAL)
    simulation: list[dict[str, Any]] | None = field(default=None, metadata=OPTIONAL)  # --simulate
    planned: Any = field(default=None, repr=False, compare=False, metadata={"json": False})
