"""The MoE family's cost description for the planner, torch-free: what a token costs in a
MoE model, in the terms the planner prices (GEMMs, parameters by where they live, FLOPs).
The planner's own formulas (plan/) turn these into time and memory; nothing here knows a
device.

- `token_gemms`: every matrix multiplication one token runs through, layer by layer, with
  the rows it contributes: attention's projections and the router (1 row), each routed
  projection (K rows: the token's K copies, in one grouped GEMM over the E experts, each
  expert's share T K / E rows of a micro-batch's T tokens on average), the shared experts
  and a dense layer's FFN (1 row), and the head.
- `param_split`: the parameters the routed experts hold (what expert parallelism shards)
  and the rest (dense: every rank of an ep group holds them).
- `moe_flops_per_token`: 6 FLOPs per multiplied parameter and row (forward, the input and
  the weight gradients) plus the attention scores' 12 L (n_head x head_dim) T, PaLM's
  count (Chowdhery et al., 2022, appendix B) with the active parameters for N.
- `ranks_per_token`, `routed_row_bytes`: where the routed copies go under expert
  parallelism: the ranks a token's experts fall on, and what the experts' rank keeps of
  each copy it computes (the part of a layer's activations that follows the routing).
- `layer_activation_bytes`: what autograd keeps of a token in layer i until backward,
  tensor by tensor as the model's code saves them (counted from its autograd graph with
  saved-tensor hooks, and against the doctor's fake-tensor simulation:
  tests/unit/test_moe_cost.py). The norms' share depends on the device's kernels, which
  the planner knows (plan/model/memory.py's rule for the GPT): it is passed in.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

from trainwise.models.moe.shapes import MoEShape


@dataclass(frozen=True)
class TokenGemm:
    """One matrix multiplication of a token: `rows` rows of `in_features` times an
    `in_features` x `out_features` weight (per expert, for the routed ones)."""

    name: str  # the module's name in a layer, as the model names it
    kind: str  # attention, router, experts, shared, dense, head
    in_features: int
    out_features: int
    rows: float = 1.0
    grouped: int = 0  # the experts a grouped GEMM runs over (0: a plain GEMM)

    @property
    def flops(self) -> float:
        """Forward FLOPs a token spends in it (2 a multiply-add)."""
        return 2.0 * self.rows * self.in_features * self.out_features


def layer_gemms(shape: MoEShape, i: int) -> list[TokenGemm]:
    """Layer i's GEMMs a token runs through."""
    return list(_layer_gemms(shape, i))


@lru_cache(maxsize=4096)
def _layer_gemms(shape: MoEShape, i: int) -> tuple[TokenGemm, ...]:
    """layer_gemms, cached (the planner asks of every layer for every candidate it
    prices; a TokenGemm is frozen, so the tuple is shared)."""
    d, hd = shape.d_model, shape.head_dim
    q, kv, m = shape.n_head * hd, shape.n_kv_head * hd, shape.moe
    out = [
        TokenGemm("attn.q_proj", "attention", d, q),
        TokenGemm("attn.k_proj", "attention", d, kv),
        TokenGemm("attn.v_proj", "attention", d, kv),
        TokenGemm("attn.out_proj", "attention", q, d),
    ]
    if not shape.is_moe_layer(i):
        f = m.d_dense
        return (*out, TokenGemm("mlp.gate", "dense", d, f), TokenGemm("mlp.up", "dense", d, f),
                TokenGemm("mlp.down", "dense", f, d))
    k, e, f = m.top_k, m.experts, m.d_expert
    out += [
        TokenGemm("moe.router.gate", "router", d, e),
        TokenGemm("moe.experts.gate_proj", "experts", d, f, rows=k, grouped=e),
        TokenGemm("moe.experts.up_proj", "experts", d, f, rows=k, grouped=e),
        TokenGemm("moe.experts.down_proj", "experts", f, d, rows=k, grouped=e),
    ]
    if m.shared_experts:
        s = m.shared_width
        out += [TokenGemm("moe.shared.gate", "shared", d, s), TokenGemm("moe.shared.up", "shared", d, s),
                TokenGemm("moe.shared.down", "shared", s, d)]
    return tuple(out)


def token_gemms(shape: MoEShape) -> list[TokenGemm]:
    """Every GEMM of a token through the model: the layers' in order, then the head (the
    embedding is a lookup)."""
    gemms = [g for i in range(shape.n_layer) for g in layer_gemms(shape, i)]
    return gemms + [TokenGemm("lm_head", "head", shape.d_model, shape.vocab_size)]


@dataclass(frozen=True)
class ParamSplit:
    """A MoE model's parameters by where they live under expert parallelism."""

    experts: int  # the routed experts' (sharded over ep, then over FSDP within)
    dense: int  # the rest: attention, router, shared experts, dense layers, embeddings

    @property
    def total(self) -> int:
        return self.experts + self.dense


def param_split(shape: MoEShape) -> ParamSplit:
    experts = shape.expert_total()
    return ParamSplit(experts=experts, dense=shape.num_params() - experts)


def attention_flops_per_token(shape: MoEShape, seq_len: int) -> float:
    """The attention scores and their values (forward and backward), per token: 12 L x
    (n_head x head_dim) x T (PaLM's count: the causal half not taken off)."""
    return 12.0 * shape.n_layer * shape.n_head * shape.head_dim * seq_len


@lru_cache(maxsize=256)
def moe_flops_per_token(shape: MoEShape, seq_len: int) -> float:
    """Model FLOPs per token of training (what MFU counts): 6 per multiplied parameter
    and row (each routed expert's K rows), plus the attention scores (cached: the planner
    asks for every candidate it prices)."""
    gemms = sum(3.0 * g.flops for g in token_gemms(shape))
    return gemms + attention_flops_per_token(shape, seq_len)


def layer_activation_bytes(
    shape: MoEShape, i: int, *, compute_bytes: int, norm_row: Callable[[int], float],
    micro_batch: int, seq_len: int, grouped: bool = False, token_split: int = 1,
) -> float:
    """Bytes per token that autograd keeps for layer i of a training micro-batch of
    `micro_batch` sequences of `seq_len`, the layer's parameters and the residual stream
    in `compute_bytes` a value (fp32, or FSDP's 16-bit parameter dtype; autocast's extra
    16-bit casts of the Linears' inputs are not counted here). `norm_row(w)`: the bytes
    one RMSNorm over a row of width w keeps, its input included (a device's kernels
    decide: the CPU's composite op keeps an fp32 normalised copy and the per-row rstd).
    `grouped`: the experts run as torch._grouped_mm (its int32 offsets). `token_split`:
    tensor parallelism's split of the MoE layer's tokens (models.moe.parallel): a tp rank
    routes 1 / tp of them, so the router's, the dispatch's and the routed copies' bytes
    are 1 / tp a token of the whole; the shared experts keep the gathered sequence.

    Attention (as the GPT's, heads of their own width): the norm, the projections' input,
    what SDPA keeps (the rotated q, and k, v repeated to every head under grouped-query
    attention, else as projected; its output and fp32 log-sum-exp a head) and the output
    projection's input; Qwen3's q/k norms, a norm per head. A MoE feed-forward: the norm
    and its output (the router reads it in fp32, a copy of it in 16-bit); the router's fp32
    scores and the K chosen ids (renormalised: the K weights and their sum); the dispatch's
    sort order and token ids (int64); per routed copy the rows (K a token), the gate and
    up outputs, the SiLU and the product (4 f), the down output and its unsorted copy
    (weighted on combine: 3 d in all, and the weight); the shared experts' 4 x their width;
    the balancing loss's [sequences, experts] (fp32). A leading dense layer: the norm, its
    output and a SwiGLU's 4 x d_dense."""
    e, h, hd = compute_bytes, shape.d_model, shape.head_dim
    q, kv, m = shape.n_head * hd, shape.n_kv_head * hd, shape.moe
    sdpa = 3 * q if shape.n_kv_head != shape.n_head else q + 2 * kv
    attention = norm_row(h) + e * (h + sdpa + 2 * q) + 4 * shape.n_head
    if shape.qk_norm:
        attention += shape.n_head * norm_row(hd) + shape.n_kv_head * norm_row(hd)
    if not shape.is_moe_layer(i):
        return attention + norm_row(h) + e * (h + 4 * m.d_dense)
    tokens, k = micro_batch * seq_len, m.top_k
    router = 4 * m.experts + 8 * k + (4 * k + 4 if m.renormalize else 0)
    if m.score == "sigmoid":
        router += 4  # the balancing loss normalises the scores: their sum
    if e != 4:  # the router's fp32 copies: of its input, and of its weight a micro-batch
        router += 4 * h + 4 * m.experts * h / tokens
    dispatch = 16 * k + (4 * m.experts / tokens if grouped else 0)
    experts = e * k * (3 * h + 4 * m.d_expert) + e * k
    balance = 4 * m.experts / seq_len
    # The norm's output: kept by the router's GEMM in fp32 (which reads a copy in 16-bit)
    # and by the shared experts' (under the tp split, the router's slice and the shared
    # experts' gathered copy apart).
    split = token_split
    kept = (h if m.shared_experts else 0) + (
        h / split if e == 4 and (split > 1 or not m.shared_experts) else 0)
    ffn = norm_row(h) + e * (kept + 4 * m.shared_width)
    return attention + ffn + (router + dispatch + experts + balance) / split


def ranks_per_token(shape: MoEShape, ep: int) -> float:
    """The ranks of an `ep`-way expert group a token's top_k experts fall on, on average
    when it routes uniformly (experts / ep on each rank): ep x (1 - the chance that none
    of its top_k distinct experts is on a given rank). A dispatcher that sends a token
    once to each rank holding any of its experts (DeepEP's: its dispatch layout counts
    tokens per rank) moves this many copies, where one a routed expert moves top_k."""
    m = shape.moe
    local, missed = m.experts // ep, 1.0
    for i in range(m.top_k):
        missed *= max(0, m.experts - local - i) / (m.experts - i)
    return ep * (1.0 - missed)


def routed_row_bytes(shape: MoEShape, compute_bytes: int) -> float:
    """Of `layer_activation_bytes`'s routed copies, what the rank that computes them keeps
    of one: its sorted row, the gate and up outputs, the SiLU and the product, the down
    output (the unsorted copy and its weight are the token's own rank's). Under expert
    parallelism the busiest rank keeps more of these than the mean."""
    return compute_bytes * (2 * shape.d_model + 4 * shape.moe.d_expert)
