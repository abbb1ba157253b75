"""The MoE family's cost description (models/moe/cost.py): the GEMMs and FLOPs a token
costs, the parameters by where they live, and the activations a layer keeps, counted
against the model's own autograd graph (saved-tensor hooks, fp32 and 16-bit parameters)
and against the doctor's fake-tensor simulation (doctor/simulate.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from trainwise.models.moe import MOE_PRESETS
from trainwise.models.moe.cost import (
    layer_activation_bytes,
    moe_flops_per_token,
    param_split,
    token_gemms,
)
from trainwise.models.moe.model import MoEBlock, MoEModel

TINY = MOE_PRESETS["moe-tiny"]


def cpu_norm_row(compute_bytes: int):
    """CPU's RMSNorm (a composite op): its input, an fp32 normalised copy (and the fp32
    input in 16-bit), the per-row rstd: plan/model/memory.py's rule for the GPT's norms."""
    return lambda w: compute_bytes * w + (4 if compute_bytes == 4 else 6) * w + 4


def saved_bytes(shape, index, dtype, kernel, batch=2, seq=16) -> float:
    """What autograd keeps of one training forward of layer `index` (saved-tensor hooks:
    every storage once, parameters and buffers aside; the layer's input where it is
    kept), per token."""
    torch.manual_seed(0)
    block = MoEBlock(shape, index).train().to(dtype)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.1)
    if block.moe is not None:
        block.moe.experts.kernel = kernel
    own = {t.untyped_storage().data_ptr() for t in [*block.parameters(), *block.buffers()]}
    x = torch.randn(batch, seq, shape.d_model, dtype=dtype, requires_grad=True)
    seen: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in own:
            seen.setdefault(storage.data_ptr(), storage.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(x)
    return sum(seen.values()) / (batch * seq)


SHAPES = {
    "tiny": (TINY, 1),
    "no-shared-mha-top3": (replace(TINY, n_kv_head=4, moe=replace(TINY.moe, shared_experts=0,
                                                                   top_k=3)), 1),
    "qwen3-like": (replace(TINY, qk_norm=True, d_head=32, moe=replace(
        TINY.moe, shared_experts=0, renormalize=False)), 1),
    "sigmoid": (replace(TINY, moe=replace(TINY.moe, score="sigmoid")), 1),
    "dense-layer": (replace(TINY, moe=replace(TINY.moe, dense_layers=1, d_dense=48)), 0),
}


@pytest.mark.parametrize("name", list(SHAPES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kernel", ["loop", "grouped"])
def test_layer_activations_are_what_autograd_keeps(name, dtype, kernel):
    shape, index = SHAPES[name]
    if kernel == "grouped" and not hasattr(torch, "_grouped_mm"):
        pytest.skip("this torch has no _grouped_mm")
    e = torch.finfo(dtype).bits // 8
    want = saved_bytes(shape, index, dtype, kernel)
    got = layer_activation_bytes(shape, index, compute_bytes=e, norm_row=cpu_norm_row(e),
                                 micro_batch=2, seq_len=16, grouped=kernel == "grouped")
    assert got == pytest.approx(want, rel=1e-9), (got, want)


def test_layer_activations_agree_with_the_fake_tensor_simulation():
    """The doctor's simulation of one process (PyTorch's memory tracker on fake tensors,
    the model's own step): the activations of 4 layers less those of 2, per layer and
    token, are the formula's layer."""
    from trainwise.config.parallel_dims import ParallelDims
    from trainwise.doctor.simulate import simulate_layout
    from trainwise.models.profile import profile_model

    peaks = {}
    for layers in (2, 4):
        shape = replace(TINY, n_layer=layers)
        profile = profile_model(lambda s=shape: MoEModel(s), seq_len=64, vocab_size=256,
                                micro_batch=2)
        sim = simulate_layout(profile, ParallelDims(), micro_batch=2, seq_len=64)
        peaks[layers] = sim.parts["activations"]
    measured = (peaks[4] - peaks[2]) / 2 / (2 * 64)
    # Fake tensors run the experts as even runs (layers._padded): no loop, no offsets.
    formula = layer_activation_bytes(TINY, 1, compute_bytes=4, norm_row=cpu_norm_row(4),
                                     micro_batch=2, seq_len=64)
    assert measured == pytest.approx(formula, rel=0.01), (measured, formula)


def test_token_gemms_and_flops():
    gemms = token_gemms(TINY)
    experts = [g for g in gemms if g.kind == "experts"]
    assert len(experts) == 3 * TINY.n_layer and all(g.rows == 2 and g.grouped == 8 for g in experts)
    # 6 a parameter and row: all but the idle experts, as the active count says (the
    # embedding a lookup, so not multiplied; the norms neither).
    multiplied = sum(g.rows * g.in_features * g.out_features for g in gemms)
    norms = 2 * TINY.n_layer * TINY.d_model + TINY.d_model
    assert multiplied == TINY.active_params() - TINY.vocab_size * TINY.d_model - norms
    attention = 12 * TINY.n_layer * TINY.n_head * TINY.head_dim * 128
    assert moe_flops_per_token(TINY, 128) == 6 * multiplied + attention


def test_parameters_by_where_they_live():
    mixtral = MOE_PRESETS["mixtral-8x7b"]
    split = param_split(mixtral)
    assert split.experts == 32 * 8 * 3 * 4096 * 14336
    # attention, router and norms of 32 layers, the embedding and the head, the final norm
    dense = 32 * (4096 * (2 * 4096 + 2 * 1024) + 8 * 4096 + 2 * 4096) + 2 * 32000 * 4096 + 4096
    assert split.total == mixtral.num_params() and split.dense == dense


def test_shapes_and_cost_import_no_torch():
    """The planner reads them: it imports no torch."""
    import subprocess
    import sys

    code = ("import sys; import trainwise.models.moe.cost, trainwise.models.moe.shapes; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    from helpers import cli_env, hang_limit

    proc = subprocess.run([sys.executable, "-c", code], env=cli_env(), capture_output=True,
                          text=True, timeout=hang_limit())
    assert proc.returncode == 0, proc.stderr
