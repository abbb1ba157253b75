"""Tensor parallelism (Megatron-LM, Shoeybi et al., 2019): what `tp` ranks that split every
block's matmuls hold, send and compute. The one place for the TP formulas.

Memory. The attention and MLP projections are split column- then row-wise over the `tp`
ranks, the embedding and the head over the vocabulary (torchtitan's Llama plan); the
norms, the row-parallel projections' biases (added once the partial sums are reduced) and
learned position embeddings stay replicated. So parameters, gradients and optimizer state
are divided by `tp` except those.

Activations (Korthikanti et al., 2022, "Reducing Activation Recomputation in Large
Transformer Models", Table 2): per layer s·b·h·(10 + 24/t) with tensor parallelism alone
(the norms' inputs and outputs and the dropouts stay replicated) and s·b·h·34/t with
sequence parallelism, which splits the norm regions over the sequence. Adapted to
trainwise's block (memory.activation_bytes_per_token, SDPA instead of unfused attention)
and to DTensor's sequence parallelism, measured with `trainwise plan --simulate`: every
saved tensor is divided by `t` except each norm's output, which is all-gathered before
the column-parallel linears and saved whole by them (Megatron-LM saves the shard and
gathers again in backward; DTensor does not). Without sequence parallelism the norms'
share is kept whole. The loss is vocabulary-parallel (torchtitan's loss_parallel), so the
head's logits are divided by `t` either way, but its decomposed ops hold
LOSS_PARALLEL_TENSORS shard-sized tensors where the fused loss holds three.

Communication (ibid., section 4.2.2): each block runs two all-reduces forward (after the
attention and after the MLP) and two backward, each of s·b·h activations; with sequence
parallelism each becomes an all-gather plus a reduce-scatter of the same volume. A
recomputed (checkpointed) block runs its forward's two again. They run on the link between
the `tp` ranks, which sit inside one node, each call priced by plan/model/network.py (its bytes
and its steps' latency). Assumption: forward's wait (each feeds the next
matmul); backward's overlap the weight-gradient GEMMs, as Megatron-LM's tensor-parallel
linear layers do (the input gradient's all-reduce, or reduce-scatter with sequence
parallelism, runs asynchronously while the weight gradient is computed), and wait only for
what exceeds them. A runtime without that overlap (plain DTensor) waits for all of it: then
a step has the backward share more exposed.

Compute. Each rank runs 1/t of every matmul; plan.compute prices the narrower GEMMs by
their shape (plan.gemm).
"""

from __future__ import annotations

from trainwise.models.moe.shapes import MoEShape
from trainwise.models.shapes import GPTShape
from trainwise.plan.model.comm import Collective, Layout
from trainwise.plan.model.precision import BYTES

# Measured (`trainwise plan --simulate`): DTensor's loss_parallel runs log-softmax and the
# NLL as decomposed ops on the vocabulary shards, and at the head's backward holds this many
# shard-sized tensors a token (the fused kernel on a whole vocabulary: 3).
LOSS_PARALLEL_TENSORS = 5
# What the vocabulary-parallel loss holds beyond the whole-vocabulary loss's tensors
# (memory.LOSS_TENSORS: 3 for the standard loss, which the measurement above compares).
LOSS_PARALLEL_EXTRA = LOSS_PARALLEL_TENSORS - 3
TP_FORWARD = "tp forward all-reduce (or all-gather + reduce-scatter)"
TP_BACKWARD = "tp backward all-reduce (or all-gather + reduce-scatter)"


def norm_size(shape: GPTShape) -> int:
    """Parameters of one norm (GPTShape.num_params counts them the same way)."""
    return shape.d_model * (2 if shape.norm == "layernorm" and shape.bias else 1)


def block_replicated(shape: GPTShape) -> int:
    """Parameters of one block that TP replicates: its two norms, and the biases of the
    row-parallel projections (out_proj, down), added after the partial sums are reduced."""
    return 2 * norm_size(shape) + (2 * shape.d_model if shape.bias else 0)


def replicated_params(shape: GPTShape) -> int:
    """The parameters TP replicates: every block's (block_replicated), the final norm and
    learned position embeddings (added to the whole sequence; not in the plan)."""
    positions = shape.max_seq_len * shape.d_model if shape.pos == "learned" else 0
    return shape.n_layer * block_replicated(shape) + norm_size(shape) + positions


def params_per_rank(params: float, shape: GPTShape | None, tp: int) -> float:
    """Parameters one TP rank holds: the replicated ones whole, the rest divided by `tp`."""
    if tp == 1:
        return float(params)
    replicated = replicated_params(shape) if shape is not None else 0
    return replicated + (params - replicated) / tp


def activation_split(per: dict, tp: int, sequence_parallel: bool) -> dict:
    """memory.activation_bytes_per_token's figures on one of `tp` ranks (see above)."""
    if tp == 1:
        return per
    # The loss on vocabulary shards: LOSS_PARALLEL_EXTRA more of 1/t each than the head's
    # figure holds (which the split below divides by t).
    loss = LOSS_PARALLEL_EXTRA * per["loss"] / tp
    if sequence_parallel:
        # Each norm's output is all-gathered before its linears, which save it whole.
        gathered = per["gathered"] * (1 - 1 / tp)
        out = {key: value / tp for key, value in per.items()}
        out["layer"] += 2 * gathered
        out["head"] += gathered + loss
        return out
    norms = per["norms"]  # the norm regions, which TP alone leaves whole
    return {
        **per,
        "layer": norms + (per["layer"] - norms) / tp,
        "head": per["head_norm"] + (per["head"] - per["head_norm"]) / tp + loss,
        "working_set": per["residual"] + (per["working_set"] - per["residual"]) / tp,
    }


def tp_collectives(
    shape: GPTShape | MoEShape | None,
    seq_len: int,
    micro_batch: int,
    precision: str,
    tp: int,
    recomputed_blocks: float,
    grad_accum: int,
    layout: Layout,
    per_block: float = 2.0,
) -> list[Collective]:
    """The TP traffic of one step through one rank's link, forward and backward: per
    micro-batch and block, two collectives forward (two more for a recomputed block) and two
    backward, each an all-reduce of s·b·h elements in the compute dtype (moving 2(t-1)/t of
    it; an all-gather and a reduce-scatter with sequence parallelism move the same) over
    `tp` consecutive ranks of `layout`. `recomputed_blocks`: blocks' worth of forward
    collectives run again (selective-op's half a block's each: plan.model.selective_op).
    `per_block`: the collectives a block runs each way where not the GPT's two (a
    Mixture-of-Experts layer's: plan.moe.parallel.tp_per_layer)."""
    if tp == 1 or shape is None:
        return []
    one = seq_len * micro_batch * shape.d_model * BYTES[precision]
    forward = grad_accum * per_block * (shape.n_layer + recomputed_blocks)
    backward = grad_accum * per_block * shape.n_layer
    group = (tp, 1)
    return [
        layout.collective(TP_FORWARD, "all_reduce", forward * one, group, forward, True),
        layout.collective(TP_BACKWARD, "all_reduce", backward * one, group, backward, True),
    ]


def tp_exposed_seconds(collectives: list[Collective], compute_s: float, recompute: float) -> float:
    """What the step waits for of the TP collectives: all of forward's; of backward's, what
    the weight-gradient GEMMs (2N of the 6N FLOPs per token, so a third of the compute
    without recomputation) cannot hide (see the module's docstring)."""
    forward = sum(c.seconds for c in collectives if c.name == TP_FORWARD)
    backward = sum(c.seconds for c in collectives if c.name == TP_BACKWARD)
    weight_grads = compute_s / recompute / 3
    return forward + max(0.0, backward - weight_grads)
