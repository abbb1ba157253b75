"""The planner prices a Mixture-of-Experts model under tensor parallelism and pipeline
stages (plan/moe/parallel.py): a tp rank's share of the parameters by hand, TP dividing
the expert-free GEMMs and leaving the routed experts' whole, its collectives' count a
layer, the search weighing tp and pp with ep, a stage's parameters, bubble and
activations by the dense model's formulas, and what is still refused in one line. (The
memory of tp layouts against `--simulate`: tests/dist/test_moe_simulate.py.)"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from trainwise.cli.main import main
from trainwise.config import load_config
from trainwise.config.parallel_dims import ParallelDims
from trainwise.models.moe import MOE_PRESETS
from trainwise.models.moe.cost import layer_gemms
from trainwise.plan.estimate import Setup, price
from trainwise.plan.inputs import PLAN_DEFAULTS, resolve_inputs
from trainwise.plan.model.compute import compute_time
from trainwise.plan.model.memory import Workload
from trainwise.plan.model.pipeline import (
    bubble_fraction,
    pipeline_stages,
    rank_chunks,
    stage_workload,
)
from trainwise.plan.model.tensor_parallel import TP_FORWARD, tp_collectives
from trainwise.plan.moe.compute import _plain_gemms, _routed_gemms, moe_micro_batch
from trainwise.plan.moe.memory import moe_activations, moe_params
from trainwise.plan.moe.parallel import rank_shape, tp_per_layer, zb_passes
from trainwise.plan.space import EVERYTHING, layouts

TINY = MOE_PRESETS["moe-tiny"]  # 2 layers, d 64, 4 heads (2 kv), a shared expert, 8 experts
QWEN = MOE_PRESETS["qwen3-235b-a22b"]  # no shared expert


def plan_inputs(**keys):
    return resolve_inputs(load_config(None, {**PLAN_DEFAULTS, **keys}))


def workload(shape=TINY, micro_batch: int = 2, seq: int = 128) -> Workload:
    return Workload(shape.num_params(), None, seq, micro_batch, moe=shape, imbalance=1.0)


def test_a_tp_rank_holds_half_the_dense_parameters_and_every_expert():
    """tp 2: attention, the shared expert and the vocabulary halved (the runtime's plan);
    the norms and the router whole; the routed experts split by ep alone (ETP 1)."""
    d, v = TINY.d_model, TINY.vocab_size
    whole_layer = 2 * d + TINY.router_params()
    halved_layer = (TINY.attention_params() + TINY.shared_params()) / 2
    by_hand = TINY.n_layer * (whole_layer + halved_layer) + 2 * v * d / 2 + d
    p = moe_params(workload(), 1, 2)
    assert p.dense == by_hand
    assert p.root == v * d + d and p.experts == TINY.expert_total()
    assert moe_params(workload(), 2, 2).experts == TINY.expert_total() / 2
    assert moe_params(workload(), 1, 1).dense == TINY.num_params() - TINY.expert_total()


def test_tp_divides_the_expert_free_gemms_and_leaves_the_routed_ones():
    """On H100, Qwen3-235B's layer at 4096 tokens: the attention's (and router's) GEMMs on
    a tp 4 rank take about a quarter (the router stays whole); the routed experts' take
    the same, as every tp rank computes the same tokens; the layer's whole micro-batch
    lies between the two."""
    hw = plan_inputs(**{"model.name": "qwen3-235b-a22b", "plan.gpus": 8}).hardware
    quarter = rank_shape(QWEN, 4)
    for backward in (False, True):
        plain = [_plain_gemms(s, True, 4096, hw, "bf16", None, backward) for s in (QWEN, quarter)]
        assert plain[1] / plain[0] == pytest.approx(0.25, rel=0.15)
        routed = [_routed_gemms(s, 4096, 8, 1.0, hw, "bf16", None, backward)
                  for s in (QWEN, quarter)]
        assert routed[1] == routed[0] > plain[1]
    w = workload(QWEN, 1, 4096)
    whole, split = (moe_micro_batch(w, 8, tp, hw, False, None).device_s for tp in (1, 4))
    assert whole / 4 < split < whole


def test_tp_collectives_a_layer_follow_what_the_runtime_splits():
    """Attention's one each way; a MoE layer's token split: its shared experts' gather and
    reduce-scatter (one more), and without sequence parallelism the all-gather of its
    routed output (half an all-reduce); a MoE layer without shared experts under sequence
    parallelism none (it routes the stream's own shard)."""
    assert (tp_per_layer(TINY, True), tp_per_layer(TINY, False)) == (2.0, 2.5)
    assert (tp_per_layer(QWEN, False), tp_per_layer(QWEN, True)) == (1.5, 1.0)
    inputs = plan_inputs(**{"model.name": "qwen3-30b-a3b", "plan.gpus": 8,
                            "data.seq_len": 4096, "data.global_batch": 32})
    forward = {}
    for sp in (False, True):
        setup = Setup(ParallelDims(1, 4, 2, ep=4, fsdp=True), "none", 2, 2,
                      sequence_parallel=sp)
        (c,) = [c for c in price(inputs, setup).collectives if c.name == TP_FORWARD]
        forward[sp] = c.wire_bytes
    assert forward[True] == pytest.approx(forward[False] / 1.5)


def test_the_search_weighs_tp_and_pp_with_ep_for_a_moe():
    inputs = plan_inputs(**{"model.name": "qwen3-30b-a3b", "plan.gpus": 16,
                            "data.seq_len": 4096, "data.global_batch": 64})
    found = layouts(inputs, replace(EVERYTHING, max_pp=4))
    assert any(d.tp > 1 and d.ep > 1 for d in found)
    assert any(d.pp > 1 and d.ep > 1 for d in found)
    assert any(d.tp > 1 and d.pp > 1 and d.ep > 1 for d in found)


def test_a_moe_plan_with_tp_pp_and_ep_is_priced_as_pinned(capsys):
    assert main(["plan", "--model", "qwen3-30b-a3b", "--gpus", "16", "--seq", "4096",
                 "--global-batch", "64", "--micro-batch", "1", "--set", "parallel.tp=2",
                 "--set", "parallel.pp=2", "--set", "parallel.ep=4", "--json"]) == 0
    chosen = json.loads(capsys.readouterr().out)["recommendation"]
    assert chosen["strategy"].startswith("pp2 + tp2 + ep4 + ")
    assert chosen["plan"]["step"]["bubble"] > 0 and chosen["plan"]["step"]["comm"] > 0


FOUR = replace(TINY, n_layer=4)


def test_a_stage_is_the_moe_model_of_its_layers_and_its_outer_parts():
    """pp 2 over 4 layers: the first rank holds two layers and the embedding, the last
    two layers, the final norm and the head; the head's loss only on the last."""
    w = workload(FOUR)
    first, last = pipeline_stages(w, ParallelDims(pp=2), "1F1B", 1, 4)
    d, v = TINY.d_model, TINY.vocab_size
    two_layers = 2 * FOUR.layer_params(0)
    sw = [stage_workload(w, s) for s in (first, last)]
    assert [s.params for s in sw] == [two_layers + v * d, two_layers + d + v * d]
    assert [s.moe.n_layer for s in sw] == [2, 2] and [s.head for s in sw] == [False, True]
    assert sw[0].params + sw[1].params == FOUR.num_params()


def test_the_bubble_is_the_dense_formula_over_the_slowest_moe_stage():
    inputs = plan_inputs(**{"model.name": "qwen3-30b-a3b", "plan.gpus": 16,
                            "data.seq_len": 4096, "data.global_batch": 32})
    dims = ParallelDims(1, 4, 2, 2, ep=4, fsdp=True, reshard_after_forward=False)
    for schedule, v in (("1F1B", 1), ("InterleavedZeroBubble", 2)):
        setup = Setup(dims, "full", 1, 8, schedule=schedule, virtual=v)
        plan = price(inputs, setup)
        w = replace(inputs.workload, micro_batch=1, ac="full")
        stages = pipeline_stages(w, dims, schedule, v, 8)
        chunks = rank_chunks(2, v, schedule)  # each runs its forward's syncs apart
        slowest = max(compute_time(inputs, stage_workload(w, s), 8, 2, dims, True, chunks).seconds
                      for s in stages)
        share = bubble_fraction(schedule, 2, v, 8, zb_passes(w.moe, 4096))
        assert plan.step.bubble == pytest.approx(share * slowest)
    # ZB-H1's bubble: (T_F + T_B - T_W) / (T_F + T_B + T_W) of 1F1B's, T_W the layer's GEMMs
    f, b, t_w = zb_passes(w.moe, 4096)
    assert t_w == sum(g.flops for g in layer_gemms(w.moe, 0))
    assert f - t_w == pytest.approx((b - t_w) / 2.5)


def test_a_stage_holds_the_activations_of_its_micro_batches_in_flight():
    """A stage without the head holding k micro-batches holds k times one's (the GPT's
    rule); the head's stage adds the loss only for the micro-batch in its backward."""
    w = workload(FOUR)
    first, last = pipeline_stages(w, ParallelDims(pp=2), "1F1B", 1, 4)
    sw = stage_workload(w, first)
    one = moe_activations(replace(sw, in_flight=1.0), False, "cpu")
    two = moe_activations(replace(sw, in_flight=2.0), False, "cpu")
    assert two.head == pytest.approx(2 * one.head) and two.block > one.block
    head = stage_workload(w, last)
    held = moe_activations(replace(head, in_flight=2.0, head_in_flight=2.0), False, "cpu")
    alone = moe_activations(replace(head, in_flight=1.0, head_in_flight=1.0), False, "cpu")
    assert alone.head < held.head < 2 * alone.head


def test_the_tp_rule_matches_the_gpts_with_a_shared_expert_on_every_layer():
    """moe-tiny (a shared expert on each layer): its TP traffic is the dense rule's."""
    from trainwise.plan.model.comm import Layout
    from trainwise.plan.moe.parallel import moe_tp_collectives

    layout = Layout(8, 8, 4e11, 5e10, 8, 1e-6, 5e-6)
    w = workload()
    moe = moe_tp_collectives(w, 2, 0.0, 2, layout, True)
    dense = tp_collectives(TINY, w.seq_len, w.micro_batch, w.precision, 2, 0.0, 2, layout)
    assert [c.wire_bytes for c in moe] == [c.wire_bytes for c in dense]
