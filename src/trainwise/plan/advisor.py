"""The `auto` strategy: one replica fits with headroom -> ddp, else fsdp, else fsdp with
CPU offload. The decision comes with the sentence that explains it."""

from __future__ import annotations

from dataclasses import dataclass

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
) -> Decision:
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
        return Decision(
            "fsdp",
            False,
            sharded,
            replica,
            budget,
            f"fsdp: {over}; sharded over {world} workers it needs {fmt_bytes(sharded.total)} each.",
        )
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
