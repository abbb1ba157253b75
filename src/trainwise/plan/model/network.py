"""How NCCL moves a collective across a cluster: the bytes on each class of link, the time
of the slowest, plus a latency per algorithm step (the alpha-beta model).

Links. Within a node each GPU reaches the others at `intra_bps` (NVLink/xGMI through a
switch, or PCIe); between nodes a node has `nics` NICs of `nic_bps` each. Both figures are
what NCCL reaches (nccl-tests' bus bandwidth), not line rates: hardware.catalog keeps the
line rate and the share NCCL reaches, each with its source.

Ring (nccl-tests doc/PERFORMANCE.md; NCCL's choice for all-gather and reduce-scatter, and
for large all-reduces beyond two nodes): over n ranks each rank sends and receives f x S,
f = (n-1)/n for an all-gather or reduce-scatter of S bytes (the whole buffer) and 2(n-1)/n
for an all-reduce: the "bus bytes" whose rate nccl-tests reports as busbw. A ring over k
nodes with g ranks on each passes g-1 NVLink hops inside a node and enters it through one
NIC. NCCL runs several rings (channels) at once, each crossing the node boundary through
another NIC (its tuner prices a ring at nChannels x bwInter: NVIDIA/nccl
src/graph/tuning.cc), so the node's NICs carry f x S together, in parallel, while each GPU
carries (g-1)/g of its f x S over NVLink. A flat ring moves f x S into each node, not the
(k-1)/k x S a hierarchical algorithm would: NCCL's rings are flat.

Tree (all-reduce only; NCCL runs it where its tuner predicts less time: two nodes, or
latency-bound sizes at scale): a chain through the GPUs of each node and two binary trees
across nodes, each reducing then broadcasting half the buffer (NVIDIA blog "Massively
Scale Your Deep Learning Training with NCCL 2.4", 2019). An interior node of one tree
receives 2 x S/2 from its children and S/2 from its parent, and S/2 as a leaf of the other:
2S through its NICs each way; with two nodes, S. Each GPU moves 2(g-1)/g x S over NVLink.

Sharing. Groups that run at once on a node (the data-parallel groups of the other
tensor-parallel ranks, HSDP's replicas on their rails) share its NICs: a group with g of
the node's G busy GPUs gets g/G of min(nics, G) NICs (a GPU drives one NIC: rail-optimized
nodes such as DGX H100 have one per GPU).

Latency (NCCL's tuning model, src/graph/tuning.cc, Simple protocol): a base per call, then
per step one hop's latency: a ring takes n-1 steps (all-gather, reduce-scatter) or 2(n-1)
(all-reduce), k-1 or 2(k-1) of them across nodes; a tree 2((g-1) + log2 k) steps, log2 k
of them across nodes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# NVIDIA/nccl src/graph/tuning.cc (ncclTunerConstantsDefaults, Simple protocol): the base
# latency of a ring or tree call, in seconds.
BASE_LATENCY_S = 8.4e-6
OPS = ("all_gather", "reduce_scatter", "all_reduce", "send_recv")


@dataclass(frozen=True)
class Fabric:
    """The links of the nodes a job runs on (bytes/s per direction, as NCCL reaches them)."""

    gpus_per_node: int  # GPUs the job uses on each node
    intra_bps: float  # per GPU, within a node
    nic_bps: float  # per NIC, between nodes
    nics_per_node: int | None = None  # None: one per GPU
    intra_step_s: float = 0.0  # latency of one algorithm step within a node
    net_step_s: float = 0.0  # of one step across nodes

    @property
    def base_s(self) -> float:
        """NCCL's base latency a call, on links with latency figures (none: a hand-built
        or CPU layout, priced by bandwidth alone)."""
        return BASE_LATENCY_S if self.intra_step_s or self.net_step_s else 0.0

    def nics_for(self, per_node: int) -> float:
        """The NICs a group with `per_node` ranks on each node drives (see Sharing above)."""
        busy = self.gpus_per_node
        nics = min(self.nics_per_node or busy, busy)
        return nics * min(per_node, busy) / busy


@dataclass(frozen=True)
class Group:
    """A collective's ranks: `ranks` in all, `per_node` of them on each of its nodes."""

    ranks: int
    per_node: int

    @property
    def nodes(self) -> int:
        return -(-self.ranks // self.per_node)


def group_of(size: int, stride: int, gpus_per_node: int) -> Group:
    """The group of `size` ranks `stride` apart (ranks numbered node by node)."""
    per_node = max(1, min(size, gpus_per_node // stride)) if stride <= gpus_per_node else 1
    return Group(size, per_node)


@dataclass(frozen=True)
class Cost:
    """One call of a collective: the bytes on each link class, and its time."""

    algorithm: str  # "ring", "tree", "p2p" or "none"
    bus_bytes: float  # per rank, as nccl-tests counts them (f x S)
    intra_bytes: float  # per GPU, over the node's own links
    inter_bytes: float  # per node, over the NICs the group drives
    bandwidth_s: float  # the slowest link class's bytes over its bandwidth
    latency_s: float

    @property
    def seconds(self) -> float:
        return self.bandwidth_s + self.latency_s


NOTHING = Cost("none", 0.0, 0.0, 0.0, 0.0, 0.0)


def bus_factor(op: str, n: int) -> float:
    """nccl-tests' busbw / algbw: the share of the buffer each rank sends."""
    if n <= 1:
        return 0.0
    if op == "all_reduce":
        return 2.0 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    if op == "send_recv":
        return 1.0
    raise ValueError(f"unknown collective {op!r}")


def _time(intra: float, inter: float, group: Group, fabric: Fabric) -> float:
    t_intra = intra / fabric.intra_bps if intra else 0.0
    t_inter = inter / (fabric.nics_for(group.per_node) * fabric.nic_bps) if inter else 0.0
    return max(t_intra, t_inter)


def ring(op: str, size: float, group: Group, fabric: Fabric) -> Cost:
    """A ring all-gather, reduce-scatter or all-reduce of `size` bytes (the whole buffer)."""
    n, g, k = group.ranks, group.per_node, group.nodes
    bus = bus_factor(op, n) * size
    if k == 1:
        intra, inter = bus, 0.0
    else:
        intra, inter = bus * (g - 1) / g, bus
    steps = n - 1 if op != "all_reduce" else 2 * (n - 1)
    net_steps = k - 1 if op != "all_reduce" else 2 * (k - 1)
    latency = (
        fabric.base_s + (steps - net_steps) * fabric.intra_step_s + net_steps * fabric.net_step_s
    )
    return Cost("ring", bus, intra, inter, _time(intra, inter, group, fabric), latency)


def tree(size: float, group: Group, fabric: Fabric) -> Cost:
    """NCCL's tree all-reduce of `size` bytes across nodes (see the module's docstring)."""
    g, k = group.per_node, group.nodes
    bus = bus_factor("all_reduce", group.ranks) * size
    intra = 2.0 * size * (g - 1) / g
    inter = size if k == 2 else 2.0 * size
    latency = fabric.base_s + 2 * (
        (g - 1) * fabric.intra_step_s + math.log2(k) * fabric.net_step_s
    )
    return Cost("tree", bus, intra, inter, _time(intra, inter, group, fabric), latency)


def collective(op: str, size: float, group: Group, fabric: Fabric) -> Cost:
    """One call of `op` over `group`: `size` is the whole buffer (an all-gather's output, a
    reduce-scatter's input, an all-reduce's buffer) or, for send_recv, the bytes sent to
    one peer (in the same node when the group has one node, else across). An all-reduce
    across nodes takes the faster of ring and tree, as NCCL's tuner does."""
    if group.ranks <= 1 or size <= 0:
        return NOTHING
    if op == "send_recv":
        across = group.nodes > 1
        bandwidth = fabric.nic_bps if across else fabric.intra_bps
        step = fabric.net_step_s if across else fabric.intra_step_s
        return Cost(
            "p2p", size, 0.0 if across else size, size if across else 0.0,
            size / bandwidth, fabric.base_s + step,
        )
    best = ring(op, size, group, fabric)
    if op == "all_reduce" and group.nodes > 1:
        best = min(best, tree(size, group, fabric), key=lambda c: c.seconds)
    return best


def bus_bandwidth(op: str, size: float, group: Group, fabric: Fabric) -> float:
    """The busbw nccl-tests would report for one call: bus bytes over its time."""
    cost = collective(op, size, group, fabric)
    return cost.bus_bytes / cost.seconds if cost.seconds else math.inf


def nic_bps_from_rail_busbw(busbw: float, fabric: Fabric) -> float:
    """A NIC's bandwidth from the bus bandwidth measured on the rails (one rank per node,
    every rail at once: `trainwise doctor`'s inter-node groups), whose rings each drive
    their share of the node's NICs (nics_for(1))."""
    return busbw / fabric.nics_for(1)
