"""The pipeline-parallel training step (parallel.pp > 1), on torch.distributed.pipelining:
this rank's stages (models.pipeline) wrapped in `PipelineStage`s over the mesh's pp group,
and one of torch's schedules over them.

A step takes the rank's micro_batch x grad_accum samples as one batch, which the schedule
cuts into parallel.pp_microbatches (each inside one of the loader's micro-batches); the
loss is computed on the last stage, each pipeline micro-batch's mean weighted by its share
of the counted targets of its loader micro-batch (targets may be ignored: SFT prompts) and
by 1 / grad_accum, so that the losses and gradients are the data-parallel step's: the mean
over the loader's micro-batches of each one's mean loss. Afterwards a tied head's gradient
is summed with the embedding's (each copy of a parameter the first and last stage share:
models.pipeline's ties, whose values the step makes equal at the start), and the gradient
norm (clipping, the non-finite check) is completed over the pipeline. The loss stays on
the last stage until the metrics are due (the recorder's reduction over all ranks, every
logging.flush_every steps).

Telemetry (CUDA events on GPU, host clocks on CPU): `compute` is the time inside the
stages' forward and backward (PipelineStage's *_one_chunk calls, timed on this rank);
`bubble` the rest of the
schedule's wall time: waiting on the neighbouring stages (the fill and drain of the
schedule, and transfers not hidden, which one rank's clock cannot tell apart); `sync`
the exposed communication after the schedule (the tied gradient).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    BACKWARD_INPUT,
    BACKWARD_WEIGHT,
    FULL_BACKWARD,
    RECV_B,
    REDUCE_GRAD,
    SEND_B,
    PipelineScheduleSingle,
    ScheduleGPipe,
    ScheduleLoopedBFS,
    ScheduleZBVZeroBubble,
    get_schedule_class,
)
from torch.distributed.tensor import DTensor

from trainwise.data.shards import IGNORE
from trainwise.models.moe.layers import not_counted
from trainwise.models.pipeline import SINGLE_STAGE, V_SHAPED, stage_info
from trainwise.run.engine.materialize import plain_name
from trainwise.run.engine.mesh import JobMesh
from trainwise.run.engine.step import (
    Batch,
    DataParallelStep,
    StepResult,
    aux_source,
    last_aux,
    no_counted_target,
    pooled_mean,
    total_grad_norm,
)
from trainwise.run.observe.telemetry import Spans

BACKWARD_ACTIONS = (FULL_BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, SEND_B, RECV_B, REDUCE_GRAD)
Copies = tuple[torch.nn.Parameter | None, torch.nn.Parameter | None]  # first stage's, last's
TIMED = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")
# torch's runtime metadata inference (first step): a real forward and backward of each stage
# on made-up inputs (PipelineStage, torch 2.13), whose routing a MoE model must not count.
INFERENCE = ("_forward_metadata_inference", "_backward_metadata_inference")


class PipelineStep(DataParallelStep):
    """Runs training steps through a pipeline schedule over this rank's stages (`parts`,
    cut by models.pipeline, stage indices `stage_ids` of `num_stages`). Clipping, the
    update and the guard are the data-parallel step's, with the norm completed over the
    pipeline."""

    def __init__(
        self,
        parts: list[torch.nn.Module],
        stage_ids: list[int],
        num_stages: int,
        schedule: str,
        microbatches: int,
        mesh: JobMesh,
        *args: Any,
        **kwargs: Any,
    ):
        super().__init__(*args, **kwargs)
        self.name, self.microbatches = schedule, microbatches
        self.stage_ids, self.num_stages = stage_ids, num_stages
        self.pp_group = mesh.pp_group()
        self.pp_size = dist.get_world_size(self.pp_group)
        self.first, self.last = 0 in stage_ids, num_stages - 1 in stage_ids
        self.compute = Spans(self.device)  # this step's stage forwards and backwards
        self.stages = self._stages(parts)
        for stage in self.stages:
            for method in TIMED:
                setattr(stage, method, self._timed(getattr(stage, method)))
        self.schedule = build_schedule(
            get_schedule_class(schedule), self.stages, microbatches, self._loss
        )
        self._eval_schedule: Any = None
        self._share: float | None = None  # each micro-batch's loss weight, if one for all
        # Parameters the first and last stage share (a tied head): {last's name: first's}.
        info = stage_info(parts[0])
        self.ties = info.ties if info is not None else {}
        # The last stage on another rank than the first (not in the V: both on rank 0).
        self.tie_group = tie_group(mesh) if self.ties and schedule not in V_SHAPED else None
        self._tied = self.tied_copies(parts)  # found once: the parts keep their parameters
        sync_tied_weights(self._tied, self.tie_group)

    def tied_copies(self, parts: list[torch.nn.Module]) -> list[Copies]:
        """For each shared parameter, this rank's copies of it: the first stage's (under
        the whole model's name) and the last stage's (under its own), None where this
        rank does not hold that stage."""
        found = []
        for alias, name in self.ties.items():
            first = last = None
            for part, i in zip(parts, self.stage_ids, strict=True):
                want = name if i == 0 else alias if i == self.num_stages - 1 else None
                held = [p for n, p in part.named_parameters() if plain_name(n) == want]
                if held and i == 0:
                    first = held[0]
                elif held:
                    last = held[0]
            found.append((first, last))
        return found

    def _stages(self, parts: list[torch.nn.Module]) -> list[PipelineStage]:
        stages = [
            PipelineStage(part, i, self.num_stages, self.device, group=self.pp_group)
            for part, i in zip(parts, self.stage_ids, strict=True)
        ]
        for stage in stages:  # torch's metadata inference trains nothing: no counting then
            for method in INFERENCE:
                if hasattr(stage, method):
                    setattr(stage, method, not_counted(getattr(stage, method)))
        return stages

    def _timed(self, method: Callable) -> Callable:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = self.compute.mark()
            try:
                return method(*args, **kwargs)
            finally:
                self.compute.add(start, self.compute.mark())

        return timed

    def _loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """A pipeline micro-batch's part of the step's loss: its mean weighted by its share
        of its loader micro-batch's counted targets (_targets, made once a step: the same
        share for every micro-batch when no target is ignored, else two figures carried
        beside each sample's targets, read as tensors: an index by a 0-d tensor would
        read it on the host, a GPU synchronisation per micro-batch)."""
        if self._share is not None:
            y, weight = target, self._share
        else:
            y, figures = target[..., 0], target.reshape(-1, 3)[0]
            # A loader micro-batch without a counted target (prompts that fill the
            # sequence) weighs 0, not 0 / 0: no gradient, as without stages.
            weight = figures[1] / figures[2].clamp(min=1)
        loss = self.loss_fn(output, y) * weight
        loss = loss * float("nan") if self.poison else loss  # a fault injected by a test
        aux = last_aux(self.loss_fn)
        if aux is not None:  # read back from the schedule's losses (_loss_part): those
            # of its micro-batches only (torch's metadata inference calls this too)
            loss.aux_part = aux * weight
        return loss

    def _targets(self, y: torch.Tensor) -> torch.Tensor:
        """The step's targets as _loss takes them, from the loader's (on the host): as they
        are where no target is ignored (each pipeline micro-batch's weight is then 1 /
        microbatches) and on a rank without the last stage (its schedule reads none);
        else with two figures beside each sample's ([B, T, 3] for tokens, [B, 3] for a
        class a sample: any target shape): its pipeline micro-batch's counted targets,
        and its loader micro-batch's counted targets x grad_accum. A pipeline micro-batch
        of ignored targets only adds 0 (its weight), with a graph: its first target is
        made a counted one."""
        accum, micro = self.grad_accum, self.microbatches
        kept = y != IGNORE
        uniform = not self.last or bool(kept.all())  # a host tensor: no synchronisation
        self._share = 1.0 / micro if uniform else None
        if uniform:
            return y
        denominators = kept.reshape(accum, -1).sum(1) * accum
        counted = kept.reshape(micro, -1).sum(1)
        y = y.clone()
        firsts = y.view(micro, -1)[:, 0]
        firsts.copy_(torch.where(counted == 0, 0, firsts))
        shape = (-1, *[1] * (y.dim() - 1))
        per_sample = [
            figure.repeat_interleave(len(y) // n).view(shape).expand_as(y)
            for figure, n in ((counted, micro), (denominators, accum))
        ]
        return torch.stack([y, *per_sample], dim=-1)

    def step(
        self, parts: list[torch.nn.Module], batches: Iterator[Batch], probe: bool
    ) -> StepResult:
        clock = self.clock
        clock.mark("start")
        self.begin_a2a()
        self.stage = "data loading"
        x, y, *rest = self._batch(batches)
        y = self._targets(y).to(self.device)
        x, *rest = (t.to(self.device) for t in (x, *rest))
        clock.mark("data")
        self.stage = f"the pipeline schedule ({self.name}, {self.microbatches} micro-batches)"
        wall = Spans(self.device)
        started = wall.mark()
        losses: list[torch.Tensor] = []
        run(self.schedule, self.first, x, y, rest, losses, self.autocast)
        wall.add(started, wall.mark())
        clock.mark("last")
        self.stage = "the pipeline's tied gradients"
        loss, aux = self._loss_part(losses)
        sync_tied_grads(self._tied, self.tie_group)
        clock.mark("sync")
        norm, finite = self.update(parts)
        clock.mark("optim")
        return StepResult(
            loss, norm, clock.take(), False, time.perf_counter(), finite,
            bubble=(wall, self.compute.take()),
            aux_loss=aux, **self.moe_results(),
        )

    def _batch(self, batches: Iterator[Batch]) -> list[torch.Tensor]:
        """The step's grad_accum loader batches as one, where the loader left them (the
        host): the schedule cuts it."""
        micro = [next(batches) for _ in range(self.grad_accum)]
        return [t[0] if len(t) == 1 else torch.cat(t) for t in zip(*micro, strict=True)]

    def _loss_part(
        self, losses: list[torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """This rank's part of the step's loss and of its auxiliary part (StepResult.loss and
        aux_loss; None when the loss function adds none, as on every rank), without
        communication: the last stage's sums counted for each rank of its pipeline, which
        hold none, so that the mean of the parts over all ranks is the mean over the
        pipelines."""
        has_aux = aux_source(self.loss_fn) is not None
        if not self.last:
            zero = torch.zeros((), device=self.device)
            return zero, (zero if has_aux else None)
        loss = torch.stack(losses).sum().detach().float() * self.pp_size
        if not has_aux:
            return loss, None
        auxes = [part.aux_part for part in losses if getattr(part, "aux_part", None) is not None]
        aux = torch.stack(auxes).sum() if auxes else torch.zeros((), device=self.device)
        return loss, aux.detach().float() * self.pp_size

    def _last_stage_sum(self, losses: list[torch.Tensor]) -> torch.Tensor:
        """The sum of the last stage's losses, on every rank of the pipeline (a SUM over
        the pp group, where only the last stage's rank adds a value)."""
        mine = torch.stack(losses).sum().detach().float() if self.last else None
        total = mine if mine is not None else torch.zeros((), device=self.device)
        dist.all_reduce(total, group=self.pp_group)
        return total

    def grad_norm(self, counted: list[list[torch.Tensor]]) -> torch.Tensor:
        """The global norm: this rank's stages', completed over the pipeline."""
        squared = total_grad_norm(counted).float().square()
        dist.all_reduce(squared, group=self.pp_group)
        return squared.sqrt()

    def counted(self, parts: list[torch.nn.Module]) -> list[torch.Tensor]:
        """A tied head's copy is the embedding's gradient again: counted once."""
        return [
            p for part, i in zip(parts, self.stage_ids, strict=True)
            for name, p in part.named_parameters()
            if not (i == self.num_stages - 1 and plain_name(name) in self.ties)
        ]

    def evaluate(self, parts: list[torch.nn.Module], batches: Iterable[Batch]) -> float:
        """Held-out loss through a forward-only run of the pipeline: one micro-batch per
        loader batch, on stages of their own (the training schedule's keep their shapes)."""
        if self._eval_schedule is None:
            self._eval_schedule = eval_schedule(self.name, self._stages(parts), self.loss_fn)
        for part in parts:
            part.eval()
        total, n = torch.zeros((), device=self.device), 0
        with torch.no_grad():
            for batch in batches:
                x, y, *rest = (t.to(self.device) for t in batch)
                losses: list[torch.Tensor] = []
                run(self._eval_schedule, self.first, x, y, rest, losses, self.autocast, eval=True)
                loss = self._last_stage_sum(losses)  # one micro-batch: its mean
                if not no_counted_target(batch):  # run all the same: its collectives pair
                    total += loss
                    n += 1
        for part in parts:
            part.train()
        return pooled_mean(total, n)


def run(
    schedule: Any,
    first: bool,
    x: torch.Tensor,
    y: torch.Tensor,
    rest: list[torch.Tensor],
    losses: list[torch.Tensor],
    context: Callable[[], AbstractContextManager],
    eval: bool = False,
) -> None:
    """One pass of `schedule`: the inputs go in at the first stage; `doc` (packed examples)
    goes to every stage, which each need its attention mask."""
    kwargs = {"doc": rest[0]} if rest else {}
    args = (x,) if first else ()
    call = schedule.eval if eval else schedule.step
    with context():
        call(*args, target=y, losses=losses, **kwargs)


def build_schedule(
    cls: type, stages: list[PipelineStage], microbatches: int, loss_fn: Callable
) -> Any:
    """torch's schedule `cls` over this rank's stages (a single-stage class takes one)."""
    # The loss weighs each micro-batch itself (PipelineStep._loss): no division by their count.
    if issubclass(cls, PipelineScheduleSingle):
        return cls(stages[0], microbatches, loss_fn=loss_fn, scale_grads=False)
    return cls(stages, microbatches, loss_fn=loss_fn, scale_grads=False)


def eval_schedule(schedule: str, stages: list[PipelineStage], loss_fn: Callable) -> Any:
    """A forward-only pass of one micro-batch: GPipe's for one stage per rank, the looped
    breadth-first one for several; in the V, ZBV's order with its forwards alone (its
    runtime would run the backward actions of its order even in `eval`)."""
    if schedule in SINGLE_STAGE:
        return build_schedule(ScheduleGPipe, stages, 1, loss_fn)
    if schedule not in V_SHAPED:
        return build_schedule(ScheduleLoopedBFS, stages, 1, loss_fn)
    v = build_schedule(ScheduleZBVZeroBubble, stages, 1, loss_fn)
    v.pipeline_order_with_comms = {  # torch's lowered order (compute and p2p), less backward
        rank: [a for a in actions if a.computation_type not in BACKWARD_ACTIONS]
        for rank, actions in v.pipeline_order_with_comms.items()
    }
    return v


def tie_group(mesh: JobMesh) -> dist.ProcessGroup | None:
    """The group of this rank's first- and last-stage ranks (pp coordinates 0 and pp - 1,
    the same data- and tensor-parallel coordinates), which both hold the tied embedding;
    None where this rank is in none. Every rank creates every such group, in one order.
    With two stages' ranks (pp 2) the pair is the rank's pp group itself: no new group
    (each gloo group keeps a thread that wakes every 10 ms beside the step)."""
    ranks = mesh.device_mesh.mesh
    pairs = ranks.reshape(ranks.shape[0], -1)
    if pairs.shape[0] == 2:
        return mesh.pp_group()
    mine = None
    for j in range(pairs.shape[1]):
        group = dist.new_group([int(pairs[0, j]), int(pairs[-1, j])])
        if dist.get_rank() in (int(pairs[0, j]), int(pairs[-1, j])):
            mine = group
    return mine


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def sync_tied_grads(copies: list[Copies], group: dist.ProcessGroup | None) -> None:
    """Each shared parameter's copies (first stage, last stage) get the sum of their
    gradients: on this rank, then over `group` (the copies on other ranks)."""
    for pair in copies:
        grads = [_local(p.grad) for p in pair if p is not None and p.grad is not None]
        if not grads or group is None and len(grads) == 1:
            continue
        # One copy here (the other on the group's other rank): summed in place.
        total = grads[0] if len(grads) == 1 else torch.stack(grads).sum(0)
        if group is not None:
            dist.all_reduce(total, group=group)
        if len(grads) > 1:
            for grad in grads:
                grad.copy_(total)


@torch.no_grad()
def sync_tied_weights(copies: list[Copies], group: dist.ProcessGroup | None) -> None:
    """Each shared parameter's last-stage copy takes the first stage's values (a model
    built on the meta device drew the copy by its own name), sent over `group` where the
    stages sit on different ranks: a sum to which only the first stage's rank adds."""
    for first, last in copies:
        if first is None and last is None or group is None and (first is None or last is None):
            continue
        value = _local(first).clone() if first is not None else torch.zeros_like(_local(last))
        if group is not None:
            dist.all_reduce(value, group=group)
        if last is not None:
            _local(last).copy_(value)
