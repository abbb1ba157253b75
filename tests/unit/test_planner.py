"""The planner's models beyond memory (communication, compute, cost, checkpoints, the
decision, the sweep) against hand arithmetic and published figures. Expected values are
worked out in the comments from the formulas in the modules' docstrings."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from helpers import memory_of
from trainwise.config import load_config
from trainwise.config.parallel_dims import ParallelDims
from trainwise.models.shapes import PRESETS
from trainwise.plan import choose_accumulation, decide_auto, runtime_allowed
from trainwise.plan.estimate import SIMPLER_WITHIN, evaluate
from trainwise.plan.inputs import PLAN_DEFAULTS, resolve_inputs
from trainwise.plan.model.comm import Layout, exposed_seconds, layout_collectives, step_collectives
from trainwise.plan.model.cost import checkpoint_plan, job_cost
from trainwise.plan.model.flops import model_flops_per_token, recompute_factor
from trainwise.plan.model.memory import Workload
from trainwise.plan.planner import BEST, SweepRow, knee, make_plan, parse_sweep
from trainwise.plan.record import plan_record
from trainwise.plan.search import EVERYTHING, knob_memory, layout_knobs, recommend, search
from trainwise.plan.space import replica_batch

GB = 1e9


# These tests pin the planner's logic (search, policies, seeds) under the flat compute
# of the plan.efficiency override at 0.4, the figures they were derived with; the
# per-operation compute model has its own tests (test_compute.py).
FLAT = {"plan.efficiency": 0.4}


def plan_inputs(**flags):
    """Resolved inputs from `trainwise plan`'s defaults and dotted-key flags."""
    return resolve_inputs(load_config(None, {**FLAT, **flags}, base=PLAN_DEFAULTS))


# --- communication ---------------------------------------------------------------------------

NODE = Layout(gpus=4, gpus_per_node=8, intra_bps=100.0, inter_bps=10.0)
DDP4 = ParallelDims(dp_replicate=4)  # the layouts whose exposure is worked out by hand
FSDP4 = ParallelDims(dp_shard=4, fsdp=True)


def test_ddp_all_reduce_volume_by_hand():
    # Ring all-reduce over 4 ranks: 2 x 3/4 x (1000 params x 4 bytes fp32 grads) = 6000.
    (c,) = step_collectives("ddp", 1000, NODE, "bf16", "fp32", grad_accum=8)
    assert c.wire_bytes == 6000  # once per step whatever the accumulation (no_sync)
    assert c.bytes_per_s == 100.0 and c.seconds == 60.0


def test_fsdp_volumes_by_hand():
    # bf16 all-gathers 1000 x 2 = 2000 bytes, fp32 reduce-scatter 4000, factor 3/4.
    # full, in 5 equal units: gathered for forward, and all but the last unit again for
    # backward, on each of 2 micro-batches: 2 x (1 + 4/5) x 0.75 x 2000 = 5400;
    # reduce-scatter once: 3000.
    gather, scatter = step_collectives("fsdp-full", 1000, NODE, "bf16", "fp32", 2, units=5)
    assert (gather.wire_bytes, scatter.wire_bytes) == (pytest.approx(5400), 3000)
    # grad_op keeps the parameters from forward to backward: one gather per micro-batch.
    gather, scatter = step_collectives("fsdp-grad-op", 1000, NODE, "bf16", "fp32", 2, units=5)
    assert (gather.wire_bytes, scatter.wire_bytes) == (3000, 3000)
    # A root unit (200 of the 1000) is gathered once, as the last block: the 3 other
    # blocks' 800 x 3/4 again, 2 x (1000 + 600) x 2 x 0.75 = 4800.
    gather, _ = layout_collectives(FSDP4, 1000, NODE, "bf16", "fp32", 2, units=5, root=200)
    assert gather.wire_bytes == pytest.approx(4800)


def test_zero_paper_volume_ratios():
    # Rajbhandari et al. 2020, section 7.2: ZeRO-2 moves the same volume as data parallelism
    # (2 psi), ZeRO-3 1.5x (3 psi) -- with every collective in one dtype; here 1.5x less
    # the last of 80 blocks, not gathered again for backward.
    layout = Layout(64, 8, 1.0, 1.0)

    def volume(name: str) -> float:
        return sum(c.wire_bytes for c in step_collectives(name, 1e9, layout, "fp32", "fp32", 1,
                                                          units=80))

    assert volume("fsdp-grad-op") / volume("ddp") == pytest.approx(1.0)
    assert volume("fsdp-full") / volume("ddp") == pytest.approx(1.5 - 0.5 / 80)


def test_hsdp_shards_within_nodes_and_all_reduces_across():
    # 16 GPUs, 8 per node: FSDP over 8 (factor 7/8) on NVLink, then an all-reduce of the
    # gradient shards (4000 / 8 = 500 bytes) over 2 replicas: 2 x 1/2 x 500 = 500 on the network.
    layout = Layout(16, 8, intra_bps=100.0, inter_bps=10.0)
    gather, scatter, across = step_collectives("hsdp", 1000, layout, "bf16", "fp32", 1, units=2)
    assert gather.wire_bytes == 1.5 * 7 / 8 * 2000 and gather.bytes_per_s == 100.0
    assert scatter.wire_bytes == 7 / 8 * 4000
    assert across.wire_bytes == 500 and across.bytes_per_s == 10.0


def test_a_collective_across_nodes_runs_on_the_nodes_nics_in_parallel():
    # 16 ranks on 2 nodes of 8, 8 NICs of 10 B/s each: a ring all-gather's bus bytes cross
    # each node's 8 NICs at once (80 B/s), and 7/8 of them NVLink (100 / (7/8) B/s).
    layout = Layout(16, 8, intra_bps=100.0, inter_bps=10.0)
    assert layout.nodes == 2
    within = layout.collective("g", "all_gather", 800.0, (8, 1))
    across = layout.collective("g", "all_gather", 800.0, (16, 1))
    assert within.bytes_per_s == 100.0 and across.bytes_per_s == pytest.approx(80.0)
    one_nic = replace(layout, nics_per_node=1)
    assert one_nic.collective("g", "all_gather", 800.0, (16, 1)).bytes_per_s == 10.0
    assert step_collectives("single", 1000, layout, "bf16", "fp32", 1) == []


def test_exposed_communication_by_hand():
    (c,) = step_collectives("ddp", 1000, NODE, "fp32", "fp32", 1)  # 60 s on the link
    # DDP hides its all-reduce behind the last micro-batch's backward (2/3 of 120 s = 80 s)
    # except the last bucket: 2 x 3/4 x 25 MB at 100 B/s, capped at the whole 60 s.
    assert exposed_seconds([c], 120.0, DDP4, 0.1, grad_accum=1) == 60.0
    fast = replace(c, bytes_per_s=1e9)  # 6e-6 s: hidden but for its last bucket (all of it)
    assert exposed_seconds([fast], 120.0, DDP4, 0.1, 1) == pytest.approx(6e-6)
    # With 4 micro-batches only the last one's backward hides it: 2/3 x 30 = 20 s.
    slow = replace(c, bytes_per_s=0.2e3)  # 30 s
    assert exposed_seconds([slow], 120.0, DDP4, 0.0, 4) == pytest.approx(30.0)
    assert exposed_seconds([replace(c, bytes_per_s=1e3)], 120.0, DDP4, 0.0, 4) == (
        pytest.approx(6.0)  # 6 s all-reduce in a 20 s window: only the bucket, all 6 s
    )


def test_exposed_fsdp_communication_by_hand():
    # bf16, 4 ranks, 2 micro-batches, 2 units: gathers 2 x 1.5 x 0.75 x 2000 = 4500 B (45 s
    # at 100 B/s), reduce-scatter 3000 B (30 s); compute 45 s. The link needs 30 s more
    # than the compute; the reduce-scatter overruns the last micro-batch's backward
    # (2/3 x 22.5 = 15 s) by 15 s. Exposed: max(30, 15) = 30, plus one unit (10 %) of one
    # micro-batch's gathers (22.5 s) and of the reduce-scatter (30 s): 5.25 s -> 35.25 s.
    fsdp = step_collectives("fsdp-full", 1000, NODE, "bf16", "fp32", 2, units=2)
    assert exposed_seconds(fsdp, 45.0, FSDP4, 0.1, grad_accum=2) == pytest.approx(35.25)
    # Never more than the communication itself.
    assert exposed_seconds(fsdp, 0.0, FSDP4, 0.5, grad_accum=2) == pytest.approx(75.0)


# --- compute ---------------------------------------------------------------------------------


def test_flops_without_a_shape_are_6n():
    # Kaplan et al. 2020: C = 6N per token.
    assert model_flops_per_token(1000, None, 4096) == 6000


def test_recompute_factor_by_hand():
    # Full recomputation runs the forward again: (6N + 2N) / 6N = 4/3 (Korthikanti et al.).
    assert recompute_factor("full", 32) == pytest.approx(4 / 3)
    assert recompute_factor("none", 32) == 1.0
    # selective checkpoints 16 of 32 blocks: 1 + 0.5/3.
    assert recompute_factor("selective", 32) == pytest.approx(1 + 1 / 6)


def test_step_compute_by_hand():
    # llama-7b, seq 4096, global batch 1024 on 8 GPUs: 128 sequences per GPU per step.
    # FLOPs per token 6 x matmul params + 12 L h s; rate 989 TFLOP/s bf16 x 0.4, the
    # plan.efficiency override (the default is the per-operation model, test_compute).
    inputs = replace(plan_inputs(), efficiency=0.4)
    s = evaluate(inputs, "fsdp-full")
    shape = PRESETS["llama-7b"]
    per_token = model_flops_per_token(shape.num_params(), shape, 4096)
    peak = inputs.hardware.peak_flops
    assert s.step.compute == pytest.approx(128 * 4096 * per_token / (peak * 0.4))
    # MFU: model FLOPs achieved over all peaks; compute-bound here, so close to 0.4.
    assert s.mfu == pytest.approx(s.tokens_per_s * per_token / (8 * peak))
    assert 0.39 < s.mfu <= 0.4


def test_global_batch_smaller_than_gpus_idles_gpus():
    s = evaluate(plan_inputs(**{"plan.gpus": 16, "data.global_batch": 8}), "ddp")
    assert any("smaller than 16 GPUs" in note for note in s.notes)


# --- cost and checkpoints --------------------------------------------------------------------


def test_checkpoint_plan_by_hand():
    # 100 GB over 2 nodes writing 2 GB/s each: 25 s. System MTBF 1000 h / 2 = 1.8e6 s.
    # Daly: tau = sqrt(2 x 25 x 1.8e6) - 25 = 9461.83 s. 1e6 s of training: 105.69 saves;
    # failures over (1e6 + 105.69 x 25) s = 0.55702.
    ck = checkpoint_plan(100 * GB, 2 * GB, 2, 1e6, 1000.0, 600.0)
    tau = math.sqrt(2 * 25 * 1.8e6) - 25
    assert ck.save_s == 25
    assert ck.interval_min == pytest.approx(tau / 60)
    assert ck.expected_failures == pytest.approx((1e6 + 1e6 / tau * 25) / 1.8e6)
    assert ck.loss_per_failure_s == pytest.approx(600 + tau / 2)


def test_cost_terms_add_up_by_hand():
    # 8 GPUs, $2/h, 1 h of steps with 10 % exposed communication; saves every 10 min of 6 s
    # (6 saves, 36 s), 0.5 failures of 300 s: retry 186 s.
    ck = checkpoint_plan(1.0, 1.0, 1, 1.0, 1.0, 1.0)
    ck = replace(ck, interval_min=10.0, save_s=6.0, expected_failures=0.5, loss_per_failure_s=300)
    c = job_cost(8, 2.0, 3600.0, 0.1, ck)
    assert c.comm_wait_usd == pytest.approx(0.8 * 2)  # 0.1 h x 8 GPUs
    assert c.compute_usd == pytest.approx(7.2 * 2)
    assert c.failure_retry_usd == pytest.approx(186 * 8 / 3600 * 2)
    assert c.total_usd == pytest.approx(c.compute_usd + c.comm_wait_usd + c.failure_retry_usd)
    assert c.gpu_hours == pytest.approx(8 + 186 * 8 / 3600)
    assert c.wall_hours == pytest.approx((3600 + 186) / 3600)


def test_every_strategy_cost_adds_up_and_matches_its_hours():
    plan = make_plan(plan_inputs(**{"plan.gpus": 16}))
    for s in plan.strategies:
        c = s.cost
        assert c.total_usd == pytest.approx(c.compute_usd + c.comm_wait_usd + c.failure_retry_usd)
        assert c.gpu_hours == pytest.approx(c.wall_hours * s.gpus)
        assert c.total_usd == pytest.approx(c.gpu_hours * plan.inputs.hardware.price_per_gpu_hour)


# --- published memory figures ----------------------------------------------------------------


def test_zero_paper_model_states():
    # Rajbhandari et al. 2020, Figure 1: a 7.5B model with Adam needs 120 GB of model states
    # per GPU under data parallelism (16 bytes per parameter) and 1.9 GB with ZeRO-3
    # (P_os+g+p) on 64 GPUs.
    w = Workload(params=7_500_000_000, shape=None, seq_len=1, micro_batch=1, precision="bf16")
    assert memory_of(w, "ddp", 64).model_states == 120 * GB
    assert memory_of(w, "fsdp", 64).model_states == pytest.approx(1.875 * GB)


# --- the decision ----------------------------------------------------------------------------


def test_seed_rule_a_replica_that_fits_gets_ddp_on_a_fast_network():
    plan = make_plan(plan_inputs(**{"model.name": "gpt2-124m", "data.seq_len": 1024}))
    assert plan.strategy("single").fits
    assert plan.recommendation.strategy == "ddp"
    assert plan.recommendation.scenario == "ddp"


def test_seed_rule_a_replica_that_does_not_fit_gets_fsdp():
    plan = make_plan(plan_inputs())  # llama-7b on 8 x H100: 162 GB for one replica
    assert not plan.strategy("single").fits
    assert plan.recommendation.strategy in ("fsdp-grad-op", "fsdp-full")
    assert plan.recommendation.scenario == "fsdp"
    assert plan.questions[0][1].startswith("No.")


def test_seed_rule_slow_network_small_model_warns_sharding_is_slower():
    plan = make_plan(
        plan_inputs(
            **{"model.name": "gpt2-124m", "data.seq_len": 1024, "cluster.intra_node_gbps": 0.05}
        )
    )
    assert any("slower than one GPU" in w for w in plan.warnings)
    assert plan.questions[1][1].startswith("No.")


def test_small_model_on_two_gpus_is_an_mvp():
    plan = make_plan(
        plan_inputs(**{"model.name": "gpt2-124m", "data.seq_len": 1024, "plan.gpus": 2})
    )
    assert plan.recommendation.scenario == "mvp"


def test_only_offload_fits_is_offline_batch():
    # llama-70b on 2 A10G (24 GB): 1.4 TB for one replica; only cpu offload, with full
    # checkpointing, fits.
    plan = make_plan(
        plan_inputs(**{"model.name": "llama-70b", "cluster.gpu": "A10G", "plan.gpus": 2})
    )
    rec = plan.recommendation
    assert rec.scenario == "offline-batch"
    assert plan.best.fits and rec.choice.dims.cpu_offload
    assert any(r.startswith("Only cpu offload fits") for r in rec.reasons)


def test_nothing_fits_is_offline_batch_with_the_smallest_footprint_and_a_fix():
    # The same at 32k tokens a sequence and 100 GB of host memory: nothing fits; the plan
    # shows the configuration that needs the least, and the fewest GPUs that do fit.
    flags = {"model.name": "llama-70b", "cluster.gpu": "A10G", "plan.gpus": 2,
             "data.seq_len": 32768, "cluster.host_memory_gb": 100}
    inputs = plan_inputs(**flags)
    plan = make_plan(inputs)
    rec = plan.recommendation
    assert rec.scenario == "offline-batch"
    assert not plan.best.fits
    _, searched = search(inputs)
    every = [  # every setting of every layout searched
        knob_memory(inputs, knob.setup(dims, m, replica_batch(inputs, dims)))
        for dims in searched
        for knob in layout_knobs(inputs, dims, EVERYTHING)
        for m in knob.micros
    ]
    assert plan.best.memory.total == min(m.total for m in every)
    assert any(r.startswith("Nothing fits") for r in rec.reasons)
    fix = next(r for r in rec.reasons if r.startswith("With "))
    gpus = int(fix.split()[1])
    assert recommend(inputs.with_gpus(gpus)).fits
    assert not recommend(inputs.with_gpus(gpus // 2)).fits  # the fewest (of the doublings)


def test_objective_time_picks_the_fastest_that_fits():
    inputs = plan_inputs(**{"plan.objective": "time", "plan.gpus": 16})
    plan = make_plan(inputs)
    fitting, _ = search(inputs)
    fastest = min(s.cost.wall_hours for s in fitting)
    assert plan.best.cost.wall_hours <= fastest * (1 + SIMPLER_WITHIN)
    cheaper = make_plan(replace(inputs, objective="cost")).best
    assert plan.best.cost.wall_hours <= cheaper.cost.wall_hours
    # And never slower than the named strategies that fit (beyond the simplicity margin).
    named = [s for s in plan.strategies if s.fits and s.name != "single"]
    assert plan.best.cost.wall_hours <= min(s.cost.wall_hours for s in named) * 1.01


def test_hsdp_only_across_nodes():
    assert "hsdp" not in [s.name for s in make_plan(plan_inputs()).strategies]
    plan = make_plan(plan_inputs(**{"plan.gpus": 16}))
    assert "hsdp" in [s.name for s in plan.strategies]
    assert plan.inputs.nodes == 2


def test_hsdp_only_on_whole_nodes():
    # 12 GPUs at 8 per node: a 1.5-replica mesh the runtime would refuse.
    assert "hsdp" not in [s.name for s in make_plan(plan_inputs(**{"plan.gpus": 12})).strategies]


def test_accumulating_under_fsdp_keeps_unsharded_gradients():
    # FSDP2 skips the reduce-scatter between micro-batches and keeps every parameter's
    # unsharded gradient in the reduce dtype (fp32): 6.74e9 x 4 bytes on each GPU.
    one = evaluate(plan_inputs(**{"data.global_batch": 8}), "fsdp-full")  # 1 per GPU
    many = evaluate(plan_inputs(), "fsdp-full")  # 128 micro-batches per GPU
    assert (one.grad_accum, many.grad_accum) == (1, 128)
    assert many.memory.grads == PRESETS["llama-7b"].num_params() * 4
    assert many.memory.total > one.memory.total + 23e9  # (27.0 - 3.4) GB more


def test_the_scenario_is_the_jobs_even_for_one_asked_strategy():
    plan = make_plan(plan_inputs(**{"plan.gpus": 16, "plan.strategy": "ddp"}))
    assert [s.name for s in plan.strategies] == ["ddp"]
    assert plan.recommendation.scenario == "fsdp"  # fsdp fits, although ddp was asked for


def test_network_answer_is_about_the_recommended_strategy():
    plan = make_plan(
        plan_inputs(**{"plan.gpus": 64, "model.name": "llama-13b", "data.global_batch": 64})
    )
    assert plan.recommendation.strategy in ("fsdp-grad-op", "fsdp-full", "hsdp")
    assert plan.questions[1][1].split(". ", 1)[1].startswith(plan.recommendation.strategy)


def test_one_strategy_when_asked():
    plan = make_plan(plan_inputs(**{"plan.strategy": "fsdp-full"}))
    assert [s.name for s in plan.strategies] == ["fsdp-full"]


def test_network_answer_states_the_break_even_bandwidth():
    plan = make_plan(plan_inputs())
    answer = plan.questions[1][1]
    assert "GB/s, sharding is slower than one GPU" in answer
    assert "370 GB/s" in answer  # NVLink 4 as NCCL reaches it, from the catalog


def test_crash_answer_uses_the_young_daly_interval():
    plan = make_plan(plan_inputs(**{"plan.gpus": 64}))
    best = plan.strategy(plan.recommendation.strategy)
    assert f"{best.checkpoint.interval_min:.0f} min" in plan.questions[2][1]
    assert "8 nodes" in plan.questions[2][1]


# --- sweep and knee --------------------------------------------------------------------------


def _rows(points):
    return [SweepRow(n, "x", True, t, t / n, 1.0, 1.0, 1.0, 100.0 * n) for n, t in points]


def test_knee_by_hand():
    # 1 -> 2 adds 90 per GPU (>= half of 100); 2 -> 4 adds 30 per GPU, less than half of
    # 190 / 2 = 95: the knee is at 2.
    assert knee(_rows([(1, 100), (2, 190), (4, 250)])) == 2
    assert knee(_rows([(1, 100), (2, 200), (4, 400)])) is None


def test_sweep_rows_and_knees_in_the_plan():
    plan = make_plan(plan_inputs(**{"cluster.inter_node_gbps": 1.0}), parse_sweep("1..64"))
    assert {r.gpus for r in plan.sweep} == {1, 2, 4, 8, 16, 32, 64}
    assert plan.knees["fsdp-full"] is not None  # a slow network bends the curve
    record = plan_record(plan)
    assert len(record["sweep"]) == len(plan.sweep)


def test_past_the_knee_warns():
    # At 0.05 GB/s between nodes even the best configuration without pipeline stages stops
    # scaling past one node.
    inputs = plan_inputs(**{"plan.gpus": 64, "cluster.inter_node_gbps": 0.05})
    plan = make_plan(inputs, parse_sweep("1..64"), allowed=replace(EVERYTHING, max_pp=1))
    best = [r for r in plan.sweep if r.strategy == BEST]
    assert plan.knees[BEST] == knee(best) == 8
    assert any("past the scaling knee of the best configuration (8 GPUs)" in w for w in plan.warnings)
    # Stages send activations across the slow links, not weights: with them (the default)
    # the best scales further.
    staged = make_plan(inputs, parse_sweep("1..64"))
    assert staged.knees[BEST] is None or staged.knees[BEST] > 8


@pytest.mark.parametrize(
    "text, counts",
    [("1,2,4,8", [1, 2, 4, 8]), ("1..1024", [2**k for k in range(11)]), ("3..12", [3, 6, 12])],
)
def test_parse_sweep(text, counts):
    assert parse_sweep(text) == counts


@pytest.mark.parametrize("text", ["", "a,b", "0,1", "8..2", "1..x"])
def test_parse_sweep_rejects(text):
    with pytest.raises(ValueError):
        parse_sweep(text)


# --- the JSON record -------------------------------------------------------------------------


def test_json_record_has_the_documented_schema():
    record = plan_record(make_plan(plan_inputs(), [1, 2]))
    assert set(record) >= {
        "inputs",
        "strategies",
        "recommendation",
        "questions",
        "warnings",
        "sweep",
    }
    rec = record["recommendation"]
    assert set(rec) == {"strategy", "scenario", "reasons", "fits", "configuration", "layout",
                        "config", "plan", "alternatives"}
    assert rec["config"]["parallel.strategy"] in ("fsdp", "hsdp") and rec["plan"]["fits"]
    assert all(set(a) == {"configuration", "config", "why_not", "plan"} for a in rec["alternatives"])
    assert all(set(q) == {"question", "answer"} for q in record["questions"])
    s = record["strategies"][0]
    assert set(s) >= {
        "name",
        "fits",
        "memory_per_gpu",
        "host_memory_per_node",
        "comm_bytes_per_step_per_gpu",
        "step",
        "tokens_per_s",
        "mfu",
        "scaling_efficiency",
        "hours_to_train",
        "cost",
        "checkpoint",
    }
    mem = s["memory_per_gpu"]
    assert set(mem) >= {
        "params",
        "grads",
        "optimizer",
        "model_states",
        "activations",
        "buffers",
        "overhead",
        "total",
    }
    phase = mem.pop("peak_phase")
    assert phase in (
        "head backward",
        "block backward",
        "end of a block's backward",
        "optimizer step",
    )
    assert all(isinstance(v, int) for v in mem.values())
    assert mem["model_states"] == mem["params"] + mem["grads"] + mem["optimizer"]
    parts = ("model_states", "activations", "buffers", "overhead")
    assert sum(mem[k] or 0 for k in parts) == pytest.approx(mem["total"], abs=4)
    assert set(s["step"]) == {"compute", "bubble", "comm", "exposed_comm", "data", "total"}
    assert set(s["cost"]) == {
        "gpu_hours",
        "compute_usd",
        "comm_wait_usd",
        "failure_retry_usd",
        "total_usd",
    }
    assert set(s["checkpoint"]) >= {"interval_min", "expected_failures"}


def test_bare_parameter_count_has_no_activations():
    record = plan_record(make_plan(plan_inputs(**{"plan.params": 3_000_000_000})))
    assert record["inputs"]["shape"] is None
    assert all(s["memory_per_gpu"]["activations"] is None for s in record["strategies"])


# --- the run-time auto: the planner's search over what the runtime runs ----------------------

ALLOW = runtime_allowed("full", None)  # what auto may choose with the default parallel.shard


def _job_inputs(world: int, **flags):
    """llama-7b (micro-batch 1, bf16, AdamW) on `world` H100 workers, 8 a machine, as the
    runtime sees a job: the batch grows with the workers (no global batch)."""
    return replace(plan_inputs(**flags).with_gpus(world), global_batch=None)


def test_auto_on_two_machines_with_a_slow_link_shards_within_machines():
    # One replica (170.8 GB) does not fit 72 GB. With one 100 GbE NIC a machine (12.5 GB/s
    # for its 8 GPUs) fsdp over all 16 sends every gather across the network; shard groups
    # inside a machine do not.
    slow = {"cluster.inter_node_gbps": 12.5, "cluster.nics_per_node": 1}
    inputs = _job_inputs(16, **{"cluster.nodes": 2, **slow})
    d = decide_auto(inputs, runtime_allowed("full", None))
    dims = d.choice.dims
    assert (d.strategy, d.cpu_offload, dims.tp) == ("hsdp", False, 1)
    assert dims.dp_shard <= 8 and d.replicate == 16 // dims.dp_shard
    # fsdp-full crosses the NIC with bf16 gathers twice and fp32 gradients (8 bytes a
    # parameter), hsdp with the fp32 gradients alone (4).
    assert d.choice.plan.step.total < evaluate(inputs, "fsdp-full").step.total / 1.5
    assert d.reason.startswith("hsdp: ") and dims.describe() in d.reason


def test_auto_with_grad_op_keeps_it():
    inputs = _job_inputs(16, **{"cluster.nodes": 2, "cluster.inter_node_gbps": 12.5})
    d = decide_auto(inputs, runtime_allowed("grad_op", None))
    assert d.choice.dims.fsdp and not d.choice.dims.reshard_after_forward


def test_auto_keeps_a_given_shard_group():
    inputs = _job_inputs(16, **{"cluster.nodes": 2})
    d = decide_auto(inputs, runtime_allowed("full", 16))
    assert (d.strategy, d.choice.dims.dp_shard) == ("fsdp", 16)


def test_auto_weighs_ddp_against_sharding_when_a_replica_fits():
    # gpt2-124m fits one GPU, on two machines of one 25 GbE NIC each. At 16 sequences a
    # worker the step hides DDP's all-reduce. At 4 it does not, but NCCL's tree all-reduce
    # already reduces inside each machine before crossing, so the NIC carries what hsdp's
    # all-reduce across machines would: ddp, the simplest, stays within 1 % of the best.
    flags = {
        "cluster.nodes": 2, "model.name": "gpt2-124m",
        "cluster.inter_node_gbps": 3.125, "cluster.nics_per_node": 1,
    }
    big = decide_auto(_job_inputs(16, **flags, **{"data.micro_batch": 16}), ALLOW)
    small = decide_auto(_job_inputs(16, **flags, **{"data.micro_batch": 4}), ALLOW)
    assert (big.strategy, small.strategy) == ("ddp", "ddp")
    inputs = _job_inputs(16, **flags, **{"data.micro_batch": 4})
    ddp, hsdp = evaluate(inputs, "ddp"), evaluate(inputs, "hsdp")
    assert ddp.step.exposed_comm > 0.1 * ddp.step.total  # not hidden
    assert ddp.step.total <= 1.01 * hsdp.step.total


def test_auto_keeps_the_jobs_tensor_parallel_degree():
    # llama-70b on 64 GPUs: the planner's best uses tensor parallelism, but tp sets the
    # samples per step, so auto keeps the job's degree and lays out the rest around it.
    # (Checkpointing held at selective, the whole-block modes' best: with selective-op the
    # best needs no tp.)
    flags = {"model.name": "llama-70b", "parallel.ac": "full"}
    inputs = _job_inputs(64, **flags)
    assert recommend(inputs, replace(EVERYTHING, ac="selective")).dims.tp > 1
    assert decide_auto(inputs, runtime_allowed("full", None)).choice.dims.tp == 1
    d = decide_auto(inputs, runtime_allowed("full", None, tp=8))
    assert (d.choice.dims.tp, d.choice.dims.fsdp, d.choice.dims.world) == (8, True, 64)
    assert "tp 8" in d.reason


def test_accumulation_is_sharded_only_when_the_full_gradients_do_not_fit():
    # 16 H100s in two machines, 4 micro-batches a step. llama-7b keeps its full gradients
    # between micro-batches within 72 GB and reduce-scatters once; llama-13b's full
    # gradients (26 GB) do not fit beside the rest, so they are reduce-scattered every time.
    def job(model: str):
        return replace(_job_inputs(16, **{"model.name": model, "cluster.nodes": 2}), grad_accum=4)

    zero3 = ParallelDims(2, 8, fsdp=True)
    assert decide_auto(job("llama-7b"), ALLOW).choice.accumulate == "unsharded"
    assert choose_accumulation(job("llama-7b"), zero3, "none", 1, 4) == "unsharded"
    assert decide_auto(job("llama-13b"), ALLOW).choice.accumulate == "sharded"
    assert choose_accumulation(job("llama-13b"), zero3, "none", 1, 4) == "sharded"
    kept = decide_auto(job("llama-13b"), runtime_allowed("full", None, accumulate="unsharded"))
    assert kept.choice.accumulate == "unsharded" and not kept.choice.fits
