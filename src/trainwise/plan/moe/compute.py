"""The compute of a Mixture-of-Experts model on one rank: plan.model.compute's
per-operation model, over the GEMMs and bytes of models.moe.cost.

One micro-batch of T tokens on a rank of an `ep`-way expert group:
- every token's GEMMs (models.moe.cost.layer_gemms: attention, router, shared experts,
  a leading dense layer's FFN) by shape, forward and backward, and attention as SDPA's
  flash kernel, as for a dense GPT;
- the routed experts as grouped GEMMs (plan.gemm.grouped_gemm_seconds): the rank holds
  experts / ep of each MoE layer, each multiplying the rows routed to it from the ep group,
  ep x T x top_k / experts on average; the busiest rank gets `imbalance` times that
  (moe.imbalance), and the step waits for it. Expert parallelism thus makes each expert's
  GEMM taller (more efficient) as well as fewer;
- the memory-bound work as bytes at the memory bandwidth: norms and residual adds, rotary,
  the router's softmax and top-k, the gathers that sort the tokens by expert and return
  them, the experts' SwiGLU activation, the combine's fp32 scaling and scatter-add;
- the host's operations (torchtitan's MoE dispatches about MOE_FORWARD_OPS a layer) and,
  with ep > 1, the host sync in every MoE layer's forward: the host reads how many rows
  it receives before it can dispatch the exchange. torchtitan's token dispatcher copies
  the output splits with .to("cpu", non_blocking=False) and .tolist()s them
  (torchtitan/distributed/expert_parallel.py at 022f885f3, "this would incur a
  device-to-host sync"; models/common/token_dispatcher.py _sync_token_count_exchange
  today); Megatron-Core's alltoall dispatcher copies the counts on a side stream and
  synchronizes with it (megatron/core/transformer/moe/token_dispatcher.py
  _maybe_dtoh_and_synchronize, at 1e057005, the published rows' commit, as today), its
  DeepEP path, as torchtitan's, has the CPU spin until the received counts arrive
  (moe/fused_a2a.py FusedDispatch: "the CPU will wait for GPU's signal to arrive";
  deepseek-ai/DeepEP csrc/deep_ep.cpp
  intranode_dispatch at 92fe2de, the "Synchronize total received tokens" loop unless
  num_worst_tokens is given; README: "an implicit CPU wait for GPU received count
  signal"). The backward reuses the forward's splits or DeepEP's handle (cached mode:
  no wait); a layer recomputed whole runs its forward, and its sync, again. A sync
  drains what the host had queued, so the host banks no time across it
  (plan.model.compute.work_seconds prices the stretches; _passes lays them out), and
  after it the device waits for the host to dispatch the next SYNC_IDLE_OPS operations.
On one of `tp` tensor-parallel ranks, the MoE model of its share (plan.moe.parallel.
rank_shape): attention's heads, the dense and shared FFNs and the head's vocabulary
split, the router and the routed experts whole, on the rank's 1 / tp of the tokens (the
runtime's token split: the router's and routed GEMMs, the routing's bytes).
Activation checkpointing runs the checkpointed blocks' forward again; selective-op every
layer's forward less attention and the GEMMs its policy kept (_layer_recompute).
torch.compile is not modelled for MoE blocks (priced eager).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import lru_cache

from trainwise.config.parallel_dims import ParallelDims
from trainwise.models.moe.cost import TokenGemm, layer_gemms
from trainwise.models.moe.shapes import MoEShape
from trainwise.plan.inputs import Hardware
from trainwise.plan.model.compute import (
    BACKWARD_OPS_PER_FORWARD_OP,
    EAGER_OP_S,
    FSDP_OPS_PER_PARAM,
    MEMORY_SHARE,
    ROTARY_PASSES,
    SAC_MODE_OPS,
    Work,
    _gemm,
    _head,
    fsdp_every_micro_batch,
    fsdp_rounds,
    gqa_repeat_bytes,
    norm_bytes,
    optimizer_step_work,
    synced_chain,
)
from trainwise.plan.model.gemm import (
    FUSED_ATTENTION_SHARE,
    GENERATIONS,
    GemmTable,
    attention_seconds,
    grouped_gemm_seconds,
)
from trainwise.plan.model.memory import Workload, checkpointed_blocks
from trainwise.plan.model.precision import BYTES, MASTER_BYTES
from trainwise.plan.model.selective_op import SELECTIVE_OP, kept
from trainwise.plan.moe.memory import expert_layout, held_params, moe_params
from trainwise.plan.moe.parallel import rank_shape

# Operations eager PyTorch dispatches in one layer's forward (counted from torchtitan's
# Transformer block and models/common/moe.py, token_dispatcher.py): the attention's
# (norm, projections, views, rotary, SDPA, residual) and a MoE FFN's (norm; router: gate,
# its fp32 cast, softmax, top-k, gather, renormalisation; the routing map and counts; the
# sort and gathers; the grouped GEMMs, silu, product, casts; the combine's upcast, scale,
# cast and scatter-add; the shared experts; the residual add), and with ep > 1 the
# all-to-all's own (the counts' exchange, the splits read to the host, the two
# exchanges, the permutation to and from the local experts' order).
ATTENTION_OPS = 43
MOE_FORWARD_OPS = 40
EP_FORWARD_OPS = 14
# Assumption: after the split sizes' device-to-host sync the device idles while the host
# dispatches the operations up to the next GEMM (the exchange, the permutation, offsets).
SYNC_IDLE_OPS = 5
# Parameter tensors of a MoE layer FSDP handles (norms, q/k norms, four projections,
# the router, the shared expert's three, the experts' three 3-D weights).
MOE_LAYER_TENSORS = 15
ROOT_TENSORS = 3  # the embedding, the final norm, the head


def moe_micro_batch(w: Workload, ep: int, tp: int, hw: Hardware, autocast: bool,
                    table: GemmTable | None, hook_ops: float = 0.0) -> Work:
    """One micro-batch of `w` (a MoE workload) on a rank of an ep-way expert group and
    of a tp-way tensor-parallel one (its share: plan.moe.parallel.rank_shape): every
    layer forward and backward, the checkpointed ones' forward again, the head.
    `hook_ops`: the operations FSDP's hooks dispatch in a layer a micro-batch
    (fsdp_layer_ops), half in its forward, half in its backward (an assumption)."""
    assert w.moe is not None
    shape = rank_shape(w.moe, tp)
    kernels = Kernels(w.norm_kernel, w.attention, w.routing)
    return _micro_batch(shape, w.seq_len, w.micro_batch, ep, w.imbalance, hw, w.precision,
                        autocast, w.ac, table, w.loss, kernels, w.head, tp, hook_ops)


@dataclass(frozen=True)
class Kernels:
    """The kernels a step runs (memory.Workload's norm_kernel, attention, routing)."""

    norm: str = "fused"
    attention: str = "sdpa"
    routing: str = "eager"

    def attention_share(self, hw: Hardware) -> float | None:
        """The share of the peak the attention runs at (None: the generation's SDPA)."""
        if self.attention == "sdpa":
            return None
        return FUSED_ATTENTION_SHARE.get(hw.generation)


@lru_cache(maxsize=16384)
def _micro_batch(
    shape: MoEShape, seq: int, micro_batch: int, ep: int, imbalance: float, hw: Hardware,
    precision: str, autocast: bool, ac: str, table: GemmTable | None, loss: str,
    kernels: Kernels, head: bool, tp: int = 1, hook_ops: float = 0.0,
) -> Work:
    tokens = seq * micro_batch
    recomputed = checkpointed_blocks(ac, shape.n_layer)
    one = _one_layer(shape)
    hooks = Work(0.0, hook_ops / 2)  # a pass's share of a layer's FSDP hooks
    work = Work()
    for moe in (False, True):  # the layers of a kind are alike: priced once, counted
        layers = [i for i in range(shape.n_layer) if shape.is_moe_layer(i) == moe]
        if not layers:
            continue
        forward = _layer_forward(one, moe, tokens, seq, ep, imbalance, hw, precision,
                                 autocast, table, kernels, tp)
        backward = _layer_backward(one, moe, tokens, seq, ep, imbalance, hw, precision,
                                   autocast, table, kernels, tp)
        again = sum(1 for i in layers if i in recomputed)
        whole = 0 if ac == SELECTIVE_OP else again  # the layers recomputed whole
        work = work + _passes(forward, backward, hooks, len(layers), whole, moe and ep > 1)
        if ac == SELECTIVE_OP:  # what the policy did not keep runs again, in every layer
            forward = _layer_recompute(shape, moe, layers[0], forward, tokens, seq, ep,
                                       imbalance, hw, precision, table, kernels, tp)
            work = work + forward.times(again)  # the split sizes' copy kept: no sync
    if head:
        work = work + _head(shape, tokens, 1, hw, precision, table, loss)  # type: ignore[arg-type]
    return work


def _passes(forward: Work, backward: Work, hooks: Work, layers: int, again: int,
            syncs: bool) -> Work:
    """`layers` alike layers forward and backward, each pass with its FSDP `hooks`,
    `again` of them recomputed whole (their forward run again in the backward, without
    FSDP's hooks). `syncs`: each forward reads the all-to-all's split sizes on the host
    (see the module's docstring), so the forward is a run of syncs one layer apart
    (plan.model.compute.synced_chain, work_seconds), and so is the backward where
    recomputed layers sync again, each sync `layers / again` layers' backward apart;
    the backward's own all-to-alls reuse the forward's splits and do not sync."""
    forward_pass, backward_pass = forward + hooks, backward + hooks
    if not syncs:
        return (forward_pass + backward_pass).times(layers) + forward.times(again)
    work = synced_chain(forward_pass, layers)
    if not again:
        return work + backward_pass.times(layers)
    return work + synced_chain(forward + backward_pass.times(layers / again), again)


@lru_cache(maxsize=1024)
def _one_layer(shape: MoEShape) -> MoEShape:
    """`shape` with as few layers as keep its kinds (a layer's price reads its kind, never
    how many there are): the key under which a pipeline stage's layers, whatever its
    blocks, share their price."""
    return replace(shape, n_layer=shape.moe.dense_layers + 1)


def _layer_recompute(
    shape: MoEShape, moe: bool, index: int, forward: Work, tokens: int, seq: int, ep: int,
    imbalance: float, hw: Hardware, precision: str, table: GemmTable | None,
    kernels: Kernels, tp: int = 1,
) -> Work:
    """What a layer's backward runs again under selective-op: its `forward` less attention
    and the GEMMs whose outputs the policy kept (plan.moe.memory._kept_by_policy's rule);
    the split sizes' sync is not repeated (the copy to the host is kept). Every operation
    is dispatched again, and twice through the policy's dispatch mode (SAC_MODE_OPS)."""
    gemms = [g for g in layer_gemms(shape, index) if g.kind != "router"]
    names = frozenset(g.name for g, keep in zip(gemms, kept(gemms), strict=True) if keep)
    saved = _plain_gemms(shape, moe, tokens, hw, precision, table, False, names, tp)
    if moe:
        saved += _routed_gemms(shape, tokens // tp, ep, imbalance, hw, precision, table, False,
                               names)
    attention = _attention(shape, tokens, seq, hw, kernels, FORWARD_ATTENTION_PASSES)
    idle = SYNC_IDLE_OPS * EAGER_OP_S if moe and ep > 1 else 0.0
    return Work(forward.device_s - saved - attention - idle,
                forward.host_ops * (1 + 2 * SAC_MODE_OPS))


def _gemms(shape: MoEShape, moe: bool) -> list[TokenGemm]:
    """A layer's GEMMs (models.moe.cost.layer_gemms) of a MoE layer or a dense one."""
    index = shape.moe.dense_layers if moe else 0
    return layer_gemms(shape, index)


def _plain_gemms(shape: MoEShape, moe: bool, tokens: int, hw: Hardware, precision: str,
                 table: GemmTable | None, backward: bool,
                 names: frozenset[str] | None = None, tp: int = 1) -> float:
    """Every token's GEMMs of a layer (those in `names`, when given): forward (T, out, in);
    backward the input gradient (T, in, out) and the weight gradient (out, in, T). The
    router's on the rank's 1 / tp of the tokens (models.moe.parallel's token split)."""
    total = 0.0
    for g in _gemms(shape, moe):
        if g.grouped or (names is not None and g.name not in names):
            continue
        o, i = g.out_features, g.in_features
        t = tokens // tp if g.kind == "router" else tokens
        if backward:
            total += _gemm(t, i, o, hw, precision, table) + _gemm(o, i, t, hw, precision, table)
        else:
            total += _gemm(t, o, i, hw, precision, table)
    return total


def _routed_gemms(
    shape: MoEShape, tokens: int, ep: int, imbalance: float, hw: Hardware, precision: str,
    table: GemmTable | None, backward: bool, names: frozenset[str] | None = None,
) -> float:
    """The rank's experts of one MoE layer as grouped GEMMs (those in `names`, when
    given), on the busiest rank's rows (each of its experts / ep experts multiplies ep x T
    x top_k / experts rows on average, `imbalance` times that): forward (m, out, in);
    backward the input gradients (m, in, out) and the weight gradients (out, in, m)."""
    gen, e = GENERATIONS[hw.generation], BYTES[precision]

    def grouped(groups: int, rows: float, n: int, k: float) -> float:
        return grouped_gemm_seconds(groups, rows, n, math.ceil(k), hw.clocked_flops,
                                    hw.hbm_bps, e, gen, table)

    total = 0.0
    for g in _gemms(shape, True):
        if not g.grouped or (names is not None and g.name not in names):
            continue
        groups = g.grouped // ep
        m = tokens * ep * g.rows / g.grouped * imbalance
        o, i = g.out_features, g.in_features
        if backward:
            total += grouped(groups, m, i, o) + grouped(groups, o, i, m)
        else:
            total += grouped(groups, m, o, i)
    return total


def _layer_bytes(shape: MoEShape, moe: bool, imbalance: float, precision: str,
                 autocast: bool, kernels: Kernels, tp: int = 1) -> float:
    """Bytes per token a layer's forward reads and writes outside its GEMMs and attention
    (see the module's docstring); the routed rows' share is the busiest rank's, the
    router's and the routed rows' 1 / tp a token under the tp token split."""
    norm_kernel = kernels.norm
    e = BYTES[precision]
    r = MASTER_BYTES if autocast else e
    h, m = shape.d_model, shape.moe
    q, kv = shape.n_head * shape.head_dim, shape.n_kv_head * shape.head_dim
    casts = (r + e) * h if autocast else 0
    norms = 2 * (norm_bytes(r, e, norm_kernel) * h + casts) + 2 * 3 * r * h  # and residuals
    attention = ROTARY_PASSES * e * (q + kv) + 2 * e * q
    attention += gqa_repeat_bytes(e, q, shape.n_kv_head != shape.n_head, kernels.attention)
    if shape.qk_norm:
        attention += norm_bytes(e, e, norm_kernel) * (q + kv)
    if not moe:
        return norms + attention + 5 * e * m.d_dense
    k = m.top_k * imbalance
    router = 4 * MASTER_BYTES * m.experts  # logits written, softmax read and written, top-k
    # Eager: the sort's gather (read and write a row), the combine's upcast, scale, cast
    # back and scatter-add, per routed row. Fused: the permutation reads and writes each
    # routed row once, the unpermutation reads it once and writes each token once.
    if kernels.routing == "fused":
        routed = m.top_k * h * 3 * e + h * e
    else:
        routed = m.top_k * h * (2 * e + (e + MASTER_BYTES) + 3 * MASTER_BYTES
                                + (MASTER_BYTES + e) + 3 * e)
    # The experts' SwiGLU activation on the busiest rank's rows.
    split = (router + routed + k * 5 * e * m.d_expert) / tp
    return norms + attention + split + 5 * e * m.shared_width


@lru_cache(maxsize=16384)  # a stage's layers are alike whatever its micro-batch's knobs
def _layer_forward(
    shape: MoEShape, moe: bool, tokens: int, seq: int, ep: int, imbalance: float,
    hw: Hardware, precision: str, autocast: bool, table: GemmTable | None, kernels: Kernels,
    tp: int = 1,
) -> Work:
    gemms = _plain_gemms(shape, moe, tokens, hw, precision, table, False, None, tp)
    if moe:
        gemms += _routed_gemms(shape, tokens // tp, ep, imbalance, hw, precision, table, False)
    attention = _attention(shape, tokens, seq, hw, kernels, FORWARD_ATTENTION_PASSES)
    moved = tokens * _layer_bytes(shape, moe, imbalance, precision, autocast, kernels, tp)
    idle = SYNC_IDLE_OPS * EAGER_OP_S if moe and ep > 1 else 0.0  # the split sizes' sync
    return Work(gemms + attention + moved / (hw.hbm_bps * MEMORY_SHARE) + idle,
                _forward_ops(moe, ep))


# Attention's FLOPs a token, over seq x (heads x head_dim): forward 2; backward 5, 2.5
# times the forward.
FORWARD_ATTENTION_PASSES = 2.0
BACKWARD_ATTENTION_PASSES = 5.0


def _attention(shape: MoEShape, tokens: int, seq: int, hw: Hardware, kernels: Kernels,
               passes: float) -> float:
    """Seconds of a layer's attention (its forward, its backward, or the forward that
    selective-op subtracts from a recomputation: one price for all three)."""
    flops = passes * tokens * seq * shape.n_head * shape.head_dim
    return attention_seconds(flops, hw.clocked_flops, GENERATIONS[hw.generation],
                             kernels.attention_share(hw))


def _forward_ops(moe: bool, ep: int) -> int:
    """Operations a layer's forward dispatches (a dense layer's FFN: six)."""
    if not moe:
        return ATTENTION_OPS + 6
    return ATTENTION_OPS + MOE_FORWARD_OPS + (EP_FORWARD_OPS if ep > 1 else 0)


@lru_cache(maxsize=16384)  # a stage's layers are alike whatever its micro-batch's knobs
def _layer_backward(
    shape: MoEShape, moe: bool, tokens: int, seq: int, ep: int, imbalance: float,
    hw: Hardware, precision: str, autocast: bool, table: GemmTable | None, kernels: Kernels,
    tp: int = 1,
) -> Work:
    """Input and weight gradients of every GEMM, attention's backward (2.5 times its
    forward), the elementwise work twice."""
    gemms = _plain_gemms(shape, moe, tokens, hw, precision, table, True, None, tp)
    if moe:
        gemms += _routed_gemms(shape, tokens // tp, ep, imbalance, hw, precision, table, True)
    attention = _attention(shape, tokens, seq, hw, kernels, BACKWARD_ATTENTION_PASSES)
    moved = 2 * tokens * _layer_bytes(shape, moe, imbalance, precision, autocast, kernels, tp)
    return Work(gemms + attention + moved / (hw.hbm_bps * MEMORY_SHARE),
                BACKWARD_OPS_PER_FORWARD_OP * _forward_ops(moe, ep))


def moe_per_step(hw: Hardware, w: Workload, dims: ParallelDims | None,
                 micro_batches: float) -> Work:
    """The optimizer step on the rank's shards and, under FSDP, the copies of every
    gather (the fp32 shard cast to 16 bits, the gathered buffer copied out) and reduction
    for each of its rounds (plan.model.compute.fsdp_rounds: every micro-batch, once a step
    under pipeline stages), dense parameters and the rank's experts alike."""
    shape = w.moe
    assert shape is not None
    dims = dims or ParallelDims()
    held = held_params(w, dims)
    work = optimizer_step_work(hw, w, held, ROOT_TENSORS + MOE_LAYER_TENSORS * shape.n_layer)
    if not dims.fsdp:
        return work
    p, experts = moe_params(w, dims.ep, dims.tp), expert_layout(dims)
    e = BYTES[w.precision]
    # Gathered for forward, and (ParallelDims.regathered_blocks) the resharded blocks' part
    # again for backward: the dense layers' (not the root's) and the experts'.
    layers = max(1, shape.moe_layers)
    dense_again = (p.dense - p.root) * dims.regathered_blocks(shape.n_layer) / shape.n_layer
    moved = 0.0
    for params, again, shard in (
        (p.dense, dense_again, dims.dp_shard),
        (p.experts, p.experts * dims.regathered_blocks(layers) / layers, experts.shard),
    ):
        moved += (params + again) * (MASTER_BYTES / shard + 2 * e) + params * (e + MASTER_BYTES)
    rounds = fsdp_rounds(dims, micro_batches)
    tensors = ROOT_TENSORS  # the layers' own where not in their passes (fsdp_layer_ops)
    if not fsdp_layer_ops(dims):
        tensors += MOE_LAYER_TENSORS * shape.n_layer
    return work + Work(rounds * moved / (hw.hbm_bps * MEMORY_SHARE),
                       rounds * FSDP_OPS_PER_PARAM * tensors)


def fsdp_layer_ops(dims: ParallelDims | None) -> float:
    """The operations FSDP's hooks dispatch in one layer a micro-batch where they run
    every micro-batch (fsdp_rounds): inside the layer's forward and backward, between
    its syncs. Once a step (pipeline stages) they are priced beside the step, as the
    optimizer is: one micro-batch of the step's runs them."""
    if dims is None or not dims.fsdp or not fsdp_every_micro_batch(dims):
        return 0.0
    return FSDP_OPS_PER_PARAM * MOE_LAYER_TENSORS
