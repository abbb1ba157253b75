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
"""

from __future__ import annotations

from dataclasses import dataclass

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
        return out + [TokenGemm("mlp.gate", "dense", d, f), TokenGemm("mlp.up", "dense", d, f),
                      TokenGemm("mlp.down", "dense", f, d)]
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
    return out


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


def moe_flops_per_token(shape: MoEShape, seq_len: int) -> float:
    """Model FLOPs per token of training (what MFU counts): 6 per multiplied parameter
    and row (each routed expert's K rows), plus the attention scores."""
    gemms = sum(3.0 * g.flops for g in token_gemms(shape))
    return gemms + attention_flops_per_token(shape, seq_len)
