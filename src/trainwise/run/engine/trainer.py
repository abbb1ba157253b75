"""The training components of a job, built in one place: the mesh (once), the model's parts
(run/engine/parts.py: converted, parallelized, seeded), optimizer, schedule, gradient
scaler and the step strategy. The worker trains with them; the doctor times, overfits and
checkpoints them."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from trainwise.config import JobConfig, job_hash
from trainwise.config.lineage import lineage_keys
from trainwise.config.parallel_dims import ParallelDims
from trainwise.faults import NO_FAULTS, Faults
from trainwise.models.converters import (
    build_converters,
    post_optimizer_hooks,
    weights_set_hooks,
)
from trainwise.models.pipeline import default_microbatches, rank_stages
from trainwise.plan.model.comm import allreduce_factor
from trainwise.run.checkpoint.dcp import Checkpointer, Place, SaveSchedule
from trainwise.run.checkpoint.states import training_states
from trainwise.run.checkpoint.store import root_for
from trainwise.run.engine.mesh import JobMesh, job_mesh
from trainwise.run.engine.optim import build_optimizer, build_scheduler
from trainwise.run.engine.parts import build_parts
from trainwise.run.engine.pipeline import PipelineStep
from trainwise.run.engine.precision import autocast_context, build_grad_scaler
from trainwise.run.engine.step import Batch, DataParallelStep, StepResult, TrainStep
from trainwise.run.job.distributed import DistEnv
from trainwise.run.job.resolve import Job
from trainwise.run.observe.telemetry import Spans


@dataclass
class Trainer:
    """A job's training components on this rank: the model's parts, on the mesh built once
    for the job, and the step strategy that trains them."""

    parts: list[torch.nn.Module]  # the model, or this rank's pipeline stages
    mesh: JobMesh
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler | None
    step: TrainStep
    # The converters' hooks for weights set otherwise than by the optimizer (float8's scales)
    on_weights_set: list[Callable[[list[torch.nn.Module]], None]] = field(default_factory=list)

    def weights_set(self) -> None:
        """The weights were built or loaded (a checkpoint): the converters follow them."""
        for hook in self.on_weights_set:
            hook(self.parts)

    @property
    def dp_rank(self) -> int:
        return self.mesh.dp_rank

    @property
    def dp_size(self) -> int:
        return self.mesh.dp_size

    def train_step(self, batches: Iterator[Batch], probe: bool = False) -> StepResult:
        return self.step.step(self.parts, batches, probe)

    def evaluate(self, batches: Iterable[Batch]) -> float:
        return self.step.evaluate(self.parts, batches)


def build_trainer(
    cfg: JobConfig,
    job: Job,
    device: torch.device,
    *,
    group: dist.ProcessGroup | None = None,
    precision: str | None = None,
    faults: Faults = NO_FAULTS,
) -> Trainer:
    """The job's components on `job.world` ranks: those of `group` when given (the doctor
    times smaller worlds inside one launch), else the default group. `precision`
    overrides precision.dtype (the doctor compares with fp32); `faults` is the worker's
    fault seam (a test's slow network)."""
    c = cfg
    dtype = precision or c.precision.dtype
    dims = job.dims
    mesh = job_mesh(dims, device.type, group)
    converters = build_converters(cfg)
    # Expert parallelism's all-to-alls, timed every step (telemetry; no sync added).
    a2a = Spans(device) if dims.ep > 1 else None
    bundle, parts = build_parts(cfg, job, mesh, device, dtype, converters, a2a)
    follow = weights_set_hooks(converters)
    for hook in follow:  # initialised or pretrained
        hook(parts)
    for part in parts:
        faults.network(part, allreduce_factor)  # slowed only under a test's fault
    # Dropout differs between data-parallel ranks; the ranks of one tensor-parallel group
    # draw the same masks (they hold the same replicated activations).
    torch.manual_seed(c.train.seed + 1 + mesh.dp_rank)
    optimizer = build_optimizer(parts, c.optim)
    scheduler = build_scheduler(optimizer, c.train.steps, c.schedule)
    scaler = build_grad_scaler(dims.fsdp, dtype, device, c.precision.init_scale)
    loss_fn = local_loss(bundle.loss_fn) if dims.tp > 1 else bundle.loss_fn
    hooks = post_optimizer_hooks(converters)
    if dims.pp > 1:
        step = build_pipeline_step(
            cfg, job, mesh, parts, dtype, device, loss_fn, optimizer, scheduler, scaler,
            hooks, a2a,
        )
        return Trainer(parts, mesh, optimizer, scheduler, scaler, step, follow)
    step = build_step(
        dims, dtype, device, loss_fn, optimizer, scheduler, scaler, job.grad_accum,
        c.train.grad_clip,
        sharded_accumulation=job.sharded_accumulation,
        # Compiled blocks run their collectives inside the graph: no dispatch to time.
        time_tp=dims.tp > 1 and not c.train.compile,
        after_optimizer=hooks,
        a2a=a2a,
    )
    return Trainer(parts, mesh, optimizer, scheduler, scaler, step, follow)


def build_pipeline_step(
    cfg: JobConfig,
    job: Job,
    mesh: JobMesh,
    parts: list[torch.nn.Module],
    dtype: str,
    device: torch.device,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    scaler: torch.amp.GradScaler | None,
    hooks: list[Callable[[list[torch.nn.Module]], None]],
    a2a: Spans | None = None,
) -> PipelineStep:
    """The pipeline step over this rank's stages (`parts`, from parts.split), with the
    schedule and micro-batches of parallel.pp_*; the forward (and the loss) under the
    layout's precision and loss contexts."""
    p, dims = cfg.parallel, job.dims

    def autocast() -> AbstractContextManager:
        return loss_context(dims.tp, autocast_context(dims.fsdp, dtype, device))

    microbatches = p.pp_microbatches or default_microbatches(cfg.data.micro_batch, job.grad_accum)
    ids = rank_stages(mesh.pp_rank, dims.pp, p.pp_virtual, p.pp_schedule)
    return PipelineStep(
        parts, ids, dims.pp * p.pp_virtual, p.pp_schedule, microbatches, mesh,
        loss_fn, optimizer, scheduler, scaler, autocast, job.grad_accum, cfg.train.grad_clip,
        device, after_optimizer=hooks, a2a=a2a,
    )


def build_step(
    dims: ParallelDims,
    dtype: str,
    device: torch.device,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    scaler: torch.amp.GradScaler | None,
    grad_accum: int,
    grad_clip: float,
    **options: Any,
) -> TrainStep:
    """The data-parallel step, its forward under the layout's precision and loss
    contexts (the trainer and the doctor's simulation build it here; pipeline stages get
    build_pipeline_step's). `options`: DataParallelStep's keywords."""

    def autocast() -> AbstractContextManager:
        return loss_context(dims.tp, autocast_context(dims.fsdp, dtype, device))

    return DataParallelStep(
        loss_fn, optimizer, scheduler, scaler, autocast, grad_accum, grad_clip, device,
        backward_context=lambda: loss_context(dims.tp), **options,
    )


def loss_context(tp: int, inner: AbstractContextManager | None = None) -> AbstractContextManager:
    """With tensor parallelism the logits arrive sharded by vocabulary: the loss (forward
    and backward) runs under DTensor's loss_parallel, which computes it on the shards."""
    if tp <= 1:  # entered at every micro-batch: no stack to build for nothing
        return inner if inner is not None else contextlib.nullcontext()
    stack = contextlib.ExitStack()
    if inner is not None:
        stack.enter_context(inner)
    stack.enter_context(loss_parallel())
    return stack


def local_loss(loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> Callable:
    """The loss as a plain tensor (loss_parallel returns a replicated DTensor): the loop
    adds, averages and logs it with plain ones. to_local keeps the autograd graph."""

    def loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        value = loss_fn(output, target)
        return value.to_local() if isinstance(value, DTensor) else value

    loss.__wrapped__ = loss_fn  # what it wraps says which part is auxiliary (step.last_aux)
    return loss


def build_checkpointer(
    cfg: JobConfig,
    job: Job,
    env: DistEnv,
    device: torch.device,
    run_dir: Path,
    trainer: Trainer,
    log: logging.Logger,
    group: dist.ProcessGroup | None,
    root: Path | None = None,
) -> Checkpointer:
    """The job's Checkpointer over the trainer's state, its collectives on `group` (the
    job's host group; None: one process); `root` defaults to the run's checkpoint folder
    (the doctor gives its own)."""
    c = cfg
    place = Place(root or root_for(run_dir, c.checkpoint.dir), run_dir, env.rank, env.world, device)
    return Checkpointer(
        c.checkpoint,
        place,
        training_states(
            trainer.parts, trainer.optimizer, env.rank, device, frozen_saved=not c.lora.rank
        ),
        {"scheduler": trainer.scheduler, "scaler": trainer.scaler},
        meta={
            "strategy": job.dims.name, "dp_size": trainer.dp_size, "model": c.model.name,
            "model_spec": asdict(job.model_spec), "config_hash": job_hash(c),
            "lineage": lineage_keys(c, job.global_batch, job.base_weights),
        },
        schedule=SaveSchedule(c.train.steps, c.cluster.mtbf_hours, c.cluster.nodes),
        log=log,
        group=group,
        timeout_s=c.parallel.timeout_s,
        attempt=env.attempt,
    )
