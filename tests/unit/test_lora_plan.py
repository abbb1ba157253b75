"""LoRA in the planner (plan.model.lora and what reads it: memory, FLOPs, communication,
the plan's outputs and checks). Expected values are worked out by hand in the comments on
a toy shape small enough to count every parameter."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainwise.cli.main import main
from trainwise.config import load_config
from trainwise.config.parallel_dims import ParallelDims
from trainwise.models.shapes import PRESETS, GPTShape
from trainwise.plan.emit import job_config
from trainwise.plan.inputs import PLAN_DEFAULTS, resolve_inputs
from trainwise.plan.model.comm import Layout, layout_collectives
from trainwise.plan.model.flops import flops_per_token, head_flops_per_token, recompute_factor
from trainwise.plan.model.lora import (
    DEFAULT_TARGETS,
    LoraPlan,
    adapter_activation_bytes,
    adapter_params,
    dropout_mask_bytes,
    first_block_bytes,
    head_input_bytes,
    param_counts,
    rank_split,
)
from trainwise.plan.model.memory import Workload, estimate_memory
from trainwise.plan.model.setup import Setup
from trainwise.plan.planner import make_plan
from trainwise.plan.search import search
from trainwise.report.analysis import analyse
from trainwise.report.run_view import render_text
from trainwise.report.rundir import load_run
from trainwise.report.summary import render_summary

# 2 layers, width 8, 2 heads, MLP 32 (gelu), vocabulary 16, 4 learned positions, untied,
# no biases. Each block: q, k, v, out 8 x 8 = 64 each (256), up 32 x 8 and down 8 x 32
# (512): 768 in its Linears, plus two layernorms of 8. The model: token embedding 16 x 8
# = 128, positions 4 x 8 = 32, 2 x (768 + 16) = 1568, final norm 8, head 128: 1864.
TOY = GPTShape(
    n_layer=2, d_model=8, n_head=2, n_kv_head=2, d_ff=32, vocab_size=16, max_seq_len=4,
    norm="layernorm", mlp="gelu", pos="learned", tie_embeddings=False, bias=False,
)
# Rank 2 on every Linear of a block (the defaults): r (in + out) = 2 x 16 = 32 for q, k,
# v and out (128), 2 x 40 = 80 for up and down (160): 288 a block, 576 in the model.
R2 = LoraPlan(rank=2)
BASE, ADAPTERS = 1864, 576


def test_toy_counts_by_hand():
    assert TOY.num_params() == BASE
    assert adapter_params(TOY, R2) == ADAPTERS
    assert param_counts(BASE, TOY, R2) == (ADAPTERS, BASE + ADAPTERS)
    # The head trains whole too: 576 + 128; the embeddings: + the token embedding's 128.
    assert param_counts(BASE, TOY, LoraPlan(2, train_head=True))[0] == 704
    assert param_counts(BASE, TOY, LoraPlan(2, train_embeddings=True, train_head=True))[0] == 832
    # Only the attention's query and value: 2 layers x (32 + 32) = 128.
    assert adapter_params(TOY, LoraPlan(2, targets=("q_proj", "v_proj"))) == 128


def test_llama_70b_rank_16_trains_207m_of_69b():
    # Per layer: q and o 16 x (8192 + 8192) = 262,144 each; k and v 16 x (8192 + 1024) =
    # 147,456 each; gate, up, down 16 x (8192 + 28672) = 589,824 each: 2,588,672; x 80
    # layers = 207,093,760 (PEFT prints the same for all-linear rank 16).
    shape = PRESETS["llama-70b"]
    trainable, total = param_counts(shape.num_params(), shape, LoraPlan(16))
    assert trainable == 207_093_760
    assert total == shape.num_params() + 207_093_760


def test_lora_flops_by_hand():
    # Matmul parameters (plan.flops): 1864 less the token embedding (a lookup, 128) and the
    # positions (32) = 1704. Full fine-tune at 4 tokens a sequence: 6 x 1704 + attention's
    # 12 x 2 layers x 8 x 4 = 768: 10,992.
    assert flops_per_token(TOY, 4) == 10_992
    # LoRA: every base parameter frozen, 4 FLOPs each (forward and the input gradient,
    # no weight gradient), the adapters 6: 4 x 1704 + 6 x 576 + 768 = 11,040.
    assert flops_per_token(TOY, 4, R2) == 11_040
    # The head trains: it keeps its weight gradient, 4 x 1576 + 6 x (128 + 576) + 768.
    assert flops_per_token(TOY, 4, LoraPlan(2, train_head=True)) == 11_296


def test_a_stage_without_the_head_drops_its_frozen_matmul():
    # The head's 16 x 8 = 128 matmul parameters: 6 FLOPs each when they train, 4 when
    # LoRA freezes them; a pipeline stage without the head does not run them.
    assert head_flops_per_token(TOY) == 768
    assert head_flops_per_token(TOY, R2) == 512
    assert head_flops_per_token(TOY, LoraPlan(2, train_head=True)) == 768


def test_llama_70b_lora_step_does_31_percent_fewer_flops():
    # Matmul parameters: 68,976,648,192 less the token embedding's 32000 x 8192 =
    # 68,714,504,192. Full: 6 x that + 12 x 80 x 8192 x 4096 (attention) =
    # 412,287,025,152 + 32,212,254,720 = 444,499,279,872. LoRA r16: 2 fewer per frozen
    # parameter (137,429,008,384) and 6 per adapter (6 x 207,093,760 = 1,242,562,560):
    # 308,312,834,048, 30.6 % fewer.
    shape = PRESETS["llama-70b"]
    full, lora = flops_per_token(shape, 4096), flops_per_token(shape, 4096, LoraPlan(16))
    assert (full, lora) == (444_499_279_872, 308_312_834_048)
    assert 1 - lora / full == pytest.approx(0.306, abs=5e-4)


def test_recomputation_costs_half_a_lora_step():
    # Full checkpointing runs the forward (2 a parameter) again: 8/6 of a full fine-tune's
    # step, 6/4 of LoRA's; selective on 2 layers recomputes 1: 1 + 1/2 x 2/4.
    assert recompute_factor("full", 2) == pytest.approx(4 / 3)
    assert recompute_factor("full", 2, lora=True) == 1.5
    assert recompute_factor("selective", 2, lora=True) == 1.25


def toy_memory(dims: ParallelDims, precision: str = "bf16", lora: LoraPlan | None = R2):
    w = Workload(BASE, TOY, seq_len=4, micro_batch=1, precision=precision, lora=lora)
    return estimate_memory(w, Setup.of(dims, w), "cpu")


def test_lora_memory_parts_by_hand():
    # One process in bf16: the frozen 1864 at 2 bytes (3728) and the 576 adapters at fp32
    # (2304): 6032 of parameters; gradients 576 x 4 = 2304; AdamW 576 x 8 = 4608.
    one = toy_memory(ParallelDims())
    assert (one.states, one.optimizer) == (6032 + 2304 + 4608, 4608)
    assert one.params == 6032
    # Full fine-tune: 1864 x (4 + 4 + 8) = 29,824 of states.
    assert toy_memory(ParallelDims(), lora=None).states == 29_824
    # FSDP over 2: every part halved (states 6472); DDP over 2 holds fp32 buckets for the
    # adapters' gradients only, the gradients themselves, in every phase (576 x 4 = 2304;
    # a full fine-tune's: 1864 x 4).
    fsdp = toy_memory(ParallelDims(dp_shard=2, fsdp=True))
    assert fsdp.states == (6032 + 2304 + 4608) / 2
    ddp = toy_memory(ParallelDims(dp_replicate=2), precision="fp32")
    assert (ddp.grads, ddp.buffers) == (2304, 0)  # (a CPU device: no cuBLAS workspace)
    assert toy_memory(ParallelDims(dp_replicate=2), "fp32", lora=None).grads == 1864 * 4
    # fp32: the frozen base stays 4 bytes: 1864 x 4 + 576 x 4 = 9760.
    assert toy_memory(ParallelDims(), precision="fp32").params == 9760


def test_lora_activation_terms_by_hand():
    # Per token and block, bf16 (2 bytes), TOY (h 8, f 32): lora_B keeps lora_A's 2-wide
    # output for q, k, v, out, up, down: 6 x 2 x 2 = 24.
    assert adapter_activation_bytes(TOY, R2, 2) == 24
    # Dropout 0.1 on CUDA (a byte of mask): each adapter keeps its dropped input and mask,
    # (2 + 1) x (8 x 5 + 32) = 216; out's and down's inputs are kept by nobody now
    # (-2 x 40); nor are the two norm outputs, read only by adapted layers (-2 x 2 x 8).
    drop = LoraPlan(2, dropout=0.1)
    assert adapter_activation_bytes(TOY, drop, 2, device="cuda") == 24 + 216 - 80 - 32
    # CPU's dropout keeps the noise in its input's dtype: (2 + 2) x 72 = 288.
    assert adapter_activation_bytes(TOY, drop, 2, device="cpu") == 24 + 288 - 80 - 32
    assert (dropout_mask_bytes("cuda", 4), dropout_mask_bytes("cpu", 2)) == (1, 2)
    # Under autocast with fp32 norm outputs each adapted reader drops its own bf16 cast:
    # q, k, v, up (2 + 4 - 2) x 8 = 32 each, out (2 + 2 - 2) x 8 = 16, down 2 x 32 = 64.
    autocast = adapter_activation_bytes(TOY, drop, 2, autocast=True, device="cpu", norm_bytes=4)
    assert autocast == 24 + 4 * 32 + 16 + 64
    # A frozen untied head keeps no input (2 x 8); an adapted or trained one does.
    assert head_input_bytes(TOY, R2, 2, "cuda") == 16
    assert head_input_bytes(TOY, LoraPlan(2, train_head=True), 2, "cuda") == 0
    assert head_input_bytes(TOY, LoraPlan(2, targets=("q_proj", "lm_head")), 2, "cuda") == 0
    # The first block's frozen layernorm saves nothing of its own (here 32), nor with
    # dropout q, k and v their masks (3 x 8 bytes); unless the embeddings train.
    assert first_block_bytes(TOY, R2, 32, 2, "cuda") == 32
    assert first_block_bytes(TOY, drop, 32, 2, "cuda") == 32 + 24
    assert first_block_bytes(TOY, LoraPlan(2, train_embeddings=True), 32, 2, "cuda") == 0


def test_tp_splits_adapters_like_their_base():
    # tp 2: q, k, v, up split their outputs (B), out and down their inputs (A), the other
    # factor whole: q 2 x (8 + 4) = 24 (x 3 with k and v), out 2 x (4 + 8) = 24, up
    # 2 x (8 + 16) = 48, down 2 x (16 + 8) = 48: 192 a block, 384 a rank.
    assert adapter_params(TOY, R2, tp=2) == 384
    assert rank_split(BASE, TOY, R2, tp=2)[1] == 384


def test_fsdp_gathers_everything_and_reduces_only_the_adapters():
    # FSDP over 2 (bf16, fp32 reduction), in 4 equal units: all-gather (1864 + 576) x 2
    # bytes in forward and 3/4 of it again in backward (the last unit stays gathered), x
    # 1/2; reduce-scatter 576 x 4 x 1/2. DDP: all-reduce 2 x 1/2 x 576 x 4.
    layout = Layout(gpus=2, gpus_per_node=2, intra_bps=1.0, inter_bps=1.0)
    frozen, trained = rank_split(BASE, TOY, R2)
    fsdp = ParallelDims(dp_shard=2, fsdp=True)
    gather, scatter = layout_collectives(
        fsdp, frozen + trained, layout, "bf16", "fp32", 1, units=4, trained=trained
    )
    assert gather.wire_bytes == pytest.approx((1 + 3 / 4) * 2440 * 2 / 2)
    assert scatter.wire_bytes == 576 * 4 / 2
    (reduce,) = layout_collectives(
        ParallelDims(dp_replicate=2), frozen + trained, layout, "bf16", "fp32", 1, trained=trained
    )
    assert reduce.wire_bytes == 2 * 576 * 4 / 2


def test_default_targets_are_the_runtimes():
    from trainwise.models.lora import DEFAULT_TARGETS as RUNTIME

    assert tuple(RUNTIME) == DEFAULT_TARGETS


def plan_of(**flags):
    return resolve_inputs(load_config(None, flags, base=PLAN_DEFAULTS))


SEVENTY_ON_FOUR = {
    "model.name": "llama-70b", "cluster.gpu": "H100-SXM", "plan.gpus": 4,
    "cluster.nproc": 4, "data.global_batch": 16, "plan.tokens": 1e8,
}


def test_lora_tunes_70b_on_four_h100s_where_a_full_fine_tune_does_not_fit():
    # Full: 16 bytes a parameter, 1.1 TB over 4 x 80 GB (and over the hosts' 1 TB).
    full = make_plan(plan_of(**SEVENTY_ON_FOUR))
    assert not full.best.fits
    # LoRA r16: 138 GB of bf16 base, 207M adapters (3.3 GB of states), sharded over 4.
    inputs = plan_of(**SEVENTY_ON_FOUR, **{"lora.rank": 16})
    lora = make_plan(inputs)
    assert lora.best.fits and lora.recommendation.choice.dims.fsdp
    fitting, _ = search(inputs)
    assert any(s.setup.dims.fsdp and not s.setup.dims.cpu_offload for s in fitting)
    # The headline says what trains.
    from trainwise.report.plan_view import headline

    assert "207.1M trainable of 69.18B parameters" in headline(lora)


def test_emit_keeps_the_lora_section():
    cfg = load_config(None, {**SEVENTY_ON_FOUR, "lora.rank": 16, "lora.alpha": 32.0,
                             "lora.targets": ["q_proj", "v_proj"]}, base=PLAN_DEFAULTS)
    inputs = resolve_inputs(cfg)
    choice = make_plan(inputs).recommendation.choice
    emitted = job_config(cfg, choice, inputs)
    assert (emitted.lora.rank, emitted.lora.alpha) == (16, 32.0)
    assert emitted.lora.targets == ["q_proj", "v_proj"]


def test_plan_json_records_trainable_and_total(capsys):
    args = ["plan", "--model", "llama-7b", "--gpus", "2", "--set", "lora.rank=8", "--json"]
    assert main(args) == 0
    record = json.loads(capsys.readouterr().out)["inputs"]
    # llama-7b rank 8, per layer: 4 x 8 x 8192 (q, k, v, o) + 3 x 8 x 15104 (gate, up,
    # down) = 262,144 + 362,496; x 32 layers = 19,988,480.
    assert record["trainable_params"] == 19_988_480
    assert record["total_params"] == record["params"] + 19_988_480
    assert record["lora_rank"] == 8


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--params", "7e9"], "bare parameter count"),
        (["--model", "tiny", "--set", "lora.targets=['nope']"], "'nope' matches no Linear"),
        (["--model", "tiny", "--set", "lora.rank=100"], "larger than a targeted layer"),
    ],
)
def test_what_the_planner_cannot_plan_is_one_line_and_exit_2(flags, words, capsys):
    base = ["plan", "--set", "lora.rank=8"]
    assert main([*base, *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0]


def test_the_train_summary_and_the_report_print_trainable_of_total(tmp_path: Path):
    summary = {"model": "llama-70b", "params": 68_976_648_192, "precision": "bf16",
               "trainable_params": 207_093_760, "total_params": 69_183_741_952}
    assert "207.1M trainable of 69.18B parameters (0.30 %)" in render_summary(summary)
    run = tmp_path / "run"
    run.mkdir()
    (run / "job.json").write_text(json.dumps({
        "world": 1, "device": "cpu", "strategy": "single", "params": 1864,
        "trainable_params": 576, "total_params": 2440, "precision": "fp32",
        "tokens_per_step": 8, "global_batch": 2,
    }))
    (run / "config.toml").write_text('[model]\nname = "tiny"\n[train]\nsteps = 1\n')
    (run / "metrics.jsonl").write_text(json.dumps({
        "step": 1, "attempt": 0, "time": 101.0, "elapsed": 1.0, "loss": 2.0,
        "step_time": 1.0, "tokens_per_s": 8.0, "samples_per_s": 2.0,
    }) + "\n")
    (run / "events.jsonl").write_text(
        json.dumps({"time": 100.0, "kind": "ready", "attempt": 0, "step": 0, "world": 1})
        + "\n" + json.dumps({"time": 101.0, "kind": "finish", "step": 1}) + "\n"
    )
    text = render_text(analyse(load_run(str(run))))
    assert "576 trainable of 2,440 parameters (23.61 %)" in text


def test_the_compute_model_skips_frozen_weight_gradients():
    # llama-70b on 8 H100s under FSDP, 4 sequences a GPU: the step saves less than the
    # FLOPs' 30.6 % (attention, the memory-bound work and the optimizer's pass over the
    # base stay, the adapters' thin GEMMs run at a low rate) but most of it: the frozen
    # layers' weight-gradient GEMMs, a third of the matmul time, are gone.
    from trainwise.plan.model.compute import compute_time

    base = {"model.name": "llama-70b", "plan.gpus": 8}
    full = plan_of(**base)
    lora = plan_of(**base, **{"lora.rank": 16})
    dims = ParallelDims(dp_shard=8, fsdp=True)
    t_full = compute_time(full, full.workload, 4, 1, dims).seconds
    t_lora = compute_time(lora, lora.workload, 4, 1, dims).seconds
    assert 1 - 0.306 < t_lora / t_full < 0.8
