"""Unit tests of trainwise.plan (memory, strategy advice, FLOPs, byte formatting) and of the
learning-rate schedule (trainwise.run.optim.lr_factor). Expected values are worked out by
hand in the comments, from the formulas in the modules' docstrings."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from trainwise.config.schema import ScheduleConfig
from trainwise.models.shapes import GPTShape
from trainwise.plan import (
    BYTES,
    OPTIMIZER_STATE_BYTES,
    MemoryEstimate,
    Workload,
    activation_bytes,
    choose_strategy,
    estimate_memory,
    flops_per_token,
    fmt_bytes,
    matmul_params,
    mfu,
)
from trainwise.run.optim import lr_factor

# A model of 1000 parameters whose activations are not modelled.
W = Workload(params=1000, shape=None, seq_len=4, micro_batch=2)

# A hand-sized GPT: L=2, d=8, a=2 heads of 4, d_ff=32, V=16, T_max=4, GPT-2 style.
SHAPE = GPTShape(
    n_layer=2,
    d_model=8,
    n_head=2,
    n_kv_head=2,
    d_ff=32,
    vocab_size=16,
    max_seq_len=4,
    norm="layernorm",
    mlp="gelu",
    pos="learned",
    tie_embeddings=True,
    bias=True,
)


def _mem(params, grads, optimizer, activations, buffers) -> MemoryEstimate:
    return MemoryEstimate(params, grads, optimizer, activations, buffers)


def test_precision_and_optimizer_bytes():
    assert BYTES == {"fp32": 4, "bf16": 2, "fp16": 2}
    # AdamW: exp_avg + exp_avg_sq in fp32 = 2 x 4; SGD momentum: one fp32 buffer.
    assert OPTIMIZER_STATE_BYTES == {"adamw": 8, "sgd": 4}


# --- estimate_memory, params = 1000, no shape ------------------------------------------------


def test_single():
    # fp32 params 1000x4, grads 1000x4, AdamW 1000x8, no activations, no buckets.
    est = estimate_memory(W, "single", 1)
    assert est == _mem(4000, 4000, 8000, 0, 0)
    assert est.total == 16000


def test_ddp_adds_gradient_buckets():
    # As single, plus a flat fp32 copy of the gradients for the all-reduce: 1000x4.
    est = estimate_memory(W, "ddp", 2)
    assert est == _mem(4000, 4000, 8000, 0, 4000)
    assert est.total == 20000
    # A world of one all-reduces nothing.
    assert estimate_memory(W, "ddp", 1).buffers == 0


def test_fsdp_full_on_world_4():
    # States / 4: 4000/4, 4000/4, 8000/4. Unknown structure -> the whole model is one block;
    # full resharding holds the block in use and the prefetched one: 2 x 1000 x 4 bytes.
    est = estimate_memory(W, "fsdp", 4, shard="full")
    assert est == _mem(1000, 1000, 2000, 0, 8000)
    assert est.total == 12000


def test_fsdp_grad_op_on_world_4():
    # ZeRO-2: the gathered parameters stay between forward and backward: 1000 x 4 bytes.
    est = estimate_memory(W, "fsdp", 4, shard="grad_op")
    assert est == _mem(1000, 1000, 2000, 0, 4000)


def test_hsdp_divides_by_the_shard_degree_not_the_world():
    # 4 workers as 2 replicas x 2 shards: states / 2: 2000, 2000, 4000; buffers as fsdp.
    est = estimate_memory(W, "hsdp", 4, shard_degree=2)
    assert est == _mem(2000, 2000, 4000, 0, 8000)
    # Without a shard degree hsdp shards over the world, like fsdp.
    assert estimate_memory(W, "hsdp", 4) == estimate_memory(W, "fsdp", 4)


def test_cpu_offload_keeps_no_states_on_the_device():
    # Device: 2 x 1000 x 4 (blocks in flight) + 1000 x 4 (one block's fp32 grads) = 12000.
    est = estimate_memory(W, "fsdp", 4, cpu_offload=True)
    assert est == _mem(0, 0, 0, 0, 12000)


def test_precision_changes_compute_copies_not_master_states():
    bf16 = replace(W, precision="bf16")
    # Master params and grads stay fp32.
    assert estimate_memory(bf16, "single", 1) == estimate_memory(W, "single", 1)
    # FSDP's gathered blocks are in the compute dtype: 2 x 1000 x 2 bytes.
    assert estimate_memory(bf16, "fsdp", 4).buffers == 4000
    assert estimate_memory(bf16, "fsdp", 4, shard="grad_op").buffers == 2000


def test_adamw_vs_sgd_optimizer_bytes():
    sgd = replace(W, optimizer="sgd")
    assert estimate_memory(W, "single", 1).optimizer == 8000  # 1000 x 8
    assert estimate_memory(sgd, "single", 1).optimizer == 4000  # 1000 x 4
    assert estimate_memory(sgd, "fsdp", 4).optimizer == 1000  # 1000 x 4 / 4


def test_unknown_strategy_is_rejected():
    with pytest.raises(ValueError, match="unknown strategy"):
        estimate_memory(W, "zero9", 2)


# --- activation_bytes ------------------------------------------------------------------------


def _gpt_workload(shape: GPTShape = SHAPE, **kw) -> Workload:
    return Workload(params=shape.num_params(), shape=shape, seq_len=4, micro_batch=2, **kw)


def test_activation_bytes_by_hand_fp32():
    # s=4, b=2, h=8, a=2, L=2, V=16. s*b*h = 64; 34 + 5*a*s/h = 34 + 5*2*4/8 = 39.
    # fp32 doubles the paper's 16-bit counts: per layer 64 * 39 * 2 = 4992; two layers 9984.
    # Logits and their gradient in fp32: s*b*V*4*2 = 4*2*16*8 = 1024.
    assert activation_bytes(_gpt_workload()) == 9984 + 1024


def test_activation_bytes_by_hand_bf16():
    # Per layer 64 * 39 * 1 = 2496, two layers 4992; logits stay fp32: 1024.
    assert activation_bytes(_gpt_workload(precision="bf16")) == 4992 + 1024


def test_activation_bytes_with_checkpointing_by_hand():
    shape = replace(SHAPE, n_layer=4)
    # Per layer 4992 (fp32, as above); a block's input s*b*h*4 = 256; logits 1024.
    none = activation_bytes(_gpt_workload(shape, ac="none"))
    selective = activation_bytes(_gpt_workload(shape, ac="selective"))
    full = activation_bytes(_gpt_workload(shape, ac="full"))
    assert none == 4 * 4992 + 1024  # 20992
    # selective checkpoints blocks 0 and 2: two blocks keep everything, one checkpointed
    # block keeps its input, the other is recomputed in full during backward: 16256.
    assert selective == 2 * 4992 + 1 * 256 + 4992 + 1024
    # full: three saved inputs + the one block being recomputed: 6784.
    assert full == 3 * 256 + 4992 + 1024
    assert full < selective < none


def test_checkpointing_more_blocks_never_needs_more_memory_tiny_preset_depth():
    # L=2: full = 256 + 4992 = 5248, selective (block 0 only) = 4992 + 4992 = 9984,
    # none = 2 * 4992 = 9984 (+ logits in each).
    full = activation_bytes(_gpt_workload(ac="full"))
    selective = activation_bytes(_gpt_workload(ac="selective"))
    none = activation_bytes(_gpt_workload(ac="none"))
    assert full <= selective <= none


def test_no_shape_means_no_activations():
    assert activation_bytes(W) == 0.0


def test_activations_enter_the_estimate():
    w = _gpt_workload()
    assert estimate_memory(w, "single", 1).activations == 9984 + 1024


# --- choose_strategy -------------------------------------------------------------------------


def test_world_1_that_fits_is_single():
    # Replica 16000 bytes; budget 100000 x (1 - 0.2) = 80000.
    d = choose_strategy(W, 1, 100_000, 0.2)
    assert (d.strategy, d.cpu_offload) == ("single", False)
    assert d.budget_bytes == 80_000
    assert d.estimate == d.replica == estimate_memory(W, "single", 1)
    assert fmt_bytes(16000) in d.reason  # "16.0 KB"
    assert fmt_bytes(80_000) in d.reason  # "80.0 KB"


def test_world_2_that_fits_is_ddp():
    # Replica with buckets 20000 bytes <= budget 80000.
    d = choose_strategy(W, 2, 100_000, 0.2)
    assert (d.strategy, d.cpu_offload) == ("ddp", False)
    assert d.estimate.total == 20000
    assert "20.0 KB" in d.reason  # fmt_bytes(20000)
    assert "80.0 KB" in d.reason and "100.0 KB" in d.reason


def test_replica_too_big_but_sharded_fits_is_fsdp():
    # World 4: replica 20000 > budget 15000 >= fsdp full 12000.
    d = choose_strategy(W, 4, 15_000, 0.0)
    assert (d.strategy, d.cpu_offload) == ("fsdp", False)
    assert d.estimate.total == 12000
    assert d.replica.total == 20000
    assert fmt_bytes(20000) in d.reason and fmt_bytes(12000) in d.reason


def test_shard_mode_is_passed_through():
    # grad_op on world 4: 1000 + 1000 + 2000 + 4000 = 8000 fits 9000; full (12000) would not.
    d = choose_strategy(W, 4, 9_000, 0.0, shard="grad_op")
    assert (d.strategy, d.cpu_offload) == ("fsdp", False)
    assert d.estimate.total == 8000


def test_neither_fits_offloads_when_allowed():
    # Sharded 12000 > 5000; offloaded 12000 > 5000 too (unknown structure): may not fit.
    d = choose_strategy(W, 4, 5_000, 0.0, allow_offload=True)
    assert (d.strategy, d.cpu_offload) == ("fsdp", True)
    assert d.estimate == estimate_memory(W, "fsdp", 4, cpu_offload=True)
    assert "may still not fit" in d.reason
    assert fmt_bytes(12000) in d.reason


def test_offload_that_fits_says_so():
    # A GPT workload of 10000 params with SHAPE's structure (V*d = 128, L = 2):
    # largest unit max((10000 - 128) / 2, 128) = 4936 params; activations 11008 (above).
    w = Workload(params=10_000, shape=SHAPE, seq_len=4, micro_batch=2)
    # fsdp full, world 4: 10000 + 10000 + 20000 + 11008 + 2*4936*4 (=39488) = 90496.
    # offload: 11008 + 39488 + 4936*4 (=19744) = 70240.
    assert estimate_memory(w, "fsdp", 4).total == 90496
    d = choose_strategy(w, 4, 80_000, 0.0)
    assert (d.strategy, d.cpu_offload) == ("fsdp", True)
    assert d.estimate.total == 70240
    assert "and fits" in d.reason
    assert fmt_bytes(70240) in d.reason and fmt_bytes(90496) in d.reason


def test_neither_fits_without_offload_says_it_may_not_fit():
    d = choose_strategy(W, 4, 5_000, 0.0, allow_offload=False)
    assert (d.strategy, d.cpu_offload) == ("fsdp", False)
    assert d.estimate.total == 12000
    assert "may still not fit" in d.reason


def test_world_1_without_offload_target_does_not_offload():
    d = choose_strategy(W, 1, 5_000, 0.0, allow_offload=False)
    assert d.cpu_offload is False


# --- FLOPs -----------------------------------------------------------------------------------


def test_num_params_of_the_hand_sized_shape():
    # norm (layernorm + bias) 2*8 = 16; attention 4 * 8*8 = 256 + biases 8+16+8 = 288;
    # mlp 8*32 + 32*8 = 512 + biases 32+8 = 552; block = 2*16 + 288 + 552 = 872.
    # token embedding 16*8 = 128, final norm 16, positions 4*8 = 32:
    # 128 + 2*872 + 16 + 32 = 1920 (tied head: no extra).
    assert SHAPE.num_params() == 1920


def test_matmul_params_excludes_lookups():
    # Tied, learned positions: the position table (32) is a lookup; the token table is the
    # LM head, so it counts: 1920 - 32 = 1888.
    assert matmul_params(SHAPE) == 1888
    # Untied: one more 128-weight table, and the input one is a lookup: 2048 - 128 - 32.
    untied = replace(SHAPE, tie_embeddings=False)
    assert untied.num_params() == 2048
    assert matmul_params(untied) == 1888
    # Rotary positions have no table: 1920 - 32 = 1888 parameters, all of them matmuls.
    rope = replace(SHAPE, pos="rope")
    assert rope.num_params() == 1888
    assert matmul_params(rope) == 1888


def test_flops_per_token_by_hand():
    # 6 * 1888 + 12 * L * d * T = 11328 + 12 * 2 * 8 * 4 (= 768) = 12096.
    assert flops_per_token(SHAPE, 4) == 12096
    # Twice the context: attention term doubles: 11328 + 1536.
    assert flops_per_token(SHAPE, 8) == 12864


def test_mfu_arithmetic():
    # 1000 tok/s x 6e9 FLOP/token = 6e12 FLOP/s of a 1.2e13 peak: 0.5.
    assert mfu(1000.0, 6e9, 1.2e13) == pytest.approx(0.5)
    assert mfu(0.0, 6e9, 1.2e13) == 0.0


@pytest.mark.parametrize(
    ("n", "text"),
    [
        (0, "0 B"),
        (999, "999 B"),
        (1000, "1.0 KB"),
        (1500, "1.5 KB"),
        (2_500_000, "2.5 MB"),
        (80e9, "80.0 GB"),
        (3e12, "3.0 TB"),
        (-2000, "-2.0 KB"),
    ],
)
def test_fmt_bytes_units(n, text):
    assert fmt_bytes(n) == text


# --- lr_factor -------------------------------------------------------------------------------


def _sched(**kw) -> ScheduleConfig:
    return ScheduleConfig(**kw)


def test_warmup_is_linear():
    cfg = _sched(warmup_steps=4, decay="cosine", min_lr_ratio=0.1)
    # (step + 1) / 4 for steps 0..3.
    assert [lr_factor(s, 100, cfg) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]


def test_decay_starts_at_peak_after_warmup():
    for decay in ("cosine", "linear", "constant"):
        cfg = _sched(warmup_steps=4, decay=decay, min_lr_ratio=0.1)
        assert lr_factor(4, 100, cfg) == pytest.approx(1.0)


@pytest.mark.parametrize("decay", ["cosine", "linear"])
def test_last_step_reaches_min_lr_ratio(decay):
    cfg = _sched(warmup_steps=4, decay=decay, min_lr_ratio=0.1)
    assert lr_factor(99, 100, cfg) == pytest.approx(0.1)


def test_cosine_and_linear_midpoints_by_hand():
    # total 13, warmup 2: span = 13 - 2 - 1 = 10; step 7 is progress 5/10 = 0.5.
    cos = _sched(warmup_steps=2, decay="cosine", min_lr_ratio=0.2)
    lin = _sched(warmup_steps=2, decay="linear", min_lr_ratio=0.2)
    # cosine: 0.5 * (1 + cos(pi/2)) = 0.5; linear: 1 - 0.5 = 0.5; 0.2 + 0.8 * 0.5 = 0.6.
    assert lr_factor(7, 13, cos) == pytest.approx(0.6)
    assert lr_factor(7, 13, lin) == pytest.approx(0.6)
    # progress 0.2 (step 4): cosine 0.5 * (1 + cos(0.2 pi)); linear 0.8.
    assert lr_factor(4, 13, cos) == pytest.approx(0.2 + 0.8 * 0.5 * (1 + math.cos(0.2 * math.pi)))
    assert lr_factor(4, 13, lin) == pytest.approx(0.2 + 0.8 * 0.8)


def test_constant_stays_at_peak():
    cfg = _sched(warmup_steps=3, decay="constant", min_lr_ratio=0.1)
    assert [lr_factor(s, 20, cfg) for s in range(3, 20)] == [1.0] * 17


def test_no_warmup_starts_at_peak():
    cfg = _sched(warmup_steps=0, decay="linear", min_lr_ratio=0.0)
    # span = 11 - 0 - 1 = 10: step 0 -> 1.0, step 10 -> 0.0.
    assert lr_factor(0, 11, cfg) == 1.0
    assert lr_factor(10, 11, cfg) == pytest.approx(0.0)
