"""Peak bytes on one device for a Mixture-of-Experts model: plan.model.memory's phases
(head backward, block backward, end of a block's backward, optimizer step) with the
parameters split the way torchtitan splits them (torchtitan/distributed/parallel_dims.py,
models/common/MOE_SHARDING.md).

Parameters. The dense ones (models.moe.cost.dense_params: embeddings, attention, routers,
shared experts, leading dense FFNs) are laid out as a dense model's: a replica on every
rank (single, DDP) or sharded over the dp_shard ranks of a group (FSDP, HSDP). The routed
experts are split over `ep` ranks borrowed from the data-parallel ones (each holds experts
/ ep of every MoE layer), and the rest of the data parallelism shards each slice (FSDP:
over dp_shard / ep ranks, torchtitan's efsdp mesh) or replicates it (DDP: dp / ep
copies). Their gradients and optimizer state follow them. FSDP gathers a block's dense
parameters over dp_shard and its experts over efsdp (torchtitan wraps the experts as
their own unit), so a gathered block holds its dense parameters and its rank's experts
whole.

Activations (models.moe.cost.layer_activation_bytes, counted against the model's
autograd graph): per layer what the model keeps of a token, its routed copies top_k a
token on average, the busiest expert rank `imbalance` times that many
(models.moe.cost.routed_row_bytes a copy; moe.imbalance); around them the GPT's rules for
the head, a checkpointed block's input and the working set of a block's backward.

Tensor parallelism and pipeline stages (plan.moe.parallel): one tp rank holds its share
of the model (rank_shape: attention, the dense and shared FFNs and the vocabulary split,
the router and the routed experts whole) and keeps its activations; a pipeline rank is
the MoE model of its stage (stage_workload) with its micro-batches in flight, the GPT's
rules (plan.model.pipeline).

Not modelled: CPU offload, LoRA, the auxiliary loss's few bytes a sequence.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import lru_cache
from itertools import accumulate

from trainwise.config.parallel_dims import ParallelDims
from trainwise.models.moe.cost import (
    layer_activation_bytes,
    layer_gemms,
    routed_row_bytes,
)
from trainwise.models.moe.shapes import MoEShape
from trainwise.plan.model.memory import (
    LOSS_TENSORS,
    ActivationProfile,
    MemoryEstimate,
    Workload,
    _at_peak,
    _step_temp,
    checkpointed_blocks,
    loss_bytes,
    replica_peak,
)
from trainwise.plan.model.precision import BYTES, MASTER_BYTES, OPTIMIZER_STATE_BYTES
from trainwise.plan.model.selective_op import SELECTIVE_OP, kept
from trainwise.plan.model.setup import Setup
from trainwise.plan.model.tensor_parallel import LOSS_PARALLEL_EXTRA
from trainwise.plan.moe.parallel import layers_params, rank_shape


@dataclass(frozen=True)
class ExpertLayout:
    """How a layout holds the routed experts: split over `ep` ranks, each slice sharded
    over `shard` ranks (FSDP's efsdp; 1 without FSDP) and kept in `replicas` copies."""

    ep: int
    shard: int
    replicas: int


def expert_layout(dims: ParallelDims) -> ExpertLayout:
    """The experts' split as the runtime builds its mesh: ParallelDims.expert_dims, the one
    statement of it (torchtitan's sparse mesh: under FSDP with ep dividing dp_shard, efsdp
    = dp_shard / ep and the replica groups replicate; otherwise every data-parallel rank
    outside the ep group holds a copy)."""
    replicas, shards = dims.expert_dims()
    return ExpertLayout(dims.ep, shards, replicas)


@dataclass(frozen=True)
class MoEParams:
    """Parameters of one rank's view of the model (one tp rank's share: plan.moe.parallel.
    rank_shape; a pipeline stage's layers and outer parts): `dense` in all, `root` of them
    outside the layers, `dense_block` a layer's on average, `experts` the rank's slice of
    all the routed experts (experts / ep of every MoE layer, unsharded) and `expert_block`
    one MoE layer's slice."""

    dense: float
    root: float
    dense_block: float
    experts: float
    expert_block: float

    @property
    def block(self) -> float:
        """A gathered block: its dense parameters and the rank's experts of it."""
        return self.dense_block + self.expert_block


def moe_params(w: Workload, ep: int, tp: int = 1) -> MoEParams:
    """The split of `w`'s parameters (w.moe's layers, and what w.params holds besides:
    the embeddings, final norm and head of the model or of its pipeline stage) on a rank
    of an `ep`-way expert group and a `tp`-way tensor-parallel one (the embedding and head
    over the vocabulary, the final norm whole)."""
    assert w.moe is not None
    return _moe_params(w.moe, w.params, w.head, ep, tp)


@lru_cache(maxsize=4096)
def _moe_params(moe: MoEShape, params: int, head: bool, ep: int, tp: int) -> MoEParams:
    """moe_params, cached by what it reads (a workload's moments of a pipeline step differ
    in what it does not)."""
    shape = rank_shape(moe, tp)
    layers = layers_params(shape)
    norm = moe.d_model if head else 0
    root = (params - layers_params(moe) - norm) / tp + norm
    experts = shape.expert_total()  # tensor parallelism leaves them whole
    dense_layers = layers - experts
    return MoEParams(dense_layers + root, root, dense_layers / shape.n_layer, experts / ep,
                     experts / ep / max(1, shape.moe_layers))


def held_params(w: Workload, dims: ParallelDims) -> float:
    """Parameters one rank keeps between steps (its shards): the dense ones over dp_shard
    under FSDP, its expert slice over efsdp."""
    p, experts = moe_params(w, dims.ep, dims.tp), expert_layout(dims)
    return p.dense / (dims.dp_shard if dims.fsdp else 1) + p.experts / experts.shard


@lru_cache(maxsize=4096)
def moe_activations(w: Workload, autocast: bool, device: str, tp: int = 1,
                    sequence_parallel: bool = True) -> ActivationProfile:
    """The activations at each moment of backward (memory.activation_profile's three),
    the busiest expert rank's: its routed rows `w.imbalance` times the mean; on one of
    `tp` ranks, its share (plan.moe.parallel.rank_shape), the norms over the residual
    stream split over the sequence with sequence parallelism (the MoE layer's and the
    projections' inputs gathered whole). A pipeline stage's other micro-batches in
    flight hold what they saved meanwhile, as the GPT's (memory.activation_profile)."""
    assert w.moe is not None
    split = tp if sequence_parallel and tp > 1 else 1
    if tp > 1:
        w = replace(w, moe=rank_shape(w.moe, tp))
    shape = w.moe
    layer = _layer_bytes(w, autocast, device, split, tp)
    per = _around(w, autocast, device, tp, split)
    ckpt = checkpointed_blocks(w.ac, shape.n_layer)
    kept = [per["block_input"] if i in ckpt else layer[shape.is_moe_layer(i)]
            for i in range(shape.n_layer)]
    if w.ac == SELECTIVE_OP:
        kept = [per["block_input"] + _kept_by_policy(w, i) for i in range(shape.n_layer)]
    below = list(accumulate(kept, initial=0.0))  # what the blocks below block i keep
    block = below[-1] + per["working"]
    for i in ckpt:
        block = max(block, below[i] + layer[shape.is_moe_layer(i)] + per["working"])
    head = per["head"] if w.head else 0.0
    saved_head = head - (per["loss_grads"] if w.head else 0.0)
    heads = w.in_flight if w.head_in_flight is None else w.head_in_flight
    others = (w.in_flight - 1.0) * below[-1] + (heads - 1.0) * saved_head
    others += _kept_for_w(w, autocast)
    tokens = w.seq_len * w.micro_batch
    return ActivationProfile(tokens * (below[-1] + head + others), tokens * (block + others),
                             tokens * (below[-2] + others))


def _kept_for_w(w: Workload, autocast: bool) -> float:
    """Bytes per token of the output gradients a zero-bubble stage's micro-batches past
    their input-gradient pass keep until W (`w.past_i`; memory.weight_grad_bytes_per_token's
    rule): per layer every GEMM's output gradient (the routed ones' on the busiest rank's
    rows) and the two norms' outputs', on average over the layers; the head's logits' and
    the final norm's; the stage output's."""
    if not any(w.past_i):
        return 0.0
    shape = w.moe
    assert shape is not None
    e = BYTES[w.precision]
    r = MASTER_BYTES if autocast and w.precision != "fp32" else e
    h = shape.d_model
    outputs = sum(g.out_features * g.rows * (w.imbalance if g.grouped else 1.0)
                  for i in range(shape.n_layer) for g in layer_gemms(shape, i))
    layer = e * outputs / shape.n_layer + 2 * r * h
    blocks, heads, stage_outputs = w.past_i
    return blocks * layer + heads * (e * shape.vocab_size + r * h) + stage_outputs * r * h


def _kept_by_policy(w: Workload, i: int) -> float:
    """Bytes per token that selective-op's policy keeps of layer i besides its input
    (plan.model.selective_op's rule on models.moe.cost.layer_gemms, in forward order): the
    outputs of every other GEMM, the router's left out (torchtitan recomputes it and does
    not count it), the routed ones on the busiest rank's rows; SDPA's output and
    log-sum-exp; the router's top-k (fp32 scores and int64 ids). The experts counted as
    grouped GEMMs, three in all (CUDA's torch._grouped_mm, and the even runs on tensors
    without values); the CPU's loop over the experts alternates within them instead."""
    shape, e = w.moe, BYTES[w.precision]
    assert shape is not None
    gemms = [g for g in layer_gemms(shape, i) if g.kind != "router"]
    outputs = sum(
        g.out_features * (g.rows * w.imbalance if g.grouped else g.rows)
        for g, keep in zip(gemms, kept(gemms), strict=True) if keep
    )
    attention = e * shape.n_head * shape.head_dim + MASTER_BYTES * shape.n_head
    top_k = (MASTER_BYTES + 8) * shape.moe.top_k if shape.is_moe_layer(i) else 0
    return e * outputs + attention + top_k


def _norm_row(residual: int, device: str, fsdp_low: bool, stream: int = 0,
              split: int = 1) -> Callable[[int], float]:
    """Bytes one RMSNorm over a row of width w keeps, its input included: the input on
    CUDA (the fused kernel); on a CPU also the composite op's fp32 normalised copy (and
    the fp32 input under 16-bit parameters) and the row's rstd (memory.py's GPT rule).
    Under sequence parallelism the norms over the residual stream (of width `stream`)
    hold 1/`split` of the sequence: per token of the whole, 1/split of a row."""

    def row(w: int) -> float:
        kept = residual * w if device != "cpu" else residual * w + (6 if fsdp_low else 4) * w + 4
        return kept / split if w == stream else kept

    return row


@lru_cache(maxsize=1024)
def _layer_bytes(w: Workload, autocast: bool, device: str, split: int = 1,
                 tp: int = 1) -> dict[bool, float]:
    """Bytes per token a layer keeps (models.moe.cost.layer_activation_bytes), keyed by
    whether it is a MoE layer, on the busiest expert rank (`split`: sequence parallelism's,
    _norm_row; `tp`: the MoE layer's token split, 1 / tp of the routed rows a rank). Under autocast (single, DDP in 16 bits) the residual stream and the norms
    stay fp32 and each Linear after a norm keeps its own 16-bit cast of it: an
    approximation, not checked against autograd."""
    shape = w.moe
    assert shape is not None
    e, low = BYTES[w.precision], w.precision != "fp32"
    casting = autocast and low
    r = MASTER_BYTES if casting else e
    norm_row = _norm_row(r, device, low and not autocast, shape.d_model, split)
    routed = shape.moe.top_k * (w.imbalance - 1.0) * routed_row_bytes(shape, e)
    out = {}
    for moe in (False, True):
        layers = [i for i in range(shape.n_layer) if shape.is_moe_layer(i) == moe]
        if not layers:
            continue
        kept = layer_activation_bytes(
            shape, layers[0], compute_bytes=e, norm_row=norm_row, micro_batch=w.micro_batch,
            seq_len=w.seq_len, grouped=device == "cuda", token_split=tp,
        )
        if casting:  # k and v's casts of the attention's norm output, a second FFN reader's
            second = (not moe and shape.moe.d_dense) or (moe and shape.moe.shared_experts)
            kept += e * shape.d_model * (2 + (1 if second else 0))
        out[moe] = kept + (routed / tp if moe else 0.0)
    return out


def _around(w: Workload, autocast: bool, device: str, tp: int = 1,
            split: int = 1) -> dict[str, float]:
    """What the planner adds around the layers, per token, as for the dense GPT
    (memory.activation_bytes_per_token): a checkpointed block's input, the head (the final
    norm, its output, the loss's tensors at its backward (memory.LOSS_TENSORS), those its
    backward adds being `loss_grads`; on a vocabulary shard of `tp`, the
    vocabulary-parallel loss's LOSS_PARALLEL_EXTRA more), and a block's working set in
    backward (the gradients of its widest intermediates: the busiest rank's routed
    copies, a shared or dense FFN); `split`: sequence parallelism's, of the residual
    stream."""
    shape = w.moe
    assert shape is not None
    e, low = BYTES[w.precision], w.precision != "fp32"
    r = MASTER_BYTES if autocast and low else e
    h, m = shape.d_model, shape.moe
    loss = loss_bytes(w.loss, w.precision, autocast)
    norm_row = _norm_row(r, device, low and not autocast, h, split)
    routed = m.top_k * w.imbalance * e * (3 * m.d_expert + h) if shape.moe_layers else 0.0
    whole = LOSS_TENSORS[w.loss]
    tensors = whole + LOSS_PARALLEL_EXTRA if tp > 1 else whole
    return {
        "block_input": r * h / split,
        "head": norm_row(h) + e * h + tensors * loss * shape.vocab_size,
        "loss_grads": (whole - 1) * loss * shape.vocab_size,
        "working": routed + 3 * e * max(m.shared_width, m.d_dense) + r * h,
    }


def moe_memory(w: Workload, setup: Setup, device: str) -> MemoryEstimate:
    """estimate_memory of a MoE workload (`w` at the setup's micro-batch and ac)."""
    dims = setup.dims
    shape = w.moe
    assert shape is not None
    p = moe_params(w, dims.ep, dims.tp)
    c, opt = BYTES[w.precision], OPTIMIZER_STATE_BYTES[w.optimizer]
    held = held_params(w, dims)
    whole = p.dense + p.experts  # the rank's parameters, gathered
    accumulating = setup.grad_accum > 1
    if not dims.fsdp:
        prof = moe_activations(w, True, device, dims.tp, setup.sequence_parallel)
        # autocast's weight casts: all saved, or under selective-op the root's and the one
        # block's being recomputed (plan.model.memory._autocast_copies)
        held_copies = p.root + p.block if w.ac == SELECTIVE_OP else whole
        copies = held_copies * c if w.precision != "fp32" else 0.0
        return replica_peak(
            (whole * MASTER_BYTES, whole * MASTER_BYTES, whole * opt), prof, copies,
            whole * _step_temp(w, device), w, device,
            replicated=dims.dp_size > 1, accumulating=accumulating,
        )
    prof = moe_activations(w, False, device, dims.tp, setup.sequence_parallel)
    reduce_copy = MASTER_BYTES if w.reduce_dtype == "fp32" and c != MASTER_BYTES else 0
    blocks = whole - p.root
    in_flight = min(2, shape.n_layer) * p.block if dims.reshard_after_forward else blocks
    # The blocks kept gathered since their forward (ParallelDims.regathered_blocks): all,
    # or the last, a MoE layer.
    kept = shape.n_layer - dims.regathered_blocks(shape.n_layer)
    at_head = (blocks if kept == shape.n_layer else kept * p.block) * c
    params, grads, states = held * MASTER_BYTES, held * MASTER_BYTES, held * opt
    g_bwd = whole * BYTES[w.reduce_dtype] if accumulating else 0.0  # unsharded, kept
    if accumulating and setup.accumulate == "sharded":
        g_bwd = grads
    g_bwd *= w.grads_held  # (a pipeline rank whose backward has not reached every stage)
    root = p.root * c
    phases = {
        "head backward": (params, g_bwd, states, prof.head, root + at_head),
        "block backward": (params, g_bwd, states, prof.block, root + in_flight * c),
        "end of a block's backward": (
            params, max(grads, g_bwd), states, prof.rest,
            root + in_flight * c + p.block * (c + reduce_copy),
        ),
        "optimizer step": (params, grads, states, 0.0, held * _step_temp(w, device)),
    }
    return _at_peak(phases, device, states=params + grads + states)
