"""One optimizer step (gradient accumulation, probe, clipping, update) and evaluation."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from trainwise.run.parallelize import set_gradient_sync
from trainwise.run.telemetry import StageClock


@dataclass
class StepResult:
    loss: torch.Tensor  # local mean loss of the step (not yet averaged over ranks)
    grad_norm: torch.Tensor
    spans: dict[str, float] | None  # stage seconds when read; None when not read this step
    probe_sync_s: float | None  # exposed sync measured by this step's probe


class Stepper:
    """Runs training steps on a parallelized model. The probe (on chosen steps) runs every
    micro-batch without gradient sync, then the last micro-batch again with its loss
    multiplied by zero and the sync on: the gradients are bit-for-bit those of a normal
    step, and the difference in time between the two last passes is the exposed sync."""

    def __init__(
        self,
        model,
        loss_fn,
        optimizer,
        scheduler,
        scaler,
        autocast,
        grad_accum: int,
        grad_clip: float,
        device: torch.device,
    ):
        self.model = model
        self.loss_fn = loss_fn
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.scaler = scaler
        self.autocast = autocast
        self.grad_accum = grad_accum
        self.grad_clip = grad_clip if grad_clip > 0 else math.inf
        self.device = device
        self.clock = StageClock(device)

    def _forward_backward(self, x, y, sync: bool, scale: float) -> torch.Tensor:
        with set_gradient_sync(self.model, sync), self.autocast():
            loss = self.loss_fn(self.model(x), y) * scale
        (self.scaler.scale(loss) if self.scaler else loss).backward()
        return loss.detach()

    def step(self, batches, probe: bool, read_clock: bool) -> StepResult:
        clock = self.clock
        clock.mark("start")
        total = torch.zeros((), device=self.device)
        x = y = None
        for a in range(self.grad_accum):
            x, y = next(batches)
            x = x.to(self.device, non_blocking=True)
            y = y.to(self.device, non_blocking=True)
            clock.mark("data")
            sync = a == self.grad_accum - 1 and not probe
            total += self._forward_backward(x, y, sync, 1.0 / self.grad_accum)
            clock.mark("last" if a == self.grad_accum - 1 else "compute")
        if probe:
            self._forward_backward(x, y, True, 0.0)
            clock.mark("probe")
        if self.scaler:
            self.scaler.unscale_(self.optimizer)
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        if self.scaler:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        clock.mark("optim")
        if not (read_clock or probe):
            clock.discard()  # not read this step: no device sync for it
            return StepResult(total, norm, None, None)
        spans = clock.spans()
        probe_sync = None
        if probe:
            # The probe pass repeats the last micro-batch's compute; what it took beyond
            # the first pass is communication the step could not hide.
            probe_sync = max(0.0, spans.pop("probe") - spans["last"])
        spans["compute"] = spans.get("compute", 0.0) + spans.pop("last")
        return StepResult(total, norm, spans, probe_sync)


def mean_over_ranks(value: torch.Tensor) -> float:
    if dist.is_initialized() and dist.get_world_size() > 1:
        value = value.detach().clone()
        dist.all_reduce(value)  # SUM: gloo has no AVG
        value /= dist.get_world_size()
    return float(value)


@torch.no_grad()
def evaluate(model, loss_fn, batches, autocast, device: torch.device) -> float:
    """Mean held-out loss over this rank's batches, averaged over ranks."""
    model.eval()
    total = torch.zeros((), device=device)
    n = 0
    for x, y in batches:
        with autocast():
            total += loss_fn(model(x.to(device)), y.to(device)).float()
        n += 1
    model.train()
    return mean_over_ranks(total / max(n, 1))
