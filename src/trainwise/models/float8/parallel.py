"""Float8 under tensor parallelism, and float8's all-gathers on gloo.

Tensorwise: torchao's float8 styles, as torchtitan's Llama plan uses them
(torchtitan/models/llama3/parallelize.py, `enable_float8_tensorwise_tp`): a converted
Linear's ColwiseParallel becomes Float8ColwiseParallel and RowwiseParallel
Float8RowwiseParallel (the same shards; the input cast to float8 before its
redistribution, the output gradient cast to float8 before its own), and the
PrepareModuleInput that gathers the sequence before the attention's q/k/v or the MLP's
up/gate becomes PrepareFloat8ModuleInput when all of them are converted: the activation is
cast once and all-gathered in float8, half the bytes of bf16. A Linear with a bias keeps
torch's style: the float8 style hands the module a float8 output gradient, from which the
bias's gradient would be summed (one process sums it in high precision: measured on the
`tiny` preset under tp 2, its biases' gradients 2-7 % off). Rowwise keeps torch's styles.

gloo has no float8 type ("Invalid scalar type", measured: tp 2 fails without this): on a
CPU, where torchao emulates float8, its own all-gather of a Float8TrainingTensor
(DTensor's redistributions above, e.g. the sequence gathered before q/k/v) runs with the
data viewed as uint8, the same bytes. FSDP's all-gather needs nothing: a unit that holds
other parameters too (a block's norms) is gathered as bytes already (torch's FSDP packs
mixed dtypes as uint8).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel

from trainwise.models.float8.convert import torchao_float8
from trainwise.models.gpt import MLP, Attention

# The Linears that read a module's input: they must all be float8 for the input to be
# gathered in float8 (PrepareFloat8ModuleInput hands them a Float8TrainingTensor).
_READERS: dict[type, tuple[str, ...]] = {
    Attention: ("q_proj", "k_proj", "v_proj"),
    MLP: ("up", "gate"),
}


def float8_tp_plans(model: nn.Module, plans: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`plans` with torchao's float8 styles where the module is a converted Linear (or
    feeds only converted ones); every other entry as it was."""
    torchao_float8()
    from torchao.float8.float8_linear import Float8Linear
    from torchao.float8.float8_tensor_parallel import (
        Float8ColwiseParallel,
        Float8RowwiseParallel,
        PrepareFloat8ModuleInput,
    )

    swaps = {ColwiseParallel: Float8ColwiseParallel, RowwiseParallel: Float8RowwiseParallel}
    modules = dict(model.named_modules())
    out = []
    for plan in plans:
        new = {}
        for name, style in plan.items():
            module = modules.get(name)
            if isinstance(module, Float8Linear) and type(style) in swaps and module.bias is None:
                style = copy.copy(style)
                style.__class__ = swaps[type(style)]  # the same fields: layouts, output
            elif type(style) is PrepareModuleInput and _reads_in_float8(module, Float8Linear):
                style = PrepareFloat8ModuleInput(
                    input_layouts=style.input_layouts,
                    desired_input_layouts=style.desired_input_layouts,
                    input_kwarg_layouts=style.input_kwarg_layouts or None,
                    desired_input_kwarg_layouts=style.desired_input_kwarg_layouts or None,
                    use_local_output=style.use_local_output,
                )
            new[name] = style
        out.append(new)
    return out


def _reads_in_float8(module: nn.Module | None, float8_linear: type) -> bool:
    """Whether every Linear that reads `module`'s input (a GPT attention's or MLP's) is
    converted."""
    readers = next((r for kind, r in _READERS.items() if isinstance(module, kind)), None)
    if readers is None:
        return False
    linears = [getattr(module, r) for r in readers if getattr(module, r, None) is not None]
    return bool(linears) and all(isinstance(m, float8_linear) for m in linears)


_installed = False


def gather_float8_as_bytes() -> None:
    """torchao's all-gather of a Float8TrainingTensor, its data moved as uint8 (the same
    bytes), which gloo carries; once per process."""
    global _installed
    if _installed:
        return
    torchao_float8()
    from torchao.float8 import float8_ops

    def through_bytes(handler: Any) -> Any:
        def gather(aten_op: Any, args: tuple, kwargs: dict | None = None) -> Any:
            def as_bytes(data: torch.Tensor, *rest: Any, **options: Any) -> torch.Tensor:
                return aten_op(data.view(torch.uint8), *rest, **options).view(data.dtype)

            return handler(as_bytes, args, kwargs or {})

        return gather

    for op in (
        torch.ops._c10d_functional.all_gather_into_tensor.default,
        torch.ops.c10d_functional.all_gather_into_tensor.default,
    ):
        float8_ops.FLOAT8_OPS_TABLE[op] = through_bytes(float8_ops.FLOAT8_OPS_TABLE[op])
    _installed = True
