"""Activation checkpointing of a model's blocks (`parallel.ac`): the one place its modes
wrap blocks, for the runtime (run.engine.parallelize) and for the planner's measured
profile of a module (models.profile).

- `full`: every block's forward runs again in its backward; only its input is kept.
- `selective`: every other block, from the first (layer-wise).
- `selective-op`: every block, under a per-operation policy (torchtitan's SelectiveAC,
  torchtitan/distributed/activation_checkpoint.py): the outputs of the operations that
  are expensive to run again are kept, the rest recomputed. Kept: attention's (SDPA's
  kernels: flash, memory-efficient, cuDNN, the CPU's flash), every other matmul of the
  block in the order its forward runs them (the 1st, 3rd, ...: mm, addmm, bmm, the
  grouped and scaled ones counted alike, so a biased Linear counts as an unbiased one),
  the reduce-scatters and all-to-alls of tensor and expert parallelism (running them again
  would communicate again), an absolute maximum (float8's scale), top-k (a MoE router's
  choice stays the one the forward made) and copies from a GPU to the host. A MoE
  router's gate is always recomputed and not counted (torchtitan's
  force_recompute_mm_shapes_by_fqns default). torch.utils.checkpoint's
  create_selective_checkpoint_contexts runs the policy; the planner counts the same rule
  op by op for trainwise's GPT block (plan.model.selective_op).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

SELECTIVE_OP = "selective-op"
# Linears whose matmul is recomputed and left out of the count (by module-name suffix).
RECOMPUTED_LINEARS = ("router.gate",)


def checkpointed(mode: str, index: int) -> bool:
    """Whether block `index` is wrapped under `mode` (plan.model.memory.checkpointed_blocks
    is the planner's copy of this rule; a test holds them equal)."""
    if mode in ("full", SELECTIVE_OP):
        return True
    return mode == "selective" and index % 2 == 0


def checkpoint_blocks(root: nn.Module, blocks: list[nn.Module], mode: str) -> list[nn.Module]:
    """Wrap `blocks` of `root` in activation checkpointing as `mode` says, replacing each in
    its parent; returns the new block list."""
    wrapped = []
    for i, block in enumerate(blocks):
        if checkpointed(mode, i):
            new = checkpoint_block(block, mode)
            _replace_child(root, block, new)
            wrapped.append(new)
        else:
            wrapped.append(block)
    return wrapped


def checkpoint_block(block: nn.Module, mode: str) -> nn.Module:
    """One block wrapped: recomputed whole, or under the per-operation policy. The
    recomputation draws the same dropout masks as the forward did."""
    if mode != SELECTIVE_OP:
        return checkpoint_wrapper(block, preserve_rng_state=True)
    recomputed = frozenset(
        (m.weight.shape[1], m.weight.shape[0])  # as mm's right operand: (in, out)
        for name, m in block.named_modules()
        if isinstance(m, nn.Linear) and name.endswith(RECOMPUTED_LINEARS)
    )
    return checkpoint_wrapper(
        block, preserve_rng_state=True,
        context_fn=lambda: create_selective_checkpoint_contexts(op_policy(recomputed)),
    )


def op_policy(recomputed: frozenset[tuple[int, ...]] = frozenset()) -> Callable:
    """A fresh policy for one forward of one block (its matmul count starts at zero):
    keep SAVED ops' outputs and every other matmul's, recompute the rest; matmuls whose
    right operand has a shape in `recomputed` are recomputed and not counted."""
    matmuls, saved = _op_sets()
    count = {False: 0, True: 0}  # forward, recomputation (torch < 2.12 asks both)

    def policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
        if func in matmuls:
            if _right_shape(func, args) in recomputed:
                return CheckpointPolicy.PREFER_RECOMPUTE
            count[ctx.is_recompute] += 1
            odd = count[ctx.is_recompute] % 2 == 1
            return CheckpointPolicy.MUST_SAVE if odd else CheckpointPolicy.PREFER_RECOMPUTE
        if func in saved or _to_host(func, args, kwargs):
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return policy


@lru_cache(maxsize=1)
def _op_sets() -> tuple[frozenset, frozenset]:
    """(the matmuls counted, the other ops whose outputs are kept), those this torch has."""
    aten, c10d = torch.ops.aten, torch.ops._c10d_functional
    matmuls = _present(aten, (
        "mm", "addmm", "bmm", "linear", "_scaled_mm", "_grouped_mm", "_scaled_grouped_mm",
    ))
    saved = _present(aten, (
        "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_fused_attention_overrideable", "_flash_attention_forward",
        "_efficient_attention_forward", "max", "topk",
    )) | _present(c10d, ("reduce_scatter_tensor", "all_to_all_single"))
    return matmuls, saved


def _present(namespace: object, names: tuple[str, ...]) -> frozenset:
    """The `.default` overloads of `names` that `namespace` (torch.ops.aten, ...) has."""
    found = (getattr(namespace, name, None) for name in names)
    return frozenset(op.default for op in found if op is not None and hasattr(op, "default"))


def _right_shape(func: object, args: tuple) -> tuple[int, ...] | None:
    """The shape of a matmul's weight operand as mm sees it ((in, out) for a 2-D one)."""
    aten = torch.ops.aten
    if func is aten.linear.default:
        return tuple(reversed(args[1].shape))
    operand = args[2] if func is aten.addmm.default else args[1]
    return tuple(operand.shape) if isinstance(operand, torch.Tensor) else None


def _to_host(func: object, args: tuple, kwargs: dict) -> bool:
    """A copy from a GPU to the host (a MoE layer's split sizes): kept, so that the
    recomputation does not synchronise with the device again."""
    if func is not torch.ops.aten._to_copy.default or "device" not in kwargs:
        return False
    source = args[0]
    return isinstance(source, torch.Tensor) and source.is_cuda and str(kwargs["device"]) == "cpu"


def _replace_child(root: nn.Module, old: nn.Module, new: nn.Module) -> None:
    for parent in root.modules():
        for name, child in parent.named_children():
            if child is old:
                setattr(parent, name, new)  # ModuleList children are named "0", "1", ...
                return
    raise ValueError("block to wrap is not part of the model")
