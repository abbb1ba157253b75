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
    ranks_per_token,
    routed_row_bytes,
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
    the model's own step): the activations of 2 layers less those of 1, per token, are the
    formula's layer (as 4 less 2, halved, are: 1.0002 of it either way)."""
    from trainwise.config.parallel_dims import ParallelDims
    from trainwise.doctor.simulate import simulate_layout
    from trainwise.models.profile import profile_model

    peaks = {}
    for layers in (1, 2):
        shape = replace(TINY, n_layer=layers)
        profile = profile_model(lambda s=shape: MoEModel(s), seq_len=64, vocab_size=256,
                                micro_batch=2)
        sim = simulate_layout(profile, ParallelDims(), micro_batch=2, seq_len=64)
        peaks[layers] = sim.parts["activations"]
    measured = (peaks[2] - peaks[1]) / (2 * 64)
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


# -- what the planner adds to the description (plan/moe) ------------------------------------

MIXTRAL = MOE_PRESETS["mixtral-8x7b"]


@pytest.mark.parametrize(
    "name, total, active",
    [("mixtral-8x7b", 46.7e9, 12.9e9), ("qwen3-30b-a3b", 30.5e9, 3.3e9),
     ("qwen3-235b-a22b", 235e9, 22e9), ("deepseek-moe-16b", 16.4e9, 2.8e9)],
)
def test_total_and_active_parameters_match_the_published_figures(name, total, active):
    shape = MOE_PRESETS[name]
    assert shape.num_params() == pytest.approx(total, rel=0.005)
    assert shape.active_params() == pytest.approx(active, rel=0.02)


def test_flops_per_token_of_mixtral_by_hand():
    """Mixtral 8x7B at 4096 tokens: per layer q, k, v, out (4096 x (4096 + 1024 + 1024 +
    4096)), the router (4096 x 8) and two of the eight experts (3 x 4096 x 14336 each),
    the head 4096 x 32000; six FLOPs each, and the attention 12 x 32 x 4096 x 4096."""
    layer = 4096 * (2 * 4096 + 2 * 1024) + 4096 * 8 + 2 * 3 * 4096 * 14336
    multiplied = 32 * layer + 4096 * 32000
    assert moe_flops_per_token(MIXTRAL, 4096) == 6 * multiplied + 12 * 32 * 4096 * 4096
    # 6 x the published 12.9B active, less the embedding lookup and the norms: within 1 %
    assert moe_flops_per_token(MIXTRAL, 1) == pytest.approx(6 * (12.9e9 - 32000 * 4096),
                                                            rel=0.01)


def test_ranks_a_token_reaches():
    assert ranks_per_token(MIXTRAL, 1) == 1.0
    # two of 8 experts, 4 a rank: a rank misses both with 4/8 x 3/7
    assert ranks_per_token(MIXTRAL, 2) == pytest.approx(2 * (1 - 4 / 8 * 3 / 7))
    assert ranks_per_token(MIXTRAL, 8) == pytest.approx(2.0)  # one expert a rank
    assert 1 < ranks_per_token(MOE_PRESETS["qwen3-30b-a3b"], 8) < 8


def test_a_routed_copy_is_part_of_the_layer_count():
    """Doubling the routed experts' width (no shared expert, whose width would follow)
    adds 4 (gate, up, silu, product) x the extra width a routed copy, as routed_row_bytes
    and layer_activation_bytes both say."""
    base = replace(TINY, moe=replace(TINY.moe, shared_experts=0))
    wide = replace(base, moe=replace(base.moe, d_expert=2 * TINY.moe.d_expert))

    def layer(shape):
        return layer_activation_bytes(shape, 1, compute_bytes=2, norm_row=cpu_norm_row(2),
                                      micro_batch=2, seq_len=16)

    extra = 2 * 4 * TINY.moe.d_expert * TINY.moe.top_k
    assert layer(wide) - layer(base) == extra
    assert (routed_row_bytes(wide, 2) - routed_row_bytes(base, 2)) * TINY.moe.top_k == extra
