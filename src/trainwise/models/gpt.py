"""A decoder-only GPT: its shape (`GPTShape`, with an exact analytic parameter count), the
named presets, and the module itself, built from self-contained `Block`s that the runtime
can wrap one by one with FSDP2 and activation checkpointing."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from trainwise.errors import ModelError

_NORMS = ("layernorm", "rmsnorm")
_MLPS = ("gelu", "swiglu")
_POS = ("learned", "rope")


@dataclass(frozen=True)
class GPTShape:
    """Everything that decides a GPT's parameters and FLOPs."""

    n_layer: int
    d_model: int
    n_head: int
    n_kv_head: int
    d_ff: int
    vocab_size: int
    max_seq_len: int
    norm: Literal["layernorm", "rmsnorm"]
    mlp: Literal["gelu", "swiglu"]
    pos: Literal["learned", "rope"]
    tie_embeddings: bool
    bias: bool
    # Rotary base frequency; only read when pos == "rope" (Llama 2: 1e4, Llama 3: 5e5).
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        problems: list[str] = []
        for name in (
            "n_layer",
            "d_model",
            "n_head",
            "n_kv_head",
            "d_ff",
            "vocab_size",
            "max_seq_len",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                problems.append(f"model shape {name} = {value!r}: must be a positive integer")
        for name, allowed in (("norm", _NORMS), ("mlp", _MLPS), ("pos", _POS)):
            if getattr(self, name) not in allowed:
                problems.append(
                    f"model shape {name} = {getattr(self, name)!r}: "
                    f"must be one of {', '.join(allowed)}"
                )
        if problems:  # the divisibility checks below need valid integers
            raise ModelError(problems)
        if self.d_model % self.n_head:
            problems.append(
                f"model shape d_model = {self.d_model} is not divisible by "
                f"n_head = {self.n_head}; pick n_head dividing d_model"
            )
        elif self.pos == "rope" and self.head_dim % 2:
            problems.append(
                f"model shape head_dim = d_model / n_head = {self.head_dim} is odd; "
                "rope needs an even head_dim, change d_model or n_head"
            )
        if self.n_head % self.n_kv_head:
            problems.append(
                f"model shape n_head = {self.n_head} is not divisible by "
                f"n_kv_head = {self.n_kv_head}; pick n_kv_head dividing n_head"
            )
        if not self.rope_theta > 0:
            problems.append(f"model shape rope_theta = {self.rope_theta!r}: must be > 0")
        if problems:
            raise ModelError(problems)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    def num_params(self) -> int:
        """Exact parameter count of `GPT(self)`, tied weights counted once."""
        d, f, v, hd = self.d_model, self.d_ff, self.vocab_size, self.head_dim
        q_dim, kv_dim = self.n_head * hd, self.n_kv_head * hd
        norm = d * (2 if self.norm == "layernorm" and self.bias else 1)
        attn = d * q_dim + 2 * d * kv_dim + q_dim * d
        n_in = 2 if self.mlp == "swiglu" else 1  # swiglu has a gate and an up projection
        mlp = n_in * d * f + f * d
        if self.bias:
            attn += q_dim + 2 * kv_dim + d
            mlp += n_in * f + d
        block = 2 * norm + attn + mlp
        total = v * d + self.n_layer * block + norm
        if self.pos == "learned":
            total += self.max_seq_len * d
        if not self.tie_embeddings:
            total += v * d
        return total


def _gpt2(n_layer: int, d_model: int, n_head: int) -> GPTShape:
    return GPTShape(
        n_layer=n_layer,
        d_model=d_model,
        n_head=n_head,
        n_kv_head=n_head,
        d_ff=4 * d_model,
        vocab_size=50257,
        max_seq_len=1024,
        norm="layernorm",
        mlp="gelu",
        pos="learned",
        tie_embeddings=True,
        bias=True,
    )


def _llama(
    n_layer: int,
    d_model: int,
    n_head: int,
    n_kv_head: int,
    d_ff: int,
    vocab_size: int,
    max_seq_len: int,
    tie: bool,
    rope_theta: float = 10000.0,
) -> GPTShape:
    return GPTShape(
        n_layer=n_layer,
        d_model=d_model,
        n_head=n_head,
        n_kv_head=n_kv_head,
        d_ff=d_ff,
        vocab_size=vocab_size,
        max_seq_len=max_seq_len,
        norm="rmsnorm",
        mlp="swiglu",
        pos="rope",
        tie_embeddings=tie,
        bias=False,
        rope_theta=rope_theta,
    )


PRESETS: dict[str, GPTShape] = {
    # CPU-sized, for tests and smoke runs (byte vocabulary).
    "tiny": GPTShape(
        n_layer=2,
        d_model=64,
        n_head=4,
        n_kv_head=4,
        d_ff=256,
        vocab_size=256,
        max_seq_len=128,
        norm="layernorm",
        mlp="gelu",
        pos="learned",
        tie_embeddings=True,
        bias=True,
    ),
    # CPU-friendly, Llama-style so the rmsnorm/swiglu/rope/GQA path gets real use (~6M).
    "small": GPTShape(
        n_layer=6,
        d_model=256,
        n_head=8,
        n_kv_head=4,
        d_ff=1024,
        vocab_size=256,
        max_seq_len=256,
        norm="rmsnorm",
        mlp="swiglu",
        pos="rope",
        tie_embeddings=True,
        bias=False,
    ),
    # openai-community/gpt2 config.json: n_layer 12, n_embd 768, n_head 12, n_positions 1024.
    "gpt2-124m": _gpt2(12, 768, 12),
    # openai-community/gpt2-medium config.json: n_layer 24, n_embd 1024, n_head 16.
    "gpt2-350m": _gpt2(24, 1024, 16),
    # meta-llama/Llama-3.2-1B config.json: 16 layers, hidden 2048, 32 heads, 8 kv heads,
    # intermediate 8192, vocab 128256, tied, rope_theta 5e5 (context cut to 2048 for planning).
    "llama-1b": _llama(16, 2048, 32, 8, 8192, 128256, 2048, tie=True, rope_theta=500000.0),
    # meta-llama/Llama-2-7b-hf config.json: 32 layers, hidden 4096, 32 heads, inter. 11008.
    "llama-7b": _llama(32, 4096, 32, 32, 11008, 32000, 4096, tie=False),
    # meta-llama/Llama-2-13b-hf config.json: 40 layers, hidden 5120, 40 heads, inter. 13824.
    "llama-13b": _llama(40, 5120, 40, 40, 13824, 32000, 4096, tie=False),
    # meta-llama/Llama-2-70b-hf config.json: 80 layers, hidden 8192, 64 heads, 8 kv heads,
    # intermediate 28672.
    "llama-70b": _llama(80, 8192, 64, 8, 28672, 32000, 4096, tie=False),
}


def _bare(cls: type[nn.Module], *args: object, **kwargs: object) -> nn.Module:
    """Build a layer without its default init: GPT.init_weights initialises every tensor once,
    so a model built here and one built on meta + to_empty + init_weights draw the same
    random numbers (and big meta builds skip wasted work)."""
    return cls(*args, device="meta", **kwargs).to_empty(device=torch.get_default_device())


def _norm(shape: GPTShape) -> nn.Module:
    if shape.norm == "rmsnorm":
        return _bare(nn.RMSNorm, shape.d_model, eps=1e-5)
    return _bare(nn.LayerNorm, shape.d_model, eps=1e-5, bias=shape.bias)


class Rotary(nn.Module):
    """Rotary position tables (cos/sin per position and frequency), kept as non-persistent
    buffers so they follow the block to any device and are rebuilt by `reset_buffers`."""

    def __init__(self, head_dim: int, max_seq_len: int, theta: float):
        super().__init__()
        self.head_dim, self.theta = head_dim, theta
        self.register_buffer("cos", torch.empty(max_seq_len, head_dim // 2), persistent=False)
        self.register_buffer("sin", torch.empty(max_seq_len, head_dim // 2), persistent=False)
        self.reset_buffers()

    @torch.no_grad()
    def reset_buffers(self) -> None:
        # Computed where the buffers live, so this also works on meta and after to_empty.
        dev = self.cos.device
        inv_freq = self.theta ** (
            -torch.arange(0, self.head_dim, 2, device=dev, dtype=torch.float32) / self.head_dim
        )
        pos = torch.arange(self.cos.shape[0], device=dev, dtype=torch.float32)
        angles = torch.outer(pos, inv_freq)
        self.cos.copy_(angles.cos())
        self.sin.copy_(angles.sin())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Rotate x[B, H, T, head_dim] by position (rotate-half layout, real arithmetic)."""
        t = x.shape[-2]
        cos, sin = self.cos[:t].to(x.dtype), self.sin[:t].to(x.dtype)
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class Attention(nn.Module):
    """Causal self-attention with grouped-query heads (n_kv_head <= n_head)."""

    def __init__(self, shape: GPTShape, dropout: float):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = shape.n_head, shape.n_kv_head, shape.head_dim
        q_dim, kv_dim = shape.n_head * self.head_dim, shape.n_kv_head * self.head_dim
        self.q_proj = _bare(nn.Linear, shape.d_model, q_dim, bias=shape.bias)
        self.kv_proj = _bare(nn.Linear, shape.d_model, 2 * kv_dim, bias=shape.bias)
        self.out_proj = _bare(nn.Linear, q_dim, shape.d_model, bias=shape.bias)
        self.rotary = (
            Rotary(self.head_dim, shape.max_seq_len, shape.rope_theta)
            if shape.pos == "rope"
            else None
        )
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.n_head, self.head_dim).transpose(1, 2)
        k, v = (
            self.kv_proj(x)
            .view(b, t, 2, self.n_kv_head, self.head_dim)
            .permute(2, 0, 3, 1, 4)
            .unbind(0)
        )
        if self.rotary is not None:
            q, k = self.rotary(q), self.rotary(k)
        if self.n_kv_head != self.n_head:
            # Plain repeat rather than SDPA's enable_gqa: every backend accepts it.
            k = k.repeat_interleave(self.n_head // self.n_kv_head, dim=1)
            v = v.repeat_interleave(self.n_head // self.n_kv_head, dim=1)
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        return self.out_proj(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    """Feed-forward: GELU (GPT-2) or SwiGLU (Llama)."""

    def __init__(self, shape: GPTShape):
        super().__init__()
        self.swiglu = shape.mlp == "swiglu"
        d, f, bias = shape.d_model, shape.d_ff, shape.bias
        self.up = _bare(nn.Linear, d, f, bias=bias)
        self.gate = _bare(nn.Linear, d, f, bias=bias) if self.swiglu else None
        self.down = _bare(nn.Linear, f, d, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate is not None:
            return self.down(F.silu(self.gate(x)) * self.up(x))
        return self.down(F.gelu(self.up(x), approximate="tanh"))


class Block(nn.Module):
    """One pre-norm transformer layer, forward(x) -> x; owns everything it needs (rope
    tables included) so FSDP and checkpoint wrappers can take it as a unit."""

    def __init__(self, shape: GPTShape, dropout: float = 0.0):
        super().__init__()
        self.norm1, self.attn = _norm(shape), Attention(shape, dropout)
        self.norm2, self.mlp = _norm(shape), MLP(shape)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.norm1(x)))
        return x + self.drop(self.mlp(self.norm2(x)))


class GPT(nn.Module):
    """Decoder-only language model: forward(idx[B, T]) -> logits[B, T, vocab]."""

    def __init__(self, shape: GPTShape, dropout: float = 0.0):
        super().__init__()
        if not 0.0 <= dropout < 1.0:
            raise ModelError(f"model.dropout = {dropout!r}: must be in [0, 1)")
        self.shape = shape
        self.tok_emb = _bare(nn.Embedding, shape.vocab_size, shape.d_model)
        self.pos_emb = (
            _bare(nn.Embedding, shape.max_seq_len, shape.d_model)
            if shape.pos == "learned"
            else None
        )
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(shape, dropout) for _ in range(shape.n_layer))
        self.norm = _norm(shape)
        # Tied: the head reuses tok_emb.weight in forward, so there is one Parameter that
        # survives to_empty/FSDP without re-tying.
        self.lm_head = (
            None
            if shape.tie_embeddings
            else _bare(nn.Linear, shape.d_model, shape.vocab_size, bias=False)
        )
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """GPT-2 style init of every parameter (and rebuild of the rope tables); safe on
        meta and after `to_empty`."""
        std = 0.02
        residual_std = std / math.sqrt(2 * self.shape.n_layer)
        for module in self.modules():
            if isinstance(module, nn.Linear | nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=std)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.LayerNorm | nn.RMSNorm):
                module.reset_parameters()
            elif isinstance(module, Rotary):
                module.reset_buffers()
        # Projections that write into the residual stream are scaled down by depth.
        for block in self.blocks:
            nn.init.normal_(block.attn.out_proj.weight, mean=0.0, std=residual_std)
            nn.init.normal_(block.mlp.down.weight, mean=0.0, std=residual_std)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        if t > self.shape.max_seq_len:
            raise ModelError(
                f"input length {t} exceeds the model's max_seq_len = "
                f"{self.shape.max_seq_len}; shorten the sequence or raise "
                "model.seq_len"
            )
        x = self.tok_emb(idx)
        if self.pos_emb is not None:
            x = x + self.pos_emb(torch.arange(t, device=idx.device))
        x = self.drop(x)
        for block in self.blocks:
            x = block(x)
        x = self.norm(x)
        if self.lm_head is None:
            return F.linear(x, self.tok_emb.weight)
        return self.lm_head(x)
