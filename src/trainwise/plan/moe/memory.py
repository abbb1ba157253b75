"""Peak bytes on one device for a Mixture-of-Experts model: plan.model.memory's phases
(head backward, block backward, end of a block's backward, optimizer step) with the
parameters split the way torchtitan splits them (torchtitan/distributed/parallel_dims.py,
models/common/MOE_SHARDING.md).

Parameters. The dense ones (models.moe.cost.dense_params: embeddings, attention, routers,
shared experts, leading dense FFNs) are laid out as a dense model's: a replica on every
rank (single, DDP) or sharded over the dp_shard ranks of a group (FSDP, HSDP). The routed
experts are split over `ep` ranks borrowed from the data-parallel ones (each holds experts
/ ep of every MoE layer), and the rest of the data parallelism shards each slice (FSDP:
over dp_shard / ep ranks, torchtitan's efsdp mesh) or replicates it (DDP: dp / ep
copies). Their gradients and optimizer state follow them. FSDP gathers a block's dense
parameters over dp_shard and its experts over efsdp (torchtitan wraps the experts as
their own unit), so a gathered block holds its dense parameters and its rank's experts
whole.

Activations (models.moe.cost.activation_bytes_per_token): per layer the attention and,
on a MoE layer, what the token's own rank keeps of the router, the sort and the combine,
plus what the experts' rank keeps of the routed rows: top_k a token on average, the
busiest rank `imbalance` times that (moe.imbalance). Checkpointed blocks keep their input.

Not modelled: tensor parallelism and pipeline stages of a MoE model (the planner refuses
them), CPU offload, LoRA, the auxiliary loss's few bytes a sequence.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from itertools import accumulate

from trainwise.config.parallel_dims import ParallelDims
from trainwise.models.moe.cost import activation_bytes_per_token, dense_params
from trainwise.models.moe.shapes import MoEShape
from trainwise.plan.model.memory import (
    ActivationProfile,
    MemoryEstimate,
    Workload,
    _at_peak,
    _step_temp,
    checkpointed_blocks,
)
from trainwise.plan.model.precision import BYTES, MASTER_BYTES, OPTIMIZER_STATE_BYTES
from trainwise.plan.model.setup import Setup


@dataclass(frozen=True)
class ExpertLayout:
    """How a layout holds the routed experts: split over `ep` ranks, each slice sharded
    over `shard` ranks (FSDP's efsdp; 1 without FSDP) and kept in `replicas` copies."""

    ep: int
    shard: int
    replicas: int


def expert_layout(dims: ParallelDims) -> ExpertLayout:
    """torchtitan's sparse mesh (pp, dp_replicate, efsdp, ep): under FSDP efsdp = dp_shard
    / ep and the replica groups replicate; without FSDP (or with ep borrowing replicas
    too) every data-parallel rank outside the ep group holds a copy."""
    ep = dims.ep
    if dims.fsdp and dims.dp_shard % ep == 0:
        return ExpertLayout(ep, dims.dp_shard // ep, dims.dp_replicate)
    return ExpertLayout(ep, 1, dims.dp_size // ep)


@dataclass(frozen=True)
class MoEParams:
    """Parameters of one rank's view of the model (tensor parallelism aside): `dense` in
    all, `root` of them outside the layers, `dense_block` a layer's on average, `experts`
    the rank's slice of all the routed experts (experts / ep of every MoE layer, unsharded)
    and `expert_block` one MoE layer's slice."""

    dense: float
    root: float
    dense_block: float
    experts: float
    expert_block: float

    @property
    def block(self) -> float:
        """A gathered block: its dense parameters and the rank's experts of it."""
        return self.dense_block + self.expert_block


@lru_cache(maxsize=256)
def moe_params(shape: MoEShape, ep: int) -> MoEParams:
    """The split of `shape`'s parameters on a rank of an `ep`-way expert group."""
    dense, root = float(dense_params(shape)), float(shape.outer_params())
    experts = shape.expert_total() / ep
    return MoEParams(dense, root, (dense - root) / shape.n_layer, experts,
                     experts / shape.moe_layers)


def held_params(shape: MoEShape, dims: ParallelDims) -> float:
    """Parameters one rank keeps between steps (its shards): the dense ones over dp_shard
    under FSDP, its expert slice over efsdp."""
    p, experts = moe_params(shape, dims.ep), expert_layout(dims)
    return p.dense / (dims.dp_shard if dims.fsdp else 1) + p.experts / experts.shard


@lru_cache(maxsize=4096)
def moe_activations(w: Workload, autocast: bool, device: str) -> ActivationProfile:
    """The activations at each moment of backward (memory.activation_profile's three),
    the busiest expert rank's: its routed rows `w.imbalance` times the mean."""
    shape = w.moe
    assert shape is not None
    e, low = BYTES[w.precision], w.precision != "fp32"
    norm = MASTER_BYTES if autocast and low else e  # norm outputs, residual stream
    per = activation_bytes_per_token(shape, e, norm, norm, autocast and low)
    k = shape.moe.top_k * w.imbalance  # routed rows a token on the busiest rank
    cpu_norms = _cpu_norm_bytes(shape, low and not autocast) if device == "cpu" else 0.0
    moe_layer = per["attention"] + per["moe_ffn"] + k * per["routed"] + 2 * cpu_norms
    dense_layer = per["attention"] + per["dense_ffn"] + 2 * cpu_norms
    layer = [moe_layer if shape.is_moe_layer(i) else dense_layer for i in range(shape.n_layer)]
    working = per["working"] + k * per["routed_working"]
    ckpt = checkpointed_blocks(w.ac, shape.n_layer)
    kept = [per["block_input"] if i in ckpt else layer[i] for i in range(shape.n_layer)]
    below = list(accumulate(kept, initial=0.0))  # what the blocks below block i keep
    block = below[-1] + working
    for i in ckpt:
        block = max(block, below[i] + layer[i] + working)
    head = per["head"] + cpu_norms if w.head else 0.0
    tokens = w.seq_len * w.micro_batch
    return ActivationProfile(tokens * (below[-1] + head), tokens * block,
                             tokens * below[-2])


def _cpu_norm_bytes(shape: MoEShape, low_fsdp: bool) -> float:
    """What a CPU's composite RMSNorm keeps beyond its input, per norm and token: the fp32
    upcast or normalised copy and the rstd (memory.activation_bytes_per_token's CPU rule;
    16-bit parameters without autocast keep more)."""
    h = shape.d_model
    return (6 * h + 4) if low_fsdp else (4 * h + 4)


def moe_memory(w: Workload, setup: Setup, device: str) -> MemoryEstimate:
    """estimate_memory of a MoE workload (`w` at the setup's micro-batch and ac)."""
    dims = setup.dims
    shape = w.moe
    assert shape is not None
    p = moe_params(shape, dims.ep)
    c, opt = BYTES[w.precision], OPTIMIZER_STATE_BYTES[w.optimizer]
    held = held_params(shape, dims)
    whole = p.dense + p.experts  # the rank's parameters, gathered
    accumulating = setup.grad_accum > 1
    if not dims.fsdp:
        prof = moe_activations(w, True, device)
        copies = whole * c if w.precision != "fp32" else 0.0  # autocast's weight casts
        buckets = whole * MASTER_BYTES if dims.dp_size > 1 else 0.0
        params, grads, states = whole * MASTER_BYTES, whole * MASTER_BYTES, whole * opt
        g_bwd = grads if accumulating else 0.0
        phases = {
            "head backward": (params, g_bwd, states, prof.head, buckets + copies),
            "block backward": (params, g_bwd, states, prof.block, buckets + copies),
            "optimizer step": (params, grads, states, 0.0,
                               buckets + whole * _step_temp(w, device)),
        }
        return _at_peak(phases, device, states=params + grads + states)
    prof = moe_activations(w, False, device)
    reduce_copy = MASTER_BYTES if w.reduce_dtype == "fp32" and c != MASTER_BYTES else 0
    blocks = whole - p.root
    in_flight = min(2, shape.n_layer) * p.block if dims.reshard_after_forward else blocks
    at_head = 0.0 if dims.reshard_after_forward else blocks * c
    params, grads, states = held * MASTER_BYTES, held * MASTER_BYTES, held * opt
    g_bwd = whole * BYTES[w.reduce_dtype] if accumulating else 0.0  # unsharded, kept
    if accumulating and setup.accumulate == "sharded":
        g_bwd = grads
    root = p.root * c
    phases = {
        "head backward": (params, g_bwd, states, prof.head, root + at_head),
        "block backward": (params, g_bwd, states, prof.block, root + in_flight * c),
        "end of a block's backward": (
            params, max(grads, g_bwd), states, prof.rest,
            root + in_flight * c + p.block * (c + reduce_copy),
        ),
        "optimizer step": (params, grads, states, 0.0, held * _step_temp(w, device)),
    }
    return _at_peak(phases, device, states=params + grads + states)
