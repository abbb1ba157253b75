"""Communication per training step: the bytes each GPU sends per strategy, the time on the
bottleneck link, and the part that compute cannot hide.

Each collective's bytes per rank are nccl-tests' bus bytes ("PERFORMANCE.md"): over n
ranks an all-reduce of S bytes moves 2(n-1)/n x S, an all-gather or a reduce-scatter
(n-1)/n x S. Their time on the cluster's links (NVLink within a node, the node's NICs
across nodes, and a latency per algorithm step) is plan/model/network.py's. Volumes per
strategy follow ZeRO (Rajbhandari et al., 2020, section 7): DDP
all-reduces the gradients once per step (no_sync between micro-batches); FSDP all-gathers
the parameters for forward (and, when `full` reshards after forward, every block's but the
last again for backward: ParallelDims.regathered_blocks) on every micro-batch and
reduce-scatters the gradients once per step; HSDP does FSDP inside a node and all-reduces
the gradient shards across nodes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from trainwise.config.parallel_dims import ParallelDims
from trainwise.plan.model.network import Fabric, collective, group_of
from trainwise.plan.model.precision import BYTES, FLOAT8_BYTES, MASTER_BYTES

GRAD_BYTES = MASTER_BYTES  # DDP reduces the fp32 gradients (autocast leaves them fp32)
DDP_BUCKET_BYTES = 25e6  # DDP's default bucket_cap_mb: the last bucket's all-reduce is exposed
ACROSS_NODES = "all-reduce grad shards across nodes"  # HSDP's collective between replicas


def allreduce_factor(n: int) -> float:
    return 2.0 * (n - 1) / n if n > 1 else 0.0


def gather_factor(n: int) -> float:
    """All-gather and reduce-scatter."""
    return (n - 1) / n if n > 1 else 0.0


@dataclass(frozen=True)
class Collective:
    """One kind of collective in a step: bus bytes per rank (all its calls), the rate its
    slowest link class moves them at, and the latency of all its calls."""

    name: str
    wire_bytes: float
    bytes_per_s: float
    # Gathers run on every micro-batch, beside its compute; reductions once per step, in
    # the last micro-batch's backward.
    per_micro_batch: bool = False
    latency_s: float = 0.0

    @property
    def seconds(self) -> float:
        return (self.wire_bytes / self.bytes_per_s if self.wire_bytes else 0.0) + self.latency_s


@dataclass(frozen=True)
class Layout:
    """GPUs and their links: bytes/s per direction per GPU within a node and per NIC
    between nodes, as NCCL reaches them; NICs per node (None: one per GPU); the latency
    of an algorithm step on each."""

    gpus: int
    gpus_per_node: int
    intra_bps: float
    inter_bps: float
    nics_per_node: int | None = None
    intra_step_s: float = 0.0
    inter_step_s: float = 0.0

    @property
    def nodes(self) -> int:
        return -(-self.gpus // self.gpus_per_node)

    @property
    def fabric(self) -> Fabric:
        return Fabric(
            min(self.gpus_per_node, self.gpus), self.intra_bps, self.inter_bps,
            self.nics_per_node, self.intra_step_s, self.inter_step_s,
        )

    def collective(
        self, name: str, op: str, size: float, ranks: tuple[int, int], calls: int = 1,
        per_micro_batch: bool = False,
    ) -> Collective:
        """`calls` calls of `op` moving `size` bytes in all (nccl-tests' buffer sizes) over
        `ranks` = (group size, stride between its ranks)."""
        fabric = self.fabric
        group = group_of(ranks[0], ranks[1], fabric.gpus_per_node)
        one = collective(op, size / max(1, calls), group, fabric)
        bps = one.bus_bytes / one.bandwidth_s if one.bandwidth_s else math.inf
        return Collective(
            name, calls * one.bus_bytes, bps, per_micro_batch, calls * one.latency_s
        )


def step_collectives(
    name: str,
    params: float,
    layout: Layout,
    precision: str,
    reduce_dtype: str,
    grad_accum: int,
    units: int = 1,
) -> list[Collective]:
    """The collectives one optimizer step runs, per GPU, for the planner's row `name` on
    the layout's GPUs (hsdp: one shard group per node)."""
    dims = ParallelDims.from_plan_name(name, layout.gpus, layout.gpus_per_node)
    return layout_collectives(
        dims, params, layout, precision, reduce_dtype, grad_accum, units=units
    )


def fsdp_blocks(units: int, root: float) -> int:
    """The block units among a model's `units` FSDP units: all but the root unit, when it
    holds parameters (`root`)."""
    return units - 1 if root else units


def regathered_share(dims: ParallelDims, units: int, root: float) -> float:
    """The share of a model's block parameters (in `units` FSDP units, the root unit's
    `root` apart) that backward gathers again (ParallelDims.regathered_blocks)."""
    blocks = fsdp_blocks(units, root)
    return dims.regathered_blocks(blocks) / max(1, blocks)


def layout_collectives(
    dims: ParallelDims,
    params: float,
    layout: Layout,
    precision: str,
    reduce_dtype: str,
    grad_accum: int,
    accumulate: str = "unsharded",
    units: int = 1,
    trained: float | None = None,
    float8_params: float = 0.0,
    root: float = 0.0,
) -> list[Collective]:
    """The data-parallel collectives of one optimizer step, per GPU, for the layout `dims`
    (`params`: what one tensor-parallel rank holds, in `units` FSDP units, each its own
    call). Ranks are row-major over (dp_replicate, dp_shard, tp), so a shard group is
    dp_shard ranks tp apart and a replica group dp_replicate ranks dp_shard x tp apart.
    `accumulate` = "sharded" reduce-scatters (and, hybrid, all-reduces) on every
    micro-batch instead of once per step. `trained`: the parameters of those that have
    gradients (LoRA: the adapters; None: all): only theirs are reduced, while FSDP gathers
    every parameter, frozen or not, forward and backward. `float8_params`: those gathered in
float8 (1 byte each). `root`: the parameters of the root unit (embeddings, final norm,
head), when it is one of the `units`: gathered once per micro-batch, as are the blocks kept
gathered from forward to backward (ParallelDims.regathered_blocks gathers the others
again for backward)."""
    if dims.dp_size == 1:
        return []
    trained = params if trained is None else trained
    if not dims.fsdp:
        grads = trained * GRAD_BYTES
        buckets = max(1, math.ceil(grads / DDP_BUCKET_BYTES))
        group = (dims.dp_replicate, dims.tp)
        return [layout.collective("all-reduce grads", "all_reduce", grads, group, buckets)]
    # FSDP all-gathers param_dtype copies; float8 Linears' weights in float8 when asked
    # (`float8_params`: plan.model.float8.gathered_float8_params).
    gather = params * BYTES[precision] - float8_params * (BYTES[precision] - FLOAT8_BYTES)
    reduce = trained * BYTES[reduce_dtype]
    d = dims.dp_shard
    every = grad_accum if accumulate == "sharded" else 1
    blocks = fsdp_blocks(units, root)
    regathered = dims.regathered_blocks(blocks)
    # The root is not float8 (torchtitan's converters leave the head out): the blocks'
    # gathered bytes are the rest.
    block_gather = (gather - root * BYTES[precision]) / max(1, blocks)
    shard = (d, dims.tp)
    out = [
        layout.collective(
            "all-gather params", "all_gather", grad_accum * (gather + regathered * block_gather),
            shard, grad_accum * (units + regathered), per_micro_batch=True,
        ),
        # The reduce-scatter `every` times a step: once, or on every micro-batch with
        # sharded accumulation (then beside each backward).
        layout.collective(
            "reduce-scatter grads", "reduce_scatter", every * reduce, shard, every * units,
            per_micro_batch=every > 1,
        ),
    ]
    if dims.hybrid:
        replicas = (dims.dp_replicate, d * dims.tp)
        out.append(
            layout.collective(
                ACROSS_NODES, "all_reduce", every * reduce / d, replicas, every * units,
                per_micro_batch=every > 1,
            )
        )
    return out


def exposed_seconds(
    collectives: list[Collective],
    compute_s: float,
    dims: ParallelDims,
    unit_fraction: float,
    grad_accum: int = 1,
) -> float:
    """Communication time the step waits for.

    Overlap (Li et al., 2020, "PyTorch Distributed", section 3.2.3 for DDP's bucketed
    all-reduce during backward; FSDP2 prefetches the next block's all-gather during the
    current block's compute): the gathers of every micro-batch hide behind the step's
    compute; the reductions (DDP's all-reduce, FSDP's reduce-scatter, HSDP's all-reduce
    across nodes) only behind the last micro-batch's backward (2/3 of its compute), since
    the others skip synchronisation. What exceeds either window is exposed, plus one piece
    nothing hides: DDP's last bucket; FSDP's first gather and last reduce-scatter, one unit
    (`unit_fraction` of the model) each.
    """
    gathers = [c for c in collectives if c.per_micro_batch]
    reductions = [c for c in collectives if not c.per_micro_batch]
    t_gather = sum(c.seconds for c in gathers)
    t_reduce = sum(c.seconds for c in reductions)
    total = t_gather + t_reduce
    if total == 0:
        return 0.0
    waits = outlasting_seconds(collectives, compute_s, grad_accum)
    if not dims.fsdp:
        c = reductions[0]
        first = min(c.seconds, allreduce_factor(dims.dp_size) * DDP_BUCKET_BYTES / c.bytes_per_s)
    else:
        one_gather = t_gather / grad_accum / max(1, len(gathers)) if gathers else 0.0
        first = unit_fraction * (one_gather + t_reduce)
    return min(total, waits + first)


def outlasting_seconds(
    collectives: list[Collective], compute_s: float, grad_accum: int = 1
) -> float:
    """Seconds the data-parallel collectives run past the compute window they hide behind
    (exposed_seconds's rule, without the pieces nothing hides): the gathers and every
    micro-batch's reductions behind the step's compute, the step's reductions behind the
    last micro-batch's backward."""
    t_gather = sum(c.seconds for c in collectives if c.per_micro_batch)
    t_reduce = sum(c.seconds for c in collectives if not c.per_micro_batch)
    last_backward = compute_s / grad_accum * 2 / 3
    return max(t_gather + t_reduce - compute_s, t_reduce - last_backward, 0.0)


def contention_seconds(
    hidden_s: float, channels: int, sms: int, outlasting_s: float = 0.0
) -> float:
    """Seconds the compute loses to the `hidden_s` seconds of NCCL collectives that run
    beside it. NCCL runs each channel as one thread block that holds an SM for the whole
    collective and shares it with no compute kernel (S. Jeaugey, NVIDIA/nccl issues #689
    and #1656), so while a collective overlaps compute, the GEMMs and attention run on
    sms - channels of the sms SMs: channels/sms of the overlapped window is lost and runs
    after it. Lee et al., 2025 ("Characterizing Compute-Communication Overlap in
    GPU-Accelerated Distributed Deep Learning", arXiv 2507.03114) measure overlapped
    compute 18.9 % slower on average (up to 40 %) on A100 and H100; 32 of the H100's 132
    SMs is 24 %. The HBM bandwidth the collective moves its bytes with is left out.
    Where the collectives outlast the compute (`outlasting_s`, outlasting_seconds: the step
    waits for them), the lost compute runs in that wait, beside them on the same
    sms - channels SMs: only what is left when they end adds to the step."""
    if hidden_s <= 0 or channels <= 0 or sms <= 0:
        return 0.0
    share = min(channels, sms) / sms
    return max(0.0, hidden_s * share - outlasting_s * (1 - share))
