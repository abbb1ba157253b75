"""The configurations the planner's search may choose from: layouts (dp_replicate x
dp_shard x tp, FSDP's options) and knobs (activation checkpointing, micro-batch,
accumulation), and what a caller allows of them (`Allowed`: everything the planner can
price, or what the runtime can run today).

The space is enumerated per layout; the knobs are searched inside one (plan.search), where
dominated options are pruned: at a fixed layout, checkpointing mode and accumulation mode,
a larger micro-batch is never slower (the same compute, fewer gathers and host copies, a
longer window to hide the reductions), so only the largest that fits is priced.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from trainwise.config.parallel_dims import ParallelDims
from trainwise.plan.inputs import PlanInputs

AC_MODES = ("none", "selective", "full")  # fastest first, least memory last


@dataclass(frozen=True)
class Allowed:
    """What the search may vary. `knobs`: the micro-batch and activation checkpointing
    (else the job's own); `tp`: tensor-parallel layouts; `sharded_accumulation`:
    reduce-scattering every micro-batch; `offload`: FSDP's CPU offload (never on CPU
    workers, whatever this says). The runtime runs all of it: `auto` narrows it only by
    the job's own choices below."""

    tp: bool = True
    sharded_accumulation: bool = True
    knobs: bool = True
    offload: bool = True
    # The job's own choices the runtime keeps (None: free): FSDP's resharding after forward
    # (parallel.shard) and the shard group's size (parallel.dp_shard / replicate).
    reshard_after_forward: bool | None = None
    shard_group: int | None = None
    # The tensor-parallel degree (parallel.tp): the job keeps it, as it sets how many ranks
    # read different samples and so the samples per step.
    tp_degree: int | None = None
    accumulate: str | None = None  # parallel.accumulate when sharded / unsharded


EVERYTHING = Allowed()


def tp_degrees(inputs: PlanInputs, allowed: Allowed) -> list[int]:
    """Tensor-parallel degrees: divisors of the heads (and key/value heads), of the GPUs
    a node holds and of the GPUs; 1 alone for a model without a shape."""
    shape = inputs.workload.shape
    if allowed.tp_degree is not None:
        return [allowed.tp_degree]  # checked against the model by the job
    if not allowed.tp or shape is None:
        return [1]
    limit = math.gcd(shape.n_head, shape.n_kv_head, inputs.gpus_per_node, inputs.gpus)
    return divisors(limit)


def divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def layouts(inputs: PlanInputs, allowed: Allowed) -> list[ParallelDims]:
    """Every layout of inputs.gpus GPUs: for each tp, no data parallelism (one GPU or pure
    TP), DDP, and FSDP over shard groups of every size dividing the data-parallel ranks
    (ZeRO-3 and ZeRO-2; replicas of them when the group is smaller), plus CPU offload
    (ZeRO-3 only) where allowed. Simplest first."""
    offload = allowed.offload and inputs.hardware.device == "cuda"
    resharding = (False, True)
    if allowed.reshard_after_forward is not None:
        resharding = (allowed.reshard_after_forward,)
    out: list[ParallelDims] = []
    for tp in tp_degrees(inputs, allowed):
        dp = inputs.gpus // tp
        if allowed.shard_group is None:
            # dp 1: no wrapper at all; replicas of a TP model are FSDP2's (as they run)
            out.append(ParallelDims(dp_replicate=dp, tp=tp).runnable())
        for shard in divisors(dp):
            if allowed.shard_group not in (None, shard):
                continue
            replicas = dp // shard
            if shard > 1:
                for full in resharding:
                    out.append(
                        ParallelDims(replicas, shard, tp, fsdp=True, reshard_after_forward=full)
                    )
            if offload and True in resharding:
                out.append(ParallelDims(replicas, shard, tp, fsdp=True, cpu_offload=True))
    return out


def replica_batch(inputs: PlanInputs, dims: ParallelDims) -> int:
    """Sequences each data-parallel rank runs a step: the global batch over the ranks
    (rounded up: a batch that does not divide leaves some ranks short), at least one; the
    job's micro-batch x accumulation when the global batch grows with the GPUs."""
    if inputs.global_batch is None:
        return inputs.workload.micro_batch * inputs.grad_accum
    return max(1, -(-inputs.global_batch // dims.dp_size))


def micro_batches(inputs: PlanInputs, batch: int, allowed: Allowed) -> list[int]:
    """Micro-batch sizes, ascending: the divisors of the replica's batch; or the job's own
    (at most the batch), when the knobs are fixed."""
    if allowed.knobs:
        return divisors(batch)
    accum = max(1, math.ceil(batch / inputs.workload.micro_batch - 1e-9))
    return [max(1, math.ceil(batch / accum - 1e-9))]


def ac_modes(inputs: PlanInputs, allowed: Allowed) -> tuple[str, ...]:
    """Checkpointing modes: all three for a model with a shape (without one, recomputing
    saves no modelled memory); the job's own when the knobs are fixed."""
    if not allowed.knobs or inputs.workload.shape is None:
        return (inputs.workload.ac,)
    return AC_MODES


def accumulations(dims: ParallelDims, grad_accum: int, allowed: Allowed) -> tuple[str, ...]:
    """Accumulation modes: sharded or unsharded for FSDP with several micro-batches (the
    job's, when it names one)."""
    if not (dims.fsdp and grad_accum > 1):
        return ("unsharded",)
    if allowed.accumulate is not None:
        return (allowed.accumulate,)
    return ("unsharded", "sharded") if allowed.sharded_accumulation else ("unsharded",)
