"""Tensor parallelism and pipeline stages of a Mixture-of-Experts model, as the planner
prices them: the dense model's rules (plan.model.tensor_parallel, plan.model.pipeline)
applied to the parts of a MoE layer that models.moe.parallel splits.

Tensor parallelism. The runtime's plan (models.moe.parallel.moe_tp_plan) splits
attention (q, k, v column-wise, the output row-wise: whole heads a rank), the leading
dense layers' FFN and the shared experts (gate and up column-wise, down row-wise) and
the embedding and head over the vocabulary, as the GPT's; the norms, the q/k norms, the
router and the routed experts stay whole on every tp rank. That is expert tensor
parallelism 1 (Megatron-Core's expert_tensor_parallel_size = 1, its MoE recipes'
setting): the experts are split by `ep` only. One tp rank is priced as a MoE model of its
share (`rank_shape`: 1/tp of the heads, of those FFN widths and of the vocabulary, the
rest whole), so its GEMMs, attention, bytes, parameters and activations follow from the
same code as tp = 1. The MoE layer splits the tokens over the tp ranks (the runtime's
TokenSplit, as Megatron-Core): a tp rank routes, exchanges and computes 1 / tp of them,
so the router's and the routed experts' GEMMs, the routing's bytes and activations and
the all-to-all are divided by tp (plan.moe.compute, plan.moe.memory, plan.moe.comm).
`ep` is borrowed from the data- and tensor-parallel ranks together, tp innermost, so an
ep group is ep consecutive ranks. The norms' activations are counted whole (the tp-alone
rule; sequence parallelism splits them: an over-count).

TP's collectives (plan.model.tensor_parallel.tp_collectives, `tp_per_layer` of them each
way a layer): attention's one; a dense layer's FFN one more; a MoE layer's shared experts
one more (the gather of the sequence and the reduce-scatter of their output, forward and
backward), and without sequence parallelism the all-gather of the routed output (half an
all-reduce's bytes); a MoE layer without shared experts under sequence parallelism none.

Pipeline stages: the GPT's split (models.stage_split), plan.model.pipeline's stage_part
rule on the stage's layers (`stage_part`): a stage is a MoE model of its blocks, the leading
dense layers on the first stage, its embeddings and head by where they live; the
schedules' bubble, micro-batches in flight and the stages' memory are the dense model's
formulas (plan.model.pipeline) over it. The zero-bubble schedules' passes count a
layer's active parameters (`zb_passes`).
"""

from __future__ import annotations

from dataclasses import replace
from functools import lru_cache
from typing import TYPE_CHECKING

from trainwise.models.moe.cost import layer_gemms
from trainwise.models.moe.shapes import MoEShape
from trainwise.plan.model.comm import Collective, Layout
from trainwise.plan.model.tensor_parallel import tp_collectives

if TYPE_CHECKING:
    from trainwise.plan.model.memory import Workload


@lru_cache(maxsize=256)
def rank_shape(shape: MoEShape, tp: int) -> MoEShape:
    """One of `tp` ranks' share of `shape` (see the module's docstring): its heads, its
    slice of the dense and shared FFNs and of the vocabulary; the router and the routed
    experts whole. The degrees are checked by models.moe.shapes.moe_tp_problems."""
    if tp == 1:
        return shape
    m = shape.moe
    shared = {"shared_experts": 1, "d_shared": m.shared_width // tp} if m.shared_experts else {}
    return replace(
        shape, n_head=shape.n_head // tp, n_kv_head=shape.n_kv_head // tp, d_head=shape.head_dim,
        vocab_size=shape.vocab_size // tp,
        moe=replace(m, d_dense=m.d_dense // tp, **shared),  # type: ignore[arg-type]
    )


@lru_cache(maxsize=1024)
def layers_params(shape: MoEShape) -> int:
    """Parameters of all the layers of `shape` (every expert counted; cached: the
    search's pipeline moments ask for it often)."""
    return sum(shape.layer_params(i) for i in range(shape.n_layer))


def tp_per_layer(shape: MoEShape, sequence_parallel: bool) -> float:
    """TP's collectives a layer runs each way, on average over the layers, in all-reduces
    of the residual stream (see the module's docstring)."""
    # A MoE layer: its shared experts' gather and reduce-scatter (one all-reduce), and
    # without sequence parallelism the all-gather of the routed output (half of one).
    moe = (1.0 if shape.moe.shared_experts else 0.0) + (0.0 if sequence_parallel else 0.5)
    ffn = [moe if shape.is_moe_layer(i) else 1.0 for i in range(shape.n_layer)]
    return 1.0 + sum(ffn) / shape.n_layer


def moe_tp_collectives(
    w: Workload, tp: int, recomputed: float, grad_accum: int, layout: Layout,
    sequence_parallel: bool,
) -> list[Collective]:
    """The TP traffic of one step of `w` (a MoE workload) through one rank's link."""
    shape = w.moe
    assert shape is not None
    return tp_collectives(shape, w.seq_len, w.micro_batch, w.precision, tp, recomputed,
                          grad_accum, layout, tp_per_layer(shape, sequence_parallel))


def stage_shape(shape: MoEShape, blocks: int, first: bool) -> MoEShape:
    """The MoE model of a stage of `blocks` layers: the leading dense layers on the first
    (assumed to fit in it; one MoE layer left, which the shape needs), none elsewhere."""
    dense = min(shape.moe.dense_layers, blocks - 1) if first else 0
    return replace(shape, n_layer=blocks, moe=replace(shape.moe, dense_layers=dense))


def outer_parts(shape: MoEShape) -> tuple[float, float]:
    """Parameters of (the embeddings' stage's extra: the token embedding, the head's
    stage's extra: the final norm and the head, or a tied head's copy of the embedding,
    which the runtime's last stage holds: models.pipeline.split_blocks)."""
    v, d = shape.vocab_size, shape.d_model
    return float(v * d), float(d + v * d)


def stage_part(w: Workload, blocks: int, embeddings: bool, head: bool) -> Workload:
    """`w` (a MoE workload) as a pipeline rank that holds `blocks` layers (and the
    embeddings, the head) computes it: the MoE model of its layers, the embeddings and head
    it holds (their parameters), the loss only on the head's rank
    (plan.model.pipeline.stage_part's rule; stage_workload adds what it holds in flight)."""
    assert w.moe is not None
    shape = stage_shape(w.moe, max(1, blocks), embeddings)
    embedding_params, head_params = outer_parts(w.moe)
    params = layers_params(shape) + (embedding_params if embeddings else 0.0)
    params += head_params if head else 0.0
    return replace(w, params=int(params), moe=shape, head=head)


def parts(w: Workload) -> tuple[float, float, float]:
    """(a layer's parameters on average, the embeddings' stage's extra, the head's
    stage's extra), as plan.model.pipeline._parts gives a GPT's."""
    assert w.moe is not None
    return (layers_params(w.moe) / w.moe.n_layer, *outer_parts(w.moe))


def zb_passes(shape: MoEShape, seq_len: int) -> tuple[float, float, float]:
    """(T_F, T_B, T_W) of a layer in FLOPs per token (plan.model.pipeline.zb_passes's
    rule): 2 per multiplied parameter and row of its GEMMs (the routed ones' top_k rows)
    forward, again for the input gradient and the weight gradient; attention's 4 s h
    forward and 2.5 times that in T_B; on average over the layers."""
    n = sum(g.flops for i in range(shape.n_layer) for g in layer_gemms(shape, i))
    n /= shape.n_layer
    attention = 4.0 * seq_len * shape.n_head * shape.head_dim
    return n + attention, n + 2.5 * attention, n
