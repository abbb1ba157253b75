"""`parallel.ac = "selective-op"`: the per-operation policy (models.checkpointing) on the
tiny GPT's block, through torch.utils.checkpoint's real forward and backward, and the
planner's pricing of it between no checkpointing and full."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from trainwise.config.parallel_dims import ParallelDims
from trainwise.models import ModelSpec, build_model
from trainwise.models.checkpointing import checkpoint_block, checkpointed, op_policy
from trainwise.models.shapes import PRESETS
from trainwise.plan.estimate import Setup
from trainwise.plan.model.flops import recompute_factor, selective_op_share
from trainwise.plan.model.memory import Workload, checkpointed_blocks, estimate_memory
from trainwise.plan.model.selective_op import block_matmuls, kept, recomputed_matmuls

aten = torch.ops.aten
MATMULS = {aten.mm.default, aten.addmm.default, aten.bmm.default}
SAVE, RECOMPUTE = CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_RECOMPUTE


class OpLog(TorchDispatchMode):
    """Every operation that really runs while it is active (a cached output does not)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[object] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


def _block_and_input(preset: str = "tiny") -> tuple[torch.nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    bundle = build_model(ModelSpec(preset, vocab_size=64, seq_len=16))
    block = bundle.blocks[0]
    return block, torch.randn(2, 16, PRESETS[preset].d_model, requires_grad=True)


def _backward_ops(wrap, preset: str = "tiny") -> list[object]:
    """The operations the backward of one block of `preset` runs, wrapped by `wrap`."""
    block, x = _block_and_input(preset)
    out = wrap(block)(x)
    log = OpLog()
    with log:
        out.sum().backward()
    return log.ops


def _is_sdpa_forward(func: object) -> bool:
    name = str(func)
    return "scaled_dot_product" in name and "backward" not in name


def test_the_policy_keeps_attention_and_every_other_matmul_and_recomputes_the_rest():
    block, x = _block_and_input()
    decisions: list[tuple[bool, object, CheckpointPolicy]] = []
    policy = op_policy()

    def recording(ctx, func, *args, **kwargs):
        decision = policy(ctx, func, *args, **kwargs)
        decisions.append((ctx.is_recompute, func, decision))
        return decision

    out = checkpoint(block, x, use_reentrant=False,
                     context_fn=lambda: create_selective_checkpoint_contexts(recording))
    out.sum().backward()
    forward = [(f, d) for again, f, d in decisions if not again]
    mm = [d for f, d in forward if f in MATMULS]
    # The block's Linears (q, k, v, out, up, down or its gate), each one matmul forward.
    assert len(mm) == len(block_matmuls(PRESETS["tiny"]))
    assert mm == [SAVE if k else RECOMPUTE for k in kept(mm)]
    sdpa = [d for f, d in forward if _is_sdpa_forward(f)]
    assert sdpa == [SAVE]
    others = [d for f, d in forward if f not in MATMULS and not _is_sdpa_forward(f)]
    assert others and set(others) == {RECOMPUTE}  # norms, the activation, the adds ...


@pytest.mark.parametrize("preset", ["tiny", "small"])  # GELU, SwiGLU
def test_the_backward_runs_again_the_matmuls_the_planner_prices_and_no_attention(preset):
    plain = _backward_ops(lambda b: b, preset)
    full = _backward_ops(lambda b: checkpoint_block(b, "full"), preset)
    op = _backward_ops(lambda b: checkpoint_block(b, "selective-op"), preset)
    shape = PRESETS[preset]

    def count(ops, test):
        return sum(1 for f in ops if test(f))

    def mm(ops):
        return count(ops, lambda f: f in MATMULS)

    # Full: the forward again, but the last matmul (the recomputation stops once it has
    # every saved tensor; nothing saves the down projection's output).
    assert mm(full) - mm(plain) == len(block_matmuls(shape)) - 1
    # Selective-op: the matmuls the planner prices as run again, no more.
    again = recomputed_matmuls(shape)
    assert 0 < mm(op) - mm(plain) == len(again) < mm(full) - mm(plain)
    assert count(plain, _is_sdpa_forward) == 0
    assert count(full, _is_sdpa_forward) == 1
    assert count(op, _is_sdpa_forward) == 0  # SDPA's output and log-sum-exp were kept
    # The elementwise work runs again: the MLP's activation, as under full checkpointing.
    def act(f):
        return f in (aten.gelu.default, aten.silu.default)

    assert count(plain, act) == 0 < count(op, act) == count(full, act)


@pytest.mark.parametrize("preset, seq", [("tiny", 128), ("small", 256)])
def test_the_planner_prices_selective_op_between_none_and_full(preset, seq):
    shape = PRESETS[preset]

    def memory(ac: str):
        w = Workload(shape.num_params(), shape, seq, 4, ac=ac)
        return estimate_memory(w, Setup.of(ParallelDims(), w), "cpu")

    none, op, full = memory("none"), memory("selective-op"), memory("full")
    assert full.activations < op.activations < none.activations
    assert full.total < op.total < none.total
    share = selective_op_share(shape, seq)
    assert 0.0 < share < 1.0
    factors = [recompute_factor(ac, shape.n_layer, False, share)
               for ac in ("none", "selective-op", "full")]
    assert factors == sorted(factors) and len(set(factors)) == 3


@pytest.mark.parametrize("ac", ["none", "selective", "full", "selective-op"])
def test_the_planner_wraps_the_blocks_the_runtime_wraps(ac):
    for n_layer in (1, 2, 5):
        runtime = {i for i in range(n_layer) if checkpointed(ac, i)}
        assert checkpointed_blocks(ac, n_layer) == runtime
