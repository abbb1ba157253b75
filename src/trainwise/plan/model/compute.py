"""The compute seconds of one training step on one GPU: the forward, the backward, any
recomputation and the optimizer step of the samples a data-parallel rank runs, on one of
`tp` tensor-parallel ranks. The one place the planner turns work into seconds.

A per-operation model of trainwise's GPT (models.gpt), one micro-batch of T tokens:
- the GEMMs of a block and of the head by shape, forward (T, out, in) and backward (the
  input gradient (T, in, out) and the weight gradient (out, in, T)), the projections'
  output or input width divided by `tp` as Megatron-style TP splits them, each priced by
  plan.gemm (shape- and generation-dependent, or a measured GemmTable);
- attention as SDPA's flash kernel: causal, 2·T·s·d FLOPs forward and 2.5 times that
  backward (FlashAttention-2, section 3: five matmuls backward for two forward);
- the memory-bound work as bytes over the device's memory bandwidth (MEMORY_SHARE of the
  datasheet's): norms, residual adds, rotary, the MLP's activation, autocast's weight
  casts, the loss over the vocabulary, the optimizer step, FSDP's copies;
- the host: every operation the eager runtime dispatches costs EAGER_OP_S of CPU time;
  under `train.compile` a block runs as a few fused kernels. The GPU runs asynchronously
  behind the host, so a step takes the longer of the two (on a CPU device, which computes
  on the same cores, their sum), unless the host waits for the device: work that ends in
  a host sync (Work.synced: expert parallelism's, plan.moe.compute) is priced stretch by
  stretch (work_seconds).
Activation checkpointing adds the forward of each checkpointed block again (full: every
block; selective: every other one, as models.checkpointing wraps them); selective-op adds
every block's elementwise work and the matmuls its policy did not keep
(plan.model.selective_op), not attention.
Float8 training (precision.float8) runs the block Linears' GEMMs in float8 and adds their
casts as memory-bound work (plan.model.float8); the head and attention stay 16-bit.

A model read from its module (models.profile) without a GPT shape is priced the same way
from what the profile holds: its Linears' GEMMs by shape, its other matmuls' FLOPs, its
other operations' bytes and the operations it dispatches (_profiled_micro_batch).

`plan.efficiency`, when the user sets it, overrides the model: model FLOPs x recomputation
at that share of the peak. A model known only by its parameter count is priced as 6N FLOPs
a token at BARE_EFFICIENCY.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING

from trainwise.config.parallel_dims import ParallelDims
from trainwise.models.shapes import GPTShape, LinearShape, ModelProfile
from trainwise.plan.inputs import Hardware, PlanInputs
from trainwise.plan.model.comm import regathered_share
from trainwise.plan.model.float8 import (
    Float8,
    cast_bytes,
    cast_ops,
    float8_linears,
    float8_of,
    gathered_float8_params,
)
from trainwise.plan.model.flops import (
    head_flops_per_token,
    model_flops_per_token,
    model_layers,
    recompute_factor,
    selective_op_share,
)
from trainwise.plan.model.gemm import (
    FUSED_ATTENTION_SHARE,
    GENERATIONS,
    GemmTable,
    attention_seconds,
    float8_generation,
    gemm_seconds,
    slowest_pace,
)
from trainwise.plan.model.lora import (
    LoraPlan,
    block_linears,
    rank_split,
    targeted,
    trained_matmul_params,
)
from trainwise.plan.model.memory import Workload, block_params, checkpointed_blocks, fsdp_units
from trainwise.plan.model.precision import BYTES, FLOAT8_BYTES, MASTER_BYTES
from trainwise.plan.model.selective_op import SELECTIVE_OP, kept, recomputed_matmuls

if TYPE_CHECKING:
    from trainwise.plan.estimate import StrategyPlan

# A bare parameter count has no shape to price: the former single efficiency (Llama 3
# reports 38-43 % MFU on H100; Dubey et al., 2024, Table 4).
BARE_EFFICIENCY = 0.4
# Assumption: elementwise kernels stream at 80 % of the datasheet's memory bandwidth
# (STREAM-like copies reach 80-90 % on HBM parts).
MEMORY_SHARE = 0.8
# CPU time eager PyTorch spends dispatching one operation (Python, autograd, the
# dispatcher, the kernel launch): 5-25 us ("From PyTorch op to kernel launch", jiahuanglin,
# gpu_kernel_serving lesson 18); 20 us with nn.Module calls around them (an assumption).
EAGER_OP_S = 20e-6
# A compiled graph launches its kernels from generated code: the driver's 1-3 us and a
# thin wrapper (assumption: 5 us), FUSED_KERNELS_PER_BLOCK besides the GEMMs and attention.
COMPILED_OP_S = 5e-6
FUSED_KERNELS_PER_BLOCK = 6
# Assumption: Inductor fuses each block's elementwise chains (norm + cast, activation +
# product, rotary), so they move half the bytes eager's separate kernels move.
COMPILED_MEMORY_SHARE = 0.5
# Autograd runs about two kernels per forward operation (a linear: the input and weight
# gradients; an elementwise op: its gradient and the accumulation): an assumption.
BACKWARD_OPS_PER_FORWARD_OP = 2
# Operations of the model outside its blocks, per micro-batch forward (embedding, final
# norm, head, the loss's log-softmax, gather and mean, their casts) and per step outside
# the optimizer's own (gradient clipping's norm and scale, zero_grad, the loss read).
HEAD_FORWARD_OPS = 10
STEP_OPS = 15
# FSDP2 handles each parameter in Python on every unshard, reshard and gradient reduction
# (views into the gathered buffer, version counters, the sharded gradient's DTensor):
# an assumption of 20 operations per parameter tensor per micro-batch.
FSDP_OPS_PER_PARAM = 20
# Elementwise passes of a block's forward, in activation widths read or written per token
# (counted from models.gpt.Block): rotary on q and k (chunks, four products, two sums, a
# concatenation), the MLP's activation (silu, product: 5 widths; gelu: 2).
ROTARY_PASSES = 8
# A composite RMSNorm (Workload.norm_kernel) runs, per element, in eager PyTorch: the
# upcast x.float() (read the input, write fp32), pow(2) (read and write fp32), mean (read
# fp32), x * rsqrt (read and write fp32), type_as (read fp32, write the input's dtype) and
# the weight's product (read and write that dtype): torchtitan's RMSNorm
# (torchtitan/models/norms.py at 9dec370, the commit of its Dec 2024 benchmarks), and
# aten's rms_norm before torch 2.9 added a fused CUDA kernel (aten._fused_rms_norm; the
# pytorch/pytorch #153666 benchmark: the fused kernel ~9x faster than the chain).
COMPOSITE_NORM_OPS = 6
@dataclass(frozen=True)
class StepCost:
    """What one implementation of torch.optim.AdamW's step (optim.implementation) costs:
    fp32 bytes read and written a parameter, host operations a step and a tensor."""

    bytes_per_param: int
    ops: int
    ops_per_tensor: int = 0


# torch.optim.AdamW's step (torch/optim/adam.py, torch 2.13), per implementation:
# - foreach (_multi_tensor_adam, torch's default on CUDA): eight passes over whole lists,
#   each reading and writing: decoupled weight decay params *= (8 bytes), lerp_ of the
#   first moment toward the gradient (12), the second moment *= beta2 (8), addcmul_ of the
#   gradient squared (12), sqrt into a temporary (8), its div_ (8) and add_ of eps (8),
#   addcdiv_ into the parameter (16): 80 bytes a parameter; ~15 foreach operations.
# - for-loop (_single_tensor_adam): the same passes dispatched per parameter tensor: the
#   step count, weight decay, lerp_, mul_ and addcmul_, sqrt, div and add_ of eps, addcdiv_:
#   9 operations a tensor, the same bytes.
# - fused (_fused_adam, calling torch._fused_adamw_: one multi-tensor kernel): reads the
#   parameter, gradient and both moments once and writes the parameter and the moments:
#   28 bytes; the step counts' foreach add and the kernel: 2 operations.
# bench/optimizer_step.py times the three on a CPU: fused ran 3.0-3.2x foreach's rate on
# the tiny model (cache-resident) and 5.4-5.9x on small and gpt2-124m, where the bytes
# say 80 / 28 = 2.9x (CPU foreach pays for its temporaries beyond their bytes). No GPU
# figure is measured here: a GPU's step is priced by its bytes alone.
ADAMW_STEP = {
    "foreach": StepCost(80, 15),
    "for-loop": StepCost(80, 0, 9),
    "fused": StepCost(28, 2),
}
# Clipping (a foreach norm, then scale) reads the gradient once and scales it in place.
CLIP_BYTES_PER_PARAM = 12

# Selective-op's policy runs as a Python TorchDispatchMode around every operation of a
# checkpointed block, in its forward and in its recomputation (torch.utils.checkpoint's
# _CachingTorchDispatchMode and _CachedTorchDispatchMode): an assumption, one more eager
# operation's host time for each.
SAC_MODE_OPS = 1
# Operations one LoRA adapter dispatches forward (models.lora's LoRALinear: dropout, lora_A,
# lora_B, the scaling and the sum): an assumption, as for the block's operations.
ADAPTER_OPS = 5


@dataclass(frozen=True)
class ComputeTime:
    """`seconds`: one rank's compute for its samples of a step; `one_gpu_tokens_per_s`:
    what one GPU that only computes (no TP, no communication) achieves on this workload,
    the reference of the scaling efficiency."""

    seconds: float
    one_gpu_tokens_per_s: float


@dataclass(frozen=True)
class Synced:
    """`count` runs of a unit of work, each of `device_s` seconds and `host_ops`
    operations, that end in a host sync (the host waits until the device has run all it
    queued): runs one after another form chains (work_seconds)."""

    device_s: float
    host_ops: float
    count: float


@dataclass(frozen=True)
class Work:
    """Seconds on the device and operations the host dispatches; `synced`: the stretches
    of them that end in a host sync (work_seconds prices them)."""

    device_s: float = 0.0
    host_ops: float = 0.0
    synced: tuple[Synced, ...] = ()

    def __add__(self, other: Work) -> Work:
        return Work(self.device_s + other.device_s, self.host_ops + other.host_ops,
                    self.synced + other.synced)

    def times(self, k: float) -> Work:
        synced = tuple(Synced(s.device_s, s.host_ops, s.count * k) for s in self.synced)
        return Work(self.device_s * k, self.host_ops * k, synced)


def synced_chain(unit: Work, syncs: float) -> Work:
    """`syncs` runs of `unit` one after another, each ending in a host sync."""
    assert not unit.synced, "a run's unit has no sync of its own"
    return Work(unit.device_s * syncs, unit.host_ops * syncs,
                (Synced(unit.device_s, unit.host_ops, syncs),))


def work_seconds(work: Work, op_s: float, pace: float, chains: float = 1.0) -> float:
    """Seconds of `work` on a GPU whose host dispatches an operation in `op_s` and whose
    device runs at `pace` of its clock. The host runs ahead of the device, queuing
    kernels, so work takes the longer of the two, but a host sync drains the queue: the
    work between two syncs takes the longer of its own two, and such stretches add.
    Each of work.synced's runs falls into `chains` chains (a step's micro-batches, or
    the pipeline chunks of each): in a chain the work between two syncs is one run's,
    and its last run joins the work that follows the chain (the host runs ahead of the
    device again until the next chain's first sync)."""
    if not work.synced:
        return max(work.device_s / pace, work.host_ops * op_s)
    closed = [(max(0.0, s.count - chains), s) for s in work.synced]
    closed_s = sum(n * max(s.device_s / pace, s.host_ops * op_s) for n, s in closed)
    device = work.device_s - sum(n * s.device_s for n, s in closed)
    host = work.host_ops - sum(n * s.host_ops for n, s in closed)
    return closed_s + max(device / pace, host * op_s)


def compute_time(
    inputs: PlanInputs,
    w: Workload,
    samples: float,
    tp: int,
    dims: ParallelDims | None = None,
    reference: bool = True,
    chunks: int = 1,
) -> ComputeTime:
    """Compute of `samples` sequences of workload `w` (at its micro-batch and ac) on one of
    `tp` tensor-parallel ranks, in layout `dims` (None: one GPU alone); `reference`: with
    what one GPU alone achieves (else nan: a caller that needs only the seconds);
    `chunks`: the pipeline stages a stage's blocks form (each runs its forward apart)."""
    if inputs.efficiency is not None or (w.shape is None and w.profile is None and w.moe is None):
        return _flat(inputs, w, samples, tp)
    step = _step_seconds(inputs, w, samples, tp, dims, chunks)
    if not reference:
        return ComputeTime(step, math.nan)
    one = step if tp == 1 and dims is None else _step_seconds(inputs, w, samples, 1, None)
    return ComputeTime(step, samples * w.seq_len / one)


def achieved_share(inputs: PlanInputs, plan: StrategyPlan, compute_s: float) -> float:
    """The share of the peak that `compute_s` seconds of `plan`'s compute (one rank's step)
    achieve on its model FLOPs x recomputation: what a measured step calibrates as the
    `plan.efficiency` override (the flat model of _flat, run backwards)."""
    setup = plan.setup
    assert setup is not None
    w = inputs.workload
    n_layer = model_layers(w.shape, w.profile, w.moe)
    hw_flops = model_flops_per_token(
        w.params, w.shape, w.seq_len, w.lora, w.profile, w.moe
    ) * recompute_factor(setup.ac, n_layer, w.lora is not None,
                         selective_op_share(w.shape, w.seq_len, w.lora))
    tokens = setup.micro_batch * setup.grad_accum * w.seq_len
    return tokens * hw_flops / (inputs.hardware.peak_flops * setup.dims.tp * compute_s)


def _flat(inputs: PlanInputs, w: Workload, samples: float, tp: int) -> ComputeTime:
    """Model FLOPs x recomputation at one share of the peak (the override, or a bare count)."""
    n_layer = model_layers(w.shape, w.profile, w.moe)
    flops = model_flops_per_token(w.params, w.shape, w.seq_len, w.lora, w.profile, w.moe)
    if w.shape is not None and not w.head:  # a pipeline stage without the head's matmul
        flops -= head_flops_per_token(w.shape, w.lora)
    hw_flops = flops * recompute_factor(
        w.ac, n_layer, w.lora is not None, selective_op_share(w.shape, w.seq_len, w.lora)
    )
    share = inputs.efficiency if inputs.efficiency is not None else BARE_EFFICIENCY
    rate = inputs.hardware.peak_flops * share
    seconds = samples * w.seq_len * hw_flops / (rate * tp)
    return ComputeTime(seconds, rate / hw_flops)


def _step_seconds(
    inputs: PlanInputs, w: Workload, samples: float, tp: int, dims: ParallelDims | None,
    chunks: int = 1,
) -> float:
    """The step's seconds; `chunks`: the pipeline stages the rank's blocks form."""
    work, op_s = _step_work(
        inputs.hardware, inputs.compile, inputs.gemm_table, w, samples, tp, dims
    )
    hw = inputs.hardware
    if hw.device == "cpu":  # the same cores dispatch and compute
        return work.device_s + work.host_ops * op_s
    # The GPUs of a layout wait for each other: the step runs at the slowest one's clock.
    pace = slowest_pace(GENERATIONS[hw.generation], dims.world if dims is not None else 1)
    return work_seconds(work, op_s, pace, chunks * samples / w.micro_batch)


@lru_cache(maxsize=65536)
def _step_work(
    hw: Hardware,
    compiled: bool,
    table: GemmTable | None,
    w: Workload,
    samples: float,
    tp: int,
    dims: ParallelDims | None,
) -> tuple[Work, float]:
    """The step's Work and the seconds the host takes an operation (cached: the
    planner's search prices the same setups often)."""
    fsdp = dims is not None and dims.fsdp
    autocast = not fsdp and w.precision != "fp32"  # FSDP's mixed precision casts once
    micro_batches = samples / w.micro_batch
    if w.moe is not None:
        from trainwise.plan.moe.compute import (  # (builds on this)
            fsdp_layer_ops,
            moe_micro_batch,
            moe_per_step,
        )

        micro = moe_micro_batch(w, dims.ep if dims is not None else 1, tp, hw, autocast, table,
                                fsdp_layer_ops(dims))
        per_step = moe_per_step(hw, w, dims, micro_batches)
    elif w.shape is None:
        assert w.profile is not None
        micro = _profiled_micro_batch(
            w.profile, w.seq_len * w.micro_batch, hw, w.precision, w.ac, table
        )
        per_step = _per_step(hw, w, tp, dims, micro_batches)
    else:
        micro = _micro_batch(
            w.shape, w.seq_len, w.micro_batch, tp, hw, w.precision, autocast,
            compiled, w.ac, table, w.loss, w.norm_kernel, w.lora, w.head, w.attention,
            float8_of(w.float8, w.float8_all_gather, fsdp),
        )
        per_step = _per_step(hw, w, tp, dims, micro_batches)
    return micro.times(micro_batches) + per_step, COMPILED_OP_S if compiled else EAGER_OP_S


@lru_cache(maxsize=16384)
def _micro_batch(
    shape: GPTShape,
    seq: int,
    micro_batch: int,
    tp: int,
    hw: Hardware,
    precision: str,
    autocast: bool,
    compiled: bool,
    ac: str,
    table: GemmTable | None,
    loss: str = "standard",
    norm_kernel: str = "fused",
    lora: LoraPlan | None = None,
    head: bool = True,
    attention: str = "sdpa",
    float8: Float8 | None = None,
) -> Work:
    """One micro-batch: every block forward and backward, the recomputed blocks' forward
    again, the head and its loss (`head`: on this worker; a pipeline stage may not);
    with LoRA the frozen layers skip their weight gradients and the adapters' GEMMs
    run beside them. `attention`: SDPA's flash kernel, or a fused one (FlashAttention-3,
    cuDNN: gemm.FUSED_ATTENTION_SHARE where the generation has a figure). `float8`: the
    block Linears' GEMMs in float8, with their casts (plan.model.float8)."""
    tokens = seq * micro_batch
    # Inductor fuses a composite norm's chain into one kernel, as it does the rest.
    norm = "fused" if compiled else norm_kernel
    share = FUSED_ATTENTION_SHARE.get(hw.generation) if attention == "fused" else None
    forward = _block_forward(
        shape, tokens, seq, tp, hw, precision, autocast, compiled, table, norm, share, float8,
        attention,
    )
    backward = _block_backward(
        shape, tokens, seq, tp, hw, precision, autocast, compiled, table, norm,
        weight_grads=lora is None, attention_share=share, float8=float8,
        attention_kernel=attention,
    )
    recomputed = len(checkpointed_blocks(ac, shape.n_layer))
    blocks = (forward + backward).times(shape.n_layer)
    if ac == SELECTIVE_OP:  # every block runs its elementwise work and half its matmuls again
        blocks = blocks + sum(
            (_block_recompute(shape, tokens, tp, hw, precision, autocast, compiled, table,
                              norm, lora, i, float8, attention) for i in range(shape.n_layer)),
            Work(),
        )
        recomputed = 0  # the adapters' recomputed matmuls are counted among the block's
    else:
        blocks = blocks + forward.times(recomputed)
    head_trains = lora is None or trained_matmul_params(shape, lora) > 0
    work = blocks
    if head:
        work = work + _head(shape, tokens, tp, hw, precision, table, loss, head_trains)
    if lora is None:
        return work
    adapters = _adapters(shape, lora, tokens, tp, hw, precision, table)
    per_block = 1.0 / shape.n_layer  # the recomputed blocks run their adapters again
    return work + adapters + adapters.times(recomputed * per_block / 3)


@lru_cache(maxsize=1024)
def _profiled_micro_batch(
    p: ModelProfile, tokens: int, hw: Hardware, precision: str, ac: str,
    table: GemmTable | None,
) -> Work:
    """One micro-batch of `tokens` tokens of a profiled model (models.profile): each
    Linear's GEMMs by its shape and measured rows, forward and backward (the checkpointed
    blocks' forward again); its other matmuls' FLOPs (attention, convolutions) at the
    generation's large-GEMM share of the peak; the bytes its other operations read and
    write at the memory bandwidth; and the operations the host dispatches, as its sample
    run counted them. Without a sample run: the Linears alone, three operations each."""
    def passes(layers: tuple[LinearShape, ...]) -> tuple[float, float]:
        forward = backward = 0.0
        for s in layers:
            m = max(1, round(tokens * s.rows)) if s.rows > 0 else 0
            if m:
                forward += _gemm(m, s.out_features, s.in_features, hw, precision, table)
                backward += _gemm(m, s.in_features, s.out_features, hw, precision, table)
                backward += _gemm(s.out_features, s.in_features, m, hw, precision, table)
        return forward, backward

    block_fw, block_bw = passes(p.block_linears)
    outer_fw, outer_bw = passes(p.outer_linears)
    recomputed = len(checkpointed_blocks(ac, p.blocks)) if p.blocks else 0
    again = block_fw
    if ac == SELECTIVE_OP:  # every other Linear, taken in the order the module lists them
        linears = p.block_linears
        again = passes(tuple(s for s, keep in zip(linears, kept(linears), strict=True)
                             if not keep))[0]
    device = p.blocks * (block_fw + block_bw) + recomputed * again + outer_fw + outer_bw
    layers = len(p.block_linears) * p.blocks + len(p.outer_linears)
    ops = float(layers * (1 + BACKWARD_OPS_PER_FORWARD_OP))
    if p.run is not None:
        gen = GENERATIONS[hw.generation]
        device += tokens * p.run.other_flops / (hw.clocked_flops * gen.gemm_share)
        device += tokens * p.run.moved_bytes / (hw.hbm_bps * MEMORY_SHARE)
        again = recomputed / p.blocks if p.blocks else 0.0  # the forward's share run again
        ops = p.run.forward_ops * (1 + again) + p.run.backward_ops
    return Work(device, ops)


def _gemms(shape: GPTShape, tp: int) -> list[tuple[int, int]]:
    """(out, in) of a block's projections on one of `tp` ranks (lora.block_linears)."""
    return list(block_linears(shape, tp).values())


def _gemm(m: int, n: int, k: int, hw: Hardware, precision: str, table: GemmTable | None) -> float:
    gen = GENERATIONS[hw.generation]
    return gemm_seconds(m, n, k, hw.clocked_flops, hw.hbm_bps, BYTES[precision], gen, table)


def _linear_gemm(
    m: int, n: int, k: int, hw: Hardware, precision: str, table: GemmTable | None, f8: bool
) -> float:
    """A block Linear's GEMM: 16-bit, or (`f8`) float8 at the generation's fp8 share of the
    fp8 peak with 1-byte inputs (a measured table holds 16-bit rates: not used for it)."""
    if not f8:
        return _gemm(m, n, k, hw, precision, table)
    gen = float8_generation(GENERATIONS[hw.generation])
    return gemm_seconds(m, n, k, hw.fp8_flops * hw.clock_scale, hw.hbm_bps, BYTES[precision],
                        gen, input_bytes=FLOAT8_BYTES)


def _linears(shape: GPTShape, tp: int, float8: Float8 | None) -> list[tuple[int, int, bool]]:
    """(out, in, float8) of a block's projections on one of `tp` ranks."""
    if float8 is None:
        return [(o, i, False) for o, i in _gemms(shape, tp)]
    return float8_linears(shape, tp)


def norm_bytes(residual: int, element: int, kernel: str) -> int:
    """Bytes per element one norm's forward reads and writes: the fused kernel reads the
    residual stream and writes its output; the composite chain (COMPOSITE_NORM_OPS) moves
    every intermediate through memory in fp32."""
    if kernel != "composite":
        return residual + element
    f = MASTER_BYTES
    upcast = 0 if residual == f else residual + f  # .float() of an fp32 tensor is itself
    return upcast + 2 * f + f + 2 * f + (f + element) + 2 * element


def gqa_repeat_bytes(element: int, q: int, grouped: bool, attention: str) -> int:
    """Bytes per token of k and v repeated to every query head of grouped-query attention
    (`q`: the query width): SDPA's path repeats them (read and write, each); a fused kernel
    reads the grouped heads as they are (FlashAttention's flash_attn_func: "Supports
    multi-query and grouped-query attention (MQA/GQA) by passing in KV with fewer heads than
    Q"; Transformer Engine's DotProductAttention takes num_gqa_groups): none."""
    return 2 * 2 * element * q if grouped and attention == "sdpa" else 0


def _elementwise_bytes(
    shape: GPTShape, tp: int, precision: str, autocast: bool, norm_kernel: str = "fused",
    attention: str = "sdpa",
) -> float:
    """Bytes per token a block's forward reads and writes outside its GEMMs and attention:
    two norms (and autocast's casts of their outputs), two residual adds, rotary, GQA's
    repeat (gqa_repeat_bytes), the attention output's copy, the MLP's activation."""
    e = BYTES[precision]
    r = MASTER_BYTES if autocast else e  # the residual stream under autocast stays fp32
    h, f = shape.d_model, shape.d_ff // tp
    q, kv = shape.n_head * shape.head_dim // tp, shape.n_kv_head * shape.head_dim // tp
    casts = (r + e) * h if autocast else 0  # autocast's cast of each norm's output
    norms = 2 * (norm_bytes(r, e, norm_kernel) * h + casts)
    residual = 2 * 3 * r * h
    rotary = ROTARY_PASSES * e * (q + kv) if shape.pos == "rope" else 0
    repeat = gqa_repeat_bytes(e, q, shape.n_kv_head != shape.n_head, attention)
    copy = 2 * e * q
    act = e * f * (5 if shape.mlp == "swiglu" else 2)
    return norms + residual + rotary + repeat + copy + act


def _forward_ops(
    shape: GPTShape, autocast: bool, norm_kernel: str = "fused", attention: str = "sdpa"
) -> int:
    """Operations eager PyTorch dispatches in one block's forward (models.gpt.Block)."""
    linears = len(_gemms(shape, 1))
    ops = 2 + linears + 6 + 1 + 2 + 2 + 2 + (2 if shape.mlp == "swiglu" else 1)
    if norm_kernel == "composite":
        ops += 2 * COMPOSITE_NORM_OPS  # each norm's chain instead of its one kernel
    # norms, projections, q/k/v view + transpose, SDPA, output transpose + reshape,
    # dropouts, residual adds, activation
    if shape.pos == "rope":
        ops += 2 * 12  # per q and k: two table slices and casts, chunk, 4 mul, 2 add, cat
    if shape.n_kv_head != shape.n_head and attention == "sdpa":
        ops += 2  # repeat_interleave of k and v
    if autocast:
        ops += linears * (2 if shape.bias else 1)  # weight (and bias) casts
    return ops


@lru_cache(maxsize=16384)  # alike for every checkpointing mode and head
def _block_forward(
    shape: GPTShape, tokens: int, seq: int, tp: int, hw: Hardware, precision: str,
    autocast: bool, compiled: bool, table: GemmTable | None, norm_kernel: str = "fused",
    attention_share: float | None = None, float8: Float8 | None = None,
    attention_kernel: str = "sdpa",
) -> Work:
    gemms = sum(_linear_gemm(tokens, o, i, hw, precision, table, f8)
                for o, i, f8 in _linears(shape, tp, float8))
    q = shape.n_head * shape.head_dim // tp
    attention = attention_seconds(
        2.0 * tokens * seq * q, hw.clocked_flops, GENERATIONS[hw.generation], attention_share
    )
    moved = tokens * _elementwise_bytes(shape, tp, precision, autocast, norm_kernel,
                                        attention_kernel)
    if autocast:  # each weight cast to 16 bits for its matmul (read fp32, write 16-bit)
        moved += sum(o * i for o, i in _gemms(shape, tp)) * (MASTER_BYTES + BYTES[precision])
    if float8 is not None:
        moved += cast_bytes(shape, tp, tokens, precision, float8.gathered)[0]
    if compiled:
        moved *= COMPILED_MEMORY_SHARE
    memory = moved / (hw.hbm_bps * MEMORY_SHARE)
    ops = len(_gemms(shape, 1)) + 1 + FUSED_KERNELS_PER_BLOCK if compiled else _forward_ops(
        shape, autocast, norm_kernel, attention_kernel
    ) + (cast_ops(shape)[0] if float8 is not None else 0)
    return Work(gemms + attention + memory, ops)


def _block_recompute(
    shape: GPTShape, tokens: int, tp: int, hw: Hardware, precision: str, autocast: bool,
    compiled: bool, table: GemmTable | None, norm_kernel: str, lora: LoraPlan | None,
    index: int, float8: Float8 | None = None, attention: str = "sdpa",
) -> Work:
    """What block `index`'s backward runs again under selective-op (plan.model.selective_op):
    the matmuls whose outputs were not kept, priced by shape as the forward's, and its
    elementwise work (norms, rotary, the activation, the residual adds, autocast's casts);
    not attention. Eager, every operation of the forward is dispatched again (the kept
    ones return their saved outputs) and each of them, in the forward and again, through
    the policy's Python dispatch mode (SAC_MODE_OPS); compiled, the recomputation is part
    of the backward's graph."""
    again = recomputed_matmuls(shape, tp, lora, index)
    f8 = {(o, i) for o, i, f in _linears(shape, tp, float8) if f}
    gemms = sum(_linear_gemm(tokens, o, i, hw, precision, table, (o, i) in f8) for o, i in again)
    moved = tokens * _elementwise_bytes(shape, tp, precision, autocast, norm_kernel, attention)
    if autocast:
        moved += sum(o * i for o, i in _gemms(shape, tp)) * (MASTER_BYTES + BYTES[precision])
    if float8 is not None and f8:  # the recomputed float8 matmuls' forward casts, pro rata
        share = sum((o, i) in f8 for o, i in again) / len(f8)
        moved += share * cast_bytes(shape, tp, tokens, precision, float8.gathered)[0]
    if compiled:
        moved *= COMPILED_MEMORY_SHARE
        ops = FUSED_KERNELS_PER_BLOCK + len(recomputed_matmuls(shape, 1, lora, index))
    else:
        ops = _forward_ops(shape, autocast, norm_kernel, attention) * (1 + 2 * SAC_MODE_OPS)
    return Work(gemms + moved / (hw.hbm_bps * MEMORY_SHARE), ops)


@lru_cache(maxsize=16384)  # alike for every checkpointing mode and head
def _block_backward(
    shape: GPTShape, tokens: int, seq: int, tp: int, hw: Hardware, precision: str,
    autocast: bool, compiled: bool, table: GemmTable | None, norm_kernel: str = "fused",
    weight_grads: bool = True, attention_share: float | None = None,
    float8: Float8 | None = None, attention_kernel: str = "sdpa",
) -> Work:
    """Input and weight gradients of every projection (LoRA's frozen ones: input gradients
    only), attention's backward (2.5 times its forward), the elementwise work twice (each
    op reads its saved input and the output gradient and writes the input gradient)."""
    gemms = sum(
        _linear_gemm(tokens, i, o, hw, precision, table, f8)
        + (_linear_gemm(o, i, tokens, hw, precision, table, f8) if weight_grads else 0.0)
        for o, i, f8 in _linears(shape, tp, float8)
    )
    q = shape.n_head * shape.head_dim // tp
    attention = attention_seconds(
        5.0 * tokens * seq * q, hw.clocked_flops, GENERATIONS[hw.generation], attention_share
    )
    moved = 2 * tokens * _elementwise_bytes(shape, tp, precision, autocast, norm_kernel,
                                            attention_kernel)
    if float8 is not None:
        moved += cast_bytes(shape, tp, tokens, precision, float8.gathered)[1]
    if compiled:
        moved *= COMPILED_MEMORY_SHARE
    memory = moved / (hw.hbm_bps * MEMORY_SHARE)
    forward_ops = (
        len(_gemms(shape, 1)) + 1 + FUSED_KERNELS_PER_BLOCK if compiled
        else _forward_ops(shape, autocast, norm_kernel, attention_kernel)
    )
    casts = cast_ops(shape)[1] if float8 is not None and not compiled else 0
    return Work(gemms + attention + memory, BACKWARD_OPS_PER_FORWARD_OP * forward_ops + casts)


@lru_cache(maxsize=4096)  # alike for every checkpointing mode and layout of a stage
def _head(
    shape: GPTShape, tokens: int, tp: int, hw: Hardware, precision: str,
    table: GemmTable | None, loss: str = "standard", weight_grad: bool = True,
) -> Work:
    """The head's GEMM forward and backward (a frozen head: no weight gradient), and the
    loss over the vocabulary: the logits written, upcast to fp32, log-softmax forward and
    backward, cast back (36 bytes per vocabulary entry and token besides the 16-bit logits
    and their gradient); a fused loss reads the logits once and writes their gradient in
    place."""
    h, v = shape.d_model, shape.vocab_size // tp
    gemms = (
        _gemm(tokens, v, h, hw, precision, table)
        + _gemm(tokens, h, v, hw, precision, table)
        + (_gemm(v, h, tokens, hw, precision, table) if weight_grad else 0.0)
    )
    per_entry = 3 * BYTES[precision] if loss == "fused" else 36 + 2 * BYTES[precision]
    memory = tokens * v * per_entry / (hw.hbm_bps * MEMORY_SHARE)
    return Work(gemms + memory, HEAD_FORWARD_OPS * (1 + BACKWARD_OPS_PER_FORWARD_OP))


def _adapters(
    shape: GPTShape, lora: LoraPlan, tokens: int, tp: int, hw: Hardware, precision: str,
    table: GemmTable | None,
) -> Work:
    """Every adapter of the model, forward (x A^T, then B) and backward (the input and
    weight gradients of both: twice the forward), in the eager runtime's operations (the
    dropout, two linears, the scaling and the sum forward)."""
    r, gemms, layers = lora.rank, 0.0, targeted(shape, lora, tp)
    for out, inp in layers:
        forward = _gemm(tokens, r, inp, hw, precision, table) + _gemm(
            tokens, out, r, hw, precision, table
        )
        backward = (
            _gemm(tokens, inp, r, hw, precision, table) + _gemm(r, inp, tokens, hw, precision, table)
            + _gemm(tokens, r, out, hw, precision, table)
            + _gemm(out, r, tokens, hw, precision, table)
        )
        gemms += forward + backward
    ops = len(layers) * ADAPTER_OPS * (1 + BACKWARD_OPS_PER_FORWARD_OP)
    return Work(gemms, ops)


def fsdp_rounds(dims: ParallelDims, micro_batches: float) -> float:
    """How many times a step's FSDP gathers and reduces a rank's parameters: every
    micro-batch, or once under pipeline stages, whose stage keeps its parameters gathered
    (ParallelDims' rule under pp: no resharding after forward, whatever parallel.shard
    says) and its gradients unreduced until the step's last backward (torch.distributed.
    pipelining's backward_maybe_with_nosync: set_reshard_after_backward and
    set_requires_gradient_sync False but for the last; plan.estimate's dp_accum rule)."""
    return micro_batches if fsdp_every_micro_batch(dims) else 1.0


def fsdp_every_micro_batch(dims: ParallelDims) -> bool:
    """Whether FSDP gathers and reduces every micro-batch (fsdp_rounds), in the hooks of
    each one's passes; else once a step."""
    return dims.pp == 1


def optimizer_step_work(
    hw: Hardware, w: Workload, params: float, tensors: int, device: str | None = None
) -> Work:
    """The optimizer step and clipping over `params` parameters in `tensors` tensors on
    this rank (in the device's memory), the step run as on `device` (default the GPU's;
    "cpu" for a step on the host's copies: its operations, no device bytes)."""
    step = ADAMW_STEP[w.step_implementation(device or hw.device)]
    moved = params * (step.bytes_per_param + CLIP_BYTES_PER_PARAM)
    ops = STEP_OPS + step.ops + step.ops_per_tensor * tensors
    return Work(moved / (hw.hbm_bps * MEMORY_SHARE), ops)


def _per_step(
    hw: Hardware, w: Workload, tp: int, dims: ParallelDims | None, micro_batches: float
) -> Work:
    """The optimizer step on this rank's parameters (on the host with cpu offload: priced
    by the caller), and FSDP's copies and per-parameter work for each of its rounds
    (fsdp_rounds)."""
    frozen, trained = rank_split(w.params, w.shape, w.lora, tp)
    rank_params = frozen + trained
    shard = dims.dp_shard if dims is not None and dims.fsdp else 1
    tensors = (
        _param_tensors(w.shape) * w.shape.n_layer + 3 if w.shape is not None
        else w.profile.param_tensors if w.profile is not None else 1
    )
    offload = dims is not None and dims.cpu_offload  # the step runs on the host
    work = (optimizer_step_work(hw, w, 0.0, tensors, "cpu") if offload
            else optimizer_step_work(hw, w, trained / shard, tensors))
    if dims is not None and dims.fsdp:
        e = BYTES[w.precision]
        # Every unit is gathered for forward, and the blocks resharded after it again for
        # backward (ParallelDims.regathered_blocks): `again` of the blocks' parameters.
        _, root = block_params(w, tp)
        again = regathered_share(dims, fsdp_units(w), root)
        gathered = rank_params + again * (rank_params - root)
        # Each gather casts the fp32 shard to 16 bits and copies the gathered buffer out
        # into the parameters; the reduction copies the gradients in (upcast to fp32).
        moved = gathered * (MASTER_BYTES / shard + 2 * e) + rank_params * (e + MASTER_BYTES)
        # the float8 Linears' weights (the blocks') gathered in float8 are copied out in 1 byte
        f8 = gathered_float8_params(w.shape, tp, w.float8, w.float8_all_gather)
        moved -= f8 * (1 + again) * 2 * (e - FLOAT8_BYTES)
        rounds = fsdp_rounds(dims, micro_batches)
        work += Work(
            rounds * moved / (hw.hbm_bps * MEMORY_SHARE), rounds * FSDP_OPS_PER_PARAM * tensors
        )
    return work


def _param_tensors(shape: GPTShape) -> int:
    """Parameter tensors of one block: two norms (weight, and bias with layernorm + bias)
    and every projection's weight (and bias)."""
    norms = 2 * (2 if shape.norm == "layernorm" and shape.bias else 1)
    return norms + len(_gemms(shape, 1)) * (2 if shape.bias else 1)
