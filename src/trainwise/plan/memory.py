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
- ddp: its gradient buckets, a second copy of every gradient ("gradient_as_bucket_view ...
  the saved memory size will be equal to the total gradients size", DDP docs).
- fsdp full (reshard_after_forward=True): the unsharded `param_dtype` parameters of the block
  in use and of the one prefetched, plus its unsharded gradient and the `reduce_dtype` copy
  that is reduce-scattered; fsdp grad_op keeps every block's unsharded parameters from
  forward to backward. The root unit (embeddings, final norm, head) stays unsharded for the
  whole step (run.parallelize shards it with reshard_after_forward=False).
- cpu offload (FSDP2 CPUOffloadPolicy): sharded parameters, gradients and optimizer state
  live in host memory; the device keeps only the unsharded blocks in flight.

Activations: what autograd saves per token and layer, counted tensor by tensor for
trainwise's GPT block (activation_bytes_per_token below), in the manner of Korthikanti et
al., 2022 ("Reducing Activation Recomputation in Large Transformer Models", section 4.1),
whose 34·s·b·h + 5·a·s²·b assumes dropout and unfused attention. trainwise's block runs
SDPA, which saves its output and a log-sum-exp instead of the a·s² score matrices, and no
dropout by default.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from trainwise.models.shapes import GPTShape
from trainwise.plan.precision import BYTES, OPTIMIZER_STATE_BYTES

MASTER_BYTES = 4  # fp32 parameters, gradients and optimizer state (see above)

# Assumption, not a measurement: a CUDA context with PyTorch's kernels loaded holds about
# 0.5-1 GB, and the caching allocator's fragmentation typically costs a few percent of the
# peak (PyTorch "CUDA semantics: memory management"). CPU workers have neither.
CUDA_CONTEXT_BYTES = 1e9
FRAGMENTATION = 0.05


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


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per device, by what holds them. `activations` is None when not modelled."""

    params: float
    grads: float
    optimizer: float
    activations: float | None
    buffers: float  # autocast weight copies, DDP buckets, unsharded FSDP blocks
    overhead: float = 0.0  # CUDA context and allocator fragmentation (an assumption)
    host: float = 0.0  # host memory this worker needs (cpu offload)

    @property
    def model_states(self) -> float:
        return self.params + self.grads + self.optimizer

    @property
    def total(self) -> float:
        return self.model_states + (self.activations or 0.0) + self.buffers + self.overhead


def activation_bytes_per_token(shape: GPTShape, precision: str, autocast: bool) -> dict:
    """Bytes autograd keeps per token: one transformer block (`layer`), the block's input
    (`block_input`, all a checkpointed block keeps) and the head with its loss (`head`).

    `autocast` (single/ddp in 16-bit): the residual stream and the norms stay fp32 and each
    linear saves the 16-bit copy of its input; under FSDP mixed precision everything runs in
    the 16-bit parameter dtype.
    """
    e = BYTES[precision]  # compute dtype
    r = MASTER_BYTES if autocast and precision != "fp32" else e  # residual stream
    h, f, v = shape.d_model, shape.d_ff, shape.vocab_size
    q = shape.n_head * shape.head_dim
    kv = shape.n_kv_head * shape.head_dim
    cast = e if r != e else 0  # the linear's 16-bit copy of an fp32 norm output
    # Attention: norm input and output, q and kv projections (their outputs are what rope or
    # SDPA save), rope's rotated q and k, GQA's repeated k and v, SDPA's output and
    # log-sum-exp (fp32 per head), the out projection's input (a contiguous copy).
    attn = r * h + r * h + cast * h + e * (q + 2 * kv)
    if shape.pos == "rope":
        attn += e * (q + kv)
    if shape.n_kv_head != shape.n_head:
        attn += e * 2 * q
    attn += e * q + 4 * shape.n_head + e * q
    # MLP: norm input and output, then gelu: up output and gelu output; swiglu: gate output,
    # silu output, up output and their product.
    mlp = r * h + r * h + cast * h + e * f * (4 if shape.mlp == "swiglu" else 2)
    # Head: final norm in/out, the logits, cross entropy's fp32 upcast and log-softmax, and
    # the fp32 gradient of the logits that exists when backward starts.
    head = 2 * r * h + cast * h + e * v + 3 * 4 * v
    return {"layer": attn + mlp, "block_input": r * h, "head": head}


def checkpointed_blocks(ac: str, n_layer: int) -> set[int]:
    """The blocks run.parallelize wraps in activation checkpointing."""
    if ac == "full":
        return set(range(n_layer))
    if ac == "selective":
        return set(range(0, n_layer, 2))
    return set()


def activation_bytes(w: Workload, autocast: bool = False) -> float | None:
    """Peak of the saved activations of one micro-batch: at the start of backward, or
    while a checkpointed block is recomputed (the blocks above it already freed, those
    below still holding what they saved)."""
    if w.shape is None:
        return None
    per = activation_bytes_per_token(w.shape, w.precision, autocast)
    ckpt = checkpointed_blocks(w.ac, w.shape.n_layer)
    kept = [per["block_input"] if i in ckpt else per["layer"] for i in range(w.shape.n_layer)]
    peak = sum(kept) + per["head"]
    for i in ckpt:
        peak = max(peak, sum(kept[:i]) + per["layer"])
    return w.seq_len * w.micro_batch * peak


def block_params(w: Workload) -> tuple[float, float]:
    """(parameters of one transformer block, parameters of the root unit: embeddings, final
    norm, head). A model without a shape is taken as one unit."""
    if w.shape is None:
        return float(w.params), 0.0
    root = w.params - w.shape.n_layer * _one_block(w.shape)
    return float(_one_block(w.shape)), float(root)


def _one_block(shape: GPTShape) -> int:
    return replace(shape, n_layer=2).num_params() - replace(shape, n_layer=1).num_params()


def estimate_memory(
    w: Workload,
    strategy: str,
    world: int,
    shard: str = "full",
    cpu_offload: bool = False,
    shard_degree: int | None = None,
    device: str = "cpu",
) -> MemoryEstimate:
    """Peak bytes on one device for `strategy` (single, ddp, fsdp, hsdp) over `world` workers;
    hsdp shards over `shard_degree` (the GPUs of a node) and replicates across."""
    n = float(w.params)
    opt = OPTIMIZER_STATE_BYTES[w.optimizer]
    c = BYTES[w.precision]
    low = w.precision != "fp32"
    if strategy in ("single", "ddp"):
        act = activation_bytes(w, autocast=True)
        buffers = n * c if low else 0.0  # autocast's 16-bit weight copies
        if strategy == "ddp" and world > 1:
            buffers += n * MASTER_BYTES  # gradient buckets
        est = MemoryEstimate(n * MASTER_BYTES, n * MASTER_BYTES, n * opt, act, buffers)
        return _with_overhead(est, device)
    if strategy not in ("fsdp", "hsdp"):
        raise ValueError(f"unknown strategy {strategy!r}")
    d = shard_degree or world
    act = activation_bytes(w, autocast=False)
    block, root = block_params(w)
    reduce_copy = MASTER_BYTES if w.reduce_dtype == "fp32" and c != MASTER_BYTES else 0
    grads_in_flight = block * (c + reduce_copy)
    units = w.shape.n_layer if w.shape is not None else 1
    if shard == "grad_op":
        params_in_flight = (n - root) * c  # every block stays gathered until its backward
    else:
        params_in_flight = min(2, units) * block * c  # the block in use and the prefetched one
    buffers = params_in_flight + root * c + grads_in_flight
    states = (n * MASTER_BYTES / d, n * MASTER_BYTES / d, n * opt / d)
    if cpu_offload:
        est = MemoryEstimate(0.0, 0.0, 0.0, act, buffers, host=sum(states))
    else:
        est = MemoryEstimate(*states, act, buffers)
    return _with_overhead(est, device)


def _with_overhead(est: MemoryEstimate, device: str) -> MemoryEstimate:
    if device != "cuda":
        return est
    return replace(est, overhead=CUDA_CONTEXT_BYTES + FRAGMENTATION * est.total)
