"""Tensor-parallel communication, timed: the seconds a step's forward and backward spend
in DTensor's collectives (the all-reduces, all-gathers and reduce-scatters of the TP plan,
loss parallel's), which run inside compute where the stage clock cannot see them.

A dispatch mode sees every op; DTensor ops are handed back (NotImplemented) so that
DTensor desugars them into functional collectives (`_c10d_functional`), which the mode
times from issue to completion (`wait_tensor`). FSDP's own collectives go through c10d
directly and are not counted: the probe measures them (run.loop). On CPU the spans are
host time; on CUDA event pairs on the current stream, resolved after the step, so timing
adds no synchronisation. It runs on probe steps only: intercepting every op costs some
Python per op.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch._ops import HigherOrderOperator
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from trainwise.run.observe.telemetry import Spans

COLLECTIVE_NAMESPACES = ("_c10d_functional", "_c10d_functional_autograd")
NOT_COLLECTIVES = ("wait_tensor", "_wrap_tensor_autograd")  # timed, not counted


class CollectiveTimer(TorchDispatchMode):
    """Inside `with CollectiveTimer(device) as t:`, the functional collectives' time
    (`t.seconds()`), their number (`t.calls`, waits not counted), the bytes they took in
    (`t.bytes`) and the calls by (op, input bytes) (`t.by_op`)."""

    def __init__(self, device: torch.device):
        super().__init__()
        self.calls = 0
        self.bytes = 0
        self._spans = Spans(device)
        self.counting = True  # False: intercept as before, count nothing
        self.by_op: Counter[tuple[str, int]] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if isinstance(func, HigherOrderOperator):
            return func(*args, **kwargs)
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # DTensor runs the op and issues its collectives to us
        if not self.counting or getattr(func, "namespace", None) not in COLLECTIVE_NAMESPACES:
            return func(*args, **kwargs)
        start = self._spans.mark()
        out = func(*args, **kwargs)
        self._spans.add(start, self._spans.mark())
        name = func.__name__.split(".")[0]
        if name not in NOT_COLLECTIVES:
            size = sum(_tensor_bytes(a) for a in args)
            self.calls += 1
            self.bytes += size
            self.by_op[name, size] += 1
        return out

    def seconds(self) -> float:
        """The time from each collective's issue to its completion, summed."""
        return self._spans.seconds()


def _tensor_bytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, list | tuple):
        return sum(_tensor_bytes(v) for v in value)
    return 0
