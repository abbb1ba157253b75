"""Your batches as the training step takes them: a tuple of tensors (inputs, target,
*more inputs). The step calls `model(inputs, *more)` and `loss(output, target)`
(run/engine/step.py's Batch), on one part or on pipeline stages alike.

What `data.collate` (default torch's default_collate) returns becomes that tuple:
- a tuple or list (inputs, target, *more): kept as it is; every item must be a tensor.
- a dict: the target is its entry "labels", "label" or "target" (exactly one of them);
  the other tensor entries, in the dict's order, are the model's inputs:
  {"input_ids": a, "attention_mask": m, "labels": y} calls model(a, m). Entries that are
  not tensors (a text column left in the rows) are left out.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from trainwise.errors import DataError

TARGET_KEYS = ("labels", "label", "target")

Batch = tuple[torch.Tensor, ...]


def _kind(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"tensor{list(value.shape)}"
    return type(value).__name__


def _from_dict(collated: Mapping[str, Any], where: str) -> Batch:
    targets = [k for k in TARGET_KEYS if k in collated]
    if len(targets) != 1:
        found = "none of" if not targets else f"{len(targets)} of"
        raise DataError(
            f"{where} makes dict batches with keys {sorted(collated)}: {found} "
            f"{', '.join(repr(k) for k in TARGET_KEYS)}; name the target exactly one of them, "
            "or make batches (inputs, target)"
        )
    target = collated[targets[0]]
    inputs = [v for k, v in collated.items() if k != targets[0] and isinstance(v, torch.Tensor)]
    if not isinstance(target, torch.Tensor) or not inputs:
        what = f"{targets[0]!r} is a {_kind(target)}" if not isinstance(target, torch.Tensor) else (
            "no other entry is a tensor"
        )
        raise DataError(
            f"{where} makes dict batches with keys {sorted(collated)} whose {what}; the step "
            "needs tensor inputs and a tensor target: return tensors from the dataset (a "
            "Hugging Face dataset: .with_format('torch')) or give data.collate"
        )
    return (inputs[0], target, *inputs[1:])


def as_batch(collated: Any, where: str) -> Batch:
    """The step's (inputs, target, *more) from a collated batch; `where` names what made it
    (`data.collate = '...'`) in the one-line DataError a wrong batch raises."""
    if isinstance(collated, Mapping):
        return _from_dict(collated, where)
    if isinstance(collated, Sequence) and not isinstance(collated, (str, bytes)):
        items = list(collated)
        if len(items) >= 2 and all(isinstance(t, torch.Tensor) for t in items):
            return tuple(items)
        kinds = ", ".join(_kind(t) for t in items[:4]) + (", ..." if len(items) > 4 else "")
        raise DataError(
            f"{where} makes batches of {len(items)} items ({kinds}); the step needs tensors "
            "(inputs, target, *more inputs): return tensors from the dataset, or give "
            "data.collate that makes them"
        )
    raise DataError(
        f"{where} makes batches of type {_kind(collated)}; the step needs (inputs, target) "
        "tensors or a dict with 'labels': return such samples, or give data.collate"
    )


class BatchMaker:
    """A DataLoader's collate_fn: the user's collate, then as_batch. A class, not a closure,
    so that loader worker processes can take it (pickled with the user's function)."""

    def __init__(self, collate: Callable[[list[Any]], Any], where: str, own: bool = True):
        self.collate = collate
        self.where = where
        self.own = own  # data.collate's (False: torch's default_collate)

    def __call__(self, samples: list[Any]) -> Batch:
        return as_batch(self.collate(samples), self.where)
