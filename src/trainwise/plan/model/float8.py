"""What float8 training changes in a step, as the planner prices it (precision.float8;
torchao's convert_to_float8_training, as torchtitan applies it). One place for its facts;
plan.compute, plan.memory and plan.comm call these.

- Which Linears: a block's projections (q, k, v, out, gate, up, down) whose dimensions are
  multiples of 16 (torchao's `_scaled_mm` needs them; torchtitan's filter skips the rest).
  The output head stays in 16 bits (torchtitan's filter_fqns = ["output"]), and so do
  attention (SDPA's flash kernel) and everything elementwise.
- Their GEMMs: all three (forward, input gradient, weight gradient) in float8 at the
  generation's fp8 share of the fp8 peak (gemm.float8_generation); 1-byte inputs, outputs
  in the compute dtype. Rowwise is priced as tensorwise (no separate rate published).
- The casts, memory-bound work: torchao saves the high-precision input and weight for
  backward and casts each operand for every GEMM it enters: the input for the forward and
  the weight gradient, the weight for the forward and the input gradient, the output
  gradient for both backward GEMMs. Each cast reads its operand twice (the amax, then the
  scaled cast) and writes 1 byte: 2e + 1 bytes an element (e: the compute dtype's). With
  FSDP's float8 all-gather (tensorwise) the weight arrives in float8: its forward cast is
  gone and its input-gradient operand is a transposed copy (read and write 1 byte); the
  cast of the shard before the gather is left out (1/shard of a weight). Under
  train.compile the casts fuse as the other elementwise work does.
- The host: eager, each cast dispatches CAST_OPS operations; compiled, they are part of
  the graph's kernels.
- Memory: activations unchanged (the saved input is the high-precision one, as without
  float8; a compiled graph may save the float8 copy instead: not counted). FSDP's gathered
  block weights take 1 byte a parameter with float8 all-gather, else the gathered 16-bit
  copy stays and each Linear's float8 weight is a transient of one Linear (not counted).
- Communication: FSDP's all-gather moves the float8 Linears' weights in 1 byte
  (tensorwise with float8_all_gather); the amax all-reduce of their scales (one small
  call a step) is left out, as are tensor parallelism's float8 gathers of activations (TP
  is priced in 16 bits).
"""

from __future__ import annotations

from dataclasses import dataclass

from trainwise.models.float8.rule import float8_dims
from trainwise.models.shapes import GPTShape
from trainwise.plan.model.lora import block_linears
from trainwise.plan.model.precision import BYTES, FLOAT8_BYTES

# Operations one eager dynamic cast dispatches (torchao's hp_tensor_to_float8_dynamic):
# abs, amax, the scale's clamp and reciprocal, the scaled product, its clamp and the cast
# (an assumption, counted from its code path).
CAST_OPS = 7


def float8_linears(shape: GPTShape, tp: int) -> list[tuple[int, int, bool]]:
    """(out, in, float8) of each block Linear on one of `tp` ranks: float8 when the whole
    Linear's dimensions pass the runtime's rule (models.float8.rule)."""
    whole = block_linears(shape, 1).values()
    return [
        (o, i, float8_dims(i_, o_))
        for (o, i), (o_, i_) in zip(block_linears(shape, tp).values(), whole, strict=True)
    ]


def float8_block_params(shape: GPTShape, tp: int) -> int:
    """Weights of one block's float8 Linears on one of `tp` ranks."""
    return sum(o * i for o, i, f8 in float8_linears(shape, tp) if f8)


def cast_bytes(
    shape: GPTShape, tp: int, tokens: int, precision: str, gathered_float8: bool
) -> tuple[float, float]:
    """(forward, backward) bytes one block's float8 casts move for `tokens` tokens (module
    docstring); `gathered_float8`: FSDP gathered the weights in float8."""
    cast = 2 * BYTES[precision] + FLOAT8_BYTES
    forward = backward = 0.0
    for o, i, f8 in float8_linears(shape, tp):
        if not f8:
            continue
        weight = o * i * (0 if gathered_float8 else cast)
        forward += tokens * i * cast + weight
        transposed = 2 * FLOAT8_BYTES * o * i  # the gathered float8 weight, transposed
        backward += tokens * (2 * o + i) * cast + (transposed if gathered_float8 else o * i * cast)
    return forward, backward


def cast_ops(shape: GPTShape) -> tuple[int, int]:
    """(forward, backward) operations the eager casts of one block dispatch."""
    n = sum(f8 for _, _, f8 in float8_linears(shape, 1))
    return 2 * n * CAST_OPS, 4 * n * CAST_OPS


def gathered_bytes_per_param(shape: GPTShape, tp: int, block: float, element: int,
                             gathered_float8: bool) -> float:
    """Bytes one gathered block parameter takes on average (`block`: a block's parameters
    on this rank): `element`, and 1 for the float8 Linears' weights gathered in float8."""
    if not gathered_float8 or block <= 0:
        return float(element)
    f8 = float8_block_params(shape, tp)
    return element - (element - FLOAT8_BYTES) * f8 / block


@dataclass(frozen=True)
class Float8:
    """A step's float8 training as plan.compute prices it: the recipe ("tensorwise" or
    "rowwise") and whether FSDP gathers the weights in float8."""

    recipe: str
    gathered: bool


def float8_of(recipe: str, all_gather: bool, fsdp: bool) -> Float8 | None:
    """The step's float8 (None: off): FSDP's float8 all-gather needs FSDP and tensorwise."""
    if recipe == "none":
        return None
    return Float8(recipe, all_gather and fsdp and recipe == "tensorwise")


def gathered_float8_params(
    shape: GPTShape | None, tp: int, recipe: str, all_gather: bool
) -> float:
    """The parameters FSDP gathers in float8, on one of `tp` ranks: every block's float8
    Linears' weights with tensorwise and float8_all_gather; else none."""
    f8 = float8_of(recipe, all_gather, fsdp=True)
    if shape is None or f8 is None or not f8.gathered:
        return 0.0
    return float(float8_block_params(shape, tp) * shape.n_layer)
