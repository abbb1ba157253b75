"""Peak bytes on one device during a training step, by strategy, counted the way PyTorch
stores them in trainwise's runtime (run.parallelize, run.precision).

Model states (Rajbhandari et al., 2020, "ZeRO", section 3): the parameters, their
gradients and the optimizer state stay in fp32 whatever the compute precision — autocast
keeps the module in fp32 and casts per op; FSDP2's MixedPrecisionPolicy keeps the sharded
parameters in their original dtype and all-gathers a `param_dtype` copy. They are divided by
the shard degree where the strategy shards them.

Transient buffers, per strategy:
- single / ddp under bf16 or fp16 autocast: the 16-bit copy of every weight a matmul used
  in forward, saved for backward (autocast's cast cache).
- ddp: its gradient buckets, allocated when DDP wraps the model and held for the whole
  run, counted as gradients: trainwise's DDP keeps the gradients as views of them
  (`gradient_as_bucket_view`), so a replica holds one copy of its gradients through the
  step, and a second only while micro-batches accumulate under `no_sync`, which writes
  fresh gradients beside the buckets.
- fsdp full (reshard_after_forward=True): the unsharded `param_dtype` parameters of the block
  in use and of the one prefetched, plus its unsharded gradient and the `reduce_dtype` copy
  that is reduce-scattered; the last block's stay gathered from its forward to its
  backward (ParallelDims.regathered_blocks), beside the head's backward; fsdp grad_op keeps
  every block's unsharded parameters from forward to backward, as FSDP under pipeline
  stages does whatever parallel.shard says (ParallelDims: reshard_after_forward is False
  there). The root unit (embeddings, final norm, head) stays unsharded for the whole step
  (run.parallelize shards it with reshard_after_forward=False).
- cpu offload (FSDP2 CPUOffloadPolicy): sharded parameters, gradients and optimizer state
  live in host memory; the device keeps only the unsharded blocks in flight.

LoRA (plan.model.lora, `Workload.lora`): the frozen base is held in the compute dtype only;
gradients, optimizer state, autocast's copies, DDP's buckets and the optimizer's
temporaries are the trainable parameters' (the adapters, and the embeddings or head when
they train); FSDP gathers a block with its adapters and has only their gradients in
flight; the activations change by what plan.model.lora counts (adapter_activation_bytes,
first_block_bytes, head_input_bytes: _lora_activations below).

Activations: what autograd saves per token and layer, counted tensor by tensor for
trainwise's GPT block (activation_bytes_per_token below), in the manner of Korthikanti et
al., 2022 ("Reducing Activation Recomputation in Large Transformer Models", section 4.1),
whose 34·s·b·h + 5·a·s²·b assumes dropout and unfused attention. trainwise's block runs
SDPA, which saves its output and a log-sum-exp instead of the a·s² score matrices, and no
dropout by default: a GPT-2 block keeps 32·s·b·h (the 34 less the two dropout masks), its
attention's output being the out projection's input.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

from trainwise.config.parallel_dims import ParallelDims
from trainwise.config.schema import OptimizerStep
from trainwise.models.moe.shapes import MoEShape
from trainwise.models.shapes import GPTShape, ModelProfile
from trainwise.plan.model.float8 import gathered_bytes_per_param, gathered_float8_params
from trainwise.plan.model.lora import (
    LoraPlan,
    adapter_activation_bytes,
    adapter_params,
    first_block_bytes,
    frozen_norm_bytes,
    head_input_bytes,
    norm_readers,
    rank_split,
)
from trainwise.plan.model.precision import BYTES, MASTER_BYTES, OPTIMIZER_STATE_BYTES
from trainwise.plan.model.selective_op import (
    SELECTIVE_OP,
    kept_bytes_per_token,
    recompute_working_bytes,
)
from trainwise.plan.model.setup import Setup
from trainwise.plan.model.tensor_parallel import activation_split, block_replicated, params_per_rank

# Assumption, not a measurement: a CUDA context with PyTorch's kernels loaded holds about
# 0.5-1 GB, and the caching allocator's fragmentation typically costs a few percent of the
# peak (PyTorch "CUDA semantics: memory management"). CPU workers have neither.
CUDA_CONTEXT_BYTES = 1e9
FRAGMENTATION = 0.05
# Measured on one H200 (torch 2.11, bench/gpu_validate.py and the doctor): cuBLAS takes a
# 32 MiB workspace per handle and stream from the caching allocator, so tensors count it,
# once for the forward (the main thread's handle) and once for autograd's backward
# thread: the tiny model peaked at 81.8 MB against 14.1 MB of planned tensors.
CUBLAS_WORKSPACE_BYTES = 2 * 32 * 2**20


@dataclass(frozen=True)
class Workload:
    """What one worker trains: the inputs of the memory and time models."""

    params: int
    shape: GPTShape | None  # None: activations are not modelled (bare counts, custom models)
    seq_len: int
    micro_batch: int
    precision: str = "fp32"
    optimizer: str = "adamw"
    ac: str = "none"
    reduce_dtype: str = "fp32"  # dtype of FSDP's gradient reduce-scatter
    # FSDP units of a model without a shape (a bare parameter count): an assumption the
    # planner states; None means the whole model is one unit. A profiled model: its blocks.
    units: int | None = None
    # The cross-entropy (plan.loss_kernel; LOSS_TENSORS below): "standard" (trainwise's
    # F.cross_entropy on the logits as they come), "fp32" (on the logits upcast to fp32,
    # eager: torchtitan's of 2024) or "fused" (one kernel each way that keeps the 16-bit
    # logits: flash-attn's cross_entropy as llm-foundry runs it, or torch.compile's).
    loss: str = "standard"
    # The norm's kernels (model.norm_impl): "fused", one kernel each way (torch's
    # F.layer_norm; F.rms_norm since torch 2.9, which trainwise requires), or "composite",
    # RMSNorm as a chain of fp32 elementwise ops (F.rms_norm before torch 2.9, and
    # torchtitan's own RMSNorm of 2024): plan.compute prices its bytes and dispatches, and
    # its saved fp32 intermediates count as a CPU's composite RMSNorm's do.
    norm_kernel: str = "fused"
    # The optimizer step (optim.implementation): "fused", "foreach" (a temporary the size
    # of every parameter) or "for-loop"; None: torch's choice (step_implementation).
    implementation: OptimizerStep | None = None
    # LoRA (plan.model.lora): the base frozen in the compute dtype, adapters train; None:
    # every parameter trains. `params` counts the base model, without the adapters.
    lora: LoraPlan | None = None
    # A pipeline stage (plan.model.pipeline): whether this worker runs the head and its
    # loss, the micro-batches whose activations it holds at once (of its blocks, and of
    # the head where that differs: None, as many), and the share of its trained
    # parameters whose accumulated gradients exist at that moment.
    head: bool = True
    in_flight: float = 1.0
    head_in_flight: float | None = None
    grads_held: float = 1.0
    # A zero-bubble pipeline stage's micro-batches past their input-gradient pass I, whose
    # output gradients wait for the weight-gradient pass W (weight_grad_bytes_per_token):
    # (block micro-batches of stages that ran I, head micro-batches, stage outputs).
    past_i: tuple[float, float, float] = (0.0, 0.0, 0.0)
    # A model read from its module (models.profile): its blocks, their GEMMs and what a
    # sample of it measured price it where it has no shape.
    profile: ModelProfile | None = None
    # A Mixture-of-Experts model (`shape` None): plan.moe prices it from its cost
    # description (models.moe.cost); `imbalance` is the busiest expert rank's routed
    # tokens over the mean (moe.imbalance).
    moe: MoEShape | None = None
    imbalance: float = 1.0
    # The kernels a MoE model's compute is priced with (plan.moe.compute; the dense GPT's
    # path prices SDPA and has no routing): "sdpa" (FlashAttention-2) or "fused"
    # (FlashAttention-3 / cuDNN, gemm.FUSED_ATTENTION_SHARE); the token routing "eager"
    # (torchtitan's gathers, fp32 combine and scatter-add, an all-to-all row per routed
    # expert) or "fused" (one pass each way, Transformer Engine's moe_permute /
    # moe_unpermute, and DeepEP's dispatch: a row per rank holding any of its experts).
    attention: str = "sdpa"
    routing: str = "eager"
    # Float8 training (precision.float8, plan.model.float8): "none", "tensorwise" or
    # "rowwise", and whether FSDP gathers the float8 Linears' weights in float8 (tensorwise).
    float8: str = "none"
    float8_all_gather: bool = False

    def step_implementation(self, device: str) -> OptimizerStep:
        """The optimizer step this worker runs on `device` (torch's choice when unset:
        foreach on CUDA, its per-tensor loop elsewhere)."""
        if self.implementation is not None:
            return self.implementation
        return "foreach" if device == "cuda" else "for-loop"


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes on one device at the step's peak, by what holds them. The parts do not peak
    together (with `zero_grad(set_to_none=True)` there are no gradients while the
    activations are largest), so they are taken at the phase where their sum is largest:
    `phase`. `activations` is None when not modelled; `states` is the device's full share
    of parameters, gradients and optimizer state, whatever the phase."""

    params: float
    grads: float
    optimizer: float
    activations: float | None
    buffers: float  # autocast copies, gathered FSDP units, optimizer temporaries
    phase: str = ""  # "head backward", "block backward", "end of a block's backward", ...
    overhead: float = 0.0  # CUDA context and allocator fragmentation (an assumption)
    host: float = 0.0  # host memory this worker needs (cpu offload)
    states: float = 0.0
    context: float = 0.0  # the CUDA context, within `overhead`

    @property
    def reserved(self) -> float:
        """What the caching allocator holds at the peak: the total less the CUDA context,
        which the driver allocates outside it (torch.cuda.memory_stats'
        "reserved_bytes.all.peak", what torchtitan logs as memory, counts no context)."""
        return self.total - self.context

    @property
    def model_states(self) -> float:
        """Parameters, gradients and optimizer state resident at the peak."""
        return self.params + self.grads + self.optimizer

    @property
    def peak(self) -> float:
        return self.model_states + (self.activations or 0.0) + self.buffers

    @property
    def total(self) -> float:
        return self.peak + self.overhead


# The loss's vocabulary-sized tensors a token holds at the head's backward, by kernel
# (plan.loss_kernel), each of loss_bytes; one of them is kept from the forward.
# - standard, fp32: F.cross_entropy keeps its log-softmax, and its backward holds it with
#   the NLL's gradient and the log-softmax's: 3 (measured: autograd's tensors at
#   _log_softmax_backward_data, tests/unit/test_plan.py). torchtitan upcast the logits
#   (`pred.flatten(0, 1).float()` in train.py's loss_fn at 9dec370, the model's
#   `self.output(h).float()` before e10cb94) and did not compile the loss in December 2024
#   (e8977b0: "turning off compile on loss function"), so its three are fp32.
# - fused: the 16-bit logits kept, and a new gradient written by one backward kernel: 2.
#   flash-attn's CrossEntropyLoss (losses/cross_entropy.py, v1.0.9 and v2.4.2) saves the
#   logits and the log-sum-exp and keeps `inplace_backward=False` unless asked, and
#   llm-foundry builds it with `ignore_index` only (modeling_mpt.py at 5e85bd62d);
#   torch.compile of F.cross_entropy(logits.float()) saves the 16-bit logits and two
#   values a row, and its backward allocates only the 16-bit gradient (inductor's code,
#   torch 2.13), as torchtitan runs it with training.compile (components/loss.py at e7c0cae).
LOSS_TENSORS = {"standard": 3, "fp32": 3, "fused": 2}


def loss_bytes(kernel: str, precision: str, autocast: bool) -> int:
    """Bytes of one of the loss's vocabulary-sized tensors a token (LOSS_TENSORS):
    fp32 when the loss upcasts (`kernel` "fp32"), under autocast (which runs the loss in
    fp32) or in fp32 training; else the 16-bit logits' dtype (FSDP mixed precision)."""
    low = precision != "fp32"
    return MASTER_BYTES if (kernel == "fp32" or autocast or not low) else BYTES[precision]


def composite_norm(shape: GPTShape, device: str, norm_kernel: str = "fused") -> bool:
    """Whether the model's RMSNorm runs as a chain of ops that each keep their fp32 input:
    on a CPU (no fused kernel there) or by choice (model.norm_impl = "composite")."""
    return shape.norm == "rmsnorm" and (device == "cpu" or norm_kernel == "composite")


def activation_bytes_per_token(
    shape: GPTShape, precision: str, autocast: bool, device: str = "cuda", loss: str = "standard",
    frozen_embeddings: bool = False, norm_kernel: str = "fused",
) -> dict:
    """Bytes per token that autograd keeps for one transformer block (`layer`), for a
    checkpointed block (`block_input`), for the head and its loss at the start of backward
    (`head`), and the working set while a block runs its backward (`working_set`).

    `autocast` (single/ddp in 16-bit): the residual stream and the norms stay fp32 and each
    linear saves the 16-bit copy of its input; under FSDP mixed precision everything runs in
    the 16-bit parameter dtype. `frozen_embeddings` (LoRA): the embeddings are kept in the
    16-bit compute dtype, so under autocast the residual stream is 16-bit too (the blocks'
    outputs are autocast's). Checked against PyTorch's memory tracker on fake tensors
    (`trainwise plan --simulate`).
    """
    e = BYTES[precision]  # compute dtype
    low = precision != "fp32"
    r = MASTER_BYTES if autocast and low else e  # the norms' outputs
    res = e if frozen_embeddings else r  # the residual stream, a norm's input
    h, f, v = shape.d_model, shape.d_ff, shape.vocab_size
    q = shape.n_head * shape.head_dim
    kv = shape.n_kv_head * shape.head_dim
    # A norm saves its input (`own`); the linears after it save its (16-bit) output: one
    # tensor for all of them, but under autocast the output is fp32 and each linear keeps
    # its own 16-bit cast (autocast caches casts of weights only: leaf tensors that
    # require grad, autocast_mode.cpp cached_cast): three after the attention's norm.
    own = res * h
    if composite_norm(shape, device, norm_kernel):
        # Composite RMSNorm ops also keep an fp32 upcast / normalised copy and the per-token
        # rstd (CUDA's fused kernel does not); measured with --simulate on a CPU, whose
        # F.rms_norm is that chain.
        own = r * h + ((6 * h + 4) if (low and not autocast) else (4 * h + 4))
    casts = {k: len(v) if autocast and low else 1 for k, v in norm_readers(shape).items()}
    norm = own + e * h  # the final norm's (the head reads it)
    # What SDPA keeps of q, k, v: rope multiplies by constant tables and GQA's repeat saves
    # nothing, so SDPA's own inputs are what stays: q, k and v (the projection outputs, or
    # the rotated q and k), the repeated k and v with GQA. Then SDPA's output and
    # log-sum-exp (fp32 per head). The out projection reads the output as [B, T, H·D]: SDPA
    # writes it in q's memory order (the flash and CPU kernels allocate it like the
    # transposed q; the efficient kernel always as [B, T, H, D]), so it is a view of a
    # projection's q, and a copy only where rope's concatenation made q [B, H, T, D]
    # (models.gpt.Rotary). Measured: tests/unit/test_plan.py, autograd's saved tensors.
    qkv = 3 * q if shape.n_kv_head != shape.n_head else q + 2 * kv
    copy = e * q if shape.pos == "rope" else 0
    attn = own + casts["attn"] * e * h + e * qkv + e * q + 4 * shape.n_head + copy
    # MLP: gelu keeps its input and output (the down projection's input); swiglu keeps the
    # gate output, its silu, the up output and their product.
    mlp = own + casts["mlp"] * e * h + e * f * (4 if shape.mlp == "swiglu" else 2)
    # Head: the final norm and the loss's tensors at its backward (LOSS_TENSORS); the
    # logits themselves are freed after a loss that does not keep them.
    one_loss = loss_bytes(loss, precision, autocast) * v
    head = norm + LOSS_TENSORS[loss] * one_loss
    # The gradients of a block's intermediates while it runs backward.
    working = e * f * (3 if shape.mlp == "swiglu" else 2) + res * h
    # What tensor parallelism splits otherwise (plan.tensor_parallel): the norm regions and
    # the residual, which TP alone leaves whole; the linears' inputs after the norms, which
    # sequence parallelism all-gathers (`gathered`, e·h a norm); one loss tensor (`loss`).
    return {
        "layer": attn + mlp, "block_input": res * h, "head": head, "working_set": working,
        "norms": 2 * own + (casts["attn"] + casts["mlp"]) * e * h, "head_norm": norm,
        "norm_own": own, "residual": res * h, "gathered": e * h,
        "loss": one_loss,
    }


def weight_grad_bytes_per_token(
    shape: GPTShape, precision: str, autocast: bool, tp: int = 1,
    sequence_parallel: bool = True, device: str = "cuda", norm_kernel: str = "fused",
) -> dict:
    """Bytes per token a micro-batch keeps between its input-gradient pass I and its
    weight-gradient pass W on one of `tp` ranks: torch's stage_backward_input
    (torch/distributed/pipelining/_backward.py) hooks the first autograd node where each
    weight's path meets the inputs' (a Linear's MmBackward, a norm's backward) and keeps
    the gradient flowing into it, the node's output gradient, for stage_backward_weight:
    per block (`layer`) the two norms' outputs' (in the norms' dtype, split over the
    sequence with sequence parallelism) and each linear's (compute dtype; column-parallel
    outputs split by tp, the row-parallel ones' local partial sums whole); the head's
    (`head`: the final norm's and the logits', vocabulary-split); and the stage output's
    gradient it received (`output`: kept in its backward state, in the residual dtype).
    Under activation checkpointing W recomputes the block (the recomputed tensors are
    freed after I), so only these gradients are kept, as without it. The first stage
    skips I and runs its whole backward at W (stage.py), keeping only `output`. On a CPU
    RMSNorm is composite ops whose weight multiplies an fp32 copy. Without autocast and
    TP the last block's down projection's output gradient is `output` itself: counted
    twice (e·h a token, a small over-count)."""
    e = BYTES[precision]
    r = MASTER_BYTES if autocast and precision != "fp32" else e  # norms, residual stream
    n = MASTER_BYTES if composite_norm(shape, device, norm_kernel) else r  # norm outputs
    h, f, v = shape.d_model, shape.d_ff, shape.vocab_size
    q, kv = shape.n_head * shape.head_dim, shape.n_kv_head * shape.head_dim
    seq = tp if sequence_parallel else 1
    column = e * (q + 2 * kv + f * (2 if shape.mlp == "swiglu" else 1)) / tp
    row = 2 * e * h  # the attention's output projection and the MLP's down projection
    return {
        "layer": column + row + 2 * n * h / seq,
        "head": e * v / tp + n * h / seq,
        "output": r * h / seq,
    }


def checkpointed_blocks(ac: str, n_layer: int) -> set[int]:
    """The blocks the runtime wraps in activation checkpointing (models.checkpointing)."""
    if ac in ("full", SELECTIVE_OP):
        return set(range(n_layer))
    if ac == "selective":
        return set(range(0, n_layer, 2))
    return set()


@dataclass(frozen=True)
class ActivationProfile:
    """Saved activations of one micro-batch at the moments backward can peak."""

    head: float  # while the head and its loss run backward (no block gathered yet)
    block: float  # while a block runs backward, or a checkpointed one is recomputed
    rest: float  # what the blocks below the top one still hold once it is done

    @property
    def peak(self) -> float:
        return max(self.head, self.block)


@lru_cache(maxsize=4096)
def activation_profile(
    w: Workload,
    autocast: bool = False,
    device: str = "cuda",
    tp: int = 1,
    sequence_parallel: bool = True,
) -> ActivationProfile | None:
    """The activations at each moment of backward: the head's (everything saved plus the
    loss's gradients), the top block's (everything saved plus its working set), each
    checkpointed block's recomputation (the blocks above it freed, those below still
    holding what they saved); None for a model without a shape. On one of `tp`
    tensor-parallel ranks, what plan.tensor_parallel keeps of it. (Cached: the planner's
    search asks for the same workload many times.)"""
    if w.moe is not None:
        from trainwise.plan.moe.memory import moe_activations  # it builds on this module

        return moe_activations(w, autocast, device, tp, sequence_parallel)
    if w.shape is None:
        return _measured_activations(w, autocast)
    frozen_emb = w.lora is not None and not w.lora.train_embeddings
    per = activation_bytes_per_token(
        w.shape, w.precision, autocast, device, w.loss, frozen_emb, w.norm_kernel
    )
    per = activation_split(per, tp, sequence_parallel)
    first = 0.0  # what the first block keeps less than the others
    if w.lora is not None:
        per, first = _lora_activations(w, per, autocast, device, tp, sequence_parallel)
    ckpt = checkpointed_blocks(w.ac, w.shape.n_layer)
    kept = [per["block_input"] if i in ckpt else per["layer"] for i in range(w.shape.n_layer)]
    working = per["working_set"]
    if w.ac == SELECTIVE_OP:  # what the per-operation policy keeps, counted op by op
        kept = [
            kept_bytes_per_token(w.shape, w.precision, autocast, tp, sequence_parallel, w.lora,
                                 frozen_emb, i)
            for i in range(w.shape.n_layer)
        ]
        working = recompute_working_bytes(
            w.shape, w.precision, autocast, tp, sequence_parallel, w.lora, frozen_emb
        )
    if 0 not in ckpt:
        kept[0] -= first
    block = sum(kept) + working
    for i in ckpt:
        block = max(block, sum(kept[:i]) + per["layer"] + working)
    tokens = w.seq_len * w.micro_batch
    head = per["head"] if w.head else 0.0
    # A pipeline stage's other micro-batches in flight hold what they saved meanwhile: the
    # blocks', and on the head's rank the final norm's and the loss's (not the two
    # vocabulary-sized gradients its backward adds).
    saved_head = head - ((LOSS_TENSORS[w.loss] - 1) * per["loss"] if w.head else 0.0)
    heads = w.in_flight if w.head_in_flight is None else w.head_in_flight
    others = (w.in_flight - 1.0) * sum(kept) + (heads - 1.0) * saved_head
    others += _kept_for_w(w, autocast, device, tp, sequence_parallel)
    return ActivationProfile(
        tokens * (sum(kept) + head + others), tokens * (block + others),
        tokens * (sum(kept[:-1]) + others),
    )


def _measured_activations(w: Workload, autocast: bool) -> ActivationProfile | None:
    """A profiled model's activations as its sample run measured them per sample (at the
    job's precision and checkpointing: None at others, and without a run): their largest
    at backward's peaks, and what is left when the gradients peak. `autocast`: single /
    DDP's forward; else FSDP's 16-bit parameters."""
    run = w.profile.run if w.profile is not None else None
    if run is None or (run.precision, run.ac) != (w.precision, w.ac):
        return None
    largest = run.activations if autocast else run.activations_sharded
    late = run.activations_late * largest / run.activations if run.activations else 0.0
    b = w.micro_batch
    return ActivationProfile(largest * b, largest * b, late * b)


def _kept_for_w(
    w: Workload, autocast: bool, device: str, tp: int, sequence_parallel: bool
) -> float:
    """Bytes per token of the output gradients `w.past_i` keeps until W."""
    if not any(w.past_i):
        return 0.0
    assert w.shape is not None
    per = weight_grad_bytes_per_token(
        w.shape, w.precision, autocast, tp, sequence_parallel, device, w.norm_kernel
    )
    blocks, heads, outputs = w.past_i
    return blocks * per["layer"] + heads * per["head"] + outputs * per["output"]


def _lora_activations(
    w: Workload, per: dict, autocast: bool, device: str, tp: int, sequence_parallel: bool
) -> tuple[dict, float]:
    """`per` (on one of `tp` ranks) as LoRA changes it (plan.model.lora), and what the
    first block keeps less than the others."""
    shape, lora, e = w.shape, w.lora, BYTES[w.precision]
    casting = autocast and w.precision != "fp32"  # 16-bit casts of fp32 norm outputs
    split = tp if sequence_parallel else 1  # the norms' region, split over the sequence
    # A norm's output is in the residual stream's dtype: fp32 under autocast unless the
    # embeddings are LoRA's frozen 16-bit ones (activation_bytes_per_token).
    norm_bytes = MASTER_BYTES if casting and lora.train_embeddings else e
    layer = adapter_activation_bytes(shape, lora, e, tp, casting, device, norm_bytes)
    layer -= frozen_norm_bytes(shape, device) / split
    first = first_block_bytes(shape, lora, per["norm_own"], norm_bytes, device, split)
    head = head_input_bytes(shape, lora, e, device, split) if w.head else 0.0
    return {**per, "layer": per["layer"] + layer, "head": per["head"] - head}, first


def activation_bytes(w: Workload, autocast: bool = False, device: str = "cuda") -> float | None:
    """The peak of one micro-batch's activations (activation_profile)."""
    profile = activation_profile(w, autocast, device)
    return None if profile is None else profile.peak


def block_params(w: Workload, tp: int = 1) -> tuple[float, float]:
    """(parameters of one transformer block, parameters of the root unit: embeddings, final
    norm, head), on one of `tp` tensor-parallel ranks. A model without a shape is `w.units`
    equal units (default one); a profiled one its blocks and what lies outside them."""
    if w.shape is None and w.profile is not None and w.profile.blocks:
        return float(w.profile.block_params), float(w.profile.outer_params)
    if w.shape is None:
        return float(w.params) / (w.units or 1) / tp, 0.0
    block = _one_block(w.shape)
    root = w.params - w.shape.n_layer * block
    if tp > 1:  # each block's norms and row-parallel biases are replicated, the rest split
        whole = block_replicated(w.shape)
        block = whole + (block - whole) / tp
        root = params_per_rank(w.params, w.shape, tp) - w.shape.n_layer * block
    return float(block), float(root)


def fsdp_units(w: Workload) -> int:
    """The FSDP units a step gathers and reduces: a GPT's blocks and its root; a profiled
    model's blocks and, when parameters lie outside them, its root; else `w.units`."""
    if w.shape is not None:
        return w.shape.n_layer + 1
    p = w.profile
    if p is not None and p.blocks:
        return p.blocks + (1 if p.outer_params else 0)
    return w.units or 1


@lru_cache(maxsize=256)
def _one_block(shape: GPTShape) -> int:
    return replace(shape, n_layer=2).num_params() - replace(shape, n_layer=1).num_params()


def estimate_memory(
    w: Workload, setup: Setup, device: str = "cpu", runtime_bytes: float = 0.0
) -> MemoryEstimate:
    """Peak bytes on one device for `setup` (`w` at its micro-batch and checkpointing),
    plus the runtime's own `runtime_bytes` per worker (measured by a calibration) in its
    overhead. Without FSDP every rank holds a replica (DDP's buckets over
    dp_replicate > 1 ranks hold its gradients from backward on); FSDP shards over the
    dp_shard ranks of a group (HSDP replicates the groups, which costs no memory). With
    tp > 1 the device holds one tensor-parallel rank's share (plan.tensor_parallel).
    `setup.accumulate` (FSDP with grad_accum > 1): "unsharded" keeps full gradients
    between micro-batches, "sharded" reduce-scatters every micro-batch and keeps only the
    shard.

    The phases whose largest is the peak (gradients join the first two when micro-batches
    accumulate into them):
    - head backward: parameters, optimizer state, the activations and the loss's gradients;
      FSDP has only the root unit gathered (and, for grad_op, every block);
    - block backward: the activations and the block's working set; FSDP `full` has the
      block and the prefetched next one gathered;
    - end of a block's backward (FSDP): its unsharded gradients and their reduce-scatter
      copy, the sharded gradients, and the activations still held below it;
    - optimizer step: parameters, gradients, optimizer state, and foreach AdamW's
      temporaries (one fp32 value per parameter: `_foreach_sqrt`).
    """
    if (w.micro_batch, w.ac) != (setup.micro_batch, setup.ac):
        w = replace(w, micro_batch=setup.micro_batch, ac=setup.ac)
    if w.moe is not None:
        from trainwise.plan.moe.memory import moe_memory  # it builds on this module

        est = moe_memory(w, setup, device)
    else:
        est = (_sharded if setup.dims.fsdp else _replicated)(w, setup, device)
    return replace(est, overhead=est.overhead + runtime_bytes) if runtime_bytes else est


def replica_memory(
    w: Workload, world: int, device: str = "cpu", grad_accum: int = 1
) -> MemoryEstimate:
    """One full replica on each of `world` workers (DDP; one process on one): what a
    layout's memory is told against."""
    return estimate_memory(w, Setup.of(ParallelDims(dp_replicate=world), w, grad_accum), device)


def _replicated(w: Workload, setup: Setup, device: str) -> MemoryEstimate:
    """A replica on every data-parallel rank (one process, or DDP)."""
    dims = setup.dims
    frozen, n = rank_split(w.params, w.shape, w.lora, dims.tp)  # n: the trained ones
    c = BYTES[w.precision]
    prof = activation_profile(w, True, device, dims.tp, setup.sequence_parallel)
    # autocast's 16-bit copies of the fp32 weights (a frozen base is in 16 bits already;
    # a profiled model's sample run counted them among its activations)
    measured = w.shape is None and w.profile is not None and w.profile.run is not None
    copies = _autocast_copies(w, n, dims.tp) if w.precision != "fp32" and not measured else 0.0
    p, g = frozen * c + n * MASTER_BYTES, n * MASTER_BYTES
    o = n * OPTIMIZER_STATE_BYTES[w.optimizer]
    return replica_peak(
        (p, g, o), prof, copies, n * _step_temp(w, device), w, device,
        replicated=dims.dp_replicate > 1, accumulating=setup.grad_accum > 1,
    )


def replica_peak(
    states: tuple[float, float, float],
    prof: ActivationProfile | None,
    copies: float,
    step_temp: float,
    w: Workload,
    device: str,
    *,
    replicated: bool,
    accumulating: bool,
) -> MemoryEstimate:
    """The peak of a replica (one process, or DDP; a dense model's or a MoE's) from its
    parameter, gradient and optimizer-state bytes (`states`), its activations, autocast's
    weight `copies` (held through backward) and the optimizer step's temporaries."""
    p, g, o = states
    # In backward: DDP's buckets where `replicated` (the gradients themselves, as their
    # views, through the whole step), beside the `grads_held` share of the gradients
    # no_sync's micro-batches accumulate.
    g_bwd = (g * w.grads_held if accumulating else 0.0) + (g if replicated else 0.0)
    phases = {
        "head backward": (p, g_bwd, o, prof and prof.head, copies),
        "block backward": (p, g_bwd, o, prof and prof.block, copies),
        "optimizer step": (p, g, o, prof and 0.0, step_temp),
    }
    return _at_peak(phases, device, states=p + g + o)


def _autocast_copies(w: Workload, trained: float, tp: int) -> float:
    """Bytes of autocast's 16-bit copies of the `trained` fp32 weights that a step holds:
    all of them, saved by the matmuls for backward; under selective-op the root's and the
    one block's being recomputed (a checkpointed block's forward saves none, and its
    recomputation casts its own again, freed with its backward)."""
    c = BYTES[w.precision]
    if w.ac != SELECTIVE_OP or w.shape is None:
        return trained * c
    block = (adapter_params(w.shape, w.lora, tp) / w.shape.n_layer if w.lora is not None
             else block_params(w, tp)[0])
    return (trained - (w.shape.n_layer - 1) * block) * c


def _step_temp(w: Workload, device: str) -> float:
    """Bytes per parameter foreach AdamW allocates in its step (`_foreach_sqrt` of every
    second moment: optim.implementation = 'foreach'; the fused kernel keeps its values in
    registers). The per-tensor loop's one temporary (a
    tensor's square root, the largest weight's at most) is not counted."""
    foreach = w.step_implementation(device) == "foreach"
    return MASTER_BYTES if w.optimizer == "adamw" and foreach else 0.0


def _sharded(w: Workload, setup: Setup, device: str) -> MemoryEstimate:
    """FSDP over the dp_shard ranks of a group."""
    dims, tp, accumulating = setup.dims, setup.dims.tp, setup.grad_accum > 1
    frozen, t = rank_split(w.params, w.shape, w.lora, tp)  # t: the trained parameters
    n = frozen + t
    opt = OPTIMIZER_STATE_BYTES[w.optimizer]
    c = BYTES[w.precision]
    step_temp = _step_temp(w, device)
    d = dims.dp_shard
    prof = activation_profile(w, False, device, tp, setup.sequence_parallel)
    block, root = block_params(w, tp)
    reduce_copy = MASTER_BYTES if w.reduce_dtype == "fp32" and c != MASTER_BYTES else 0
    trained_block = block  # a block's gradients: all of it, or (LoRA) its adapters
    if w.lora is not None and w.shape is not None:
        trained_block = adapter_params(w.shape, w.lora, tp) / w.shape.n_layer
        block += trained_block
    grads_in_flight = trained_block * (c + reduce_copy)
    units = w.shape.n_layer if w.shape is not None else (
        w.profile.blocks if w.profile is not None and w.profile.blocks else (w.units or 1)
    )
    # A gathered block parameter's bytes: 1 for float8 weights gathered in float8.
    cg = c if w.shape is None else gathered_bytes_per_param(
        w.shape, tp, block, c, gathered_float8_params(w.shape, tp, w.float8, w.float8_all_gather) > 0
    )
    if not dims.reshard_after_forward:
        params_in_flight = (n - root) * cg  # every block stays gathered until its backward
    else:
        params_in_flight = min(2, units) * block * cg  # the block in use and the prefetched one
    # At the head's backward: the blocks kept gathered since their forward (all, or the last).
    at_head = (n - root) * cg * (units - dims.regathered_blocks(units)) / units
    p, g, o = (frozen * c + t * MASTER_BYTES) / d, t * MASTER_BYTES / d, t * opt / d
    states = p + g + o
    temp = t / d * step_temp
    if dims.cpu_offload:  # the states and the optimizer step live in host memory
        p = g = o = temp = 0.0
    # Between micro-batches FSDP2 skips the reduce-scatter (set_requires_gradient_sync
    # False, run.loop) and keeps every parameter's unsharded gradient, in the reduce dtype.
    g_bwd = t * BYTES[w.reduce_dtype] if accumulating else 0.0
    if accumulating and setup.accumulate == "sharded":
        g_bwd = g  # reduce-scattered every micro-batch: only the shard accumulates
    g_bwd *= w.grads_held  # (a pipeline rank whose backward has not reached every chunk)
    g_end = max(g, g_bwd)
    phases = {
        "head backward": (p, g_bwd, o, prof and prof.head, root * c + at_head),
        "block backward": (p, g_bwd, o, prof and prof.block, root * c + params_in_flight),
        "end of a block's backward": (
            p, g_end, o, prof and prof.rest, root * c + params_in_flight + grads_in_flight,
        ),
        "optimizer step": (p, g, o, prof and 0.0, temp),
    }
    est = _at_peak(phases, device, states=states)
    if dims.cpu_offload:
        return replace(est, host=states + t / d * step_temp, states=states)
    return est


def _at_peak(phases: dict[str, tuple], device: str, states: float) -> MemoryEstimate:
    """The phase whose parts add up to the most, as a MemoryEstimate (plus the CUDA
    overhead on a GPU)."""

    def size(parts: tuple) -> float:
        return sum(x or 0.0 for x in parts)

    phase = max(phases, key=lambda k: size(phases[k]))
    p, g, o, act, buffers = phases[phase]
    if device == "cuda":
        buffers += CUBLAS_WORKSPACE_BYTES
    peak = size((p, g, o, act, buffers))
    context = CUDA_CONTEXT_BYTES if device == "cuda" else 0.0
    overhead = context + FRAGMENTATION * peak if device == "cuda" else 0.0
    return MemoryEstimate(p, g, o, act, buffers, phase, overhead, states=states,
                          context=context)
