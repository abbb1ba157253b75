"""Per-operation selective activation checkpointing (`parallel.ac = "selective-op"`) in the
planner: what its policy keeps of trainwise's GPT block and what it runs again. The rule
is the runtime's (models.checkpointing, torchtitan's SelectiveAC); the block's order of
operations is models.gpt.Block's (and models.lora.LoRALinear's), counted here op by op
in the manner of memory.activation_bytes_per_token.

Every block is wrapped. Its forward keeps, until its backward:
- its input (as full checkpointing does);
- the outputs of every other matmul, the 1st, 3rd, ... in the order the forward runs them:
  q, k, v, the attention's output projection, then the MLP's gate (SwiGLU), up and down;
  with LoRA each adapted Linear runs lora_A, lora_B, then its own matmul. Without LoRA a
  GELU block keeps q, v and up, a SwiGLU block q, v, gate and down. A matmul's output is
  in the compute dtype; on a tensor-parallel rank a column-parallel one's is its slice, a
  row-parallel one's its whole partial sums;
- attention's output and log-sum-exp (SDPA's kernels; fp32, one value a head and token);
- with sequence parallelism, the two reduce-scatters that end the attention and the MLP
  (1/tp of the residual stream each).
Everything else (norms, rotary, GQA's repeat, the activation, the residual adds, autocast's
casts, the all-gathers before the projections) runs again in backward, as do the other
half of the matmuls (but the last Linear's: the recomputation stops before it, as nothing
saves its output): the elementwise work of the forward and those GEMMs are the recompute,
SDPA is not. While a block runs its backward it holds what it holds without
checkpointing, as `full` does.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

from trainwise.config.schema import lora_target_matches
from trainwise.models.shapes import GPTShape
from trainwise.plan.model.lora import DEFAULT_TARGETS, LoraPlan, block_linears
from trainwise.plan.model.precision import BYTES, MASTER_BYTES

SELECTIVE_OP = "selective-op"
SDPA_LSE_BYTES = MASTER_BYTES  # SDPA's log-sum-exp: fp32, one a head and token


@lru_cache(maxsize=8192)
def block_matmuls(
    shape: GPTShape, tp: int = 1, lora: LoraPlan | None = None, index: int = 0
) -> tuple[tuple[str, int, int], ...]:
    """(name, out, in) of every matmul of block `index` in the order its forward runs them,
    on one of `tp` ranks (plan.model.lora.block_linears' widths; an adapter of a Linear
    named `<name>.lora_A` / `<name>.lora_B`, before it)."""
    patterns = (lora.targets or DEFAULT_TARGETS) if lora is not None else ()
    out: list[tuple[str, int, int]] = []
    for name, (o, i) in block_linears(shape, tp).items():
        if lora is not None and lora_target_matches(f"blocks.{index}.{name}", patterns):
            out += [(f"{name}.lora_A", lora.rank, i), (f"{name}.lora_B", o, lora.rank)]
        out.append((name, o, i))
    return tuple(out)


def kept(matmuls: Sequence[object]) -> tuple[bool, ...]:
    """Whether each of a block's matmuls, in forward order, keeps its output: the 1st,
    3rd, 5th ... (the runtime's count)."""
    return tuple(i % 2 == 0 for i in range(len(matmuls)))


def recomputed_matmuls(
    shape: GPTShape, tp: int = 1, lora: LoraPlan | None = None, index: int = 0
) -> list[tuple[int, int]]:
    """(out, in) of the matmuls of block `index` that its backward runs again: those not
    kept, less the block's last Linear's own matmul and its lora_B. torch.utils.checkpoint
    stops the recomputation once it has every tensor the backward saved, and nothing
    saves their outputs (the residual add and LoRA's scaling save none; a dropout after
    the MLP would save its mask: model.dropout > 0, not modelled, runs them too)."""
    matmuls = block_matmuls(shape, tp, lora, index)
    last = matmuls[-1][0]
    unneeded = {last, f"{last}.lora_B"}
    return [
        (o, i) for (name, o, i), keep in zip(matmuls, kept(matmuls), strict=True)
        if not keep and name not in unneeded
    ]


@lru_cache(maxsize=8192)
def kept_bytes_per_token(
    shape: GPTShape, precision: str, autocast: bool, tp: int = 1,
    sequence_parallel: bool = True, lora: LoraPlan | None = None,
    frozen_embeddings: bool = False, index: int = 0,
) -> float:
    """Bytes per token that block `index` keeps from its forward to its backward under
    selective-op, on one of `tp` ranks (see the module's docstring). `autocast`
    (single/DDP in 16 bits): the block's input is the fp32 residual stream (16-bit with
    LoRA's `frozen_embeddings`); the matmuls' outputs are 16-bit either way."""
    e = BYTES[precision]
    low = precision != "fp32"
    res = MASTER_BYTES if autocast and low and not frozen_embeddings else e
    h, q = shape.d_model, shape.n_head * shape.head_dim // tp
    split = tp if sequence_parallel else 1
    matmuls = block_matmuls(shape, tp, lora, index)
    outputs = sum(o for (_, o, _), keep in zip(matmuls, kept(matmuls), strict=True) if keep)
    attention = e * q + SDPA_LSE_BYTES * shape.n_head // tp
    reduce_scatters = 2 * e * h / tp if tp > 1 and sequence_parallel else 0.0
    return res * h / split + e * outputs + attention + reduce_scatters


@lru_cache(maxsize=256)
def recompute_working_bytes(
    shape: GPTShape, precision: str, autocast: bool, tp: int = 1,
    sequence_parallel: bool = True, lora: LoraPlan | None = None,
    frozen_embeddings: bool = False,
) -> float:
    """Bytes per token a recomputed block holds at most beside what its forward saves, on
    one of `tp` ranks, counted along its recomputation and backward: the incoming
    gradient (the residual stream's), and the MLP's, where the peak is.
    - GELU: the down projection's input gradient, then the up projection's beside it.
    - SwiGLU: the product's gradient gives the gate's and up's (two f-wide tensors), and
      the up projection's input gradient (d_model wide; whole under tensor parallelism,
      the norm's gathered output) joins them before the gate's backward.
    - LoRA, recomputing an adapted up projection (GELU): its own output, lora_B's and the
      scaled update beside their sum, before the activation exists; under autocast an
      adapted down projection's input upcast to the adapters' fp32 (`.to(lora_A's
      dtype)`) and cast back, once the whole block is recomputed.
    Measured with `trainwise plan --simulate` (docs/planner.md)."""
    e = BYTES[precision]
    res = MASTER_BYTES if autocast and precision != "fp32" and not frozen_embeddings else e
    h, f = shape.d_model, shape.d_ff / tp
    split = tp if sequence_parallel else 1
    mlp = 2 * e * f + e * h if shape.mlp == "swiglu" else e * f
    if lora is not None:
        adapted = {
            name.removesuffix(".lora_A") for name, _, _ in block_matmuls(shape, tp, lora)
            if name.endswith(".lora_A")
        }
        if shape.mlp == "gelu" and "mlp.up" in adapted:
            mlp = 2 * e * f
        if autocast and precision != "fp32" and "mlp.down" in adapted:
            mlp = max(mlp, (MASTER_BYTES + e) * f)
    return mlp + res * h / split


@lru_cache(maxsize=256)
def recompute_flops_per_token(shape: GPTShape, lora: LoraPlan | None = None) -> float:
    """The matmul FLOPs per token that the model's blocks run again: 2 a multiplied
    weight of every recomputed matmul (plan.flops counts the rest of the step). (Cached:
    the search prices selective-op often, and a pipeline stage is a shape of its own.)"""
    return sum(
        2.0 * o * i
        for index in range(shape.n_layer)
        for o, i in recomputed_matmuls(shape, 1, lora, index)
    )


def recomputed_collectives(n_layer: int) -> float:
    """Blocks' worth of forward tensor-parallel collectives a step runs again: the
    all-gathers before the projections (half of a block's forward volume with sequence
    parallelism; the reduce-scatters are kept), or without it the attention's all-reduce
    (the recomputation stops at the MLP's last matmul, before its own)."""
    return n_layer / 2
