"""A decoder-only GPT built from self-contained `Block`s that the runtime can wrap one by
one with FSDP2 and activation checkpointing. Its shapes and presets are in `shapes`."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from trainwise.errors import ModelError
from trainwise.models.shapes import GPTShape, norm_impl_problem

INIT_STD = 0.02  # GPT-2's


def bare(cls: type[nn.Module], *args: object, **kwargs: object) -> nn.Module:
    """`cls(*args, **kwargs)` on the default device without its default init: trainwise's
    models initialise every tensor once, by name (`init_parameter`), so a model built whole
    and one built on meta + to_empty + filled draw the same random numbers, and big meta
    builds skip wasted work."""
    return cls(*args, device="meta", **kwargs).to_empty(device=torch.get_default_device())


def bare_embedding(rows: int, width: int) -> nn.Embedding:
    """bare's embedding, given its storage: nn.Embedding's own init draws with normal_,
    whose meta kernel imports torch._dynamo (about 1 s of a launcher's start-up on 2 cores)."""
    weight = torch.empty(rows, width, device=torch.get_default_device())
    return nn.Embedding(rows, width, _weight=weight)


class CompositeRMSNorm(nn.RMSNorm):
    """RMSNorm as a chain of fp32 elementwise operations, each its own kernel (torchtitan's
    RMSNorm of 2024, torchtitan/models/norms.py at 9dec370): the same weight and, to
    rounding, the same output as nn.RMSNorm's fused F.rms_norm, but every intermediate goes
    through memory and autograd keeps the fp32 input and the normalised output
    (model.norm_impl = "composite")."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        eps = self.eps if self.eps is not None else torch.finfo(h.dtype).eps
        y = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).type_as(x)
        return y * self.weight


def _norm(shape: GPTShape, impl: str = "fused") -> nn.Module:
    if shape.norm == "rmsnorm":
        cls = CompositeRMSNorm if impl == "composite" else nn.RMSNorm
        return bare(cls, shape.d_model, eps=shape.norm_eps)
    return bare(nn.LayerNorm, shape.d_model, eps=shape.norm_eps, bias=shape.bias)


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

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Rotate x[B, H, T, head_dim] by position (rotate-half layout, real arithmetic):
        0..T-1, or `positions` [B, T] (packed examples each start at 0)."""
        t = x.shape[-2]
        if positions is None:
            cos, sin = self.cos[:t].to(x.dtype), self.sin[:t].to(x.dtype)
        else:
            cos, sin = self.cos[positions][:, None].to(x.dtype), self.sin[positions][:, None].to(x.dtype)
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class Attention(nn.Module):
    """Causal self-attention with grouped-query heads (n_kv_head <= n_head)."""

    def __init__(self, shape: GPTShape, dropout: float):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = shape.n_head, shape.n_kv_head, shape.head_dim
        q_dim, kv_dim = shape.n_head * self.head_dim, shape.n_kv_head * self.head_dim
        # Separate projections, as Hugging Face Llama names them: a checkpoint maps one to
        # one (models.llama), and each shards on its own output dim.
        self.q_proj = bare(nn.Linear, shape.d_model, q_dim, bias=shape.bias)
        self.k_proj = bare(nn.Linear, shape.d_model, kv_dim, bias=shape.bias)
        self.v_proj = bare(nn.Linear, shape.d_model, kv_dim, bias=shape.bias)
        self.out_proj = bare(nn.Linear, q_dim, shape.d_model, bias=shape.bias)
        self.rotary = (
            Rotary(self.head_dim, shape.max_seq_len, shape.rope_theta)
            if shape.pos == "rope"
            else None
        )
        self.dropout = dropout

    def forward(
        self,
        x: torch.Tensor,
        *,
        positions: torch.Tensor | None = None,
        attn_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Causal attention over the sequence, or with `attn_mask` [B, 1, T, T] (True:
        attend) and `positions`, the layout of packed examples (packed_layout)."""
        b, t, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds n_head / tp of them.
        q = self.q_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        if self.rotary is not None:
            q, k = self.rotary(q, positions), self.rotary(k, positions)
        if self.n_kv_head != self.n_head:
            # Plain repeat rather than SDPA's enable_gqa: every backend accepts it.
            k = k.repeat_interleave(self.n_head // self.n_kv_head, dim=1)
            v = v.repeat_interleave(self.n_head // self.n_kv_head, dim=1)
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, dropout_p=self.dropout if self.training else 0.0,
            is_causal=attn_mask is None,
        )
        return self.out_proj(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    """Feed-forward: GELU (GPT-2) or SwiGLU (Llama)."""

    def __init__(self, shape: GPTShape):
        super().__init__()
        self.swiglu = shape.mlp == "swiglu"
        d, f, bias = shape.d_model, shape.d_ff, shape.bias
        self.up = bare(nn.Linear, d, f, bias=bias)
        self.gate = bare(nn.Linear, d, f, bias=bias) if self.swiglu else None
        self.down = bare(nn.Linear, f, d, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate is not None:
            return self.down(F.silu(self.gate(x)) * self.up(x))
        return self.down(F.gelu(self.up(x), approximate="tanh"))


class Block(nn.Module):
    """One pre-norm transformer layer, forward(x) -> x; owns everything it needs (rope
    tables included) so FSDP and checkpoint wrappers can take it as a unit."""

    def __init__(self, shape: GPTShape, dropout: float = 0.0, norm_impl: str = "fused"):
        super().__init__()
        self.norm1, self.attn = _norm(shape, norm_impl), Attention(shape, dropout)
        self.norm2, self.mlp = _norm(shape, norm_impl), MLP(shape)
        self.drop = nn.Dropout(dropout)

    def forward(
        self,
        x: torch.Tensor,
        *,
        positions: torch.Tensor | None = None,
        attn_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        # Keyword arguments: tensor parallelism's input layouts apply to x alone.
        x = x + self.drop(self.attn(self.norm1(x), positions=positions, attn_mask=attn_mask))
        return x + self.drop(self.mlp(self.norm2(x)))


def packed_layout(doc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For tokens tagged with their example [B, T] (several examples packed in a sequence):
    the positions, restarting at every example [B, T], and the attention mask [B, 1, T, T],
    causal and within an example only, so that no example sees another."""
    t = doc.shape[1]
    index = torch.arange(t, device=doc.device).expand_as(doc)
    starts = torch.ones_like(doc, dtype=torch.bool)
    starts[:, 1:] = doc[:, 1:] != doc[:, :-1]
    first = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values
    causal = torch.ones(t, t, dtype=torch.bool, device=doc.device).tril()
    same = doc[:, :, None] == doc[:, None, :]
    return index - first, (same & causal)[:, None]


class GPT(nn.Module):
    """Decoder-only language model: forward(idx[B, T]) -> logits[B, T, vocab]. `norm_impl`:
    its RMSNorms as torch's fused kernel or the composite fp32 chain (model.norm_impl)."""

    def __init__(self, shape: GPTShape, dropout: float = 0.0, norm_impl: str = "fused"):
        super().__init__()
        if not 0.0 <= dropout < 1.0:
            raise ModelError(f"model.dropout = {dropout!r}: must be in [0, 1)")
        if (problem := norm_impl_problem(shape, norm_impl)) is not None:
            raise ModelError(problem)
        self.shape = shape
        self.tok_emb = bare_embedding(shape.vocab_size, shape.d_model)
        self.pos_emb = (
            bare_embedding(shape.max_seq_len, shape.d_model)
            if shape.pos == "learned"
            else None
        )
        self.drop = nn.Dropout(dropout)
        # A pipeline stage (models.pipeline) holds some of them, in a ModuleDict keyed by
        # their index, so that every parameter keeps the whole model's name.
        self.blocks: nn.ModuleList | nn.ModuleDict = nn.ModuleList(
            Block(shape, dropout, norm_impl) for _ in range(shape.n_layer)
        )
        self.embeds = True  # False on pipeline stages after the first: they take activations
        self.norm = _norm(shape, norm_impl)
        # Tied: the head reuses tok_emb.weight in forward, so there is one Parameter that
        # survives to_empty/FSDP without re-tying.
        self.lm_head = (
            None
            if shape.tie_embeddings
            else bare(nn.Linear, shape.d_model, shape.vocab_size, bias=False)
        )
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """GPT-2 style init of every parameter (init_parameter, from the global RNG) and a
        rebuild of the rope tables; safe on meta and after `to_empty`."""
        for name, param in self.named_parameters():
            if not param.is_meta:  # nothing to draw (normal_'s meta kernel imports dynamo)
                self.init_parameter(name, param)
        for module in self.modules():
            if isinstance(module, Rotary):
                module.reset_buffers()

    @torch.no_grad()
    def init_parameter(
        self, name: str, tensor: torch.Tensor, generator: torch.Generator | None = None
    ) -> None:
        """Fill parameter `name` (or a full-size tensor standing for it): normal(0.02)
        weights, zero biases, unit norm scales; the projections that write into the
        residual stream scaled down by depth. The one place of these statistics: meta-device
        builds (run.materialize) draw each parameter with its own `generator`."""
        owner, leaf = name.split(".")[-2:]
        if owner.startswith("norm"):
            nn.init.ones_(tensor) if leaf == "weight" else nn.init.zeros_(tensor)
        elif leaf == "bias":
            nn.init.zeros_(tensor)
        elif name.endswith(("attn.out_proj.weight", "mlp.down.weight")):
            std = INIT_STD / math.sqrt(2 * self.shape.n_layer)
            nn.init.normal_(tensor, mean=0.0, std=std, generator=generator)
        else:
            nn.init.normal_(tensor, mean=0.0, std=INIT_STD, generator=generator)

    def layers(self) -> list[nn.Module]:
        """The blocks this model (or pipeline stage) holds, in order."""
        blocks = self.blocks
        return list(blocks.values() if isinstance(blocks, nn.ModuleDict) else blocks)

    def forward(self, idx: torch.Tensor, doc: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of idx[B, T]; with `doc` [B, T] (the example each token belongs to, from
        packed SFT data) attention stays inside each example and positions restart. A
        pipeline stage takes the previous stage's activations [B, T, d] instead of idx
        (unless it embeds) and returns them before the norm (unless it holds the norm)."""
        t = idx.shape[1]
        if t > self.shape.max_seq_len:
            raise ModelError(
                f"input length {t} exceeds the model's max_seq_len = "
                f"{self.shape.max_seq_len}; shorten the sequence or raise "
                "model.seq_len"
            )
        positions, mask = packed_layout(doc) if doc is not None else (None, None)
        x = self._embed(idx, positions) if self.embeds else idx
        for block in self.layers():
            x = block(x, positions=positions, attn_mask=mask)
        if self.norm is None:  # a pipeline stage before the last
            return x
        x = self.norm(x)
        if self.lm_head is None:
            return F.linear(x, self.tok_emb.weight)
        return self.lm_head(x)

    def _embed(self, idx: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        x = self.tok_emb(idx)
        if self.pos_emb is not None:
            whole = torch.arange(idx.shape[1], device=idx.device)
            at = positions if positions is not None else whole
            x = x + self.pos_emb(at)
        return self.drop(x)
