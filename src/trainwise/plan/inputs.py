"""The planner's inputs, resolved once from a job config (the same TOML `trainwise train`
reads, plus its [plan] section) and the hardware catalog. Every figure the models use is
here with its unit; every default is named where it is set."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from trainwise.config.parallel_dims import plan_name
from trainwise.config.schema import JobConfig
from trainwise.errors import ConfigError
from trainwise.hardware.catalog import GB, TFLOP, GPUSpec, default_catalog, find_gpu
from trainwise.models.moe.shapes import MOE_PRESETS, MoEShape, moe_job_shape, moe_tp_problems
from trainwise.models.shapes import PRESETS, GPTShape, ModelProfile, job_shape, norm_impl_problem
from trainwise.objects import is_object_reference
from trainwise.plan.model.gemm import GENERATIONS, GemmTable
from trainwise.plan.model.lora import LoraPlan, lora_of, lora_problems
from trainwise.plan.model.memory import Workload

if TYPE_CHECKING:
    from trainwise.plan.model.performance import PerformanceModel

# Defaults of `trainwise plan` without --config: a Llama-2-7B pretraining step on one
# 8-GPU H100 node (Llama 2 paper: 4M-token batches = 1024 x 4096, bf16, AdamW).
PLAN_DEFAULTS = {
    "model.name": "llama-7b",
    "data.seq_len": 4096,
    "data.micro_batch": 1,
    "data.global_batch": 1024,
    "precision.dtype": "bf16",
    "optim.name": "adamw",
    "cluster.gpu": "H100-SXM",
    "cluster.nproc": 8,
    "plan.tokens": "chinchilla",
}
# Chinchilla-optimal training (Hoffmann et al., 2022): about 20 tokens per parameter.
TOKENS_PER_PARAM = 20
DEFAULT_GPU = "H100-SXM"
DEFAULT_GPUS_PER_NODE = 8
# Between nodes: one 400 Gb/s InfiniBand NDR port per GPU, as in DGX H100 (catalog link;
# cluster.inter_node_gbps and cluster.nics_per_node replace its figures).
DEFAULT_INTER_LINK = "ib-ndr"
# Host-device copies of cpu offload go over PCIe (catalog link).
HOST_LINK = "pcie4"
# Assumption: a model known only by its parameter count is sharded in 32 FSDP units (its
# blocks; Llama-2-7B has 32 layers): it sizes the gathered units and the exposed gather.
BARE_COUNT_UNITS = 32
# A device the catalog does not know has no generation to model its operations with: the
# flat compute (model FLOPs at one share of its peak), the same for every layout.
UNKNOWN_DEVICE_EFFICIENCY = 0.4
# Assumption: 256 GB of host memory per GPU (a DGX H100 has 2 TB for 8).
HOST_MEMORY_PER_GPU = 256 * GB

# The plan's names of a shape's dimensions (flags, [plan] keys, JSON) -> GPTShape's fields.
SHAPE_FIELDS = {
    "layers": "n_layer",
    "hidden": "d_model",
    "heads": "n_head",
    "kv_heads": "n_kv_head",
    "ffn": "d_ff",
    "vocab": "vocab_size",
}


@dataclass(frozen=True)
class Hardware:
    gpu: str  # catalog name, or "custom"
    memory_bytes: float  # per GPU
    peak_flops: float  # dense, at the plan's precision, per GPU
    intra_bps: float  # bytes/s per GPU per direction within a node, as NCCL reaches it
    inter_bps: float  # between nodes: per NIC
    host_bps: float  # host <-> device (cpu offload)
    host_memory_bytes: float  # per node
    price_per_gpu_hour: float  # USD
    device: str  # "cuda" or "cpu": whether the CUDA context overhead applies
    nics_per_node: int | None = None  # None: one per GPU
    intra_step_s: float = 0.0  # latency of a collective's step within a node
    inter_step_s: float = 0.0  # and across nodes
    hbm_bps: float = 2e12  # device memory bandwidth, bytes/s (catalog hbm_gbps)
    generation: str = "hopper"  # architecture: picks GEMM and attention efficiencies
    nccl_channels: int = 0  # SMs a collective within a node occupies (catalog link.channels)
    # The GPUs' sustained clock over the one the generation's rates were measured at
    # (cluster.sustained_clock_mhz): it scales the tensor cores' rates, not the memory's.
    clock_scale: float = 1.0
    # The dense fp8 peak (float8 GEMMs: plan.model.float8), per GPU; 0: none known.
    fp8_flops: float = 0.0

    @property
    def clocked_flops(self) -> float:
        """The dense peak the GEMM and attention rates are shares of, at the GPUs' clock
        (`peak_flops` stays the datasheet's: MFU is counted against it)."""
        return self.peak_flops * self.clock_scale


@dataclass(frozen=True)
class PlanInputs:
    model: str  # preset name, "custom shape" or "params"
    workload: Workload
    global_batch: int | None  # sequences per step; None: micro x accum x GPUs (grows with them)
    grad_accum: int  # micro-batches per step when the global batch is not given
    tokens: float  # to train, in total
    gpus: int
    node_size: int  # GPUs a node holds
    hardware: Hardware
    efficiency: float | None  # achieved share of peak FLOP/s; None: the per-op model
    data_samples_per_s: float | None  # per GPU; None: the loader never limits
    mtbf_hours: float  # per node
    restart_s: float
    checkpoint_bps: float  # write bandwidth per node
    headroom: float
    objective: str  # "cost" or "time"
    strategy: str | None  # plan only this one
    checkpoint_latency_s: float = 0.0  # fixed seconds of a save, whatever its size
    # Memory a worker's runtime adds beyond the modelled tensors (a calibration measures it).
    memory_overhead_bytes: float = 0.0
    accumulate: str = "auto"  # parallel.accumulate: the named rows price it when set
    # The model that prices these inputs (plan.performance; None: the analytic one).
    performance: PerformanceModel | None = None
    compile: bool = False  # train.compile: blocks run as fused graphs (plan.compute)
    gemm_table: GemmTable | None = None  # measured GEMM rates (a calibration), else modelled
    notes: tuple[str, ...] = ()  # what the planner assumed of the model (the plan says them)

    @property
    def gpus_per_node(self) -> int:
        """GPUs used on each node: every node runs as many (torchrun starts the same count
        on each), the most that divide the GPUs; a job smaller than a node uses part of one."""
        return max(d for d in range(1, min(self.node_size, self.gpus) + 1) if self.gpus % d == 0)

    @property
    def nodes(self) -> int:
        return -(-self.gpus // self.gpus_per_node)

    def with_gpus(self, gpus: int) -> PlanInputs:
        return replace(self, gpus=gpus)


def resolve_inputs(
    cfg: JobConfig, profile: ModelProfile | None = None, moe: MoEShape | None = None
) -> PlanInputs:
    """PlanInputs from a validated job config; combinations the schema cannot judge alone
    raise ConfigError (one line each). `profile`: the model read from its module
    (models.profile.profile_model), which prices it in place of model.name: as its GPT
    shape when it has one, else by its blocks, their GEMMs and what its sample measured.
    `moe`: a Mixture-of-Experts model's shape read from an hf: directory (a MoE preset's is
    the preset's)."""
    p = cfg.plan
    notes: tuple[str, ...] = ()
    if moe is not None or cfg.model.name in MOE_PRESETS:
        params, moe, model = _moe_model(cfg, moe)
        shape = None
    elif profile is not None:
        params, shape, model = _profiled(cfg, profile)
        notes = (*profile.notes, *_unmeasured(cfg, profile))
    else:
        params, shape, model = _model(cfg)
    if moe is None and cfg.parallel.ep > 1:
        raise ConfigError(
            f"parallel.ep = {cfg.parallel.ep} splits a Mixture-of-Experts model's experts, "
            f"but model {model!r} has none: use parallel.ep = 1"
        )
    lora = lora_plan(cfg)
    if lora is not None and (problems := lora_problems(shape, lora)):
        raise ConfigError(problems)
    if (problem := _norm_problem(cfg, shape, model)) is not None:
        raise ConfigError(problem)
    if (problem := _float8_problem(cfg, shape, model)) is not None:
        raise ConfigError(problem)
    gpu_name = cfg.cluster.gpu or ("cpu" if cfg.cluster.device == "cpu" else DEFAULT_GPU)
    spec = find_gpu(gpu_name)
    assert spec is not None  # the schema checked the name
    per_node = cfg.cluster.nproc or DEFAULT_GPUS_PER_NODE
    gpus = p.gpus or per_node * cfg.cluster.nodes
    hardware = resolve_hardware(cfg, spec, per_node)
    micro = cfg.data.micro_batch
    global_batch = cfg.data.global_batch
    units = BARE_COUNT_UNITS if shape is None and moe is None else None
    workload = config_workload(cfg, params, shape, units=units, profile=profile, moe=moe)
    tokens = p.tokens
    if tokens == "chinchilla":
        tokens = TOKENS_PER_PARAM * params
    elif tokens is None:  # what `trainwise train` would run
        batch = global_batch or micro * cfg.data.grad_accum * gpus
        tokens = cfg.train.steps * batch * workload.seq_len
    return PlanInputs(
        model=model,
        workload=workload,
        global_batch=global_batch,
        grad_accum=cfg.data.grad_accum,
        tokens=float(tokens),
        gpus=gpus,
        node_size=per_node,
        hardware=hardware,
        efficiency=p.efficiency,
        data_samples_per_s=p.data_samples_per_s,
        mtbf_hours=cfg.cluster.mtbf_hours,
        restart_s=cfg.cluster.restart_min * 60.0,
        checkpoint_bps=cfg.checkpoint.write_gbps * GB,
        checkpoint_latency_s=cfg.checkpoint.save_latency_s,
        headroom=cfg.parallel.headroom,
        objective=p.objective,
        strategy=plan_name(p.strategy, cfg.parallel.shard, cfg.parallel.cpu_offload)
        if p.strategy
        else None,
        accumulate=cfg.parallel.accumulate,
        compile=cfg.train.compile,
        notes=notes,
    )


def config_workload(
    cfg: JobConfig, params: float, shape: GPTShape | None, units: int | None = None,
    profile: ModelProfile | None = None, moe: MoEShape | None = None,
) -> Workload:
    """The workload a job's config describes: the model's size and shape with the config's
    sequence, micro-batch, precision, optimizer, checkpointing, gradient reduction and
    LoRA. With a `profile` (the module read by models.profile), its shape when it has
    one; else its blocks as the FSDP units and its tokens a sample. A Mixture-of-Experts
    model is its `moe` shape, with the job's moe.imbalance. One definition for `trainwise
    plan` and the runtime's decision (run/job/resolve.py)."""
    seq = cfg.data.seq_len
    lora = lora_plan(cfg)
    if profile is not None:
        # The planner's LoRA names trainwise's GPT layers: another module's adapters are
        # not placed on its shape (every parameter counts as trained, as before).
        shape = shape or (profile.shape if lora is None or profile.stages else None)
        units = max(1, profile.blocks)
        seq = seq if shape is not None else profile.tokens
    return Workload(
        params=params,
        shape=shape,
        seq_len=seq,
        micro_batch=cfg.data.micro_batch,
        precision=cfg.precision.dtype,
        optimizer=cfg.optim.name,
        ac=cfg.parallel.ac,
        reduce_dtype=cfg.precision.reduce_dtype,
        units=units,
        lora=lora,
        profile=profile,
        moe=moe,
        imbalance=cfg.moe.imbalance if moe is not None else 1.0,
        loss=cfg.plan.loss_kernel,
        norm_kernel=cfg.model.norm_impl,
        implementation=cfg.optim.implementation,
        attention=cfg.plan.attention_kernel,
        routing=cfg.plan.routing_kernel,
        float8=cfg.precision.float8,
        float8_all_gather=cfg.precision.float8_all_gather,
    )


def lora_plan(cfg: JobConfig) -> LoraPlan | None:
    """The planner's view of the job's [lora] section (None: LoRA is off)."""
    lo = cfg.lora
    return lora_of(lo.rank, lo.targets, lo.dropout, lo.train_embeddings, lo.train_head)


def resolve_hardware(
    cfg: JobConfig, spec: GPUSpec, per_node: int, memory: float | None = None
) -> Hardware:
    """The cluster's figures: the config's where it gives them (cluster.*), else `spec`'s
    from the catalog and the defaults above. `memory`: bytes per GPU when known better than
    the catalog (a detected device). No peak at the precision raises ConfigError."""
    precision = cfg.precision.dtype
    peak = cfg.cluster.gpu_tflops * TFLOP if cfg.cluster.gpu_tflops else spec.peak(precision)
    if peak is None:
        raise ConfigError(
            f"precision.dtype = '{precision}': the catalog has no {precision} peak for "
            f"{spec.name}; choose another precision or set cluster.gpu_tflops (--gpu-tflops)"
        )
    fp8 = float8_peak(cfg, spec, peak)
    if cfg.cluster.device_memory_gb:
        memory = cfg.cluster.device_memory_gb * GB
    elif memory is None:
        memory = spec.memory_bytes
    if memory == 0:  # the catalog's cpu entry: this machine's RAM
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    catalog = default_catalog()
    # A GPU without an intra-node link in the catalog talks to its peers over PCIe.
    intra_link = spec.intra_node or catalog.links[HOST_LINK]
    inter_link = catalog.links[DEFAULT_INTER_LINK]
    c = cfg.cluster
    custom = c.gpu_tflops or c.device_memory_gb or c.hbm_gbps or c.sustained_clock_mhz
    return Hardware(
        gpu=spec.name if not custom else f"{spec.name} (custom figures)",
        memory_bytes=float(memory),
        peak_flops=float(peak),
        intra_bps=(c.intra_node_gbps * GB if c.intra_node_gbps else intra_link.nccl_bytes_per_s),
        inter_bps=(c.inter_node_gbps * GB if c.inter_node_gbps else inter_link.nccl_bytes_per_s),
        nics_per_node=c.nics_per_node or inter_link.nics_per_node,
        intra_step_s=intra_link.step_s,
        inter_step_s=inter_link.step_s,
        host_bps=catalog.links[HOST_LINK].bytes_per_s,
        host_memory_bytes=(
            c.host_memory_gb * GB if c.host_memory_gb else HOST_MEMORY_PER_GPU * per_node
        ),
        price_per_gpu_hour=(
            cfg.cost.price_per_gpu_hour
            if cfg.cost.price_per_gpu_hour is not None
            else spec.price_per_hour
        ),
        device="cpu" if spec.name == "cpu" else "cuda",
        hbm_bps=c.hbm_gbps * GB if c.hbm_gbps else spec.hbm_bytes_per_s,
        generation=spec.generation,
        nccl_channels=intra_link.channels,
        clock_scale=clock_scale(c.sustained_clock_mhz, spec),
        fp8_flops=fp8,
    )


def float8_peak(cfg: JobConfig, spec: GPUSpec, peak: float) -> float:
    """The dense fp8 peak float8 training's GEMMs run at: the catalog's, scaled as the
    job's peak is when cluster.gpu_tflops replaces the catalog's (the same clock drives both
    tensor-core rates); 0 without float8. Float8 on a GPU without an fp8 peak raises
    ConfigError."""
    if cfg.precision.float8 == "none":
        return 0.0
    fp8, own = spec.peak("fp8"), spec.peak(cfg.precision.dtype)
    if fp8 is None or own is None:
        raise ConfigError(
            f"precision.float8 = '{cfg.precision.float8}': the catalog has no fp8 peak for "
            f"{spec.name} (float8 tensor cores: Ada, Hopper, Blackwell, MI300X); set "
            "precision.float8 = 'none'"
        )
    return fp8 * peak / own


def clock_scale(clock_mhz: float | None, spec: GPUSpec) -> float:
    """The GPUs' sustained clock (cluster.sustained_clock_mhz) over the clock the
    generation's GEMM rates were measured at (plan.model.gemm, Generation.clock_mhz): a
    tensor core does the same work a cycle, so its rate follows the clock (the datasheet's
    peak is SMs x FLOPs a cycle x clock). 1 when not given; a generation without a
    measured clock raises ConfigError."""
    if clock_mhz is None:
        return 1.0
    reference = GENERATIONS[spec.generation].clock_mhz
    if not reference:
        raise ConfigError(
            f"cluster.sustained_clock_mhz = {clock_mhz:g}: no clock is known for the "
            f"{spec.generation} rates of {spec.name}; give cluster.gpu_tflops (its peak at "
            "your clock) instead"
        )
    return clock_mhz / reference


def job_tokens(cfg: JobConfig, workload: Workload, gpus: int, grad_accum: int) -> int:
    """The tokens a job trains: steps x micro-batch x accumulation x the ranks that read
    different samples (a tensor-parallel group reads the same) x sequence length."""
    dp = gpus // cfg.parallel.tp if gpus % cfg.parallel.tp == 0 else gpus
    return cfg.train.steps * workload.micro_batch * grad_accum * dp * workload.seq_len


def job_inputs(
    cfg: JobConfig,
    workload: Workload,
    gpus: int,
    per_node: int,
    spec: GPUSpec,
    grad_accum: int,
    memory: float | None = None,
) -> PlanInputs:
    """The planner's view of a job about to run: `workload` on `gpus` workers, `per_node` of
    them on each machine, with the same hardware figures `trainwise plan` would use. What
    the run-time `auto` times strategies with."""
    tokens = job_tokens(cfg, workload, gpus, grad_accum)
    return PlanInputs(
        model="job",
        workload=workload,
        global_batch=None,
        grad_accum=grad_accum,
        tokens=float(tokens),
        gpus=gpus,
        node_size=per_node,
        hardware=resolve_hardware(cfg, spec, per_node, memory),
        efficiency=cfg.plan.efficiency,
        data_samples_per_s=None,
        mtbf_hours=cfg.cluster.mtbf_hours,
        restart_s=cfg.cluster.restart_min * 60.0,
        checkpoint_bps=cfg.checkpoint.write_gbps * GB,
        checkpoint_latency_s=cfg.checkpoint.save_latency_s,
        headroom=cfg.parallel.headroom,
        objective="time",
        strategy=None,
        compile=cfg.train.compile,
    )


def unknown_device_inputs(
    cfg: JobConfig, workload: Workload, gpus: int, grad_accum: int, memory: float, device: str
) -> PlanInputs:
    """The planner's view of a job on a device the catalog does not know: its memory only.
    The links are taken as free and the GPU-hour as costing nothing, so every layout that
    fits takes the same time and the search's rule (the simplest within 1 % of the best)
    picks the simplest that fits."""
    free = math.inf
    hardware = Hardware(
        gpu="unknown", memory_bytes=memory, peak_flops=cfg.cluster.gpu_tflops * TFLOP
        if cfg.cluster.gpu_tflops else TFLOP, intra_bps=free, inter_bps=free,
        host_bps=free, host_memory_bytes=free, price_per_gpu_hour=0.0, device=device,
    )
    tokens = job_tokens(cfg, workload, gpus, grad_accum)
    return PlanInputs(
        model="job", workload=workload, global_batch=None, grad_accum=grad_accum,
        tokens=float(tokens), gpus=gpus, node_size=gpus, hardware=hardware,
        efficiency=cfg.plan.efficiency or UNKNOWN_DEVICE_EFFICIENCY, data_samples_per_s=None,
        mtbf_hours=cfg.cluster.mtbf_hours, restart_s=cfg.cluster.restart_min * 60.0,
        checkpoint_bps=cfg.checkpoint.write_gbps * GB, headroom=cfg.parallel.headroom,
        objective="time", strategy=None, checkpoint_latency_s=cfg.checkpoint.save_latency_s,
        compile=cfg.train.compile,
    )


def _model(cfg: JobConfig) -> tuple[int, GPTShape | None, str]:
    p = cfg.plan
    dims = {field: getattr(p, key) for key, field in SHAPE_FIELDS.items()}
    given = {k: v for k, v in dims.items() if v is not None}
    if p.params is not None:
        if given:
            raise ConfigError(
                "plan.params and a shape (plan.layers, plan.hidden, ...) were both given: "
                "give one (a bare count plans model states only; a shape adds activations)"
            )
        return p.params, None, "params"
    name, seq = cfg.model.name, cfg.data.seq_len
    if name in PRESETS:
        shape = job_shape(name, cfg.model.vocab_size, seq)  # the model training builds
    elif given:
        # A Llama-style block; the given dimensions replace its own.
        shape = job_shape("llama-7b", seq_len=seq)
    else:
        raise ConfigError(
            f"model.name = '{name}': the planner sizes presets ({', '.join(PRESETS)}), a bare "
            "parameter count (--params) or a shape (--layers --hidden --heads ...); "
            "give one of those"
        )
    if given:
        if "n_head" in given and "n_kv_head" not in given:
            given["n_kv_head"] = given["n_head"]
        if "d_model" in given and "d_ff" not in given:
            given["d_ff"] = (
                _swiglu_ffn(given["d_model"]) if shape.mlp == "swiglu" else 4 * given["d_model"]
            )
        shape = replace(shape, **given)  # GPTShape checks divisibility (ModelError, exit 2)
        name = "custom shape"
    return shape.num_params(), shape, name


def _moe_model(cfg: JobConfig, shape: MoEShape | None = None) -> tuple[int, MoEShape, str]:
    """(parameters, shape, name) of a Mixture-of-Experts model as the job builds it: a
    preset with the job's vocabulary and sequence, or `shape` (read from its directory). A
    shape's flags or a bare count beside it are refused, and so are the layouts and
    settings the planner does not price for one (one line each)."""
    p, name = cfg.plan, cfg.model.name
    given = [f"plan.{key}" for key in ("params", *SHAPE_FIELDS) if getattr(p, key) is not None]
    if given:
        raise ConfigError(
            f"model.name = '{name}' (a Mixture-of-Experts model) was given with "
            f"{', '.join(given)}: drop them (the model is its shape)"
        )
    shape = shape or moe_job_shape(name, cfg.model.vocab_size, cfg.data.seq_len)
    problems = moe_problems(cfg, shape)
    if problems:
        raise ConfigError(problems)
    return shape.num_params(), shape, name


def moe_unpriced(cfg: JobConfig) -> list[tuple[str, str]]:
    """The job's settings the planner's MoE model leaves out, each as (`key = value`, the
    fix): it prices data, expert and tensor parallelism and pipeline stages, not LoRA or
    CPU offload of a MoE model yet. `trainwise plan` refuses them (moe_problems); the
    runtime, which runs them, prices the job without them and says so."""
    par = cfg.parallel
    out = []
    if cfg.lora.rank > 0:
        out.append((f"lora.rank = {cfg.lora.rank}", "use lora.rank = 0"))
    if par.cpu_offload:
        out.append(("parallel.cpu_offload = true", "remove it"))
    return out


def moe_problems(cfg: JobConfig, shape: MoEShape) -> list[str]:
    """What the planner cannot price for the MoE model `shape`, one line each: an ep that
    does not divide its experts, a tp that does not split it (the runtime's rule,
    models.moe.shapes.moe_tp_problems), and what moe_unpriced names."""
    par, name = cfg.parallel, cfg.model.name
    out = []
    if shape.moe.experts % par.ep:
        out.append(
            f"parallel.ep = {par.ep} does not divide the {shape.moe.experts} experts of "
            f"{name}: choose a divisor of them"
        )
    if par.tp > 1:
        out += moe_tp_problems(shape, par.tp, cfg.data.seq_len, par.sequence_parallel is not False)
    out += [f"{setting}: the planner does not price it for {name} (Mixture-of-Experts) yet; "
            f"{fix}" for setting, fix in moe_unpriced(cfg)]
    return out


def profiled(cfg: JobConfig) -> bool:
    """Whether the planner reads the job's model from its module (models.profile): an
    import path "pkg.mod:factory", an object by value or "hf:DIR", with no bare count or
    shape given."""
    p, name = cfg.plan, cfg.model.name
    if p.params is not None or any(getattr(p, key) is not None for key in SHAPE_FIELDS):
        return False
    return name.startswith("hf:") or is_object_reference(name)


def _profiled(cfg: JobConfig, profile: ModelProfile) -> tuple[int, GPTShape | None, str]:
    """(parameters, shape or None, name) of a model read from its module."""
    p = cfg.plan
    given = [f"plan.{key}" for key in ("params", *SHAPE_FIELDS) if getattr(p, key) is not None]
    if given:
        raise ConfigError(
            f"model {profile.source} was given with {', '.join(given)}: give one (the "
            "module is priced from itself; drop the bare count or the shape)"
        )
    if lora_plan(cfg) is not None and not profile.stages:
        raise ConfigError(
            f"lora.rank = {cfg.lora.rank} with model {profile.source}: the planner places "
            "adapters on trainwise's GPT layers only; plan it without [lora] (lora.rank = 0)"
        )
    shape = profile.shape
    if shape is not None and shape.pos == "rope":  # positions cost nothing: the job's
        shape = replace(shape, max_seq_len=cfg.data.seq_len)
    return profile.params, shape, profile.source


def _unmeasured(cfg: JobConfig, profile: ModelProfile) -> tuple[str, ...]:
    """Why a profile's measured activations do not count for this job: its sample ran at
    another precision or checkpointing (the one line saying so), else nothing."""
    run, job = profile.run, (cfg.precision.dtype, cfg.parallel.ac)
    if profile.shape is not None or run is None or (run.precision, run.ac) == job:
        return ()
    return (
        f"activations are not counted: model {profile.source} was measured at "
        f"{run.precision} with ac {run.ac}, the job runs {job[0]} with ac {job[1]}; "
        "profile it at the job's (profile_model(..., precision=, ac=))",
    )


def _norm_problem(cfg: JobConfig, shape: GPTShape | None, model: str) -> str | None:
    """Why model.norm_impl cannot be priced for this model (the runtime refuses it too):
    the composite chain is trainwise's GPT's RMSNorm; None when it can."""
    if cfg.model.norm_impl == "fused":
        return None
    if shape is None:
        return (
            f"model.norm_impl = {cfg.model.norm_impl!r} applies to trainwise's GPT (a preset "
            f"or a shape); {model} runs its own norms: use model.norm_impl = 'fused'"
        )
    return norm_impl_problem(shape, cfg.model.norm_impl)


def _float8_problem(cfg: JobConfig, shape: GPTShape | None, model: str) -> str | None:
    """Why precision.float8 cannot be priced for this job: the planner prices float8 on
    trainwise's GPT's block Linears (a preset or a shape), without LoRA; None when it can."""
    f8 = cfg.precision.float8
    if f8 == "none":
        return None
    if shape is None:
        return (
            f"precision.float8 = '{f8}': the planner prices float8 on trainwise's GPT (a "
            f"preset or a shape); {model} is not one: use precision.float8 = 'none'"
        )
    if cfg.lora.rank:
        return (
            f"precision.float8 = '{f8}' with lora.rank = {cfg.lora.rank}: the planner prices "
            "float8 for full training; use precision.float8 = 'none' or lora.rank = 0"
        )
    return None


def _swiglu_ffn(d_model: int) -> int:
    """Llama's rule: 2/3 of 4d rounded up to a multiple of 256 (Touvron et al., 2023)."""
    return 256 * math.ceil(8 * d_model / 3 / 256)
