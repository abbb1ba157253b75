"""What the runtime is told: its Decision for `auto`, taken by the planner's search (no
rule of its own) and explained in one sentence; how the planner describes memory; what
makes a loader keep up."""

from __future__ import annotations

from dataclasses import dataclass

from trainwise.config.parallel_dims import ParallelDims
from trainwise.config.schema import JobConfig, ParallelConfig
from trainwise.plan.constraints import check_allowed, user_allowed
from trainwise.plan.estimate import SIMPLER_WITHIN, price
from trainwise.plan.inputs import PlanInputs
from trainwise.plan.model.memory import MemoryEstimate, replica_memory
from trainwise.plan.model.setup import Setup
from trainwise.plan.search import Allowed, Choice, describe_setup, recommend
from trainwise.plan.units import fmt_bytes

__all__ = [
    "Decision", "choose_accumulation", "decide_auto", "describe", "fmt_bytes", "runtime_allowed"
]


@dataclass(frozen=True)
class Decision:
    strategy: str
    cpu_offload: bool
    estimate: MemoryEstimate  # per device, for the chosen strategy
    replica: MemoryEstimate  # one full replica (what ddp would need)
    budget_bytes: float  # usable device memory after headroom
    reason: str
    replicate: int = 1  # hsdp's replica groups
    choice: Choice | None = None  # the planner's answer, for auto
    setup: Setup | None = None  # the configuration priced (auto: the choice's)


def describe(m: MemoryEstimate) -> str:
    """What the device holds at the peak, part by part."""
    parts = [
        ("params", m.params),
        ("grads", m.grads),
        ("optimizer", m.optimizer),
        ("activations", m.activations),
        ("buffers", m.buffers),
        ("overhead", m.overhead),
    ]
    return ", ".join(f"{name} {fmt_bytes(v)}" for name, v in parts if v)


def runtime_allowed(
    shard: str, dp_shard: int | None, tp: int = 1, accumulate: str = "auto", pp: int = 1,
    ep: int = 1,
) -> Allowed:
    """What `auto` may choose: everything the planner prices (the runtime runs all of it),
    with the job's own micro-batch, accumulation steps, checkpointing, parallel.shard,
    parallel.tp, parallel.ep and, when given, parallel.dp_shard and parallel.accumulate:
    facts of the job the search takes as given. The tensor-parallel degree is the job's
    because it sets the data-parallel size and so the samples per step; `trainwise plan`
    recommends one, and an ep."""
    parallel = ParallelConfig(shard=shard, dp_shard=dp_shard, tp=tp, accumulate=accumulate, pp=pp,
                              ep=ep)
    return user_allowed(JobConfig(parallel=parallel))


def decide_auto(inputs: PlanInputs, allowed: Allowed) -> Decision:
    """`auto`: the planner's search (plan.search.recommend, the one chooser `trainwise plan`
    prints) over what the runtime can run, as the runtime's Decision with its sentence. A
    setting no layout can meet is its own line first, as `trainwise plan` says it."""
    check_allowed(inputs, allowed)
    choice = recommend(inputs, allowed)
    dims, w, world = choice.dims, inputs.workload, inputs.gpus
    device = inputs.hardware.device
    replica = replica_memory(w, world, device, inputs.grad_accum)
    budget = choice.plan.budget_bytes
    est = choice.plan.memory
    name = dims.name + (" with cpu offload" if dims.cpu_offload else "")
    room = f"{fmt_bytes(budget)} usable of {fmt_bytes(inputs.hardware.memory_bytes)} per worker"
    fits = "which fits in" if replica.total <= budget else "more than the"
    need = f"one replica needs {fmt_bytes(replica.total)} ({describe(replica)}), {fits} {room}"
    setup = describe_setup(choice.setup)
    if choice.fits:
        reason = (
            f"{name}: {need}; the planner chose {setup}, {fmt_bytes(est.total)} per worker, "
            f"as {choice.why}."
        )
    else:
        reason = (
            f"{name}: {need}; nothing fits: {setup} needs the least, {fmt_bytes(est.total)} "
            "per worker, and may still not fit."
        )
    replicate = dims.dp_replicate if dims.hybrid else 1
    return Decision(
        dims.strategy, dims.cpu_offload, est, replica, budget, reason, replicate, choice,
        choice.setup,
    )


def choose_accumulation(
    inputs: PlanInputs, dims: ParallelDims, ac: str, micro_batch: int, grad_accum: int,
    sequence_parallel: bool = True,
) -> str:
    """`parallel.accumulate = "auto"` for a layout the job set itself: the planner prices
    both modes (memory, and the reduce-scatters each exposes) and takes the faster that
    fits, unsharded when they are within SIMPLER_WITHIN (one reduction a step, the simpler);
    when neither fits, the one needing less memory."""
    plans = [
        price(inputs, Setup(dims, ac, micro_batch, grad_accum, mode, sequence_parallel))
        for mode in ("unsharded", "sharded")
    ]
    fitting = [p for p in plans if p.fits]
    if not fitting:
        return min(plans, key=lambda p: p.memory.total).setup.accumulate
    best = min(p.step.total for p in fitting)
    simplest = next(p for p in fitting if p.step.total <= best * (1 + SIMPLER_WITHIN))
    return simplest.setup.accumulate


# What makes a loader keep up: said the same way by the planner, the doctor and the
# training loop's data-wait warning.
def loader_fixes(num_workers: int | None = None, cuda: bool = True) -> str:
    now = f", now {num_workers}" if num_workers is not None else ""
    fixes = [f"more loader processes (data.num_workers{now})"]
    fixes.append("a deeper prefetch per process (data.prefetch_factor)")
    if cuda:
        fixes.append("pinned memory (data.pin_memory = true)")
    fixes.append("pre-tokenized data read from a file (data.dataset = 'tokens')")
    return "add " + ", ".join(fixes[:-1]) + " or " + fixes[-1]
