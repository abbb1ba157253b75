"""One strategy on one cluster size: memory, step time, throughput, time and money.

Composes the single-purpose models (memory, flops, comm, cost) without adding formulas of
its own, except the step's assembly: a step is compute, plus the communication compute
cannot hide (on CPU workers, all of it: gloo's collectives run on the cores that compute),
plus the time the GPUs wait for data (the loader runs ahead in background workers, so only
what exceeds the rest of the step is waited for).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import TYPE_CHECKING

from trainwise.config.parallel_dims import PLAN_NAMES, PLAN_ROWS, ParallelDims, row_layout
from trainwise.plan.inputs import PlanInputs
from trainwise.plan.model.comm import (
    Collective,
    Layout,
    contention_seconds,
    exposed_seconds,
    layout_collectives,
    outlasting_seconds,
    regathered_share,
)
from trainwise.plan.model.compute import ADAMW_STEP, ComputeTime, fsdp_rounds
from trainwise.plan.model.cost import CheckpointPlan, Cost, checkpoint_plan, job_cost
from trainwise.plan.model.float8 import gathered_float8_params
from trainwise.plan.model.flops import (
    mfu,
    model_flops_per_token,
    model_layers,
    recompute_factor,
    selective_op_share,
)
from trainwise.plan.model.gemm import GENERATIONS
from trainwise.plan.model.lora import rank_split
from trainwise.plan.model.memory import (
    MemoryEstimate,
    Workload,
    block_params,
    checkpointed_blocks,
    fsdp_units,
)
from trainwise.plan.model.pipeline import (
    bubble_fraction,
    p2p_collective,
    p2p_exposed_seconds,
    rank_chunks,
    stage_part,
    stage_parts,
    zb_passes,
)
from trainwise.plan.model.precision import MASTER_BYTES, OPTIMIZER_STATE_BYTES
from trainwise.plan.model.selective_op import SELECTIVE_OP, recomputed_collectives
from trainwise.plan.model.setup import Setup
from trainwise.plan.model.tensor_parallel import (
    tp_collectives,
    tp_exposed_seconds,
)
from trainwise.plan.moe.comm import moe_communication

if TYPE_CHECKING:
    from trainwise.plan.model.performance import PerformanceModel

# Assumption: a GPU's share of the host cores applies foreach AdamW to 0.5 G parameters/s.
# The step is memory-bound, so the other implementations scale by their bytes a parameter
# (plan.model.compute.ADAMW_STEP, where the CPU's measured rates are compared with them).
CPU_FOREACH_ADAMW_PARAMS_PER_S = 5e8

# How the planner and the run-time `auto` rank strategies: within this share of the best,
# the simpler wins (fewer moving parts to debug); simplest first (the planner's rows).
SIMPLER_WITHIN = 0.01
SIMPLICITY = PLAN_NAMES


def cpu_optimizer_params_per_s(w: Workload) -> float:
    """Parameters a second the host's optimizer step takes (cpu offload)."""
    step = ADAMW_STEP[w.step_implementation("cpu")]
    return CPU_FOREACH_ADAMW_PARAMS_PER_S * ADAMW_STEP["foreach"].bytes_per_param / (
        step.bytes_per_param
    )


def config_keys(name: str) -> str:
    """The config that runs the plan's strategy `name`, as a user writes it."""
    kind, shard, offload = PLAN_ROWS[name]
    keys = [f"parallel.strategy = '{kind}'"]
    if shard != "full":
        keys.append(f"parallel.shard = '{shard}'")
    if offload:
        keys.append("parallel.cpu_offload = true")
    return ", ".join(keys)


@dataclass(frozen=True)
class Step:
    compute: float  # seconds of forward, backward (with recomputation) and optimizer
    comm: float  # seconds the collectives take on their links
    exposed_comm: float  # of which the step waits for
    data: float  # seconds the GPUs wait for the loader
    total: float
    bubble: float = 0.0  # seconds the pipeline's ranks idle while it fills and drains


@dataclass(frozen=True)
class StrategyPlan:
    name: str
    gpus: int
    micro_batch: int  # sequences per GPU per forward pass (at most the asked one)
    grad_accum: int  # micro-batches per optimizer step
    fits: bool
    memory: MemoryEstimate  # per GPU
    budget_bytes: float  # per GPU, after headroom
    host_memory_per_node: float
    host_fits: bool
    comm_bytes_per_step_per_gpu: float
    collectives: list[Collective]
    step: Step
    tokens_per_s: float
    mfu: float
    scaling_efficiency: float
    checkpoint: CheckpointPlan
    cost: Cost
    notes: list[str]
    setup: Setup | None = None  # the configuration priced (None: built by hand)

    @property
    def hours_to_train(self) -> float:
        return self.cost.wall_hours


def candidate_names(inputs: PlanInputs) -> list[str]:
    """The strategies worth a row, simplest first: every one, hsdp only across whole
    nodes, on one GPU only those that change its memory (none and cpu offload); or just
    the one asked for."""
    if inputs.strategy:
        return [inputs.strategy]
    whole_nodes = inputs.nodes > 1 and inputs.gpus % inputs.node_size == 0

    def worth_a_row(dims: ParallelDims) -> bool:
        if dims.cpu_offload and inputs.workload.moe is not None:
            return False  # not priced for a Mixture-of-Experts model
        if inputs.gpus == 1:
            return dims.single or dims.cpu_offload
        return whole_nodes or not dims.hybrid  # a full mesh: whole nodes replicate each other

    return [name for name in PLAN_NAMES if worth_a_row(row_layout(name))]


def layout_name(dims: ParallelDims) -> str:
    """The planner's row name of a layout: its data-parallel name, `epN + ` (experts split)
    before it, `tpN + ` before that and `ppN + ` first."""
    stages = f"pp{dims.pp} + " if dims.pp > 1 else ""
    experts = f"ep{dims.ep} + " if dims.ep > 1 else ""
    return stages + (f"tp{dims.tp} + " if dims.tp > 1 else "") + experts + dims.plan_name


def evaluate(inputs: PlanInputs, name: str) -> StrategyPlan:
    """The named data-parallel strategy `name` on inputs.gpus GPUs (`single` always on
    one), at the job's activation checkpointing and at most its micro-batch."""
    dims = ParallelDims.from_plan_name(name, inputs.gpus, inputs.gpus_per_node)
    if dims.world != inputs.gpus:  # single: one GPU whatever the cluster
        inputs = inputs.with_gpus(dims.world)
    gpus, w = inputs.gpus, inputs.workload
    # The global batch over the GPUs: each runs per_gpu samples a step, in micro-batches.
    global_batch = inputs.global_batch or w.micro_batch * inputs.grad_accum * gpus
    per_gpu = max(1.0, global_batch / gpus)
    accum = max(1, math.ceil(per_gpu / w.micro_batch - 1e-9))
    micro = max(1, math.ceil(per_gpu / accum - 1e-9))
    # parallel.accumulate when the job sets it (sharded or unsharded), else once a step
    mode = inputs.accumulate if inputs.accumulate != "auto" and dims.fsdp and accum > 1 else None
    return price(inputs, Setup(dims, w.ac, micro, accum, mode or "unsharded"), name)


@lru_cache(maxsize=1024)
def knob_workload(w: Workload, micro_batch: int, ac: str) -> Workload:
    """`w` at another micro-batch and checkpointing mode (cached: the search asks often)."""
    return replace(w, micro_batch=micro_batch, ac=ac)


def price(
    inputs: PlanInputs,
    setup: Setup,
    name: str | None = None,
    memory: MemoryEstimate | None = None,
    model: PerformanceModel | None = None,
) -> StrategyPlan:
    """Memory, step, throughput, time and cost of `setup` on inputs.gpus GPUs (`memory`:
    its estimate_memory, when the caller has it already), priced by `model` (default: the one
    the inputs adopted, plan.performance)."""
    from trainwise.plan.model.performance import model_of  # it delegates back to this module

    model = model or model_of(inputs)
    if setup.dims.pp > 1 and inputs.workload.shape is None and inputs.workload.moe is None:
        return stageless(inputs, setup, name, model)
    dims, hw = setup.dims, inputs.hardware
    w = knob_workload(inputs.workload, setup.micro_batch, setup.ac)
    gpus, tp, accum = inputs.gpus, dims.tp, setup.grad_accum
    notes: list[str] = []
    dp = dims.dp_size
    global_batch, per_rank = rank_batch(inputs, setup)
    if global_batch < dp:
        ranks = f"{dp} GPUs" if tp == 1 else f"{dp} data-parallel groups"
        notes.append(
            f"the global batch of {global_batch} sequences is smaller than {ranks}: "
            "some GPUs idle every step"
        )

    memory = memory or model.memory(inputs, setup, w)
    budget = hw.memory_bytes * (1.0 - inputs.headroom)
    host_per_node = memory.host * inputs.gpus_per_node
    host_fits = host_per_node <= hw.host_memory_bytes

    model_flops = model_flops_per_token(w.params, w.shape, w.seq_len, w.lora, w.profile, w.moe)
    timed, bubble, paced = rank_compute(model, inputs, setup, w, per_rank)
    compute = timed.seconds

    collectives, added_s, exposed = model.communication(inputs, setup, paced, compute)
    compute += added_s
    comm = sum(c.seconds for c in collectives)
    busy = compute + bubble + exposed
    data = 0.0
    if inputs.data_samples_per_s:
        data = max(0.0, per_rank / inputs.data_samples_per_s - busy)
    total = busy + data
    step = Step(compute, comm, exposed, data, total, bubble)

    tokens_per_step = global_batch * w.seq_len
    tokens_per_s = tokens_per_step / total
    utilisation = mfu(tokens_per_s, model_flops, gpus * hw.peak_flops)
    scaling = tokens_per_s / (gpus * timed.one_gpu_tokens_per_s)

    ckpt, cost = job_figures(inputs, tokens_per_step, total, exposed)
    return StrategyPlan(
        name=name or layout_name(dims),
        gpus=gpus,
        micro_batch=setup.micro_batch,
        grad_accum=accum,
        fits=memory.total <= budget and host_fits,
        memory=memory,
        budget_bytes=budget,
        host_memory_per_node=host_per_node,
        host_fits=host_fits,
        comm_bytes_per_step_per_gpu=sum(c.wire_bytes for c in collectives),
        collectives=collectives,
        step=step,
        tokens_per_s=tokens_per_s,
        mfu=utilisation,
        scaling_efficiency=scaling,
        checkpoint=ckpt,
        cost=cost,
        notes=notes,
        setup=setup,
    )


def stageless(
    inputs: PlanInputs, setup: Setup, name: str | None, model: PerformanceModel
) -> StrategyPlan:
    """A pipeline layout of a model whose blocks the planner does not see (your own
    module, priced from its parameter count): priced as the same layout without stages on
    world / pp ranks, each holding the whole model and running all of its layers, which
    bounds a stage's memory from above and takes pp times the step at the same GPU-hours.
    (A stopgap until the planner cuts such a model as the runtime does.)"""
    pp = setup.dims.pp
    plan = price(
        replace(inputs, gpus=inputs.gpus // pp), replace(setup, dims=replace(setup.dims, pp=1)),
        name, None, model,
    )
    note = (f"the planner does not cut this model into its {pp} stages: priced as every rank "
            "holding all of it (memory: an upper bound)")
    return replace(plan, name=name or layout_name(setup.dims), gpus=inputs.gpus, setup=setup,
                   notes=[*plan.notes, note])


def rank_compute(
    model: PerformanceModel, inputs: PlanInputs, setup: Setup, w: Workload, per_rank: float,
    reference: bool = True,
) -> tuple[ComputeTime, float, Workload]:
    """(one rank's compute for its samples of a step, the seconds it idles in the
    pipeline's bubble, the workload that paces the step). With pipeline stages the
    slowest of the first and last stage sets the pace (plan.model.pipeline); the bubble is
    its schedule's share of that. `reference`: with the scaling's reference (one GPU that
    only computes; else nan)."""
    dims = setup.dims
    if dims.pp == 1:
        return model.compute(inputs, w, per_rank, dims.tp, dims, reference), 0.0, w
    shape = w.shape or w.moe
    assert shape is not None
    stages = stage_parts(shape.n_layer, dims.pp, setup.virtual, setup.schedule)
    parts = (stage_part(w, *stage) for stage in stages)
    chunks = rank_chunks(dims.pp, setup.virtual, setup.schedule)
    timed = [(model.compute(inputs, sw, per_rank, dims.tp, dims, False, chunks), sw)
             for sw in parts]
    slowest, paced = max(timed, key=lambda t: t[0].seconds)
    one = math.nan  # the scaling's reference: the whole model on one GPU
    if reference:
        one = model.compute(inputs, w, per_rank, 1, None).one_gpu_tokens_per_s
    share = bubble_fraction(setup.schedule, dims.pp, setup.virtual, setup.grad_accum, passes(w))
    return ComputeTime(slowest.seconds, one), share * slowest.seconds, paced


def passes(w: Workload) -> tuple[float, float, float]:
    """A block's zero-bubble passes (zb_passes) of `w`'s model, GPT or Mixture-of-Experts."""
    return zb_passes(w.shape or w.moe, w.seq_len)


def rank_batch(inputs: PlanInputs, setup: Setup) -> tuple[int, float]:
    """(the global batch `setup` runs a step, the samples each data-parallel rank runs: at
    least one, as a rank whose share is short still runs a whole micro-batch)."""
    dp = setup.dims.dp_size
    global_batch = inputs.global_batch or setup.micro_batch * setup.grad_accum * dp
    return global_batch, max(1.0, global_batch / dp)


def job_figures(
    inputs: PlanInputs, tokens_per_step: float, step_s: float, exposed_s: float
) -> tuple[CheckpointPlan, Cost]:
    """The checkpoint plan and the job's cost when a step of `tokens_per_step` tokens takes
    `step_s` seconds, `exposed_s` of them waiting for communication."""
    w, hw = inputs.workload, inputs.hardware
    train_s = inputs.tokens / tokens_per_step * step_s
    # A checkpoint holds the trained parameters and their optimizer state (LoRA: the
    # adapters; the frozen base is the weights it was loaded from).
    size = rank_split(w.params, w.shape, w.lora)[1] * (
        MASTER_BYTES + OPTIMIZER_STATE_BYTES[w.optimizer]
    )
    ckpt = checkpoint_plan(
        size,
        inputs.checkpoint_bps,
        inputs.nodes,
        train_s,
        inputs.mtbf_hours,
        inputs.restart_s,
        inputs.checkpoint_latency_s,
    )
    cost = job_cost(inputs.gpus, hw.price_per_gpu_hour, train_s, exposed_s / step_s, ckpt)
    return ckpt, cost


def step_floor(
    inputs: PlanInputs, setup: Setup, model: PerformanceModel | None = None
) -> tuple[float, float]:
    """(the tokens a step of `setup` trains, its compute seconds): a floor under price()'s
    step, as the collectives, the host's work and the loader only add to the compute; the
    search skips pricing what cannot win by it (job_figures turns it into a floor cost)."""
    from trainwise.plan.model.performance import model_of

    model = model or model_of(inputs)
    w = knob_workload(inputs.workload, setup.micro_batch, setup.ac)
    global_batch, per_rank = rank_batch(inputs, setup)
    timed, bubble, _ = rank_compute(model, inputs, setup, w, per_rank, reference=False)
    return global_batch * w.seq_len, timed.seconds + bubble


def micro_batch_floor(
    inputs: PlanInputs, largest: Setup, most: Setup, model: PerformanceModel | None = None
) -> tuple[float, float]:
    """(the tokens a step trains, seconds) under step_floor of every pipeline setup that
    differs from `largest` only in a smaller micro-batch, `most` the one that runs the most
    micro-batches: the largest's compute (a larger micro-batch never computes longer in the
    models, plan.space) with the bubble's share at the most micro-batches (it only shrinks
    with more)."""
    from trainwise.plan.model.performance import model_of

    model = model or model_of(inputs)
    w = knob_workload(inputs.workload, largest.micro_batch, largest.ac)
    global_batch, per_rank = rank_batch(inputs, largest)
    timed, _, _ = rank_compute(model, inputs, largest, w, per_rank, reference=False)
    dims = most.dims
    share = bubble_fraction(most.schedule, dims.pp, most.virtual, most.grad_accum, passes(w))
    return global_batch * w.seq_len, timed.seconds * (1 + share)


def _communication(
    inputs: PlanInputs, setup: Setup, w: Workload, compute: float
) -> tuple[list[Collective], float, float]:
    """(the step's collectives and host copies, the seconds they add to the compute: the
    host optimizer's with cpu offload and what NCCL's SMs take from the compute they
    overlap, the seconds the step waits for them) of `setup`, whose compute is `compute`.
    A Mixture-of-Experts model's are plan.moe.comm's."""
    if w.moe is not None:
        return moe_communication(inputs, setup, w, compute)
    dims, hw, accum, tp = setup.dims, inputs.hardware, setup.grad_accum, setup.dims.tp
    layout = Layout(
        inputs.gpus, inputs.gpus_per_node, hw.intra_bps, hw.inter_bps,
        hw.nics_per_node, hw.intra_step_s, hw.inter_step_s,
    )
    # A pipeline stage's data-parallel group lies within its world/pp ranks; its FSDP
    # parameters stay gathered and its gradients unreduced until the step's last backward
    # (ParallelDims' rule and pipelining's no-sync backwards): one gather and one reduction.
    stage_layout = replace(layout, gpus=inputs.gpus // dims.pp)
    dp_accum = int(fsdp_rounds(dims, accum))
    frozen, trained = rank_split(w.params, w.shape, w.lora, tp)
    rank_params = frozen + trained
    units = fsdp_units(w)
    block, root = block_params(w, tp)
    collectives = layout_collectives(
        dims, rank_params, stage_layout, w.precision, w.reduce_dtype, dp_accum,
        setup.accumulate, units, trained,
        gathered_float8_params(w.shape, tp, w.float8, w.float8_all_gather), root,
    )
    nccl = list(collectives)  # the host copies below run on copy engines, not SMs
    host_s = 0.0
    if dims.cpu_offload:
        shard_params = rank_params / dims.dp_shard
        trained_shard = trained / dims.dp_shard  # LoRA: only the adapters have gradients
        # The shard goes to the device for each gather: every unit's in forward, the
        # blocks' resharded after it (adapters included) again in backward.
        again = regathered_share(dims, units, root) * (shard_params - root / dims.dp_shard)
        copied = accum * (shard_params + again) * MASTER_BYTES
        collectives += [
            Collective("host->device copies (offload)", copied, hw.host_bps, True),
            # The reduced gradient shard goes to the host once a step, after the
            # reduce-scatter, like a reduction.
            Collective(
                "device->host gradients (offload)", trained_shard * MASTER_BYTES, hw.host_bps
            ),
        ]
        host_s = trained_shard / cpu_optimizer_params_per_s(w)  # the step runs on the host
    busy = compute + host_s
    exposed = exposed_seconds(collectives, busy, dims, block / rank_params, dp_accum)
    if dims.pp > 1:
        p2p = p2p_collective(w, dims, layout, setup.virtual, accum, setup.sequence_parallel)
        collectives.append(p2p)
        exposed += p2p_exposed_seconds(p2p, dims.pp, setup.virtual, accum, busy)
    if hw.device == "cpu":  # gloo runs the collectives on the cores that compute: no overlap
        exposed = sum(c.seconds for c in collectives)
    n_layer = model_layers(w.shape, w.profile)
    recomputed = len(checkpointed_blocks(w.ac, n_layer)) if w.shape else 0
    if w.ac == SELECTIVE_OP and w.shape:  # the all-gathers again, not the reduce-scatters
        recomputed = recomputed_collectives(n_layer)
    tp_comm = tp_collectives(w.shape, w.seq_len, w.micro_batch, w.precision, tp, recomputed,
                             accum, layout)
    share = selective_op_share(w.shape, w.seq_len, w.lora)
    exposed += tp_exposed_seconds(tp_comm, busy, recompute_factor(w.ac, n_layer, False, share))
    everything = collectives + tp_comm
    total = sum(c.seconds for c in everything)
    hidden = 1.0 - exposed / total if total else 0.0  # the share that overlaps compute
    on_sms = sum(c.seconds for c in nccl + tp_comm) * max(0.0, hidden)
    sms = GENERATIONS[hw.generation].sms
    # Only the per-operation model prices the SMs alone: an efficiency (the override, a
    # doctor's calibration, a bare parameter count's published MFU) comes from whole steps
    # whose compute already ran beside the collectives.
    modelled = inputs.efficiency is None and (w.shape is not None or w.profile is not None)
    outlasting = outlasting_seconds(nccl, busy, dp_accum)
    slowed = contention_seconds(on_sms, hw.nccl_channels, sms, outlasting) if modelled else 0.0
    return everything, host_s + slowed, exposed
