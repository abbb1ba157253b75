"""The Mixture-of-Experts cost description (models/moe/cost.py): the GEMMs a token runs,
dense versus expert parameters, model FLOPs against published active counts, the ranks a
token's experts fall on, and the activations of a block counted by hand."""

from __future__ import annotations

from dataclasses import replace

import pytest

from trainwise.models.moe import MOE_PRESETS
from trainwise.models.moe.cost import (
    activation_bytes_per_token,
    dense_linears,
    dense_params,
    expert_linears,
    flops_per_token,
    matmul_active_params,
    ranks_per_token,
    routed_rows,
)

MIXTRAL = MOE_PRESETS["mixtral-8x7b"]
QWEN3 = MOE_PRESETS["qwen3-30b-a3b"]
TINY = MOE_PRESETS["moe-tiny"]


def test_dense_and_expert_parameters_add_up_to_the_model():
    for shape in MOE_PRESETS.values():
        assert dense_params(shape) + shape.expert_total() == shape.num_params()
    # Mixtral: 32 layers x 8 experts x 3 x 4096 x 14336 routed; the rest is dense.
    assert MIXTRAL.expert_total() == 32 * 8 * 3 * 4096 * 14336
    assert dense_params(MIXTRAL) == 1_605_636_096


def test_a_token_runs_the_attention_router_and_shared_experts_and_top_k_experts():
    moe, dense = dense_linears(TINY, True), dense_linears(TINY, False)
    # q 64, k 32, v 32, out; the router 64 -> 8; the shared expert's gate, up, down of 32
    assert [(s.in_features, s.out_features) for s in moe] == [
        (64, 64), (64, 32), (64, 32), (64, 64), (64, 8), (64, 32), (64, 32), (32, 64)]
    assert len(dense) == 4  # moe-tiny has no leading dense layer: its FFN width is 0
    experts = expert_linears(TINY)
    assert all(s.rows == 2 / 8 for s in experts)  # top 2 of 8
    assert routed_rows(TINY, 128, ep=2) == 128 * 2 * 2 / 8


@pytest.mark.parametrize(
    "name, total, active",
    [("mixtral-8x7b", 46.7e9, 12.9e9), ("qwen3-30b-a3b", 30.5e9, 3.3e9),
     ("qwen3-235b-a22b", 235e9, 22e9), ("deepseek-moe-16b", 16.4e9, 2.8e9)],
)
def test_total_and_active_parameters_match_the_published_figures(name, total, active):
    shape = MOE_PRESETS[name]
    assert shape.num_params() == pytest.approx(total, rel=0.005)
    assert shape.active_params() == pytest.approx(active, rel=0.02)


def test_flops_per_token_by_hand():
    # Mixtral 8x7B: 12,879,925,248 active, less the 32000 x 4096 embedding lookup, six
    # FLOPs each; attention 12 x 32 layers x 4096 (query width) x 4096 tokens.
    assert matmul_active_params(MIXTRAL) == 12_879_925_248 - 32000 * 4096
    assert flops_per_token(MIXTRAL, 4096) == 6 * 12_748_853_248 + 12 * 32 * 4096 * 4096
    # Qwen3's query is 32 heads x 128 = 4096 wide on a 2048-wide model.
    assert flops_per_token(QWEN3, 1) - 6 * matmul_active_params(QWEN3) == 12 * 48 * 4096


def test_ranks_a_token_reaches():
    assert ranks_per_token(MIXTRAL, 1) == 1.0
    # two of 8 experts, 4 a rank: a rank misses both with 4/8 x 3/7
    assert ranks_per_token(MIXTRAL, 2) == pytest.approx(2 * (1 - 4 / 8 * 3 / 7))
    assert ranks_per_token(MIXTRAL, 8) == pytest.approx(2.0)  # one expert a rank
    assert 1 < ranks_per_token(QWEN3, 8) < 8


def test_activations_of_a_moe_block_by_hand():
    """moe-tiny in fp32 without autocast: d 64, 4 heads of 16, 2 kv heads, 8 experts top 2
    of width 32 (renormalised), one shared expert of 32, vocabulary 256."""
    per = activation_bytes_per_token(TINY, 4, 4, 4, False)
    # the norm's input and output, SDPA's q and the repeated k, v (3 x 64), its output and
    # the out projection's input (2 x 64), the log-sum-exp of 4 heads
    assert per["attention"] == 4 * 64 + 4 * 64 + 4 * 192 + 4 * 128 + 4 * 4
    # the norm's input and its fp32 output (the router's, the shared expert's), scores of 8
    # experts, 2 top-k ids (int64), the renormalisation (2 scores and their sum), the sort
    # order and token of 2 rows (int64), the combine's fp32 rows and scores, the shared
    # expert's four 32-wide intermediates
    router = 4 * 8 + 8 * 2 + (4 * 2 + 4)
    assert per["moe_ffn"] == 2 * 4 * 64 + router + 2 * 8 * 2 + 2 * (4 * 64 + 4) + 4 * 4 * 32
    assert per["routed"] == 4 * 64 + 4 * 4 * 32  # its sorted row, gate, silu, up, product
    assert per["head"] == 4 * 64 + 4 * 64 + 3 * 4 * 256
    # bf16 autocast: the shared expert's gate and up keep their own 16-bit casts
    cast = activation_bytes_per_token(TINY, 2, 4, 4, True)
    assert cast["moe_ffn"] - per["moe_ffn"] == 2 * 2 * 64 - 4 * 4 * 32 + 4 * 2 * 32
    no_shared = replace(TINY, moe=replace(TINY.moe, shared_experts=0))
    assert activation_bytes_per_token(no_shared, 4, 4, 4, False)["moe_ffn"] == (
        per["moe_ffn"] - 4 * 4 * 32)
