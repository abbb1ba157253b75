"""The `auto` strategy: one replica fits with headroom -> ddp, else fsdp (on several
machines hsdp instead, when it fits and the planner predicts a faster step), else fsdp with
CPU offload. The decision comes with the sentence that explains it."""

from __future__ import annotations

from dataclasses import dataclass, replace

from trainwise.hardware.catalog import GB
from trainwise.plan.comm import ACROSS_NODES
from trainwise.plan.estimate import SIMPLER_WITHIN, evaluate
from trainwise.plan.inputs import PlanInputs
from trainwise.plan.memory import MemoryEstimate, Workload, estimate_memory
from trainwise.plan.units import fmt_bytes

__all__ = ["Decision", "choose_strategy", "describe", "fmt_bytes"]


@dataclass(frozen=True)
class Decision:
    strategy: str
    cpu_offload: bool
    estimate: MemoryEstimate  # per device, for the chosen strategy
    replica: MemoryEstimate  # one full replica (what ddp would need)
    budget_bytes: float  # usable device memory after headroom
    reason: str


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


def choose_strategy(
    w: Workload,
    world: int,
    device_bytes: float,
    headroom: float,
    shard: str = "full",
    allow_offload: bool = True,
    device: str = "cpu",
    grad_accum: int = 1,
    cluster: PlanInputs | None = None,
) -> Decision:
    """`cluster`: the planner's view of the machines (hardware figures, workers per node;
    its workload and GPU count are replaced by these). With it, on several whole machines,
    a model that needs sharding weighs hsdp against fsdp by the planner's step time."""
    budget = device_bytes * (1.0 - headroom)
    replica = estimate_memory(
        w, "ddp" if world > 1 else "single", world, device=device, grad_accum=grad_accum
    )
    need = f"one replica needs {fmt_bytes(replica.total)} ({describe(replica)})"
    room = f"{fmt_bytes(budget)} usable of {fmt_bytes(device_bytes)} per worker"
    if replica.total <= budget:
        if world == 1:
            return Decision(
                "single",
                False,
                replica,
                replica,
                budget,
                f"single: {need}, which fits in {room}; one worker, no communication.",
            )
        return Decision(
            "ddp",
            False,
            replica,
            replica,
            budget,
            f"ddp: {need}, which fits in {room}, so each of the {world} workers keeps a full "
            "copy and only gradients cross the network.",
        )
    sharded = estimate_memory(w, "fsdp", world, shard=shard, device=device, grad_accum=grad_accum)
    over = f"{need}, more than the {room}"
    if world > 1 and sharded.total <= budget:
        fsdp = Decision(
            "fsdp",
            False,
            sharded,
            replica,
            budget,
            f"fsdp: {over}; sharded over {world} workers it needs {fmt_bytes(sharded.total)} each.",
        )
        if cluster is None:
            return fsdp
        return _weigh_hsdp(fsdp, w, world, budget, shard, device, grad_accum, cluster, over)
    if not allow_offload:  # CPU workers: nowhere to offload to; say so rather than hide it
        best, est = ("fsdp", sharded) if world > 1 else ("single", replica)
        return Decision(
            best,
            False,
            est,
            replica,
            budget,
            f"{best}: {over}; with no GPU to offload from it needs {fmt_bytes(est.total)} per "
            "worker and may still not fit.",
        )
    offload = estimate_memory(
        w, "fsdp", world, shard=shard, cpu_offload=True, device=device, grad_accum=grad_accum
    )
    fits = "fits" if offload.total <= budget else "may still not fit"
    return Decision(
        "fsdp",
        True,
        offload,
        replica,
        budget,
        f"fsdp with cpu offload: {over}; sharded it still needs {fmt_bytes(sharded.total)} per "
        f"worker; with parameters, gradients and optimizer state in host memory it needs "
        f"{fmt_bytes(offload.total)} on the device and {fits}.",
    )


def _weigh_hsdp(
    fsdp: Decision,
    w: Workload,
    world: int,
    budget: float,
    shard: str,
    device: str,
    grad_accum: int,
    cluster: PlanInputs,
    over: str,
) -> Decision:
    """hsdp (shard within a machine, replicate across machines) instead of `fsdp` when it
    fits and the planner's step (these workers, this accumulation) is faster by more than
    SIMPLER_WITHIN: the planner's own rule, fsdp being the simpler. Only on several whole
    machines; only with full resharding (the planner times hsdp as ZeRO-3 within a node).
    Where hsdp loses, `fsdp` with a sentence on why."""
    per_node = cluster.node_size
    if per_node >= world or world % per_node:
        return fsdp
    nodes = world // per_node
    if shard != "full":
        return replace(
            fsdp,
            reason=f"{fsdp.reason} hsdp was not weighed: the planner times it only with "
            "parallel.shard = 'full'.",
        )
    hybrid = estimate_memory(
        w, "hsdp", world, shard=shard, shard_degree=per_node, device=device, grad_accum=grad_accum
    )
    if hybrid.total > budget:
        return replace(
            fsdp,
            reason=f"{fsdp.reason} hsdp (sharded within each of the {nodes} machines) would "
            f"need {fmt_bytes(hybrid.total)} per worker and does not fit.",
        )
    inputs = replace(
        cluster, workload=w, gpus=world, grad_accum=grad_accum, global_batch=None, strategy=None
    )
    flat, hier = evaluate(inputs, "fsdp-full"), evaluate(inputs, "hsdp")
    t_flat, t_hier = flat.step.total, hier.step.total
    if t_flat <= t_hier * (1 + SIMPLER_WITHIN):
        return replace(
            fsdp,
            reason=f"{fsdp.reason} hsdp (sharded within each of the {nodes} machines) fits too, "
            f"but its predicted step ({t_hier:.3g} s) is not faster than fsdp's ({t_flat:.3g} s).",
        )
    hw = inputs.hardware
    across = sum(c.wire_bytes for c in hier.collectives if c.name == ACROSS_NODES)
    return Decision(
        "hsdp",
        False,
        hybrid,
        fsdp.replica,
        budget,
        f"hsdp: {over}; it shards within each of the {nodes} machines ({per_node} workers, "
        f"{fmt_bytes(hybrid.total)} each) and replicates across them. Its predicted step is "
        f"{t_hier:.3g} s against fsdp's {t_flat:.3g} s ({t_flat / t_hier:.3g}x faster): fsdp's "
        f"gathers and reduce-scatters span all {world} workers and send "
        f"{fmt_bytes(flat.comm_bytes_per_step_per_gpu)} per worker a step over the "
        f"{hw.inter_bps / GB:.3g} GB/s link between machines; hsdp keeps them on the "
        f"{hw.intra_bps / GB:.3g} GB/s link within a machine and sends only the gradient "
        f"shards, {fmt_bytes(across)} per worker, between machines.",
    )


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
