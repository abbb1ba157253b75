"""The communication of a Mixture-of-Experts model's step, per GPU, on the NCCL network
model (plan/model/network.py) and plan.model.comm's overlap rules.

- Dense parameters: the data-parallel collectives of a dense model of their size
  (comm.layout_collectives: DDP's all-reduce, FSDP's gathers and reduce-scatter, HSDP's
  all-reduce across replicas), one FSDP unit a layer and the root.
- The rank's experts (plan.moe.memory.expert_layout): FSDP gathers them and
  reduce-scatters their gradients over the efsdp ranks (ep apart: torchtitan's sparse mesh
  puts ep innermost), and the replica groups all-reduce the shards; DDP all-reduces them
  over the dp / ep ranks that hold the same slice. With ep equal to the data-parallel
  ranks no rank shares an expert: nothing to reduce.
- Dispatch and combine: an all-to-all over the ep ranks (consecutive) for each, in every MoE
  layer's forward and again in its backward (their gradients travel back the same way),
  and once more for a checkpointed layer's recomputed forward; each rank sends its tokens'
  top_k rows of d_model in the compute dtype (with the fused routing, DeepEP's dispatch,
  one row per rank holding any of its experts: models.moe.cost.ranks_per_token), the
  busiest rank `imbalance` times the mean (moe.imbalance). Inside a node they cross NVLink, across nodes the NICs
  (network.all_to_all). They sit between the router and the experts and between the
  experts and the next layer, so the step waits for all of them (torchtitan runs them
  synchronously; DeepEP's and Megatron-Core's overlap of the all-to-all with other
  micro-batches' compute is not modelled).
- Tensor parallelism (plan.moe.parallel): TP's collectives of its attention, dense and
  shared FFNs (plan.model.tensor_parallel's, `tp_per_layer` a layer), exposed as the
  GPT's; ep borrowed from the data- and tensor-parallel ranks, tp innermost, so an ep
  group is ep consecutive ranks; each tp rank exchanges its 1 / tp of the tokens (the
  runtime's MoE layer splits them: models.moe.parallel).
- Pipeline stages: the stage's layers' collectives over its world / pp ranks, FSDP's once
  a step, and the stages' sends (plan.model.pipeline.p2p_collective), as the GPT's.
"""

from __future__ import annotations

import math
from dataclasses import replace

from trainwise.config.parallel_dims import ParallelDims
from trainwise.models.moe.cost import ranks_per_token
from trainwise.plan.inputs import PlanInputs
from trainwise.plan.model.comm import (
    DDP_BUCKET_BYTES,
    GRAD_BYTES,
    Collective,
    Layout,
    contention_seconds,
    exposed_seconds,
    layout_collectives,
    outlasting_seconds,
)
from trainwise.plan.model.compute import fsdp_rounds
from trainwise.plan.model.flops import recompute_factor
from trainwise.plan.model.gemm import GENERATIONS
from trainwise.plan.model.memory import Workload, checkpointed_blocks
from trainwise.plan.model.pipeline import p2p_collective, p2p_exposed_seconds
from trainwise.plan.model.precision import BYTES
from trainwise.plan.model.selective_op import SELECTIVE_OP, recomputed_collectives
from trainwise.plan.model.setup import Setup
from trainwise.plan.model.tensor_parallel import tp_exposed_seconds
from trainwise.plan.moe.memory import expert_layout, moe_params
from trainwise.plan.moe.parallel import moe_tp_collectives

ALL_TO_ALL = "ep all-to-all (dispatch and combine)"


def expert_collectives(
    dims: ParallelDims, experts: float, layout: Layout, precision: str, reduce_dtype: str,
    grad_accum: int, accumulate: str, units: int,
) -> list[Collective]:
    """The collectives of the rank's `experts` parameters (its slice, unsharded) in one
    step, `units` calls each (one a MoE layer; the last lies in the model's last block,
    which stays gathered from forward to backward: ParallelDims.regathered_blocks)."""
    ex = expert_layout(dims)  # ep innermost over dp x tp: its groups consecutive ranks
    if not dims.fsdp:
        if ex.replicas == 1:
            return []
        grads = experts * GRAD_BYTES
        calls = max(1, math.ceil(grads / DDP_BUCKET_BYTES))
        return [layout.collective("all-reduce expert grads", "all_reduce", grads,
                                  (ex.replicas, ex.ep), calls)]
    out = []
    every = grad_accum if accumulate == "sharded" else 1
    reduce = experts * BYTES[reduce_dtype]
    if ex.shard > 1:
        again = dims.regathered_blocks(units)
        out += [
            layout.collective(
                "all-gather expert params", "all_gather",
                grad_accum * (1 + again / max(1, units)) * experts * BYTES[precision],
                (ex.shard, ex.ep), grad_accum * (units + again), per_micro_batch=True,
            ),
            layout.collective(
                "reduce-scatter expert grads", "reduce_scatter", every * reduce,
                (ex.shard, ex.ep), every * units, per_micro_batch=every > 1,
            ),
        ]
    if ex.replicas > 1:
        out.append(layout.collective(
            "all-reduce expert grad shards across replicas", "all_reduce",
            every * reduce / ex.shard, (ex.replicas, ex.shard * ex.ep), every * units,
            per_micro_batch=every > 1,
        ))
    return out


def all_to_all_collective(w: Workload, dims: ParallelDims, layout: Layout,
                          grad_accum: int) -> list[Collective]:
    """The step's dispatch and combine all-to-alls of one rank (none without ep)."""
    shape = w.moe
    assert shape is not None
    if dims.ep == 1:
        return []
    m = shape.moe
    copies = ranks_per_token(shape, dims.ep) if w.routing == "fused" else m.top_k
    # The rank's 1 / tp of the tokens (models.moe.parallel's token split).
    one = w.seq_len * w.micro_batch / dims.tp * copies * shape.d_model * BYTES[w.precision]
    recomputed = sum(1 for i in checkpointed_blocks(w.ac, shape.n_layer) if shape.is_moe_layer(i))
    if w.ac == SELECTIVE_OP:  # its policy keeps the all-to-alls' outputs
        recomputed = 0
    calls = grad_accum * (4 * shape.moe_layers + 2 * recomputed)
    return [layout.collective(ALL_TO_ALL, "all_to_all", calls * one * w.imbalance,
                              (dims.ep, 1), calls, per_micro_batch=True)]


def all_to_all_seconds(collectives: list[Collective]) -> float:
    """The seconds of a step's dispatch and combine among a plan's collectives (the step
    waits for all of them): what a run's a2a_s measures."""
    return sum(c.seconds for c in collectives if c.name == ALL_TO_ALL)


def moe_communication(
    inputs: PlanInputs, setup: Setup, w: Workload, compute: float
) -> tuple[list[Collective], float, float]:
    """estimate._communication for a MoE workload: (the step's collectives, the seconds
    NCCL's SMs take from the compute they overlap, the seconds the step waits for them)."""
    shape = w.moe
    assert shape is not None
    dims, hw, accum = setup.dims, inputs.hardware, setup.grad_accum
    layout = Layout(
        inputs.gpus, inputs.gpus_per_node, hw.intra_bps, hw.inter_bps,
        hw.nics_per_node, hw.intra_step_s, hw.inter_step_s,
    )
    # A pipeline stage's ranks, and its FSDP parameters gathered and gradients unreduced
    # until the step's last backward (estimate._communication's rule for the GPT).
    stage_layout = replace(layout, gpus=inputs.gpus // dims.pp)
    dp_accum = int(fsdp_rounds(dims, accum))
    p = moe_params(w, dims.ep, dims.tp)
    params = layout_collectives(dims, p.dense, stage_layout, w.precision, w.reduce_dtype,
                                dp_accum, setup.accumulate, shape.n_layer + 1, root=p.root)
    params += expert_collectives(dims, p.experts, stage_layout, w.precision, w.reduce_dtype,
                                 dp_accum, setup.accumulate, shape.moe_layers)
    waited = exposed_seconds(params, compute, dims, p.block / (p.dense + p.experts), dp_accum)
    outlasting = outlasting_seconds(params, compute, dp_accum)
    a2a = all_to_all_collective(w, dims, stage_layout, accum)
    tp_comm = moe_tp_collectives(w, dims.tp, _tp_recomputed(w), accum, stage_layout,
                                 setup.sequence_parallel)
    tp_waited = tp_exposed_seconds(tp_comm, compute, recompute_factor(w.ac, shape.n_layer))
    everything = params + a2a + tp_comm
    exposed = waited + sum(c.seconds for c in a2a) + tp_waited
    if dims.pp > 1:
        p2p = p2p_collective(w, dims, layout, setup.virtual, accum, setup.sequence_parallel)
        everything.append(p2p)
        exposed += p2p_exposed_seconds(p2p, dims.pp, setup.virtual, accum, compute)
    if hw.device == "cpu":  # gloo runs the collectives on the cores that compute
        exposed = sum(c.seconds for c in everything)
    hidden = max(0.0, sum(c.seconds for c in params) - waited)
    hidden += max(0.0, sum(c.seconds for c in tp_comm) - tp_waited)
    slowed = 0.0
    if inputs.efficiency is None:  # a measured efficiency already ran beside them
        slowed = contention_seconds(hidden, hw.nccl_channels, GENERATIONS[hw.generation].sms,
                                    outlasting)
    return everything, slowed, exposed


def _tp_recomputed(w: Workload) -> float:
    """Layers' worth of TP forward collectives a step runs again: the checkpointed
    layers', or selective-op's (plan.model.selective_op.recomputed_collectives)."""
    assert w.moe is not None
    if w.ac == SELECTIVE_OP:
        return recomputed_collectives(w.moe.n_layer)
    return len(checkpointed_blocks(w.ac, w.moe.n_layer))
