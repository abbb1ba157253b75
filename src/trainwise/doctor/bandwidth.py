"""Collective bandwidth as nccl-tests measures it: each collective over message sizes from
1 KB up to a bound, a warm-up then timed iterations, the slowest rank's time. The
algorithm bandwidth is size / time; the bus bandwidth scales it by the share of the data
each rank's link carries in a ring, so that it compares with the link's speed whatever the
world size (nccl-tests, doc/PERFORMANCE.md)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from trainwise.plan.comm import allreduce_factor, gather_factor

KB = 1024
FIRST_BYTES = KB
SIZE_STEP = 4  # message sizes 1 KB, 4 KB, 16 KB, ...
MAX_BYTES = {"cuda": 256 * 2**20, "cpu": 64 * 2**20}
OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")
WARMUP = 1


def bus_factor(op: str, n: int) -> float:
    """busbw / algbw for `op` on n ranks (nccl-tests' definitions)."""
    if op == "all_reduce":
        return allreduce_factor(n)
    if op in ("all_gather", "reduce_scatter"):
        return gather_factor(n)
    if op == "broadcast":
        return 1.0
    raise ValueError(f"unknown collective {op!r}")


@dataclass(frozen=True)
class BandwidthRow:
    op: str
    bytes: int  # the message size as nccl-tests counts it: the whole buffer
    seconds: float  # per operation, the slowest rank's
    algbw: float  # bytes/s
    busbw: float  # bytes/s

    def as_dict(self) -> dict:
        return asdict(self)


def message_sizes(max_bytes: int, world: int) -> list[int]:
    """1 KB, 4 KB, ... up to max_bytes; each a whole number of fp32 elements per rank."""
    quantum = 4 * world
    sizes, size = [], FIRST_BYTES
    while size <= max_bytes:
        sizes.append(max(quantum, size // quantum * quantum))
        size *= SIZE_STEP
    return sizes


def _operation(op: str, size: int, world: int, device: torch.device, group) -> Callable[[], None]:
    n = size // 4
    if op == "all_reduce":
        buf = torch.ones(n, device=device)
        return lambda: dist.all_reduce(buf, group=group)
    if op == "broadcast":
        buf = torch.ones(n, device=device)
        return lambda: dist.broadcast(buf, src=dist.get_global_rank(group, 0), group=group)
    part = torch.ones(n // world, device=device)
    whole = torch.ones(n, device=device)
    if op == "all_gather":
        return lambda: dist.all_gather_single(whole, part, group=group)
    if op == "reduce_scatter":
        return lambda: dist.reduce_scatter_single(part, whole, group=group)
    raise ValueError(f"unknown collective {op!r}")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(
    op: str,
    size: int,
    iterations: int,
    device: torch.device,
    group: dist.ProcessGroup | None = None,
    host: dist.ProcessGroup | None = None,
) -> BandwidthRow:
    """Time `op` on `size` bytes over `group` (default: all ranks); the times are reduced
    over the gloo group `host` (the same ranks; default: `group`). Every rank of `group`
    must call it together."""
    group = group or dist.group.WORLD
    world = dist.get_world_size(group)
    run = _operation(op, size, world, device, group)
    for _ in range(WARMUP):
        run()
    _sync(device)
    dist.barrier(group=host or group)
    start = time.perf_counter()
    for _ in range(iterations):
        run()
    _sync(device)
    mine = torch.tensor([(time.perf_counter() - start) / iterations], dtype=torch.float64)
    dist.all_reduce(mine, op=dist.ReduceOp.MAX, group=host or group)
    seconds = float(mine)
    algbw = size / seconds
    return BandwidthRow(op, size, seconds, algbw, algbw * bus_factor(op, world))


def sweep(
    max_bytes: int,
    iterations: int,
    device: torch.device,
    group: dist.ProcessGroup | None = None,
    host: dist.ProcessGroup | None = None,
) -> list[BandwidthRow]:
    world = dist.get_world_size(group or dist.group.WORLD)
    return [
        measure(op, size, iterations, device, group, host)
        for op in OPS
        for size in message_sizes(max_bytes, world)
    ]


def large_message_busbw(rows: list[BandwidthRow], op: str = "all_reduce") -> float | None:
    """The bus bandwidth at the largest message of `op`: the plateau the planner's ring
    model takes as the link speed."""
    mine = [r for r in rows if r.op == op]
    return max(mine, key=lambda r: r.bytes).busbw if mine else None
