"""The training components of a job, built in one place: the model (seeded, on the device,
wrapped by its strategy), optimizer, schedule, gradient scaler and the Stepper. The worker
trains with them; the doctor times, overfits and checkpoints them."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from trainwise.config import JobConfig, job_hash
from trainwise.config.lineage import lineage_keys
from trainwise.faults import NO_FAULTS, Faults
from trainwise.models import ModelBundle, build_model
from trainwise.plan.model.comm import allreduce_factor
from trainwise.run.checkpoint.dcp import Checkpointer, Place, SaveSchedule
from trainwise.run.checkpoint.states import training_states
from trainwise.run.checkpoint.store import root_for
from trainwise.run.engine.loop import Stepper
from trainwise.run.engine.materialize import allocate, materialize
from trainwise.run.engine.optim import build_optimizer, build_scheduler
from trainwise.run.engine.parallelize import parallelize
from trainwise.run.engine.precision import autocast_context, build_grad_scaler
from trainwise.run.job.distributed import DistEnv
from trainwise.run.job.resolve import Job, sequence_parallel


@dataclass
class Trainer:
    model: torch.nn.Module
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler | None
    autocast: Callable[[], AbstractContextManager]
    stepper: Stepper
    dp_rank: int
    dp_size: int


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
    if dims.single:  # one rank's data, whatever the world
        rank = 0
    elif group is not None:
        rank = dist.get_rank(group)
    else:
        rank = dist.get_rank()
    bundle, model = build_model_for(cfg, job, device, dtype, group)
    faults.network(model, allreduce_factor)  # slowed only under a test's fault
    # Dropout differs between data-parallel ranks; the ranks of one tensor-parallel group
    # draw the same masks (they hold the same replicated activations).
    torch.manual_seed(c.train.seed + 1 + dims.dp_rank(rank))
    optimizer = build_optimizer(model, c.optim)
    scheduler = build_scheduler(optimizer, c.train.steps, c.schedule)
    scaler = build_grad_scaler(dims.fsdp, dtype, device, c.precision.init_scale)

    def autocast() -> AbstractContextManager:
        return loss_context(dims.tp, autocast_context(dims.fsdp, dtype, device))

    loss_fn = local_loss(bundle.loss_fn) if dims.tp > 1 else bundle.loss_fn
    stepper = Stepper(
        model, loss_fn, optimizer, scheduler, scaler, autocast,
        job.grad_accum, c.train.grad_clip, device,
        sharded_accumulation=job.sharded_accumulation,
        backward_context=lambda: loss_context(dims.tp),
        # Compiled blocks run their collectives inside the graph: no dispatch to time.
        time_tp=dims.tp > 1 and not c.train.compile,
    )
    return Trainer(
        model, loss_fn, optimizer, scheduler, scaler, autocast, stepper,
        dims.dp_rank(rank), dims.dp_size,
    )


def build_model_for(
    cfg: JobConfig,
    job: Job,
    device: torch.device,
    dtype: str,
    group: dist.ProcessGroup | None,
) -> tuple[ModelBundle, torch.nn.Module]:
    """The job's model, parallelized. A model with per-parameter init (the GPT) is built
    on the meta device, parallelized, then materialised shard by shard (materialize);
    others are built whole on the device from the seeded RNG, then parallelized."""
    c, dims = cfg, job.dims
    with torch.device("meta"):
        bundle = build_model(job.model_spec)
    if bundle.init_parameter is None:
        # Same seed on every rank: identical initial weights whatever the layout.
        torch.manual_seed(c.train.seed)
        bundle = build_model(job.model_spec)
        bundle.module.to(device)
    # DDP keeps a whole replica per rank and checks it at wrapping: materialise first.
    whole = not dims.fsdp and dims.tp == 1
    init = bundle.init_parameter
    if init is not None and whole:
        _fill(bundle, bundle.module, c.train.seed, device)
    sp = sequence_parallel(c)
    model = parallelize(
        bundle.module,
        bundle.blocks,
        dims,
        device=device,
        precision=dtype,
        reduce_dtype=c.precision.reduce_dtype,
        ac=c.parallel.ac,
        compile=c.train.compile,
        group=group,
        tp_plan=bundle.tp_plan(sp) if dims.tp > 1 and bundle.tp_plan else None,
    )
    if init is not None and not whole:
        # FSDP's CPU offload keeps the sharded parameters in host memory.
        home = torch.device("cpu") if dims.cpu_offload else device
        _fill(bundle, model, c.train.seed, home)
    if bundle.load_weights is not None:  # pretrained: each rank reads its own shards
        bundle.load_weights(model)
    return bundle, model


def _fill(bundle: ModelBundle, model: torch.nn.Module, seed: int, device: torch.device) -> None:
    """Storage for a meta-built model's shards: random values, or none yet when the
    pretrained weights load next (they fill every parameter: load_weights checks)."""
    if bundle.load_weights is not None:
        allocate(model, device)
    else:
        materialize(model, bundle.init_parameter, seed, device)


def loss_context(tp: int, inner: AbstractContextManager | None = None) -> AbstractContextManager:
    """With tensor parallelism the logits arrive sharded by vocabulary: the loss (forward
    and backward) runs under DTensor's loss_parallel, which computes it on the shards."""
    stack = contextlib.ExitStack()
    if inner is not None:
        stack.enter_context(inner)
    if tp > 1:
        stack.enter_context(loss_parallel())
    return stack


def local_loss(loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> Callable:
    """The loss as a plain tensor (loss_parallel returns a replicated DTensor): the loop
    adds, averages and logs it with plain ones. to_local keeps the autograd graph."""

    def loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        value = loss_fn(output, target)
        return value.to_local() if isinstance(value, DTensor) else value

    return loss


def build_checkpointer(
    cfg: JobConfig,
    job: Job,
    env: DistEnv,
    device: torch.device,
    run_dir: Path,
    trainer: Trainer,
    log: logging.Logger,
    root: Path | None = None,
) -> Checkpointer:
    """The job's Checkpointer over the trainer's state; `root` defaults to the run's
    checkpoint folder (the doctor gives its own)."""
    c = cfg
    place = Place(root or root_for(run_dir, c.checkpoint.dir), run_dir, env.rank, env.world, device)
    return Checkpointer(
        c.checkpoint,
        place,
        training_states(trainer.model, trainer.optimizer, env.rank, device),
        {"scheduler": trainer.scheduler, "scaler": trainer.scaler},
        meta={
            "strategy": job.strategy, "dp_size": trainer.dp_size, "model": c.model.name,
            "model_spec": asdict(job.model_spec), "config_hash": job_hash(c),
            "lineage": lineage_keys(c, job.global_batch),
        },
        schedule=SaveSchedule(c.train.steps, c.cluster.mtbf_hours, c.cluster.nodes),
        log=log,
        timeout_s=c.parallel.timeout_s,
        attempt=env.attempt,
    )
