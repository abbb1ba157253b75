"""The Mixture-of-Experts shapes (models/moe/shapes.py): the published models' parameter
counts, total and active, their refusals, and the [moe] section's keys and lineage."""

from __future__ import annotations

from dataclasses import replace

import pytest

from trainwise.config import load_config
from trainwise.config.lineage import lineage_keys
from trainwise.errors import ConfigError, ModelError
from trainwise.models.moe import MOE_PRESETS, MoEShape, MoESpec, moe_job_shape
from trainwise.models.shapes import GPTShape

# (total, active) as the model cards and papers give them, to their printed digits.
PUBLISHED = {
    "mixtral-8x7b": (46.7e9, 12.9e9),  # Jiang et al., 2024: 47B, 13B active
    "mixtral-8x22b": (141e9, 39e9),
    "qwen3-30b-a3b": (30.5e9, 3.3e9),
    "qwen3-235b-a22b": (235e9, 22e9),
    "deepseek-moe-16b": (16.4e9, 2.8e9),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_published_totals_and_active_parameters(name):
    shape = MOE_PRESETS[name]
    total, active = PUBLISHED[name]
    assert float(f"{shape.num_params():.3g}") == pytest.approx(total, rel=0.006)
    assert float(f"{shape.active_params():.2g}") == pytest.approx(active, rel=0.05)


def test_mixtral_count_adds_up_by_hand():
    # 32 layers x (attention 4096 x (4096 + 2 x 1024 + 4096) + 8 experts x 3 x 4096 x 14336
    # + router 8 x 4096 + 2 norms) + embedding and head 2 x 32000 x 4096 + final norm.
    layer = 4096 * (4096 + 2048 + 4096) + 8 * 3 * 4096 * 14336 + 8 * 4096 + 2 * 4096
    expected = 32 * layer + 2 * 32000 * 4096 + 4096
    assert MOE_PRESETS["mixtral-8x7b"].num_params() == expected == 46_702_792_704
    idle = 32 * 6 * 3 * 4096 * 14336  # the 6 experts a token skips in every layer
    assert MOE_PRESETS["mixtral-8x7b"].active_params() == expected - idle


def test_qwen3_head_width_and_qk_norms_count():
    shape = MOE_PRESETS["qwen3-30b-a3b"]
    assert shape.head_dim == 128 and shape.d_model // shape.n_head == 64
    # q 2048 -> 32 x 128, k and v 2048 -> 4 x 128, out 4096 -> 2048, two 128-wide norms
    assert shape.attention_params() == 2048 * 4096 * 2 + 2 * 2048 * 512 + 2 * 128
    assert shape.num_params() == 30_532_122_624


def test_dense_leading_layers_and_shared_experts_count():
    shape = MOE_PRESETS["deepseek-moe-16b"]
    dense = 2 * 2048 + 4 * 2048 * 2048 + 3 * 2048 * 10944
    moe = 2 * 2048 + 4 * 2048 * 2048 + 64 * 2048 + 3 * 2048 * 2 * 1408 + 64 * 3 * 2048 * 1408
    assert shape.layer_params(0) == dense and shape.layer_params(1) == moe
    assert shape.num_params() == dense + 27 * moe + 2 * 102400 * 2048 + 2048
    assert shape.expert_total() == 27 * 64 * 3 * 2048 * 1408


def test_a_moe_shape_cannot_be_priced_as_dense():
    """The planner's dense formulas read d_ff and mlp: a MoE shape has neither, so handing
    it to one fails instead of pricing every expert on every token."""
    from trainwise.plan.model.flops import flops_per_token

    shape = MOE_PRESETS["moe-tiny"]
    assert not isinstance(shape, GPTShape)
    assert not hasattr(shape, "d_ff") and not hasattr(shape, "mlp")
    with pytest.raises(AttributeError):
        flops_per_token(shape, 128)  # type: ignore[arg-type]


def test_bad_shapes_are_one_line_each():
    tiny = MOE_PRESETS["moe-tiny"]
    with pytest.raises(ModelError, match="top_k = 9 exceeds the moe.experts = 8"):
        replace(tiny, moe=replace(tiny.moe, top_k=9))
    with pytest.raises(ModelError, match="leaves no MoE layer"):
        replace(tiny, moe=replace(tiny.moe, dense_layers=2, d_dense=64))
    with pytest.raises(ModelError, match="needs moe.d_dense"):
        replace(tiny, moe=replace(tiny.moe, dense_layers=1))
    with pytest.raises(ModelError) as err:
        MoEShape(n_layer=0, d_model=64, n_head=4, n_kv_head=3, vocab_size=8, max_seq_len=8,
                 moe=MoESpec(experts=4, top_k=1, d_expert=0))
    assert len(err.value.problems) == 2  # n_layer and d_expert, each its own line


def test_job_shape_takes_the_jobs_vocabulary():
    shape = moe_job_shape("moe-tiny", vocab_size=300, seq_len=64)
    assert (shape.vocab_size, shape.max_seq_len) == (300, 64)
    base = MOE_PRESETS["moe-tiny"]
    assert shape.num_params() - base.num_params() == 2 * 44 * 64  # embedding and head rows


def test_moe_section_defaults_and_refusals():
    cfg = load_config(overrides=[])
    assert (cfg.moe.aux_loss_coef, cfg.moe.bias_update_rate, cfg.moe.capacity_factor) == (
        0.001, 0.0, None)
    with pytest.raises(ConfigError, match="moe.aux_loss_coef"):
        load_config(overrides=["moe.aux_loss_coef=-1"])
    with pytest.raises(ConfigError, match="moe.capacity_factor"):
        load_config(overrides=["moe.capacity_factor=0"])


def test_moe_keys_join_the_lineage_only_when_changed():
    plain = lineage_keys(load_config(overrides=[]), 8)
    assert not any(k.startswith("moe.") for k in plain)  # dense runs keep their lineage
    same = lineage_keys(load_config(overrides=["moe.aux_loss_coef=0.001"]), 8)
    assert same == plain
    changed = lineage_keys(load_config(overrides=["moe.bias_update_rate=0.001"]), 8)
    assert changed == {**plain, "moe.bias_update_rate": 0.001}
