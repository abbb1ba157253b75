"""The planner's float8 (precision.float8, plan.model.float8): the block Linears' GEMMs at
the generation's fp8 share of the catalog's fp8 peak, the head and attention unchanged,
the casts priced as memory-bound work, FSDP's weight all-gather in 1 byte with tensorwise
float8_all_gather and not with rowwise, float8 in `plan --json`'s record, and the jobs
it cannot price refused in one line."""

from __future__ import annotations

import json

import pytest

from trainwise.cli.main import main
from trainwise.config import load_config
from trainwise.errors import ConfigError
from trainwise.hardware.catalog import find_gpu
from trainwise.plan.emit import job_config
from trainwise.plan.estimate import evaluate
from trainwise.plan.inputs import PLAN_DEFAULTS, resolve_inputs
from trainwise.plan.model import compute
from trainwise.plan.model.compute import MEMORY_SHARE, Work, _block_forward, compute_time
from trainwise.plan.model.float8 import (
    Float8,
    cast_bytes,
    float8_block_params,
    float8_linears,
)
from trainwise.plan.model.gemm import GENERATIONS, float8_generation, gemm_seconds
from trainwise.plan.model.memory import block_params
from trainwise.plan.model.precision import BYTES, FLOAT8_BYTES
from trainwise.plan.planner import make_plan
from trainwise.report.plan_view import headline


def job(**keys):
    """Llama 3 8B on 8 H100 (the catalog's), FSDP, seq 8192, local batch 2, bf16."""
    base = {"model.name": "llama3-8b", "data.seq_len": 8192, "data.micro_batch": 2,
            "data.global_batch": 16, "plan.gpus": 8, "cluster.gpu": "H100-SXM",
            "plan.tokens": 1e9}
    return resolve_inputs(load_config(None, {**base, **keys}, base=PLAN_DEFAULTS))


def test_a_large_block_gemm_runs_at_the_fp8_share_of_the_fp8_peak_on_an_h100():
    h100, gen = find_gpu("H100-SXM"), GENERATIONS["hopper"]
    hbm, n = h100.hbm_bytes_per_s, 16384
    bf16 = gemm_seconds(n, n, n, h100.peak("bf16"), hbm, 2, gen)
    fp8 = gemm_seconds(n, n, n, h100.peak("fp8"), hbm, 2, float8_generation(gen),
                       input_bytes=FLOAT8_BYTES)
    # About twice as fast: the fp8 peak is twice the bf16 one, at its own (lower) share.
    rates = (h100.peak("fp8") * gen.fp8_gemm_share) / (h100.peak("bf16") * gen.gemm_share)
    assert bf16 / fp8 == pytest.approx(rates, rel=0.03)
    assert 1.7 < bf16 / fp8 < 2.0


def test_a_generation_without_an_fp8_figure_keeps_hoppers_ratio():
    hopper, blackwell = GENERATIONS["hopper"], GENERATIONS["blackwell"]
    assert not blackwell.fp8_gemm_share
    derived = float8_generation(blackwell).gemm_share / blackwell.gemm_share
    assert derived == pytest.approx(hopper.fp8_gemm_share / hopper.gemm_share)


def test_float8_runs_the_block_gemms_only_not_the_head_or_attention(monkeypatch):
    inputs = job(**{"precision.float8": "tensorwise"})
    shape = inputs.workload.shape
    calls: list[tuple[int, int, int, int | None]] = []
    attention: list[float] = []
    real_gemm, real_attention = compute.gemm_seconds, compute.attention_seconds

    def gemm(m, n, k, *args, input_bytes=None, **kw):
        calls.append((m, n, k, input_bytes))
        return real_gemm(m, n, k, *args, input_bytes=input_bytes, **kw)

    def attend(flops, *args, **kw):
        attention.append(flops)
        return real_attention(flops, *args, **kw)

    monkeypatch.setattr(compute, "gemm_seconds", gemm)
    monkeypatch.setattr(compute, "attention_seconds", attend)
    compute._micro_batch.cache_clear()
    for f8 in (None, Float8("tensorwise", True)):
        compute._micro_batch(shape, 8192, 2, 1, inputs.hardware, "bf16", False, False, "none",
                             None, float8=f8)
    compute._micro_batch.cache_clear()
    f8_calls = [c for c in calls if c[3] == FLOAT8_BYTES]
    linears = {(o, i) for o, i, _ in float8_linears(shape, 1)}
    # Forward (T, out, in), input gradient (T, in, out), weight gradient (out, in, T).
    assert {(n, k) for m, n, k, _ in f8_calls if m == 16384} == linears | {
        (i, o) for o, i in linears}
    assert len(f8_calls) == 3 * len(float8_linears(shape, 1))  # each once, with float8
    vocab = shape.vocab_size
    assert not [c for c in f8_calls if vocab in c[:3]]  # the head stays 16-bit ...
    assert [c for c in calls if vocab in c[:3] and c[3] is None]  # ... and is priced
    half = len(attention) // 2  # the same attention FLOPs, with and without float8
    assert attention[:half] == attention[half:] and attention


def test_the_casts_are_priced_as_memory_bound_work():
    inputs = job(**{"precision.float8": "tensorwise"})
    shape, hw, tokens = inputs.workload.shape, inputs.hardware, 16384
    e = BYTES["bf16"]
    forward, backward = cast_bytes(shape, 1, tokens, "bf16", gathered_float8=False)
    weights = float8_block_params(shape, 1)
    inputs_in = sum(i for _, i, _ in float8_linears(shape, 1))
    outputs = sum(o for o, _, _ in float8_linears(shape, 1))
    # Each operand cast for every GEMM it enters: read twice (amax, cast), write 1 byte.
    assert forward == (2 * e + 1) * (tokens * inputs_in + weights)
    assert backward == (2 * e + 1) * (tokens * (2 * outputs + inputs_in) + weights)
    gathered = cast_bytes(shape, 1, tokens, "bf16", gathered_float8=True)
    assert gathered[0] == forward - (2 * e + 1) * weights  # the weight arrives in float8
    # The block's forward adds exactly the casts' bytes at the memory rate to its GEMMs.
    args = (shape, tokens, 8192, 1, hw, "bf16", False, False, None)
    with_casts = _block_forward(*args, float8=Float8("tensorwise", False))
    gemms = sum(compute._linear_gemm(tokens, o, i, hw, "bf16", None, True)
                for o, i, _ in float8_linears(shape, 1))
    plain = _block_forward(*args)
    plain_gemms = sum(compute._linear_gemm(tokens, o, i, hw, "bf16", None, False)
                      for o, i, _ in float8_linears(shape, 1))
    expected = plain.device_s - plain_gemms + gemms + forward / (hw.hbm_bps * MEMORY_SHARE)
    assert isinstance(with_casts, Work)
    assert with_casts.device_s == pytest.approx(expected, rel=1e-9)


def test_float8_speeds_up_a_step_but_less_than_its_gemms():
    bf16, f8 = job(), job(**{"precision.float8": "tensorwise"})
    w = bf16.workload
    plain = compute_time(bf16, w, 2, 1).seconds
    fast = compute_time(f8, f8.workload, 2, 1).seconds
    assert 1.1 < plain / fast < 1.9  # attention, the head and the casts stay


def gathered_bytes(inputs) -> float:
    plan = evaluate(inputs, "fsdp-full")
    (gather,) = [c for c in plan.collectives if c.name == "all-gather params"]
    return gather.wire_bytes


def test_fsdp_gathers_the_float8_weights_in_one_byte_with_tensorwise_only():
    bf16 = gathered_bytes(job())
    tensorwise = gathered_bytes(job(**{"precision.float8": "tensorwise"}))
    rowwise = gathered_bytes(job(**{"precision.float8": "rowwise"}))
    off = gathered_bytes(job(**{"precision.float8": "tensorwise",
                                "precision.float8_all_gather": False}))
    w = job().workload
    n, layers = w.params, w.shape.n_layer
    f8 = float8_block_params(w.shape, 1) * layers
    blocks = n - block_params(w)[1]
    again = (layers - 1) / layers  # the blocks gathered again for backward: all but the last
    # The block Linears (most of an 8B model, not its embeddings and head) move one byte of
    # two, in forward and again in backward; the root's are gathered once, in bf16.
    saved = f8 * (1 + again) / (2 * (n + again * blocks))
    assert tensorwise == pytest.approx(bf16 * (1 - saved), rel=1e-9)
    assert 0.5 < tensorwise / bf16 < 0.6
    assert rowwise == bf16 and off == bf16


def test_float8_gathered_weights_take_less_memory_when_every_block_stays_gathered():
    def buffers(**keys) -> float:  # FSDP without resharding after forward
        return evaluate(job(**keys), "fsdp-grad-op").memory.buffers

    bf16 = buffers()
    f8 = buffers(**{"precision.float8": "tensorwise"})
    rowwise = buffers(**{"precision.float8": "rowwise"})
    assert f8 < 0.65 * bf16 and rowwise == bf16


def test_plan_json_records_float8(capsys):
    assert main(["plan", "--json", "--model", "llama3-8b", "--gpus", "8", "--calibrate",
                 "none", "--set", "precision.float8=tensorwise"]) == 0
    inputs = json.loads(capsys.readouterr().out)["inputs"]
    assert (inputs["float8"], inputs["float8_all_gather"]) == ("tensorwise", True)
    assert inputs["gpu_fp8_peak_flops"] == pytest.approx(find_gpu("H100-SXM").peak("fp8"))


def test_a_given_peak_scales_the_fp8_peak_alike():
    hw = job(**{"precision.float8": "tensorwise", "cluster.gpu_tflops": 912.0}).hardware
    h100 = find_gpu("H100-SXM")
    assert hw.fp8_flops == pytest.approx(912e12 * h100.peak("fp8") / h100.peak("bf16"))


@pytest.mark.parametrize(("keys", "words"), [
    ({"cluster.gpu": "A100-80GB"}, "no fp8 peak for A100-80GB"),
    ({"model.name": "qwen3-30b-a3b"}, "trainwise's GPT"),
    ({"plan.params": 7e9, "model.name": "custom"}, "trainwise's GPT"),
    ({"lora.rank": 8}, "lora.rank = 8"),
])
def test_what_the_planner_cannot_price_in_float8_is_one_line(keys, words):
    with pytest.raises(ConfigError) as info:
        job(**{"precision.float8": "tensorwise", **keys})
    (line,) = info.value.problems
    assert line.startswith("precision.float8 = 'tensorwise'") and words in line



def test_the_headline_and_the_emitted_job_keep_float8():
    keys = {"model.name": "llama3-8b", "plan.gpus": 8, "precision.float8": "rowwise"}
    cfg = load_config(None, keys, base=PLAN_DEFAULTS)
    inputs = resolve_inputs(cfg)
    plan = make_plan(inputs)
    assert "bf16 + float8 rowwise" in headline(plan)
    emitted = job_config(cfg, plan.recommendation.choice, inputs)
    assert (emitted.precision.float8, emitted.precision.float8_all_gather) == ("rowwise", False)
