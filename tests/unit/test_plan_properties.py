"""Properties of the planner that must hold for any input (hypothesis): the invariants a
user relies on when reading a plan, not values."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import hang_limit
from trainwise.config import load_config
from trainwise.errors import ConfigError
from trainwise.hardware.catalog import gpu_names
from trainwise.models.shapes import PRESETS
from trainwise.plan.estimate import SIMPLER_WITHIN, evaluate
from trainwise.plan.inputs import PLAN_DEFAULTS, resolve_inputs
from trainwise.plan.planner import make_plan
from trainwise.plan.search import EVERYTHING, Goal, recommend, score

GPUS = [g for g in gpu_names() if g not in ("cpu", "T4", "V100")]  # with a bf16 peak
SHARDED = ("fsdp-grad-op", "fsdp-full", "fsdp-offload")

jobs = st.fixed_dictionaries(
    {
        "model.name": st.sampled_from([p for p in PRESETS if p not in ("tiny", "small")]),
        "cluster.gpu": st.sampled_from(GPUS),
        "data.seq_len": st.sampled_from([512, 1024, 2048, 4096]),
        "data.micro_batch": st.integers(1, 8),
        "data.global_batch": st.sampled_from([None, 64, 512, 1024]),
        "precision.dtype": st.sampled_from(["fp32", "bf16"]),
        "parallel.ac": st.sampled_from(["none", "selective", "full", "selective-op"]),
        "optim.name": st.sampled_from(["adamw", "sgd"]),
        "plan.gpus": st.sampled_from([1, 2, 4, 8, 16, 64, 256]),
        "cluster.inter_node_gbps": st.floats(0.1, 200),
    }
)


def inputs_of(job: dict):
    return resolve_inputs(load_config(None, job, base=PLAN_DEFAULTS))


@settings(max_examples=60, deadline=None)
@given(jobs, st.sampled_from(SHARDED))
def test_more_gpus_never_raise_memory_per_gpu_under_sharding(job, name):
    inputs = inputs_of(job)
    fewer = evaluate(inputs, name).memory.total
    more = evaluate(inputs.with_gpus(inputs.gpus * 2), name).memory.total
    assert more <= fewer * (1 + 1e-12)


@settings(max_examples=60, deadline=None)
@given(jobs, st.floats(1.01, 100.0))
def test_more_bandwidth_never_slows_a_step(job, factor):
    inputs = inputs_of(job)
    hw = inputs.hardware
    faster = replace(
        inputs,
        hardware=replace(hw, intra_bps=hw.intra_bps * factor, inter_bps=hw.inter_bps * factor),
    )
    for name in ("ddp", "fsdp-grad-op", "fsdp-full", "hsdp", "fsdp-offload"):
        assert evaluate(faster, name).step.total <= evaluate(inputs, name).step.total * (1 + 1e-12)


@settings(max_examples=60, deadline=None)
@given(jobs)
def test_full_never_uses_more_memory_than_grad_op(job):
    inputs = inputs_of(job)
    full = evaluate(inputs, "fsdp-full").memory
    grad_op = evaluate(inputs, "fsdp-grad-op").memory
    assert full.total <= grad_op.total


# Thirty whole searches, stages weighed: about a launch's CPU (10 s quiet on 2 cores). Each
# session draws new jobs (no example database in a fresh clone), so sixty bought little more.
@pytest.mark.timeout(hang_limit(launches=2, procs=0))
@settings(max_examples=30, deadline=None)
@given(jobs)
def test_the_recommendation_fits_whenever_something_fits(job):
    plan = make_plan(inputs_of(job))
    candidates = [s for s in plan.strategies if s.name != "single" or plan.inputs.gpus == 1]
    if any(s.fits for s in candidates):
        assert plan.best.fits
    if not plan.best.fits:
        assert plan.recommendation.scenario == "offline-batch"


# One setting the user may fix: (the Allowed field, the values it takes).
TIGHTENINGS = st.one_of(
    st.tuples(st.just("ac"), st.sampled_from(["none", "selective", "full"])),
    st.tuples(st.just("micro_batch"), st.sampled_from([1, 2, 4])),
    st.tuples(st.just("tp_degree"), st.sampled_from([1, 2])),
    st.tuples(st.just("strategy"), st.sampled_from(["ddp", "fsdp", "hsdp"])),
    st.tuples(st.just("accumulate"), st.sampled_from(["sharded", "unsharded"])),
)


@pytest.mark.timeout(hang_limit(launches=2, procs=0))  # thirty searches and their tightenings
@settings(max_examples=30, deadline=None)
@given(jobs, TIGHTENINGS)
def test_tightening_a_setting_never_yields_a_cheaper_plan(job, tightening):
    inputs = inputs_of({**job, "data.global_batch": 1024, "plan.gpus": min(job["plan.gpus"], 64)})
    field, value = tightening
    free = recommend(inputs)
    try:
        tight = recommend(inputs, replace(EVERYTHING, **{field: value}))
    except ConfigError:  # no layout of these GPUs meets it: nothing to compare
        return
    goal = Goal(inputs.objective)
    if tight.fits:
        assert free.fits
        # the free answer is the simplest within 1 % of its best (plan.search)
        assert score(free.plan, goal) <= score(tight.plan, goal) * (1 + SIMPLER_WITHIN) + 1e-12
