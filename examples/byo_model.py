"""Bring your own model: a factory that returns the module and, optionally, a loss.

trainwise imports it by path (`model.name = "byo_model:build"`) with the keyword arguments
of `[model.kwargs]`. Blocks listed in a `blocks` ModuleList become FSDP units and
activation-checkpointing units, like the built-in GPT's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Residual(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.ff = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.ff(self.norm(x))


class TinyConvNet(nn.Module):
    """Digits (64 pixels) -> a 1-D convolution stem -> residual MLP blocks -> 10 classes."""

    def __init__(self, width: int, depth: int):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv1d(1, 8, kernel_size=3, padding=1), nn.GELU())
        self.proj = nn.Linear(8 * 64, width)
        self.blocks = nn.ModuleList(Residual(width) for _ in range(depth))
        self.head = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(self.stem(x.unsqueeze(1)).flatten(1))
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def label_smoothed_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits, target, label_smoothing=0.05)


def build(width: int = 64, depth: int = 2) -> tuple[nn.Module, object]:
    return TinyConvNet(width, depth), label_smoothed_loss
