"""The cost description of a Mixture-of-Experts model: the facts of its shape that the
planner prices (plan/moe), in one place and without torch. What a token multiplies (each
GEMM by shape, and how many of a micro-batch's rows it sees), which parameters are dense
and which are the routed experts that expert parallelism shards, its model FLOPs, and what
autograd keeps per token of a MoE block.

The activations are counted from the structure torchtitan's MoE has
(torchtitan/models/common/moe.py and token_dispatcher.py), the one trainwise's model
follows: a router whose gate runs in fp32 (softmax or sigmoid scores, top-k indices,
their scores gathered and renormalised), the routed tokens sorted by expert (argsort,
then an index gather), the experts as grouped GEMMs over the sorted tokens (SwiGLU: gate,
up, their product, down), the combine (the outputs upcast to fp32, scaled by their scores,
scatter-added back to their tokens), and the shared experts beside them. Until trainwise's
own model can be traced on fake tensors (doctor/simulate.py), these counts are by hand.
"""

from __future__ import annotations

from functools import lru_cache

from trainwise.models.moe.shapes import MoEShape
from trainwise.models.shapes import LinearShape

FP32 = 4  # the router's gate and scores, the combine's upcast, a norm's rstd
INDEX = 8  # int64: top-k ids, the sort order, the token of each routed row


def attention_linears(shape: MoEShape) -> tuple[LinearShape, ...]:
    """One layer's attention projections (q, k, v, out), one row a token."""
    d, q, kv = shape.d_model, shape.n_head * shape.head_dim, shape.n_kv_head * shape.head_dim
    return (LinearShape(d, q, False), LinearShape(d, kv, False), LinearShape(d, kv, False),
            LinearShape(q, d, False))


def swiglu_linears(d_model: int, width: int, rows: float = 1.0) -> tuple[LinearShape, ...]:
    """A SwiGLU feed-forward of `width`: gate and up (d -> width), down (width -> d)."""
    if not width:
        return ()
    return (LinearShape(d_model, width, False, rows), LinearShape(d_model, width, False, rows),
            LinearShape(width, d_model, False, rows))


def dense_linears(shape: MoEShape, moe_layer: bool) -> tuple[LinearShape, ...]:
    """The GEMMs every token of a layer runs: the attention, then on a MoE layer the router
    (d -> experts) and the shared experts, on a leading dense layer its dense FFN."""
    m = shape.moe
    if not moe_layer:
        return attention_linears(shape) + swiglu_linears(shape.d_model, m.d_dense)
    router = LinearShape(shape.d_model, m.experts, False)
    return (*attention_linears(shape), router, *swiglu_linears(shape.d_model, m.shared_width))


def expert_linears(shape: MoEShape) -> tuple[LinearShape, ...]:
    """One routed expert's GEMMs, with the rows it sees per token of the micro-batch on
    average: top_k / experts (each token goes to top_k of the experts)."""
    m = shape.moe
    return swiglu_linears(shape.d_model, m.d_expert, m.top_k / m.experts)


def routed_rows(shape: MoEShape, tokens: float, ep: int = 1) -> float:
    """Rows each routed expert multiplies on average when each of `ep` ranks routes
    `tokens` tokens: the ep group's tokens x top_k spread over the experts."""
    return tokens * ep * shape.moe.top_k / shape.moe.experts


def ranks_per_token(shape: MoEShape, ep: int) -> float:
    """The ranks of an `ep`-way expert group a token's top_k experts fall on, on average
    when it routes uniformly (experts / ep on each rank): ep x (1 - the chance that none
    of its top_k distinct experts is on a given rank). A dispatcher that sends a token
    once to each rank holding any of its experts (DeepEP's: its dispatch layout counts
    tokens per rank) moves this many copies, where one per routed expert moves top_k."""
    m = shape.moe
    local, missed = m.experts // ep, 1.0
    for i in range(m.top_k):
        missed *= max(0, m.experts - local - i) / (m.experts - i)
    return ep * (1.0 - missed)


@lru_cache(maxsize=256)
def dense_params(shape: MoEShape) -> int:
    """Every parameter but the routed experts': the embeddings, head, norms, attention,
    routers, shared experts and leading dense FFNs (sharded by FSDP like a dense model's)."""
    return shape.num_params() - shape.expert_total()


def outer_params(shape: MoEShape) -> int:
    """Outside the layers: the embeddings, the final norm and an untied head."""
    return shape.outer_params()


def matmul_active_params(shape: MoEShape) -> int:
    """Active parameters that multiply activations: the token embedding is a lookup (a
    tied head multiplies)."""
    lookup = 0 if shape.tie_embeddings else shape.vocab_size * shape.d_model
    return shape.active_params() - lookup


@lru_cache(maxsize=256)
def flops_per_token(shape: MoEShape, seq_len: int) -> float:
    """Model FLOPs per token (what MFU counts): 6 per active matmul parameter (forward,
    input and weight gradients: the router's gate and the top_k experts a token goes to,
    not the others) plus the attention's score and value matmuls, 12 x layers x the query
    width x the sequence (nanoGPT's 6N + 12·L·H·Q·T with H·Q the query width, which is not
    d_model for Qwen3's 128-wide heads)."""
    q = shape.n_head * shape.head_dim
    return 6.0 * matmul_active_params(shape) + 12.0 * shape.n_layer * q * seq_len


def activation_bytes_per_token(
    shape: MoEShape, compute: int, norm_out: int, residual: int, autocast: bool
) -> dict[str, float]:
    """Bytes autograd keeps per token of the micro-batch, by part of a layer (torchtitan's
    structure, see the module's docstring): `compute` bytes of the GEMMs' dtype,
    `norm_out` of the norms' outputs (fp32 under autocast), `residual` of the residual
    stream; under `autocast` each linear keeps its own 16-bit cast of an fp32 norm output.

    - `attention`: its norm's input and output (or the three casts), the q/k norms' inputs
      and rstd (Qwen3), what SDPA keeps of q, k, v (rotated; k and v repeated for
      grouped-query attention), its output and log-sum-exp, the out projection's input;
    - `moe_ffn` (on the token's own rank): the norm's input and output, the router's fp32
      copy of it (its gate runs in fp32), the scores (fp32 x experts), the top-k ids, the
      renormalisation's operands, the sort order and each routed row's token (int64), the
      combine's fp32 upcast of the outputs and their scores (top_k of each), the shared
      experts' SwiGLU intermediates;
    - `routed` (on the experts' rank, per token routed there, top_k a token on average):
      the sorted input row and the expert's SwiGLU intermediates (gate, silu, up, product);
    - `dense_ffn`: a leading dense layer's feed-forward (DeepSeek's), as a dense block's;
    - `routed_working`, `working`: the gradients of the intermediates while a block runs
      its backward (per routed token, and per token);
    - `head`, `head_norm`, `loss`: the final norm and the loss's fp32 log-softmax, as the
      dense GPT's (plan.model.memory).
    """
    h, v, m = shape.d_model, shape.vocab_size, shape.moe
    q, kv = shape.n_head * shape.head_dim, shape.n_kv_head * shape.head_dim
    e = compute
    cast = 3 if autocast else 1  # q, k, v each keep their cast under autocast
    qkv = 3 * q if shape.n_kv_head != shape.n_head else q + 3 * kv
    qk_norms = e * (q + kv) + FP32 * (shape.n_head + shape.n_kv_head) if shape.qk_norm else 0
    attention = residual * h + cast * e * h + qk_norms + e * qkv + 2 * e * q + FP32 * shape.n_head
    shared = m.shared_width
    # The FFN's norm output: the router's gate keeps it in fp32 (a copy, unless it is fp32
    # already), the shared experts' gate and up keep it too (each its own 16-bit cast
    # under autocast).
    ffn_in = residual * h + FP32 * h
    if shared and autocast:
        ffn_in += 2 * e * h
    elif shared and norm_out != FP32:
        ffn_in += norm_out * h
    router = FP32 * m.experts + INDEX * m.top_k + (FP32 * m.top_k + FP32 if m.renormalize else 0)
    sort = 2 * INDEX * m.top_k
    combine = m.top_k * (FP32 * h + FP32)
    moe_ffn = ffn_in + router + sort + combine + 4 * e * shared
    dense_ffn = residual * h + (2 if autocast else 1) * e * h + 4 * e * m.d_dense
    routed = e * h + 4 * e * m.d_expert
    loss = FP32 if (autocast or e == FP32) else e
    head_norm = residual * h + e * h
    return {
        "attention": attention, "moe_ffn": moe_ffn, "routed": routed, "dense_ffn": dense_ffn,
        "routed_working": e * (3 * m.d_expert + h),
        "working": e * 3 * max(shared, m.d_dense) + residual * h,
        "block_input": residual * h, "head": head_norm + 3 * loss * v, "head_norm": head_norm,
        "loss": loss * v,
    }
