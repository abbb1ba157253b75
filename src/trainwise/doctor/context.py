"""What every check gets: the job as it runs at this world size, this rank's place, the
plan's assumptions for the same job, and a few helpers the checks share (batches held in
memory, timed training steps, the slowest rank's figure)."""

from __future__ import annotations

import itertools
import statistics
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from trainwise.config import JobConfig
from trainwise.data import build_loader
from trainwise.doctor.gap import JobTerms
from trainwise.faults import NO_FAULTS, Faults
from trainwise.hardware import find_gpu
from trainwise.plan.calibrate import WARMUP_STEPS  # the run report's steady state, too
from trainwise.plan.estimate import StrategyPlan, evaluate
from trainwise.plan.inputs import PlanInputs, resolve_inputs
from trainwise.run.engine.trainer import Trainer
from trainwise.run.job.distributed import DistEnv
from trainwise.run.job.resolve import Job


@dataclass
class Context:
    cfg: JobConfig
    job: Job
    env: DistEnv
    device: torch.device
    run_dir: Path
    # A gloo group over every rank for the doctor's own exchanges (times, core counts,
    # results): host values need no device copy, and NCCL takes CUDA tensors only.
    host: Any = None
    faults: Faults = NO_FAULTS  # the worker's fault seam (a test's slow data or network)
    measured: dict[str, Any] = field(default_factory=dict)  # shared between checks

    @property
    def world(self) -> int:
        return self.env.world

    def plan_inputs(self, gpus: int | None = None) -> PlanInputs:
        """The planner's inputs for this job on this machine's device (the catalog entry
        it matches), at `gpus` workers (default: this world)."""
        cfg = self.cfg
        spec = find_gpu(self.job.device.name) or find_gpu("cpu")
        assert spec is not None
        cluster = cfg.cluster.model_copy(update={"gpu": spec.name, "nproc": self.env.local_world})
        plan = cfg.plan.model_copy(update={"gpus": gpus or self.world, "tokens": None})
        inputs = resolve_inputs(cfg.model_copy(update={"cluster": cluster, "plan": plan}))
        return replace(inputs, node_size=self.env.local_world)

    def planned(self, gpus: int | None = None, job: Job | None = None) -> StrategyPlan:
        """The plan's figures for the job's strategy at `gpus` workers."""
        return evaluate(self.plan_inputs(gpus), plan_name(job or self.job))

    def job_terms(self) -> JobTerms:
        """The planned job at this world, which a check's gap is charged to."""
        inputs = self.plan_inputs()
        plan = evaluate(inputs, plan_name(self.job))
        return JobTerms(
            plan.step.total, self.cfg.train.steps, self.world, inputs.hardware.price_per_gpu_hour
        )

    def slowest(self, seconds: float, host: Any = None) -> float:
        """The largest of every rank's `seconds` (a step is as slow as its slowest rank),
        over the gloo group `host` (default: all ranks)."""
        return self.reduce(seconds, dist.ReduceOp.MAX, host)

    def reduce(self, value: float, op: Any, host: Any = None) -> float:
        host = host or self.host
        if host is None:
            return value
        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t, op=op, group=host)
        return float(t)

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's `obj` (index = rank), on every rank."""
        if self.host is None:
            return [obj]
        everyone: list[Any] = [None] * self.world
        dist.all_gather_object(everyone, obj, group=self.host)
        return everyone

    def batches(self, trainer: Trainer) -> list[tuple[torch.Tensor, ...]]:
        """One step's micro-batches of this rank's data, read once and held on the device:
        timing the model without the loader."""
        c = self.cfg
        loader = build_loader(
            self.job.datasets[0], micro_batch=c.data.micro_batch, grad_accum=self.job.grad_accum,
            dp_rank=trainer.dp_rank, dp_size=trainer.dp_size, seed=c.train.seed, num_steps=1,
        )
        return [tuple(t.to(self.device) for t in batch) for batch in loader]


def plan_name(job: Job) -> str:
    """The planner's name for the job's strategy (fsdp-full, fsdp-grad-op, ...)."""
    return job.dims.plan_name


def timed_steps(
    trainer: Trainer,
    batches: list,
    steps: int,
    ctx: Context,
    host: Any = None,
    warmup: int = WARMUP_STEPS,
) -> float:
    """Seconds per step: the slowest rank's median over `steps` after `warmup`, the
    batches cycled (a median, as the run report's steady step: a step that other work on
    the machine slowed does not move it). The ranks of the gloo group `host` (default:
    all) call it."""
    source = itertools.cycle(batches)
    for _ in range(warmup):
        trainer.train_step(source, probe=False)
    if ctx.device.type == "cuda":
        torch.cuda.synchronize(ctx.device)
    if host or ctx.host:
        dist.barrier(group=host or ctx.host)
    seconds = []
    for _ in range(steps):
        start = time.perf_counter()
        trainer.train_step(source, probe=False)
        if ctx.device.type == "cuda":
            torch.cuda.synchronize(ctx.device)
        seconds.append(time.perf_counter() - start)
    return ctx.slowest(statistics.median(seconds), host)
