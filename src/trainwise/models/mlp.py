"""A plain MLP classifier for tabular data: hidden blocks (Linear + ReLU + Dropout) that the
runtime may wrap as units, then a linear head giving class logits."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from trainwise.errors import ModelError


class MLPClassifier(nn.Module):
    """forward(x[B, in_features]) -> logits[B, num_classes]."""

    def __init__(
        self,
        in_features: int,
        num_classes: int,
        hidden: Sequence[int] = (128, 128),
        dropout: float = 0.0,
    ):
        super().__init__()
        problems: list[str] = []
        for name, value in (("in_features", in_features), ("num_classes", num_classes)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                problems.append(f"model.{name} = {value!r}: must be a positive integer")
        bad = [h for h in hidden if isinstance(h, bool) or not isinstance(h, int) or h <= 0]
        if bad:
            problems.append(
                f"model.hidden = {list(hidden)!r}: every width must be a positive integer"
            )
        if not 0.0 <= dropout < 1.0:
            problems.append(f"model.dropout = {dropout!r}: must be in [0, 1)")
        if problems:
            raise ModelError(problems)
        widths = [in_features, *hidden]
        blocks = []
        for w_in, w_out in zip(widths[:-1], widths[1:], strict=True):
            layers: list[nn.Module] = [nn.Linear(w_in, w_out), nn.ReLU()]
            if dropout > 0:
                layers.append(nn.Dropout(dropout))
            blocks.append(nn.Sequential(*layers))
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Linear(widths[-1], num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)
