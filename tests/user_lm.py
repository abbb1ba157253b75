"""A user's own language model, as a test names it (`model.name = "user_lm:build"`; the
tests put this folder on the workers' PYTHONPATH): nothing of trainwise's, the classic
shape (token embedding -> blocks -> final norm -> head), written as torchtitan's models
are so that trainwise can cut it into pipeline stages: the blocks in one `layers`
container, and a forward that skips the modules a stage lacks (None). Not a test."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    """Pre-norm causal self-attention and MLP, each added to the residual stream."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, t, d = h.shape
        q, k, v = self.qkv(self.norm1(h)).view(b, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = h + self.out(a.transpose(1, 2).reshape(b, t, d))
        return h + self.mlp(self.norm2(h))


CONTAINERS = {"dict": nn.ModuleDict, "list": nn.ModuleList, "sequential": nn.Sequential}


class UserLM(nn.Module):
    """forward(tokens [B, T]) -> logits [B, T, vocab]; `tie`: the head's weight is the
    embedding's; `blocks`: the container kind of `layers`."""

    def __init__(self, vocab: int = 256, dim: int = 32, n_blocks: int = 4, heads: int = 2,
                 tie: bool = False, blocks: str = "dict"):
        super().__init__()
        self.tok_emb = nn.Embedding(vocab, dim)
        made = [Block(dim, heads) for _ in range(n_blocks)]
        kind = CONTAINERS[blocks]
        self.layers = kind({str(i): b for i, b in enumerate(made)}) if kind is nn.ModuleDict \
            else kind(*made) if kind is nn.Sequential else kind(made)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        if tie:
            self.head.weight = self.tok_emb.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_emb(tokens) if self.tok_emb is not None else tokens
        blocks = self.layers.values() if isinstance(self.layers, nn.ModuleDict) else self.layers
        for block in blocks:
            h = block(h)
        h = self.norm(h) if self.norm is not None else h
        return self.head(h) if self.head is not None else h

    @torch.no_grad()
    def init_parameter(self, name: str, tensor: torch.Tensor, generator: torch.Generator) -> None:
        """Built on the meta device and filled parameter by parameter (trainwise's
        protocol): normal(0.02) matrices and embeddings, unit norm scales, zero biases."""
        if name.endswith("bias"):
            tensor.zero_()
        elif tensor.dim() == 1:
            tensor.fill_(1.0)
        else:
            tensor.normal_(0.0, 0.02, generator=generator)


def build(**kwargs: object) -> UserLM:
    """The factory `model.name` names; `model.kwargs` go to UserLM."""
    return UserLM(**kwargs)  # type: ignore[arg-type]


def smoothed_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Cross entropy with label smoothing: not trainwise's default loss, so a run that
    lost the factory's loss on the way would show it."""
    return F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1),
                           label_smoothing=0.1)


def build_with_loss(**kwargs: object) -> tuple[UserLM, object]:
    """A factory that returns its own loss beside the module."""
    return build(**kwargs), smoothed_loss
