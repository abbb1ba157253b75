"""Per-device memory of one training step, by strategy.

This is the function behind `parallel.strategy = "auto"`; the planner grows its insides,
its callers stay. Model states follow ZeRO (Rajbhandari et al., 2020): fp32 parameters,
fp32 gradients and optimizer state, divided by the shard degree where sharded.
Activations of a GPT block follow Korthikanti et al., 2022 ("Reducing Activation
Recomputation in Large Transformer Models", eq. 1): s·b·h·(34 + 5·a·s/h) bytes per layer
at 16-bit, doubled for fp32; full activation checkpointing keeps only each block's input.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainwise.models.shapes import GPTShape
from trainwise.plan.precision import BYTES, OPTIMIZER_STATE_BYTES

MASTER_BYTES = 4  # parameters and gradients are kept in fp32; compute copies in `precision`


@dataclass(frozen=True)
class Workload:
    """What one worker trains: the inputs of the memory and time models."""

    params: int
    shape: GPTShape | None  # None: activations are not modelled (custom models)
    seq_len: int
    micro_batch: int
    precision: str = "fp32"
    optimizer: str = "adamw"
    ac: str = "none"


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per device, by what holds them."""

    params: float
    grads: float
    optimizer: float
    activations: float
    buffers: float  # communication buckets, unsharded FSDP blocks

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations + self.buffers


def activation_bytes(w: Workload) -> float:
    if w.shape is None:
        return 0.0
    s, b, h, a, L = w.seq_len, w.micro_batch, w.shape.d_model, w.shape.n_head, w.shape.n_layer
    scale = BYTES[w.precision] / 2  # the paper's counts are for 16-bit activations
    per_layer = s * b * h * (34 + 5 * a * s / h) * scale
    block_input = s * b * h * BYTES[w.precision]
    # Checkpointed blocks keep only their input, plus one block's activations while it is
    # recomputed in backward; `selective` checkpoints blocks 0, 2, 4, ... (run.parallelize).
    k = {"full": L, "selective": (L + 1) // 2}.get(w.ac, 0)
    if k:
        layers = (L - k) * per_layer + (k - 1) * block_input + per_layer
    else:
        layers = L * per_layer
    logits = s * b * w.shape.vocab_size * 4 * 2  # fp32 logits and their gradient
    return layers + logits


def estimate_memory(
    w: Workload,
    strategy: str,
    world: int,
    shard: str = "full",
    cpu_offload: bool = False,
    shard_degree: int | None = None,
) -> MemoryEstimate:
    """Peak bytes on one device for `strategy` over `world` workers (hsdp: `shard_degree`)."""
    n = w.params
    opt = OPTIMIZER_STATE_BYTES[w.optimizer]
    act = activation_bytes(w)
    if strategy in ("single", "ddp"):
        # DDP copies gradients into flat buckets for the all-reduce.
        buckets = n * MASTER_BYTES if strategy == "ddp" and world > 1 else 0.0
        return MemoryEstimate(n * MASTER_BYTES, n * MASTER_BYTES, n * opt, act, buckets)
    if strategy not in ("fsdp", "hsdp"):
        raise ValueError(f"unknown strategy {strategy!r}")
    d = shard_degree or world
    compute = BYTES[w.precision]
    if shard == "grad_op":
        unsharded = n * compute  # ZeRO-2: parameters stay gathered between forward and backward
    else:
        block = _largest_block_params(w, n)
        unsharded = 2 * block * compute  # the block in use and the one prefetched
    if cpu_offload:
        return MemoryEstimate(0.0, 0.0, 0.0, act, unsharded + _largest_block_params(w, n) * 4)
    return MemoryEstimate(n * MASTER_BYTES / d, n * MASTER_BYTES / d, n * opt / d, act, unsharded)


def _largest_block_params(w: Workload, n: int) -> float:
    if w.shape is None:
        return float(n)  # unknown structure: assume the whole model is one unit
    blocks = (n - w.shape.vocab_size * w.shape.d_model) / w.shape.n_layer
    return max(blocks, w.shape.vocab_size * w.shape.d_model)
