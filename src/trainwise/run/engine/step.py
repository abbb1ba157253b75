"""The training step as a strategy object: `TrainStep.step(parts, batches, probe)` runs one
optimizer step over the model's parts and `evaluate(parts, batches)` the held-out loss.
`DataParallelStep` runs one part (gradient accumulation, probe, clipping, update);
run/engine/pipeline.py's `PipelineStep` runs a pipeline schedule over a rank's stages.
The doctor's memory simulation runs the same object on its fake process group."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import is_fake
from torch.distributed.tensor import DTensor

from trainwise.data.shards import IGNORE
from trainwise.models.moe.balance import LoadCounter, moe_shape
from trainwise.run.engine.guard import skip_if_nonfinite, skips_on_device
from trainwise.run.engine.optim import by_mesh
from trainwise.run.engine.parallelize import reshard_all, set_gradient_sync
from trainwise.run.observe.comm_timer import CollectiveTimer
from trainwise.run.observe.telemetry import Marks, Spans, StageClock, resolve_spans

# A micro-batch: (inputs, targets, and what else the model takes: packed examples' ids).
Batch = tuple[torch.Tensor, ...]


@dataclass
class StepResult:
    """What a step leaves for the recorder; nothing here has been synchronised yet."""

    # This rank's part of the step's loss, not yet read: its mean over all ranks is the
    # step's loss (a data-parallel rank's mean loss; the recorder reduces when due).
    loss: torch.Tensor
    grad_norm: torch.Tensor
    marks: Marks  # stage marks: data, compute, last (the syncing micro-batch), probe, optim
    probe: bool  # the step ran the probe pass
    end: float  # perf_counter when the step returned (host time)
    # False: a non-finite gradient norm, the update skipped; a device flag not read yet
    # where the optimizer skipped it on the device (run/engine/guard.py).
    finite: bool | torch.Tensor = True
    tp_comm: CollectiveTimer | None = None  # a probe step's tensor-parallel collectives
    # A pipeline step's schedule and its stages' own passes (wall, compute): the wait on
    # the other stages inside its compute span is their difference ("bubble"), resolved
    # with the records; its communication after the schedule is marked "sync".
    bubble: tuple[Spans, Spans] | None = None
    # Of `loss`, the auxiliary part its loss function added (a MoE model's balancing
    # loss: last_aux), summed as the loss; None when the loss function adds none.
    aux_loss: torch.Tensor | None = None
    # Expert parallelism: the step's all-to-alls on this rank (dispatch and combine,
    # forward and backward), inside its compute; None without ep.
    a2a: Spans | None = None
    # A MoE model: this rank's tokens per expert of the step, [layers, experts] (its
    # routers' counts, before any all-reduce); None for a dense model.
    expert_tokens: torch.Tensor | None = None

    def spans(self) -> tuple[dict[str, float], float | None]:
        """Stage seconds (data, compute, optim) and, on a probe step, the exposed sync."""
        spans = resolve_spans(self.marks)
        probe_sync = spans.pop("sync", None)
        if self.probe:
            # The probe pass repeats the last micro-batch's compute; what it took beyond
            # the first pass is communication the step could not hide.
            probe_sync = max(0.0, spans.pop("probe") - spans["last"])
        spans["compute"] = spans.get("compute", 0.0) + spans.pop("last")
        if self.bubble is not None:
            wall, compute = self.bubble
            bubble = min(max(0.0, wall.seconds() - compute.seconds()), spans["compute"])
            spans["compute"] -= bubble
            spans["bubble"] = bubble
        if self.a2a is not None:  # communication inside forward and backward, as TP's
            a2a_s = min(self.a2a.seconds(), spans["compute"])
            spans["compute"] -= a2a_s
            spans["a2a"] = a2a_s
        if self.tp_comm is not None:
            # Communication too, though inside forward and backward: the planner counts it
            # with the exposed sync.
            tp_s = min(self.tp_comm.seconds(), spans["compute"])
            spans["compute"] -= tp_s
            spans["tp"] = tp_s
        return spans, probe_sync


class TrainStep(Protocol):
    """How one optimizer step runs over the model's parts."""

    stage: str  # where a failed collective was: named in its message
    poison: bool  # a test's fault: the next step's loss is NaN

    def step(self, parts: list[torch.nn.Module], batches: Iterator[Batch], probe: bool) -> StepResult:
        """Forward, backward, clip and update on the step's micro-batches from `batches`;
        `probe`: also measure the exposed gradient sync."""
        ...

    def evaluate(self, parts: list[torch.nn.Module], batches: Iterable[Batch]) -> float:
        """Mean held-out loss over this rank's batches, averaged over ranks."""
        ...


def with_grads(groups: list[list[torch.Tensor]]) -> list[list[torch.Tensor]]:
    """Of each group, the parameters that got a gradient this step (none: no group)."""
    kept = ([p for p in group if p.grad is not None] for group in groups)
    return [group for group in kept if group]


def aux_source(loss_fn: object) -> object | None:
    """The loss function that says which part of its value is auxiliary (a MoE model's,
    models.moe.MoELoss, has `last_aux`), through wrappers that name it `__wrapped__`;
    None for one that adds nothing."""
    while loss_fn is not None and not hasattr(loss_fn, "last_aux"):
        loss_fn = getattr(loss_fn, "__wrapped__", None)
    return loss_fn


def last_aux(loss_fn: object) -> torch.Tensor | None:
    """The auxiliary part of the value `loss_fn` last returned (None: it added none)."""
    source = aux_source(loss_fn)
    return None if source is None else source.last_aux


def one_part(parts: list[torch.nn.Module]) -> torch.nn.Module:
    if len(parts) != 1:
        raise ValueError(f"the data-parallel step runs one model part, not {len(parts)}")
    return parts[0]


class DataParallelStep:
    """Runs training steps on a parallelized model (one part). The probe (on chosen steps)
    runs every micro-batch without gradient sync, then the last micro-batch again with its
    loss multiplied by zero and the sync on: the gradients are bit-for-bit those of a
    normal step, and the difference in time between the two last passes is the exposed
    sync. (A model with BatchNorm would see its running statistics updated twice.)"""

    def __init__(
        self,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        scaler: torch.amp.GradScaler | None,
        autocast: Callable[[], AbstractContextManager],
        grad_accum: int,
        grad_clip: float,
        device: torch.device,
        *,
        sharded_accumulation: bool = False,
        backward_context: Callable[[], AbstractContextManager] = contextlib.nullcontext,
        time_tp: bool = False,
        after_optimizer: list[Callable[[list[torch.nn.Module]], None]] | None = None,
        guard: bool = True,
        a2a: Spans | None = None,
    ):
        self.loss_fn = loss_fn
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.scaler = scaler
        self.autocast = autocast
        self.grad_accum = grad_accum
        self.grad_clip = grad_clip if grad_clip > 0 else math.inf
        self.device = device
        # True: FSDP reduce-scatters every micro-batch and keeps only sharded gradients
        # (parallel.accumulate); False: full gradients until the last micro-batch syncs.
        self.sharded_accumulation = sharded_accumulation
        self.backward_context = backward_context  # loss_parallel under tensor parallelism
        self.time_tp = time_tp  # time DTensor's collectives on probe steps (tp > 1)
        self.after_optimizer = after_optimizer or []  # converters' post-optimizer hooks
        # False: no non-finite check (the doctor's simulation: fake tensors hold no values).
        self.guard = guard
        # Expert parallelism's all-to-alls leave their spans here (its ExpertParallel
        # styles were given it); each step takes its own.
        self.a2a = a2a
        self.loads: LoadCounter | None = None  # a MoE model's routers, found on first use
        self.looked_for_loads = False
        self.tokens: torch.Tensor | None = None  # the last step's tokens per expert
        self.clock = StageClock(device)
        self.aux: torch.Tensor | None = None  # this step's auxiliary loss so far (last_aux)
        self.poison = False
        self.stage = "the training step"  # where a failed collective was: named in its message
        # The parts' parameters grouped by mesh: (parts, clipped, counted in the norm),
        # walked once (the parts keep their parameters), not at every step.
        self._walked: tuple[list[torch.nn.Module], list, list] | None = None
        self._synced: bool | None = None  # the gradient sync setting last made

    def _forward_backward(
        self, model: torch.nn.Module, batch: Batch, sync: bool, scale: float
    ) -> torch.Tensor:
        x, y, *rest = batch  # rest: what else the model takes (packed examples' ids)
        # FSDP2's setting walks every module: made when it changes, or to turn the sync off
        # (DDP's no_sync is a context around each micro-batch).
        changed = not sync or sync != self._synced
        self._synced = sync
        toggle = set_gradient_sync(model, sync) if changed else contextlib.nullcontext()
        with toggle, self.autocast():
            loss = self.loss_fn(model(x, *rest), y)
            if scale != 1.0:  # not for one micro-batch a step: no op, no node in backward
                loss = loss * scale
            self.add_aux(scale)
            if self.poison:
                loss = loss * float("nan")  # a fault injected by a test
        with self.backward_context():
            (self.scaler.scale(loss) if self.scaler else loss).backward()
        return loss.detach()

    def add_aux(self, scale: float | torch.Tensor) -> None:
        """Count the auxiliary part of the loss function's last value, scaled as its loss."""
        aux = last_aux(self.loss_fn)
        if aux is not None:
            self.aux = aux * scale if self.aux is None else self.aux + aux * scale

    def step(self, parts: list[torch.nn.Module], batches: Iterator[Batch], probe: bool) -> StepResult:
        model = one_part(parts)
        clock = self.clock
        clock.mark("start")
        self.aux = None
        self.begin_a2a()
        timer = CollectiveTimer(self.device) if probe and self.time_tp else None
        with timer or contextlib.nullcontext():
            total, last = self._micro_batches(model, batches, probe)
            if probe:
                self.stage = "the probe pass (gradient sync)"
                if timer:  # intercepted as the pass it repeats was, so the two compare
                    timer.counting = False
                # Restore the RNG afterwards: the probe must not shift later dropout masks.
                devices = [self.device] if self.device.type == "cuda" else []
                with (torch.random.fork_rng(devices=devices, device_type=self.device.type),
                      self.a2a_paused()):
                    self._forward_backward(model, last, True, 0.0)
                clock.mark("probe")
        norm, finite = self.update(parts)
        clock.mark("optim")
        return StepResult(
            total, norm, clock.take(), probe, time.perf_counter(), finite, timer,
            aux_loss=self.aux, **self.moe_results(),
        )

    def begin_a2a(self) -> None:
        """Start the step's all-to-all spans (an evaluation's before it are not its)."""
        if self.a2a is not None:
            self.a2a.take()

    def a2a_paused(self) -> AbstractContextManager:
        """A pass that is not the step's own (the probe's): its all-to-alls not counted."""
        if self.a2a is None:
            return contextlib.nullcontext()
        return _paused(self.a2a)

    def moe_results(self) -> dict[str, object]:
        """The step's expert telemetry for its StepResult: its all-to-all spans and the
        tokens per expert read in `update` (None each where there is none)."""
        return {"a2a": self.a2a.take() if self.a2a is not None else None,
                "expert_tokens": self.tokens}

    def update(self, parts: list[torch.nn.Module]) -> tuple[torch.Tensor, bool | torch.Tensor]:
        """Clip and apply the gradients of every part (or skip a non-finite update), move
        the schedule, run the converters' hooks: (the global gradient norm, finite: a bool,
        or a device flag not read yet where the update skips itself on the device)."""
        if self.scaler:
            self.scaler.unscale_(self.optimizer)
        # torchtitan's way: one all-reduce for the norm of sharded gradients, then clip with
        # the plain tensor (clip_grad_norm_ on DTensors would reduce it twice).
        self.stage = "the gradient-norm all-reduce"
        clipped, counted = self._params(parts)
        norm = self.grad_norm(counted)
        # The guard: the norm is global (identical on every rank), so every rank skips the
        # same update: on the device where the optimizer can (run/engine/guard.py), else by
        # reading the norm here (one host sync a step); fp16's scaler does its own.
        self.stage = "the optimizer step"
        finite: bool | torch.Tensor = True
        if self.guard and not self.scaler:
            finite = (skip_if_nonfinite(self.optimizer, norm) if skips_on_device(self.optimizer)
                      else bool(torch.isfinite(norm)))
        if finite is not False:  # a device flag: the step below skips itself if it must
            clip_grads(clipped, self.grad_clip, norm)
            if self.scaler:
                self.scaler.step(self.optimizer)
                self.scaler.update()
            else:
                self.optimizer.step()
        self.tokens = self.read_loads(parts)
        for hook in self.after_optimizer:  # the bias update reads the same count
            hook(parts)
        if self.loads is not None:
            self.loads.clear()
        self.scheduler.step()  # a skipped step still moves the schedule: lr stays a function of step
        self.optimizer.zero_grad(set_to_none=True)
        return norm, finite

    def read_loads(self, parts: list[torch.nn.Module]) -> torch.Tensor | None:
        """A MoE model's tokens per expert since the last step on this rank (None for a
        dense model); the routers are found on the first call."""
        if not self.looked_for_loads:
            shape = moe_shape(parts)
            self.loads = LoadCounter(parts, shape, self.device) if shape else None
            self.looked_for_loads = True
        return self.loads.read() if self.loads is not None else None

    def grad_norm(self, counted: list[list[torch.Tensor]]) -> torch.Tensor:
        """The global 2-norm of the gradients `counted` (by mesh; identical on every rank)."""
        return total_grad_norm(counted)

    def counted(self, parts: list[torch.nn.Module]) -> list[torch.Tensor]:
        """The parameters whose gradients the norm counts: every part's."""
        return [p for part in parts for p in part.parameters()]

    def _params(
        self, parts: list[torch.nn.Module]
    ) -> tuple[list[list[torch.Tensor]], list[list[torch.Tensor]]]:
        """(the parameters clipped, those the norm counts), grouped by mesh, with a
        gradient this step."""
        if self._walked is None or self._walked[0] is not parts:
            every = [p for part in parts for p in part.parameters()]
            self._walked = (parts, by_mesh(every), by_mesh(self.counted(parts)))
        _, clipped, counted = self._walked
        return with_grads(clipped), with_grads(counted)

    def evaluate(self, parts: list[torch.nn.Module], batches: Iterable[Batch]) -> float:
        return evaluate(one_part(parts), self.loss_fn, batches, self.autocast, self.device)

    def _micro_batches(
        self, model: torch.nn.Module, batches: Iterator[Batch], probe: bool
    ) -> tuple[torch.Tensor, Batch]:
        """Forward and backward of the step's micro-batches: (the summed loss, the last
        micro-batch, which the probe repeats)."""
        total: torch.Tensor | None = None
        batch: Batch = ()
        for a in range(self.grad_accum):
            self.stage = "data loading"
            host = next(batches)
            batch = tuple(t.to(self.device, non_blocking=True) for t in host)
            self.clock.mark("data")
            last = a == self.grad_accum - 1
            sync = (last and not probe) or (self.sharded_accumulation and not last)
            self.stage = f"forward/backward of micro-batch {a + 1}/{self.grad_accum}" + (
                " (gradient sync)" if sync else ""
            )
            loss = self._forward_backward(model, batch, sync, 1.0 / self.grad_accum)
            if no_counted_target(host):  # counted as its gradient counts it: 0, not NaN
                loss = torch.zeros_like(loss)
            total = loss.float() if total is None else total + loss
            self.clock.mark("last" if last else "compute")
        return total, batch


@contextlib.contextmanager
def _paused(spans: Spans) -> Iterator[None]:
    spans.paused = True
    try:
        yield
    finally:
        spans.paused = False


def total_grad_norm(groups: list[list[torch.Tensor]]) -> torch.Tensor:
    """The global 2-norm of the gradients of `groups` (by_mesh's), a plain tensor equal on
    every rank: each mesh's norm completed over its ranks (full_tensor: one all-reduce per
    mesh), then combined. Plain gradients are whole (DDP synchronised them; or replicated)."""
    norms = []
    for group in groups:
        norm = torch.nn.utils.get_total_norm([p.grad for p in group])
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    if len(norms) == 1:
        return norms[0]
    return torch.linalg.vector_norm(torch.stack([n.float() for n in norms]))


def clip_grads(groups: list[list[torch.Tensor]], max_norm: float, norm: torch.Tensor) -> None:
    """clip_grads_with_norm_ per mesh (`groups`: by_mesh's) with the global norm (its
    foreach ops take one mesh)."""
    for group in groups:
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, norm)


class RankMean:
    """The element-wise mean of `values` over all ranks, in one collective issued at
    construction without waiting (gloo and NCCL run it beside what the caller does next);
    `result` waits for it and reads the values."""

    def __init__(self, values: torch.Tensor):
        self.values = values.detach().float().reshape(-1).clone()
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        # SUM (gloo has no AVG), divided in `result`.
        self.work = dist.all_reduce(self.values, async_op=True) if self.world > 1 else None

    def result(self) -> list[float]:
        if self.work is not None:
            self.work.wait()
            self.work = None
            self.values /= self.world
        return self.values.tolist()


def mean_over_ranks(values: torch.Tensor) -> list[float]:
    """Element-wise mean over all ranks, in one collective."""
    return RankMean(values).result()


def no_counted_target(batch: Batch) -> bool:
    """Whether a micro-batch, as the loader gives it (on the host), has targets and every
    one of them IGNORE: prompt/response examples whose prompts fill the sequence. Cross
    entropy's mean over no target is NaN, its gradient 0. Read on the host only: no
    device synchronisation (and not at all on the doctor's fake tensors)."""
    y = batch[1] if len(batch) > 1 else None
    if y is None or y.device.type != "cpu" or is_fake(y) or y.is_floating_point():
        return False
    return y.numel() > 0 and not bool((y != IGNORE).any())


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    batches: Iterable[Batch],
    autocast: Callable[[], AbstractContextManager],
    device: torch.device,
) -> float:
    """Mean held-out loss over the batches of every rank. A batch without a counted target
    has no loss to average: it runs (its forward's collectives pair with the other
    ranks') but is left out; NaN when no batch anywhere has one."""
    model.eval()
    total = torch.zeros((), device=device)
    n = 0
    for batch in batches:
        x, y, *rest = (t.to(device) for t in batch)
        with autocast():
            loss = loss_fn(model(x, *rest), y).float()
        if not no_counted_target(batch):
            total += loss
            n += 1
    model.train()
    reshard_all(model)
    return pooled_mean(total, n)


def pooled_mean(total: torch.Tensor, n: int) -> float:
    """sum(total) / sum(n) over all ranks (one collective): a mean over every rank's
    batches; NaN when no rank had one."""
    summed, count = mean_over_ranks(torch.stack([total, torch.full_like(total, n)]))
    return summed / count if count else math.nan
