"""Collective bandwidth as nccl-tests measures it: each collective over message sizes from
1 KB up to a bound, a warm-up then timed iterations, the slowest rank's time. The
algorithm bandwidth is size / time; the bus bandwidth scales it by the share of the data
each rank's link carries in a ring, so that it compares with the link's speed whatever the
world size (nccl-tests, doc/PERFORMANCE.md). The all-to-all (a Mixture-of-Experts model's
dispatch and combine under expert parallelism) is timed as nccl-tests' alltoall: each rank
sends size / n of its size-byte buffer to every rank, size counting the whole buffer, and
the bus bandwidth is algbw x (n - 1) / n, the share that leaves the rank (src/alltoall.cu;
plan.model.network.bus_factor)."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from trainwise.plan.model import network
from trainwise.plan.model.comm import allreduce_factor, gather_factor

KB = 1024
FIRST_BYTES = KB
SIZE_STEP = 4  # message sizes 1 KB, 4 KB, 16 KB, ...
MAX_BYTES = {"cuda": 256 * 2**20, "cpu": 64 * 2**20}
OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all")
WARMUP = 1


def bus_factor(op: str, n: int) -> float:
    """busbw / algbw for `op` on n ranks (nccl-tests' definitions)."""
    if op == "all_reduce":
        return allreduce_factor(n)
    if op in ("all_gather", "reduce_scatter"):
        return gather_factor(n)
    if op == "broadcast":
        return 1.0
    if op == "all_to_all":
        return network.bus_factor(op, n)
    raise ValueError(f"unknown collective {op!r}")


@dataclass(frozen=True)
class BandwidthRow:
    link: str  # "intra_node" (ranks of one node) or "inter_node" (one rank per node)
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
    if op == "all_to_all":  # size / world to each rank, even splits (nccl-tests' alltoall)
        received = torch.empty(n, device=device)
        return lambda: dist.all_to_all_single(received, whole, group=group)
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
    link: str = "intra_node",
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
    return BandwidthRow(link, op, size, seconds, algbw, algbw * bus_factor(op, world))


def sweep(
    max_bytes: int,
    iterations: int,
    device: torch.device,
    group: dist.ProcessGroup | None = None,
    host: dist.ProcessGroup | None = None,
    link: str = "intra_node",
) -> list[BandwidthRow]:
    world = dist.get_world_size(group or dist.group.WORLD)
    return [
        measure(op, size, iterations, device, group, host, link)
        for op in OPS
        for size in message_sizes(max_bytes, world)
    ]


def large_message_busbw(
    rows: list[BandwidthRow], link: str = "intra_node", op: str = "all_reduce"
) -> float | None:
    """The bus bandwidth at the largest message of `op` on `link`: the plateau the
    planner's ring model takes as the link speed."""
    mine = [r for r in rows if r.op == op and r.link == link]
    return max(mine, key=lambda r: r.bytes).busbw if mine else None


def node_id() -> str:
    """Which machine this rank is on: torchrun's node rank (GROUP_RANK) or Slurm's, with
    the host name (two agents on one host are two nodes to the job)."""
    rank = os.environ.get("GROUP_RANK", os.environ.get("SLURM_NODEID", ""))
    return f"{socket.gethostname()}/{rank}"


def link_groups(nodes: list[str]) -> dict[str, list[list[int]]]:
    """The groups each link is timed on, from every rank's node id: the ranks of each node
    (intra_node), and across nodes the ranks at the same position on each node
    (inter_node: the 'rails' HSDP's replicas all-reduce over, all at once). Groups of
    one rank time nothing and are left out."""
    order = list(dict.fromkeys(nodes))
    by_node = [[r for r, n in enumerate(nodes) if n == node] for node in order]
    depth = min(len(g) for g in by_node)
    rails = [[g[i] for g in by_node] for i in range(depth)]
    return {
        "intra_node": [g for g in by_node if len(g) > 1],
        "inter_node": [g for g in rails if len(g) > 1],
    }


def sweep_links(
    nodes: list[str], max_bytes: int, iterations: int, device: torch.device, host
) -> list[BandwidthRow]:
    """Every link of the job's layout, each over its groups at once (every rank calls this;
    group creation is collective). A rank outside every group of a link waits."""
    rank = dist.get_rank()
    gloo = dist.get_backend() == "gloo"
    rows: list[BandwidthRow] = []
    for link, groups in link_groups(nodes).items():
        made = [(ranks, dist.new_group(ranks)) for ranks in groups]
        hosts = [g if gloo else dist.new_group(r, backend="gloo") for r, g in made]
        for (ranks, group), host_group in zip(made, hosts, strict=True):
            if rank in ranks:
                rows += sweep(max_bytes, iterations, device, group, host_group, link)
        dist.barrier(group=host)
        for (ranks, group), host_group in zip(made, hosts, strict=True):
            if rank in ranks:
                for g in [group] if gloo else [group, host_group]:
                    dist.destroy_process_group(g)
    return rows
