"""Mixture-of-Experts shapes as plain data: what decides a MoE model's parameters and
FLOPs, its exact parameter count (total, and active per token), and the named presets. No
torch here, so that the planner sizes Qwen3-235B without importing it.

A `MoEShape` is its own type, not a GPTShape with a field more: its backbone is Llama's
(RMSNorm, rope, SwiGLU, no biases; optionally Qwen3's per-head q/k norms and a head width
of its own), its feed-forward is `MoESpec`'s. It has no `d_ff` and no `mlp`, which every
dense formula of the planner reads, so a MoE shape handed to one fails on the spot instead
of being priced as a dense model of the same total size (which would cost every expert's
FLOPs on every token). The dense formulas stay as they are, for dense shapes only.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal

from trainwise.errors import ModelError
from trainwise.models.shapes import indivisible_by_tp

ScoreFunction = Literal["softmax", "sigmoid"]
_SCORES = ("softmax", "sigmoid")


@dataclass(frozen=True)
class MoESpec:
    """The feed-forward of a MoE model's layers: what decides their parameters, their
    FLOPs per token and how a token is routed."""

    experts: int  # routed experts per MoE layer (E)
    top_k: int  # routed experts each token goes to (K)
    d_expert: int  # FFN width of each routed expert (a SwiGLU: gate, up, down)
    shared_experts: int = 0  # experts every token goes through beside its K routed ones
    d_shared: int = 0  # FFN width of each shared expert; 0: d_expert
    dense_layers: int = 0  # leading layers with a dense SwiGLU FFN instead (DeepSeek's
    d_dense: int = 0  # first_k_dense_replace), of this width
    score: ScoreFunction = "softmax"  # the router's scores over the experts
    renormalize: bool = True  # the K chosen scores rescaled to sum to 1 (Qwen3 norm_topk_prob)
    route_scale: float = 1.0  # the routed output multiplied by this (DeepSeek-V3: 2.5)

    @property
    def shared_width(self) -> int:
        """The shared experts' total FFN width: N shared experts of width w are one SwiGLU
        of width N x w (what Hugging Face's DeepSeek and Qwen2-MoE build), in parameters
        and FLOPs alike."""
        return self.shared_experts * (self.d_shared or self.d_expert)


@dataclass(frozen=True)
class MoEShape:
    """Everything that decides a MoE decoder's parameters and FLOPs: a Llama-style
    backbone (RMSNorm, rope, no biases) whose FFNs are `moe`'s (its leading
    `moe.dense_layers` dense, the others routed experts)."""

    n_layer: int
    d_model: int
    n_head: int
    n_kv_head: int
    vocab_size: int
    max_seq_len: int
    moe: MoESpec
    d_head: int = 0  # width of a head; 0: d_model / n_head (Qwen3: 128 whatever d_model)
    qk_norm: bool = False  # an RMSNorm over each query and key head before rope (Qwen3)
    tie_embeddings: bool = False
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    # Where the shape's figures come from (a config.json), for the plan's notes.
    source: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        problems = _positive(self, ("n_layer", "d_model", "n_head", "n_kv_head", "vocab_size",
                                    "max_seq_len"))
        problems += _positive(self.moe, ("experts", "top_k", "d_expert"), "moe.")
        for name in ("d_head",):
            if not _whole(getattr(self, name)):
                problems.append(f"model shape {name} = {getattr(self, name)!r}: must be a "
                                "whole number >= 0")
        for name in ("shared_experts", "d_shared", "dense_layers", "d_dense"):
            if not _whole(getattr(self.moe, name)):
                problems.append(f"model shape moe.{name} = {getattr(self.moe, name)!r}: must "
                                "be a whole number >= 0")
        if problems:  # the checks below need valid integers
            raise ModelError(problems)
        m = self.moe
        if m.top_k > m.experts:
            problems.append(
                f"model shape moe.top_k = {m.top_k} exceeds the moe.experts = {m.experts}: "
                "a token cannot go to more experts than there are; lower top_k"
            )
        if m.score not in _SCORES:
            problems.append(f"model shape moe.score = {m.score!r}: must be one of "
                            f"{', '.join(_SCORES)}")
        if m.dense_layers >= self.n_layer:
            problems.append(
                f"model shape moe.dense_layers = {m.dense_layers} leaves no MoE layer of the "
                f"{self.n_layer}: use fewer dense layers (or a dense GPT)"
            )
        if m.dense_layers and not m.d_dense:
            problems.append(
                f"model shape moe.dense_layers = {m.dense_layers} needs moe.d_dense, the "
                "width of their FFN"
            )
        if not m.route_scale > 0:
            problems.append(f"model shape moe.route_scale = {m.route_scale!r}: must be > 0")
        if not self.d_head and self.d_model % self.n_head:
            problems.append(
                f"model shape d_model = {self.d_model} is not divisible by n_head = "
                f"{self.n_head}; pick n_head dividing d_model, or give d_head"
            )
        elif self.head_dim % 2:
            problems.append(f"model shape head_dim = {self.head_dim} is odd; rope needs an "
                            "even head width")
        if self.n_head % self.n_kv_head:
            problems.append(
                f"model shape n_head = {self.n_head} is not divisible by n_kv_head = "
                f"{self.n_kv_head}; pick n_kv_head dividing n_head"
            )
        if not self.norm_eps > 0 or not self.rope_theta > 0:
            problems.append("model shape norm_eps and rope_theta must be > 0")
        if problems:
            raise ModelError(problems)

    @property
    def head_dim(self) -> int:
        return self.d_head or self.d_model // self.n_head

    @property
    def moe_layers(self) -> int:
        """Layers whose FFN is routed experts (the others are the leading dense ones)."""
        return self.n_layer - self.moe.dense_layers

    def is_moe_layer(self, i: int) -> bool:
        return i >= self.moe.dense_layers

    def attention_params(self) -> int:
        """One layer's attention: q, k, v, out projections and the q/k head norms."""
        d, q, kv = self.d_model, self.n_head * self.head_dim, self.n_kv_head * self.head_dim
        return d * q + 2 * d * kv + q * d + (2 * self.head_dim if self.qk_norm else 0)

    def expert_params(self) -> int:
        """One routed expert (SwiGLU: gate and up d x f, down f x d)."""
        return 3 * self.d_model * self.moe.d_expert

    def router_params(self) -> int:
        """One MoE layer's router (a d x E gate, no bias; the aux-loss-free balancing's
        per-expert bias is a buffer, not a parameter)."""
        return self.d_model * self.moe.experts

    def shared_params(self) -> int:
        """One MoE layer's shared experts."""
        return 3 * self.d_model * self.moe.shared_width

    def dense_ffn_params(self) -> int:
        """One leading dense layer's FFN."""
        return 3 * self.d_model * self.moe.d_dense

    def layer_params(self, i: int) -> int:
        """Layer i: its two norms, attention and FFN (all its routed experts)."""
        base = 2 * self.d_model + self.attention_params()
        if not self.is_moe_layer(i):
            return base + self.dense_ffn_params()
        return (base + self.router_params() + self.shared_params()
                + self.moe.experts * self.expert_params())

    def outer_params(self) -> int:
        """Outside the layers: the token embedding, the final norm and an untied head."""
        v, d = self.vocab_size, self.d_model
        return v * d + d + (0 if self.tie_embeddings else v * d)

    def num_params(self) -> int:
        """Exact parameter count of the model, every expert counted, tied weights once."""
        return self.outer_params() + sum(self.layer_params(i) for i in range(self.n_layer))

    def expert_total(self) -> int:
        """Parameters of all the routed experts (what expert parallelism shards)."""
        return self.moe_layers * self.moe.experts * self.expert_params()

    def active_params(self) -> int:
        """Parameters a token runs through: all but the routed experts it does not go to
        (K of E in each MoE layer; the router, shared experts and dense layers always).
        The embedding counts, as in the published "active" figures."""
        idle = self.moe_layers * (self.moe.experts - self.moe.top_k) * self.expert_params()
        return self.num_params() - idle


def _whole(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _positive(obj: object, names: tuple[str, ...], prefix: str = "") -> list[str]:
    return [
        f"model shape {prefix}{name} = {getattr(obj, name)!r}: must be a positive integer"
        for name in names
        if not _whole(getattr(obj, name)) or getattr(obj, name) == 0
    ]


def _mixtral(n_layer: int, d_model: int, n_head: int, d_expert: int, max_seq: int,
             source: str) -> MoEShape:
    return MoEShape(
        n_layer=n_layer, d_model=d_model, n_head=n_head, n_kv_head=8, vocab_size=32000,
        max_seq_len=max_seq, moe=MoESpec(experts=8, top_k=2, d_expert=d_expert),
        rope_theta=1e6, norm_eps=1e-5, source=source,
    )


def _qwen3(n_layer: int, d_model: int, n_head: int, d_expert: int, source: str) -> MoEShape:
    return MoEShape(
        n_layer=n_layer, d_model=d_model, n_head=n_head, n_kv_head=4, vocab_size=151936,
        max_seq_len=40960, moe=MoESpec(experts=128, top_k=8, d_expert=d_expert),
        d_head=128, qk_norm=True, rope_theta=1e6, norm_eps=1e-6, source=source,
    )


MOE_PRESETS: dict[str, MoEShape] = {
    # CPU-sized, for tests and smoke runs (byte vocabulary): 8 experts top-2 and a shared
    # expert, so that every part of the layer runs.
    "moe-tiny": MoEShape(
        n_layer=2, d_model=64, n_head=4, n_kv_head=2, vocab_size=256, max_seq_len=128,
        moe=MoESpec(experts=8, top_k=2, d_expert=32, shared_experts=1),
        source="trainwise's CPU-sized MoE",
    ),
    # mistralai/Mixtral-8x7B-v0.1 config.json: 32 layers, hidden 4096, 32 heads, 8 kv
    # heads, intermediate 14336, 8 local experts, 2 per token, vocab 32000, rope_theta 1e6,
    # max_position_embeddings 32768. 46.7B parameters, 12.9B active (Jiang et al., 2024).
    "mixtral-8x7b": _mixtral(32, 4096, 32, 14336, 32768,
                             "mistralai/Mixtral-8x7B-v0.1 config.json"),
    # mistralai/Mixtral-8x22B-v0.1 config.json: 56 layers, hidden 6144, 48 heads, 8 kv
    # heads, intermediate 16384, 8 experts, 2 per token, vocab 32000, rope_theta 1e6,
    # max_position_embeddings 65536. 141B parameters, 39B active (Mistral AI, 2024).
    "mixtral-8x22b": _mixtral(56, 6144, 48, 16384, 65536,
                              "mistralai/Mixtral-8x22B-v0.1 config.json"),
    # Qwen/Qwen3-30B-A3B config.json: 48 layers, hidden 2048, 32 heads of 128, 4 kv heads,
    # moe_intermediate_size 768, 128 experts, 8 per token, norm_topk_prob, vocab 151936,
    # untied, rope_theta 1e6, rms_norm_eps 1e-6, q/k norms. 30.5B parameters, 3.3B active.
    "qwen3-30b-a3b": _qwen3(48, 2048, 32, 768, "Qwen/Qwen3-30B-A3B config.json"),
    # Qwen/Qwen3-235B-A22B config.json: 94 layers, hidden 4096, 64 heads of 128, 4 kv
    # heads, moe_intermediate_size 1536, 128 experts, 8 per token. 235B parameters, 22B
    # active.
    "qwen3-235b-a22b": _qwen3(94, 4096, 64, 1536, "Qwen/Qwen3-235B-A22B config.json"),
    # deepseek-ai/deepseek-moe-16b-base config.json (multi-head attention, not MLA): 28
    # layers, hidden 2048, 16 heads, the first layer dense (first_k_dense_replace 1,
    # intermediate 10944), then 64 routed experts of 1408, 6 per token, softmax scores
    # not renormalised (norm_topk_prob false) and 2 shared experts; vocab 102400, max
    # positions 4096, rms_norm_eps 1e-6. 16.4B parameters, 2.8B active (Dai et al., 2024).
    "deepseek-moe-16b": MoEShape(
        n_layer=28, d_model=2048, n_head=16, n_kv_head=16, vocab_size=102400,
        max_seq_len=4096,
        moe=MoESpec(experts=64, top_k=6, d_expert=1408, shared_experts=2, dense_layers=1,
                    d_dense=10944, renormalize=False),
        norm_eps=1e-6, source="deepseek-ai/deepseek-moe-16b-base config.json",
    ),
    # Not here: DeepSeek-V2/V3 and Kimi K2 (multi-head latent attention, whose low-rank
    # projections this backbone does not model), gpt-oss (attention sinks, biases),
    # Llama 4 (interleaved and chunked attention), Qwen2-MoE (gated shared expert, qkv
    # biases).
}


def moe_job_shape(name: str, vocab_size: int | None = None,
                  seq_len: int | None = None) -> MoEShape:
    """MoE preset `name` as a job builds it: the job's vocabulary and sequence length
    replace the preset's (rope positions are no parameters: only the vocabulary changes
    the count). Training and the planner size the model here, so that they agree."""
    overrides: dict[str, int] = {}
    if vocab_size is not None:
        overrides["vocab_size"] = vocab_size
    if seq_len is not None:
        overrides["max_seq_len"] = seq_len
    return replace(MOE_PRESETS[name], **overrides)


def moe_tp_problems(s: MoEShape, tp: int, seq_len: int, sequence_parallel: bool) -> list[str]:
    """What keeps a MoE shape from splitting `tp` ways, one line each (empty: it splits)."""
    sizes = {
        "model heads (n_head)": s.n_head,
        "key/value heads (n_kv_head)": s.n_kv_head,
        "vocabulary (vocab_size)": s.vocab_size,
    }
    if s.moe.shared_experts:
        sizes["shared experts' width (moe.shared_experts x d_shared)"] = s.moe.shared_width
    if s.moe.dense_layers:
        sizes["dense layers' FFN width (moe.d_dense)"] = s.moe.d_dense
    # The MoE layer splits the sequence over the tp ranks (models.moe.parallel), with or
    # without sequence parallelism.
    sizes["sequence length (data.seq_len)"] = seq_len
    return indivisible_by_tp(sizes, tp)
