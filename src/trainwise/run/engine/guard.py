"""The non-finite guard's verdicts: whether each step's gradient norm was finite, brought to
the host without holding up the device.

An optimizer that takes `found_inf` (torch's fused AdamW, to which GradScaler hands it)
skips a non-finite update on the device itself: its parameters, moments and step count stay
as they were. The host then need not know at once: the step's verdict is copied to the host
without waiting and read after the next step, by when the device has long finished it, so a
step keeps no synchronisation for the guard. Other optimizers (foreach, for-loop, SGD) are
skipped by the host, which reads the norm before the update (one synchronisation a step on a
GPU): their verdict is known at its step."""

from __future__ import annotations

import torch


def skips_on_device(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer.step()` honours `optimizer.found_inf` (torch's fused kernels do;
    the foreach and for-loop ones refuse it)."""
    return bool(optimizer.defaults.get("fused"))


def skip_if_nonfinite(optimizer: torch.optim.Optimizer, norm: torch.Tensor) -> torch.Tensor:
    """Arm the optimizer's next step to skip itself on the device when `norm` is not
    finite; returns the device flag (True: finite), not read."""
    finite = torch.isfinite(norm)
    optimizer.found_inf = (~finite).float()  # read by torch's fused step, as GradScaler sets it
    return finite


class Verdicts:
    """The steps' verdicts in step order: `add` each step's (a bool the host knows, or a
    device flag), `take` those that can be read without waiting on the device."""

    def __init__(self) -> None:
        self._pending: list[tuple[int, bool | torch.Tensor, torch.cuda.Event | None]] = []

    def add(self, step: int, finite: bool | torch.Tensor) -> None:
        ready = None
        if isinstance(finite, torch.Tensor) and finite.device.type == "cuda":
            host = torch.empty((), dtype=torch.bool, pin_memory=True)
            host.copy_(finite, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(finite.device))
            finite = host
        self._pending.append((step, finite, ready))

    def take(self, now: bool = False) -> list[tuple[int, bool]]:
        """The verdicts in, oldest first: every one the host knew, every earlier step's
        flag, and the latest step's flag too when `now` (on a GPU, a wait for that step)."""
        cut = len(self._pending)
        if cut and not now and isinstance(self._pending[-1][1], torch.Tensor):
            cut -= 1  # the latest step's flag: the device may not be done with it
        ready, self._pending = self._pending[:cut], self._pending[cut:]
        verdicts = []
        for step, finite, event in ready:
            if event is not None:
                event.synchronize()
            verdicts.append((step, bool(finite)))
        return verdicts

    def clear(self) -> None:
        """Forget the verdicts not yet taken (a rollback discards their steps)."""
        self._pending.clear()
