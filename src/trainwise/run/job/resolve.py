"""Resolving a job against the machine: the checks that need the device and the world
size, and the strategy decision. Runs in the launching process (so bad input stops before
any worker starts) and again in each worker, which reaches the same decision from the same
inputs. Not pure: it builds the datasets (reading the data files), reads the machine's
calibration file, and looks for the manifest of a checkpoint given to resume from."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from trainwise.config import JobConfig
from trainwise.config.lineage import moe_keys as lineage_moe_keys
from trainwise.config.parallel_dims import LayoutRequest, ParallelDims
from trainwise.data import DataInfo, first_batch, user_data_problems
from trainwise.errors import ConfigError, DataError, ModelError, joined
from trainwise.hardware import GB, DeviceInfo
from trainwise.hardware.catalog import find_gpu
from trainwise.models import (
    GPTShape,
    ModelSpec,
    base_weights_id,
    build_model,
    count_parameters,
    float8_model_problems,
    lora_model_problems,
    model_kind,
    norm_impl_problems,
    resolve_moe_shape,
    resolve_shape,
    takes_example_ids,
    tp_model_problems,
)
from trainwise.models.moe import MoEShape
from trainwise.models.pipeline import (
    ZERO_BUBBLE,
    default_microbatches,
    example_input,
    extra_inputs_problem,
    module_cut,
    module_problems,
    schedule_problems,
)
from trainwise.models.shapes import ModelProfile
from trainwise.plan import (
    Decision,
    Workload,
    choose_accumulation,
    decide_auto,
    describe,
    fmt_bytes,
)
from trainwise.plan.calibrate import (
    NO_CALIBRATION,
    Calibration,
    machine_calibration,
    read_calibration,
)
from trainwise.plan.constraints import user_allowed
from trainwise.plan.estimate import Setup, StrategyPlan, candidate_names, evaluate, price
from trainwise.plan.inputs import (
    PlanInputs,
    config_workload,
    job_inputs,
    lora_plan,
    moe_unpriced,
    unknown_device_inputs,
)
from trainwise.plan.model.flops import flops_per_token, recompute_factor, selective_op_share
from trainwise.plan.model.lora import param_counts
from trainwise.plan.model.memory import replica_memory
from trainwise.plan.model.performance import CalibratedModel, model_of
from trainwise.plan.moe.comm import all_to_all_seconds
from trainwise.plan.record import strategy_record
from trainwise.records import JobRecord
from trainwise.run.job.workload import job_datasets, job_profile, job_spec


@dataclass
class Job:
    cfg: JobConfig
    world: int
    device: DeviceInfo
    backend: str
    dims: ParallelDims  # the layout: every parallel degree, resolved
    grad_accum: int  # data.grad_accum, scaled up when an elastic job runs on fewer machines
    decision: Decision
    model_spec: ModelSpec
    params: int
    shape: GPTShape | None
    data: DataInfo
    # The planner's view of this job on these machines (None: a device the catalog lacks).
    plan_inputs: PlanInputs | None = field(repr=False, default=None)
    calibration: Calibration | None = field(repr=False, default=None)  # plan.calibration's
    plan_notes: list[str] = field(repr=False, default_factory=list)  # what it replaced
    datasets: tuple[Any, Any] = field(repr=False, default=(None, None))
    # FSDP with accumulation: reduce-scatter every micro-batch (parallel.accumulate resolved).
    sharded_accumulation: bool = False
    # LoRA: what the frozen base's weights come from (registry.base_weights_id); in the
    # lineage, so a resume onto other base weights is refused. Computed by the launcher
    # and handed to its workers (run.job.lifeline): it may read every weight.
    base_weights: str | None = None
    moe: MoEShape | None = None  # a Mixture-of-Experts model's shape

    @property
    def dp_size(self) -> int:
        return self.dims.dp_size

    @property
    def strategy(self) -> str:
        """The data-parallel part's shortcut (single, ddp, fsdp, hsdp), as job.json and
        the checkpoints' manifests record it; not for decisions. People read
        `dims.name`, which says pp and tp too."""
        return self.dims.strategy

    @property
    def cpu_offload(self) -> bool:
        return self.dims.cpu_offload

    @property
    def replicate(self) -> int:
        """HSDP's replica groups (1 otherwise)."""
        return self.dims.dp_replicate if self.dims.hybrid else 1

    @property
    def accumulate(self) -> str:
        """parallel.accumulate as it runs: sharded or unsharded."""
        return "sharded" if self.sharded_accumulation else "unsharded"

    @property
    def global_batch(self) -> int:
        return self.cfg.data.micro_batch * self.grad_accum * self.dp_size

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.data.tokens_per_sample

    @property
    def flops_per_token(self) -> float | None:
        if self.moe is not None:
            from trainwise.models.moe.cost import moe_flops_per_token

            return moe_flops_per_token(self.moe, self.cfg.data.seq_len)
        if self.shape is None:
            return None
        return flops_per_token(self.shape, self.cfg.data.seq_len, lora_plan(self.cfg))

    @property
    def n_layer(self) -> int:
        """The model's blocks (1 when no shape knows them)."""
        shape = self.shape or self.moe
        return shape.n_layer if shape else 1

    @property
    def lora_counts(self) -> tuple[int | None, int | None]:
        """(trainable, total) parameters under LoRA, counted from the model's shape;
        (None, None) without LoRA or without a shape."""
        lora = lora_plan(self.cfg)
        if lora is None or self.shape is None:
            return None, None
        return param_counts(self.params, self.shape, lora)

    def summary_dict(self) -> dict[str, Any]:
        """What job.json records about the decision (the report reads it)."""
        return self.record().to_dict()

    def record(self) -> JobRecord:
        est = self.decision.estimate
        trainable, total = self.lora_counts
        return JobRecord(
            world=self.world,
            device=self.device.name,
            device_kind=self.device.kind,
            backend=self.backend,
            strategy=self.strategy,
            layout=self.dims.describe(),
            layout_name=self.dims.name,
            plan_name=self.dims.plan_name,
            requested_strategy=self.cfg.parallel.strategy,
            cpu_offload=self.cpu_offload,
            replicate=self.replicate,
            grad_accum=self.grad_accum,
            accumulate=self.accumulate,
            reason=self.decision.reason,
            params=self.params,
            trainable_params=trainable,
            total_params=total,
            global_batch=self.global_batch,
            tokens_per_step=self.tokens_per_step,
            flops_per_token=self.flops_per_token,
            recompute_factor=recompute_factor(
                self.cfg.parallel.ac, self.n_layer, self.cfg.lora.rank > 0,
                selective_op_share(self.shape, self.cfg.data.seq_len, lora_plan(self.cfg)),
            ),
            peak_flops_per_device=self.device.peak_flops(self.cfg.precision.dtype),
            precision=self.cfg.precision.dtype,
            memory_estimate={
                "params": est.params,
                "grads": est.grads,
                "optimizer": est.optimizer,
                "activations": est.activations,
                "buffers": est.buffers,
                "total": est.total,
            },
            device_budget_bytes=self.decision.budget_bytes,
        )


def resolve_nproc(cfg: JobConfig, device: DeviceInfo) -> int:
    if cfg.cluster.nproc is not None:
        return cfg.cluster.nproc
    if LayoutRequest.of(cfg.parallel).single:
        return 1
    return max(device.count, 1) if device.kind == "cuda" else 2


def check_cores(cfg: JobConfig, device: DeviceInfo, nproc: int, cores: int) -> None:
    """Before any worker: more CPU workers asked for (cluster.nproc) than this machine's
    cores is refused unless cluster.oversubscribe (they would take turns on the cores:
    every step slower, a machine's worth of processes started by a typo)."""
    c = cfg.cluster
    if device.kind != "cpu" or c.nproc is None or nproc <= cores or c.oversubscribe:
        return
    raise ConfigError(
        f"--nproc {nproc} (cluster.nproc): {nproc} CPU workers on {cores} cores would take "
        f"turns on them (slower, not faster): use --nproc {cores} or fewer, or add --oversubscribe "
        "(cluster.oversubscribe = true) to start them anyway"
    )


def start_lines(job: Job, nproc: int, cores: int) -> list[str]:
    """What the launcher says before the workers start: where the global batch comes from
    (it grows with --nproc), and warnings when CPU workers outnumber the cores or tensor
    parallelism spans machines."""
    c, nodes = job.cfg, job.world // nproc
    machines = f" x {nodes} machines" if nodes > 1 else ""
    figures = model_of(job.plan_inputs).header() if job.plan_inputs else None
    lines = [f"trainwise: plan figures: {figures}"] if figures else []
    lines += [
        f"trainwise: global batch {job.global_batch} samples per step = data.micro_batch "
        f"{c.data.micro_batch} x data.grad_accum {job.grad_accum} x data-parallel size "
        f"{job.dp_size} (--nproc {nproc}{machines}); another --nproc changes it"
    ]
    lines += [f"trainwise: {note}" for note in job.data.notes]
    if job.dims.tp > nproc:  # allowed by parallel.allow_tp_across_nodes
        lines.append(
            f"trainwise: warning: parallel.tp = {job.dims.tp} spans machines ({nproc} workers "
            "each): every layer waits on the network between them, typically several times "
            "slower than inside a machine; keep tp <= the workers of one machine if you can"
        )
    if job.device.kind == "cpu" and nproc > cores:
        lines.append(
            f"trainwise: warning: {nproc} CPU workers (--nproc {nproc}) on {cores} cores take "
            f"turns on them, so steps get slower, not faster; use --nproc {cores} or fewer"
        )
    return lines


def prepare_job(
    cfg: JobConfig,
    world: int,
    device: DeviceInfo,
    local_world: int | None = None,
    base_id: Callable[[ModelSpec, int], str | None] = base_weights_id,
) -> Job:
    """Every machine-dependent check, collected and raised once; then the decision.
    `world` is the whole job; `local_world` the workers on this machine (default: all).
    With LoRA, `base_id(spec, seed)` says what the frozen base is: by default read from the
    weights (once per process, or free in the hub cache); a worker takes its launcher's."""
    c, local = cfg, local_world or world
    backend, problems = machine_problems(c, device, local)
    problems += layout_problems(c, world, local, device)
    # Machines now: torchrun starts `local` workers on each; with an elastic range fewer
    # than cluster.nodes may have joined.
    nodes = world // local if world % local == 0 else 1
    request = LayoutRequest.of(c.parallel)
    replicate = request.replica_groups(world, nodes)
    others = c.parallel.tp * c.parallel.pp
    dp = world // others if world % others == 0 else world
    if dp % replicate:
        problems.append(
            f"parallel.replicate = {replicate} does not divide the world size {world} / "
            f"(parallel.tp x parallel.pp) {others} = {dp} data-parallel ranks: hsdp needs "
            "replicate x shard x tp x pp = world"
        )
    data = data_and_model(c, problems)
    problems += expert_problems(c, data.moe)
    problems += norm_impl_problems(data.spec)
    problems += tp_model_problems(data.spec, c.parallel.tp, c.data.seq_len, sequence_parallel(c))
    problems += lora_model_problems(data.spec, c.lora)
    problems += float8_model_problems(c, data.spec)
    accum, more = batch_problems(c, world, local, request, data.info)
    bad_data = []
    if data.info.task == "custom":  # your own dataset: read one global batch of it
        bad_data = user_data_problems(
            *data.datasets, micro_batch=c.data.micro_batch, grad_accum=accum,
            dp=data_parallel_size(c, world, request), evaluate=c.train.eval_every > 0,
        )
    more += bad_data + pipeline_problems(c, data, accum)
    if problems + more:  # the data's problems alone: a DataError
        raise (DataError if more == bad_data and not problems else ConfigError)(problems + more)

    # A Mixture-of-Experts model is priced by its shape (plan/moe), as `trainwise plan`
    # prices it, with the job's moe.imbalance and its parallel.ep kept by the search.
    workload = config_workload(c, data.params, data.shape, profile=data.profile, moe=data.moe)
    device_bytes = device_budget(c, device, local)
    view = planner_view(c, workload, world, local, device, device_bytes, accum)
    calibration, plan_notes = None, moe_pricing_notes(c, data.moe)
    if view is not None:  # the given calibration, or this machine kind's default file
        calibration, found = machine_calibration(
            c.plan.calibration, view.hardware.gpu, f"plan.calibration = {c.plan.calibration!r}"
        )
        plan_notes += found
    elif c.plan.calibration not in (None, NO_CALIBRATION):
        calibration = read_calibration(c.plan.calibration, where=f"plan.calibration = "
                                       f"{c.plan.calibration!r}")
    view, notes = calibrated(view, calibration)
    plan_notes += notes
    cluster = view  # the planner's view: what auto decides with
    decision = decide(
        workload, request, world, device_bytes, c, replicate, device.kind, accum, cluster
    )
    setup = decision.setup
    assert setup is not None
    dims = setup.dims.runnable()
    return Job(
        cfg=c,
        world=world,
        device=device,
        backend=backend,
        dims=dims,
        grad_accum=accum,
        decision=decision,
        model_spec=data.spec,
        params=data.params,
        shape=data.shape,
        data=data.info,
        plan_inputs=view,
        calibration=calibration,
        plan_notes=plan_notes,
        datasets=data.datasets,
        sharded_accumulation=dims.accumulates_sharded(setup.accumulate, accum),
        base_weights=base_id(data.spec, c.train.seed) if c.lora.rank else None,
        moe=data.moe,
    )


def machine_problems(c: JobConfig, device: DeviceInfo, local: int) -> tuple[str, list[str]]:
    """The backend for this device, and what the device cannot do as configured."""
    problems = []
    if device.kind == "cuda" and device.count == 0:
        problems.append(
            "cluster.device = 'cuda' but no CUDA device is visible: use 'cpu' or 'auto'"
        )
    backend = c.cluster.backend
    if backend == "auto":
        backend = "nccl" if device.kind == "cuda" else "gloo"
    if backend == "nccl" and device.kind != "cuda":
        problems.append("cluster.backend = 'nccl' needs CUDA devices: use 'gloo' on CPU")
    dtype = c.precision.dtype
    if dtype == "fp16" and not device.fp16:
        problems.append(
            f"precision.dtype = 'fp16' cannot run on {device.kind}: gradient scaling for fp16 "
            "needs a CUDA device; use 'bf16' or 'fp32'"
        )
    if dtype == "bf16" and not device.bf16:
        problems.append(
            f"precision.dtype = 'bf16' is not supported by {device.name}: use 'fp16' or 'fp32'"
        )
    if c.precision.float8 != "none" and device.kind == "cuda" and device.count and not device.fp8:
        cc = ".".join(map(str, device.capability or ()))
        problems.append(
            f"precision.float8 = '{c.precision.float8}' needs float8 tensor cores (compute "
            f"capability 8.9+: Ada, Hopper, Blackwell); {device.name} has {cc or 'none'}: set "
            "precision.float8 = 'none'"
        )
    if device.kind == "cuda" and device.count and local > device.count:
        problems.append(
            f"cluster.nproc = {local} exceeds the {device.count} visible GPUs: lower --nproc"
        )
    resume = c.checkpoint.resume
    if resume not in ("auto", "never") and not (Path(resume) / "manifest.json").is_file():
        what = "does not exist" if not Path(resume).exists() else "has no manifest.json"
        problems.append(
            f"checkpoint.resume = '{resume}' {what}: give a committed checkpoint directory "
            "(`trainwise checkpoints RUN` lists them), 'auto' or 'never'"
        )
    return backend, problems


@dataclass(frozen=True)
class JobData:
    """The datasets and the model they decide (the vocabulary, the classifier's shape)."""

    datasets: tuple[Any, Any]
    info: DataInfo
    spec: ModelSpec
    params: int
    shape: GPTShape | None
    profile: ModelProfile | None = None  # a model without a shape, read from its module
    moe: MoEShape | None = None  # a Mixture-of-Experts model's shape (priced by it)


def data_and_model(c: JobConfig, problems: list[str]) -> JobData:
    """Build the datasets and size the model; raises with `problems` and its own at once
    when either cannot be built (the later checks need both)."""
    try:
        train_ds, val_ds, info = job_datasets(c)
    except ConfigError as err:
        raise joined(problems, err) from None
    spec = job_spec(c, info)
    if c.model.vocab_size and info.vocab_size and c.model.vocab_size < info.vocab_size:
        problems.append(
            f"model.vocab_size = {c.model.vocab_size} is smaller than the data's vocabulary "
            f"({info.vocab_size} token ids): raise it or leave it unset"
        )
    if info.packed and not takes_example_ids(spec):
        problems.append(
            f"data.packing = true packs several examples a sequence, which model.name = "
            f"{spec.name!r} cannot keep apart (it needs the built-in GPT, model.impl = "
            "'trainwise', or a transformers model whose attention takes a custom 4-D mask): "
            "set data.packing = false"
        )
    try:
        # A model without a formula (your own, a transformers one) is read from its module
        # and measured on the data: its blocks are the FSDP units the plan prices.
        shape, moe = resolve_shape(spec), resolve_moe_shape(spec)
        known = shape is not None or moe is not None  # priced by its shape
        profile = None if known else job_profile(c, spec, train_ds)
        params = profile.params if profile is not None else count_parameters(spec)
    except ConfigError as err:
        raise joined(problems, err) from None
    return JobData((train_ds, val_ds), info, spec, params, shape, profile, moe)


def batch_problems(
    c: JobConfig, world: int, local: int, request: LayoutRequest, info: DataInfo
) -> tuple[int, list[str]]:
    """The accumulation steps, and whether the batch arithmetic holds for this data."""
    accum, problem = elastic_accum(c, world, local)
    problems = [problem] if problem else []
    dp = data_parallel_size(c, world, request)
    g = c.data.micro_batch * accum * dp
    counted = info.task != "custom"  # your own dataset: user_data_problems counts it
    if c.data.global_batch is not None and c.data.global_batch != g:
        problems.append(
            f"data.global_batch = {c.data.global_batch} is not micro_batch({c.data.micro_batch})"
            f" x grad_accum({accum}) x data-parallel size({dp}) = {g}: "
            "change one of them so that they agree"
        )
    elif counted and c.train.eval_every and info.val_samples < dp:
        problems.append(
            f"data.val_fraction = {c.data.val_fraction} holds out {info.val_samples} samples, "
            f"fewer than the {dp} data-parallel ranks that evaluate: raise data.val_fraction "
            "or set train.eval_every = 0"
        )
    elif counted and g > info.train_samples:
        problems.append(
            f"global batch {g} = micro_batch({c.data.micro_batch}) x grad_accum"
            f"({accum}) x data-parallel size({dp}) exceeds the "
            f"{info.train_samples} training samples: lower data.micro_batch"
        )
    return accum, problems


def data_parallel_size(c: JobConfig, world: int, request: LayoutRequest) -> int:
    """The ranks that share out each global batch (one for a single replica)."""
    one_replica = request.single or (request.auto and world == 1)
    return 1 if one_replica else max(1, world // (c.parallel.tp * c.parallel.pp))


def device_budget(c: JobConfig, device: DeviceInfo, local: int) -> float:
    """The memory one worker may plan with: cluster.device_memory_gb, else the device's
    (CPU workers share the machine's memory)."""
    if c.cluster.device_memory_gb:
        return c.cluster.device_memory_gb * GB
    return device.memory_bytes / (local if device.kind == "cpu" else 1)


def accumulation(
    c: JobConfig, dims: ParallelDims, accum: int, view: PlanInputs | None
) -> str:
    """How a layout the job set accumulates (sharded or unsharded): parallel.accumulate
    when it says; for auto, the planner's choice with both modes priced for the layout, or
    the layout's rule when the planner knows no figures."""
    mode = c.parallel.accumulate
    if mode == "auto" and dims.fsdp and accum > 1 and view is not None:
        sp = sequence_parallel(c) or dims.tp == 1
        mode = choose_accumulation(view, dims, c.parallel.ac, c.data.micro_batch, accum, sp)
    return "sharded" if dims.accumulates_sharded(mode, accum) else "unsharded"


def job_setup(c: JobConfig, dims: ParallelDims, accum: int, accumulate: str) -> Setup:
    """The configuration the job runs on `dims`, as the planner prices it: what its
    decision (job.json, the doctor's memory check) and plan.json both price."""
    sp = sequence_parallel(c) or dims.tp == 1  # without tp, nothing to split
    return Setup(dims, c.parallel.ac, c.data.micro_batch, accum, accumulate, sp)


def layout_problems(c: JobConfig, world: int, local: int, device: DeviceInfo) -> list[str]:
    """The degrees and options the runtime cannot run as given, one line each."""
    p = c.parallel
    problems = []
    if p.tp > 1 and world % p.tp:
        problems.append(
            f"parallel.tp = {p.tp} does not divide the {world} workers: choose a divisor of "
            "cluster.nproc x cluster.nodes"
        )
    elif p.tp > local and not p.allow_tp_across_nodes:
        problems.append(
            f"parallel.tp = {p.tp} exceeds the {local} workers of one machine: tensor "
            "parallelism communicates in every layer and belongs inside a machine; lower "
            "parallel.tp or set parallel.allow_tp_across_nodes = true"
        )
    request = LayoutRequest.of(p)
    if p.dp_shard and not request.may_shard:
        problems.append(
            f"parallel.dp_shard = {p.dp_shard} shards with FSDP but parallel.strategy = "
            f"'{p.strategy}': use 'fsdp', 'hsdp' or 'auto'"
        )
    elif p.dp_shard and world % (p.dp_shard * p.tp * p.pp):
        problems.append(
            f"parallel.dp_shard = {p.dp_shard} does not divide the {world} workers / "
            f"parallel.tp {p.tp}" + (f" / parallel.pp {p.pp}" if p.pp > 1 else "")
            + ": choose degrees whose product divides cluster.nproc x cluster.nodes"
        )
    if p.pp > 1 and world % (p.pp * p.tp):
        problems.append(
            f"parallel.pp x parallel.tp = {p.pp} x {p.tp} does not divide the {world} workers "
            "(pp x data-parallel x tp must be the world size): choose degrees whose product "
            "divides cluster.nproc x cluster.nodes"
        )
    if request.single and world > 1:
        problems.append(
            f"parallel.strategy = 'single' runs one worker but cluster.nproc = {world}: "
            "use --nproc 1, or ddp / fsdp"
        )
    if p.cpu_offload and device.kind != "cuda":
        problems.append(
            "parallel.cpu_offload = true moves sharded state from GPU to host memory and needs "
            f"a CUDA device; on {device.kind} the state is in host memory already: remove it"
        )
    return problems


def expert_problems(c: JobConfig, moe: MoEShape | None) -> list[str]:
    """What keeps the job's experts from splitting parallel.ep ways, and [moe] settings
    for a model without experts, one line each."""
    p, name = c.parallel, c.model.name
    if moe is None:
        problems = [
            f"parallel.ep = {p.ep} splits a Mixture-of-Experts model's experts, but "
            f"model.name = {name!r} has none: use parallel.ep = 1"
        ] if p.ep > 1 else []
        changed = sorted(lineage_moe_keys(c))
        if changed:
            problems.append(
                f"{', '.join(changed)} set, but model.name = {name!r} has no experts to "
                "balance or drop tokens for: remove them (or train a MoE model)"
            )
        return problems
    if p.ep > 1 and moe.moe.experts % p.ep:
        return [
            f"parallel.ep = {p.ep} does not divide the {moe.moe.experts} experts of model.name "
            f"= {name!r}: choose an ep that divides them"
        ]
    return []


def moe_pricing_notes(c: JobConfig, moe: MoEShape | None) -> list[str]:
    """What the planner's figures for the job's MoE model leave out (plan.inputs.
    moe_unpriced: it runs them, the planner's MoE model does not price them yet), one
    sentence; none for a dense model."""
    unpriced = [setting for setting, _ in moe_unpriced(c)] if moe is not None else []
    if not unpriced:
        return []
    return [f"{', '.join(unpriced)}: the planner does not price them for a Mixture-of-Experts "
            "model yet; its figures for this job leave them out"]


def pipeline_problems(c: JobConfig, data: JobData, accum: int) -> list[str]:
    """What keeps the job from running parallel.pp stages, one line each: a model that
    does not split (models.pipeline cuts the built-in GPT, and your own module that keeps
    its blocks as torchtitan's models do, checked on the meta device), and the schedule's
    rules."""
    p = c.parallel
    if p.pp == 1:
        return []
    where = f"parallel.pp = {p.pp}: model.name = {c.model.name!r}"
    if data.shape is not None:
        n_layer, model, cut = data.shape.n_layer, None, None
    elif data.moe is not None:
        n_layer, model, cut = data.moe.n_layer, None, None
    elif model_kind(c.model.name) == "custom":
        with torch.device("meta"):
            model = build_model(data.spec).module
        try:
            cut = module_cut(model, where)
        except ModelError as err:
            return err.problems
        n_layer = len(cut.keys)
    else:
        return [
            f"{where} cannot be cut into pipeline stages (the built-in GPT and MoE presets, "
            "hf: Llama and MoE models with model.impl = 'trainwise' and your own module with "
            "its blocks in `layers` or `blocks` can): use parallel.pp = 1"
        ]
    batch = c.data.micro_batch * accum
    microbatches = p.pp_microbatches or default_microbatches(c.data.micro_batch, accum)
    problems = schedule_problems(
        p.pp_schedule, p.pp, p.pp_virtual, n_layer, microbatches, batch, accum
    )
    if c.train.compile and p.pp_schedule in ZERO_BUBBLE:
        problems.append(
            f"train.compile = true with parallel.pp_schedule = '{p.pp_schedule}': torch's "
            "zero-bubble schedules split the backward, which compiled blocks do not support; "
            "use 1F1B or Interleaved1F1B, or train.compile = false"
        )
    if cut is not None and LayoutRequest.of(p).auto:
        # Its search prices a GPT's stages and a MoE model's (plan/moe/parallel.py).
        problems.append(
            f"{where}: parallel.strategy = 'auto' lets the planner choose around the stages, "
            "and it cannot cut your own module yet: set parallel.strategy = 'fsdp' or 'ddp' "
            "(the layout inside each stage)"
        )
    if cut is not None and not problems:  # run on the meta device, stage after stage
        try:
            batch = first_batch(data.datasets[0], 1)
        except Exception:  # noqa: BLE001 (the data checks say why; nothing to run with)
            batch = None
        collate = f" with data.collate = {c.data.collate!r}" if c.data.collate else ""
        problems = extra_inputs_problem(
            batch, where, f"data.dataset = {c.data.dataset!r}{collate}"
        ) or module_problems(model, cut, p.pp * p.pp_virtual, example_input(batch), where)
    return problems


def sequence_parallel(c: JobConfig) -> bool:
    """parallel.sequence_parallel, default on when tp > 1."""
    return c.parallel.tp > 1 and c.parallel.sequence_parallel is not False


def planner_view(
    c: JobConfig,
    w: Workload,
    world: int,
    local: int,
    device: DeviceInfo,
    device_bytes: float,
    accum: int,
) -> PlanInputs | None:
    """The planner's view of these machines (the figures `trainwise plan` uses: cluster.*
    where set, else the catalog's): what `auto` times hsdp against fsdp with, and what the
    report compares the run with (plan.json). None when the catalog knows nothing of the
    device: then `auto` does not weigh hsdp and the report has no plan to compare."""
    spec = (
        find_gpu(c.cluster.gpu)
        if c.cluster.gpu
        else device.gpu or (find_gpu("cpu") if device.kind == "cpu" else None)
    )
    if spec is None:
        return None
    try:
        return job_inputs(c, w, world, local, spec, accum, device_bytes)
    except ConfigError:  # no peak at this precision: nothing to time with
        return None


def calibrated(
    view: PlanInputs | None, cal: Calibration | None
) -> tuple[PlanInputs | None, list[str]]:
    """The planner's view with plan.calibration's measurements in place of its assumptions,
    and one sentence per replaced figure."""
    if cal is None:
        return view, []
    if view is None:
        return None, [f"plan.calibration {cal.source}: the catalog does not know this device"]
    return CalibratedModel(calibration=cal).adopt(view)


def job_plan(job: Job) -> dict[str, Any] | None:
    """The planner's figures for the job as it runs (plan.json): the strategy's record as
    `trainwise plan --json` gives it, plus the assumptions the report names when the run
    disagrees (efficiency, links, checkpoint write speed, price)."""
    inputs = job.plan_inputs
    if inputs is None:
        return None
    hw = inputs.hardware
    c = job.cfg
    # The job's own layout and knobs (its shard groups need not be one per machine).
    setup = job_setup(c, job.dims, job.grad_accum, job.accumulate)
    priced = price(inputs, setup)
    return {
        **strategy_record(priced),  # named as the planner's rows: tp2 + fsdp-full
        "layout": job.dims.describe(),
        "accumulate": job.accumulate,
        "efficiency": inputs.efficiency,
        "intra_node_gbps": hw.intra_bps / GB,
        "inter_node_gbps": hw.inter_bps / GB,
        "checkpoint_write_gbps": inputs.checkpoint_bps / GB,
        "price_per_gpu_hour": hw.price_per_gpu_hour,
        "gpu": hw.gpu,
        "checkpoint_latency_s": inputs.checkpoint_latency_s,
        "calibration": job.plan_notes,
        "figures": model_of(inputs).header(),  # calibrated from FILE, or the defaults
        "calibrated": job.calibration is not None,
        # The calibration run's own step: a miss here that it did not have is this run's.
        "calibration_source": job.calibration.source if job.calibration else None,
        "calibration_step_s": job.calibration.step_s if job.calibration else None,
        "calibration_save_s": job.calibration.save_s if job.calibration else None,
        # The experts' load imbalance priced (moe.imbalance, or a calibration's) and the
        # all-to-alls' seconds, which the report sets the run's measured ones beside.
        "moe_imbalance": inputs.workload.imbalance if job.moe is not None else None,
        "all_to_all_s": all_to_all_seconds(priced.collectives) if job.dims.ep > 1 else None,
        # The other strategies on the same workers, for the report's advice. Only beside a
        # data-parallel layout: they run more samples a step than a tensor-parallel or
        # pipelined one.
        "alternatives": [
            {"name": alt.name, "fits": alt.fits, "step_total": alt.step.total,
             "tokens_per_s": alt.tokens_per_s}
            for alt in (evaluate(inputs, n) for n in candidate_names(inputs))
            if alt.gpus == inputs.gpus and not (offloads(alt) and hw.device == "cpu")
        ] if job.dims.tp == 1 and job.dims.pp == 1 else [],
    }


def offloads(plan: StrategyPlan) -> bool:
    """Whether a planner's row offloads to the host (nothing to gain on CPU workers)."""
    return plan.setup is not None and plan.setup.dims.cpu_offload


def elastic_accum(c: JobConfig, world: int, local: int) -> tuple[int, str | None]:
    """The micro-batches each rank accumulates at this world size. An elastic job
    (--nnodes MIN:MAX) keeps the global batch of its largest size, so that a checkpoint
    resumes on fewer machines with the same samples per step: fewer ranks accumulate more.
    Every machine count of the range must divide it evenly (else the problem, one line)."""
    accum, most, fewest = c.data.grad_accum, c.cluster.nodes, c.cluster.min_nodes
    if fewest is None or fewest == most:
        return accum, None
    # The least grad_accum whose batch splits evenly over every machine count in the range.
    need = math.lcm(*(n // math.gcd(n, most) for n in range(fewest, most + 1)))
    if accum % need:
        return accum, (
            f"data.grad_accum = {accum} cannot keep the global batch on every machine count of "
            f"--nnodes {fewest}:{most}: use a multiple of {need}"
        )
    full = most * local
    return (accum * full // world if world < full and world % local == 0 else accum), None


def set_by(strategy: str, offload: bool, dims: ParallelDims) -> str:
    """A layout the job set, as its reason starts: `ddp (set by parallel.strategy)`; with
    stages or tensor parallelism the layout's name and every key that made it, `pp 2 (set by
    parallel.strategy = 'ddp', parallel.pp = 2)` (pp 2 on 2 workers leaves no ddp)."""
    how = " with cpu offload" if offload else ""
    if dims.pp == 1 and dims.tp == 1:
        return f"{strategy}{how} (set by parallel.strategy)"
    keys = [f"parallel.strategy = '{strategy}'"]
    keys += [f"parallel.{k} = {v}" for k, v in (("pp", dims.pp), ("tp", dims.tp)) if v > 1]
    return f"{dims.name}{how} (set by {', '.join(keys)})"


def decide(
    w: Workload,
    request: LayoutRequest,
    world: int,
    device_bytes: float,
    c: JobConfig,
    replicate: int,
    device_kind: str,
    accum: int,
    cluster: PlanInputs | None = None,
) -> Decision:
    """The layout the job runs and its memory, priced by the planner's model on its view
    of these machines (`cluster`; None: a device the catalog lacks, its memory only):
    the planner's chooser for auto, else the layout asked for, with its tensor
    parallelism, sequence parallelism and accumulation, as plan.json prices it."""
    inputs = cluster or unknown_device_inputs(c, w, world, accum, device_bytes, device_kind)
    if request.auto:  # the constraints `trainwise plan` reads from the same job
        return decide_auto(inputs, user_allowed(c))
    dims = request.layout(world, replicate)
    setup = job_setup(c, dims, accum, accumulation(c, dims, accum, cluster))
    est = price(inputs, setup).memory  # the function the planner's rows and search price with
    replica = replica_memory(w, world, device_kind, accum)
    strategy, offload = request.kind(replicate), request.cpu_offload
    if est.total > device_bytes:
        raise ConfigError(
            f"parallel.strategy = '{strategy}' needs {fmt_bytes(est.total)} per worker "
            f"({describe(est)}) but a device has {fmt_bytes(device_bytes)}: use 'auto', "
            "'fsdp', parallel.cpu_offload = true, or a smaller data.micro_batch"
        )
    note = dims.shard_note(c.parallel.shard)
    reason = (
        f"{set_by(strategy, offload, dims)}: {fmt_bytes(est.total)} per worker "
        f"({describe(est)}); one replica would need {fmt_bytes(replica.total)}."
        + (f" {note}." if note else "")
    )
    return Decision(
        strategy, offload, est, replica, device_bytes * (1 - c.parallel.headroom), reason,
        setup=setup,
    )
