"""Unit tests of trainwise.plan (memory, strategy advice, FLOPs, byte formatting) and of the
learning-rate schedule (trainwise.run.engine.optim.lr_factor). Expected values are worked out by
hand in the comments, from the formulas in the modules' docstrings."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from helpers import memory_of
from trainwise.config import load_config
from trainwise.config.parallel_dims import ParallelDims
from trainwise.config.schema import ScheduleConfig
from trainwise.errors import ConfigError
from trainwise.models.shapes import GPTShape
from trainwise.plan import (
    BYTES,
    OPTIMIZER_STATE_BYTES,
    MemoryEstimate,
    Workload,
    activation_bytes,
    decide_auto,
    flops_per_token,
    fmt_bytes,
    matmul_params,
    mfu,
    runtime_allowed,
)
from trainwise.plan.inputs import unknown_device_inputs
from trainwise.plan.model.memory import (
    CUBLAS_WORKSPACE_BYTES,
    LOSS_TENSORS,
    activation_bytes_per_token,
    activation_profile,
    block_params,
    loss_bytes,
)
from trainwise.run.engine.optim import lr_factor

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


def parts(est: MemoryEstimate) -> tuple:
    return (est.params, est.grads, est.optimizer, est.activations, est.buffers)


def test_precision_and_optimizer_bytes():
    assert BYTES == {"fp32": 4, "bf16": 2, "fp16": 2}
    # AdamW: exp_avg + exp_avg_sq in fp32 = 2 x 4; SGD momentum: one fp32 buffer.
    assert OPTIMIZER_STATE_BYTES == {"adamw": 8, "sgd": 4}


# --- estimate_memory, params = 1000, no shape, CPU kernels ------------------------------------


def test_single():
    # fp32 params 1000x4, grads 1000x4, AdamW 1000x8, activations unknown, no buffers. The
    # peak is the optimizer step, where all three exist: 16000.
    est = memory_of(W, "single", 1)
    assert parts(est) == (4000, 4000, 8000, None, 0)
    assert est.model_states == 16000
    assert (est.total, est.phase) == (16000, "optimizer step")


def test_ddp_keeps_its_gradients_in_its_buckets():
    # DDP's buckets, a fp32 copy of the gradients (1000x4), exist from wrapping on, and
    # the gradients are views of them (gradient_as_bucket_view): one copy, held from
    # backward through the optimizer step. 16000, as one process at its step.
    est = memory_of(W, "ddp", 2)
    assert parts(est) == (4000, 4000, 8000, None, 0)
    assert est.total == memory_of(W, "single", 1).total == 16000
    # Accumulating under no_sync writes fresh gradients beside the buckets: 4000 more.
    est = memory_of(W, "ddp", 2, grad_accum=2)
    assert parts(est) == (4000, 8000, 8000, None, 0)
    assert est.total == 20000
    # A world of one all-reduces nothing: no buckets, and no gradients in backward.
    assert memory_of(W, "ddp", 1) == memory_of(W, "single", 1)
    assert parts(memory_of(W, "single", 1)) == (4000, 4000, 8000, None, 0)  # at its step


def test_fsdp_full_on_world_4():
    # States / 4: 1000, 1000, 2000. Unknown structure -> the whole model is one unit: its
    # gathered fp32 parameters 1000x4 and its unsharded fp32 gradients 1000x4 = 8000 of
    # buffers. Peak at the end of its backward: 1000 + 2000 + 1000 + 4000 + 4000 = 12000.
    est = memory_of(W, "fsdp", 4, shard="full")
    assert parts(est) == (1000, 1000, 2000, None, 8000)
    assert (est.total, est.phase) == (12000, "end of a block's backward")


def test_hsdp_divides_by_the_shard_degree_not_the_world():
    # 4 workers as 2 replicas x 2 shards: states / 2: 2000, 2000, 4000; buffers as fsdp.
    est = memory_of(W, "hsdp", 4, shard_degree=2)
    assert parts(est) == (2000, 2000, 4000, None, 8000)
    assert est.total == 16000
    # Without a shard degree hsdp shards over the world, like fsdp.
    assert memory_of(W, "hsdp", 4) == memory_of(W, "fsdp", 4)


def test_cpu_offload_moves_the_states_to_the_host():
    est = memory_of(W, "fsdp", 4, cpu_offload=True)
    assert (est.params, est.grads, est.optimizer, est.buffers) == (0, 0, 0, 8000)
    assert est.total == 8000  # the unit's gathered parameters and its gradients
    assert est.host == 1000 + 1000 + 2000  # the sharded states, in host memory


def test_precision_changes_compute_copies_not_master_states():
    bf16 = replace(W, precision="bf16")
    # Master params, grads and optimizer state stay fp32.
    assert memory_of(bf16, "single", 1).states == memory_of(W, "single", 1).states
    # Autocast keeps a bf16 copy of every weight it cast (1920 x 2 = 3840) through backward:
    # SHAPE in bf16 peaks in the head's backward with params 7680 + AdamW 15360 +
    # activations 7168 (below) + the copies.
    single = memory_of(_gpt_workload(precision="bf16"), "single", 1)
    assert (single.phase, single.buffers, single.grads) == ("head backward", 3840, 0)
    assert single.total == 7680 + 15360 + 7168 + 3840
    # FSDP: gathered bf16 params 1000x2 + unsharded bf16 grads 1000x2 + their fp32 copy for
    # the fp32 reduce-scatter 1000x4 = 8000; with a bf16 reduce, no copy: 4000.
    assert memory_of(bf16, "fsdp", 4).buffers == 8000
    assert memory_of(replace(bf16, reduce_dtype="bf16"), "fsdp", 4).buffers == 4000


def test_adamw_vs_sgd_optimizer_bytes():
    sgd = replace(W, optimizer="sgd")
    assert memory_of(W, "single", 1).optimizer == 8000  # 1000 x 8
    assert memory_of(sgd, "single", 1).optimizer == 4000  # 1000 x 4
    assert memory_of(sgd, "fsdp", 4).optimizer == 1000  # 1000 x 4 / 4


def test_cuda_adds_the_context_fragmentation_foreach_temporaries_and_cublas_workspaces():
    # On CUDA AdamW runs foreach: one more fp32 value per parameter at the step, 4000, and
    # cuBLAS's two 32 MiB workspaces (forward and backward threads), so the peak is
    # 20000 + 64 MiB; then 1 GB of context + 5 % of the peak. CPU workers have none of it.
    est = memory_of(W, "single", 1, device="cuda")
    workspaces = 64 * 2**20
    assert est.peak == 20000 + workspaces
    assert est.overhead == 1e9 + 0.05 * (20000 + workspaces)
    assert est.total == est.peak + est.overhead
    assert memory_of(W, "single", 1).peak == 16000  # CPU
    assert memory_of(W, "single", 1).overhead == 0


def test_the_reserved_memory_is_the_total_without_the_cuda_context():
    # What torch.cuda.memory_stats' "reserved_bytes.all.peak" counts (torchtitan's logged
    # memory): the tensors and the allocator's fragmentation, not the driver's context.
    est = memory_of(W, "single", 1, device="cuda")
    assert est.context == 1e9
    assert est.reserved == pytest.approx(est.peak * 1.05, rel=1e-12)
    assert memory_of(W, "single", 1).reserved == memory_of(W, "single", 1).total  # CPU


def test_accumulating_micro_batches_keep_the_gradients_through_backward():
    # With grad_accum 2, the gradients of the first micro-batch are held while the second
    # runs backward: an unsharded GPT's backward phase then includes them.
    # SHAPE, fp32: params 7680 + AdamW 15360 + activations 10624 = 33664 in the top block's
    # backward; with accumulation the gradients (7680) are there too.
    w = _gpt_workload()
    one = memory_of(w, "single", 1)
    two = memory_of(w, "single", 1, grad_accum=2)
    assert (one.total, one.grads) == (33664, 0)
    assert (two.total, two.grads) == (33664 + 7680, 7680)
    assert two.phase == one.phase == "block backward"


def test_unknown_strategy_is_rejected():
    # The layout value reads the words; the memory model takes only layouts.
    with pytest.raises(ConfigError, match="'zero9' has no layout"):
        ParallelDims.from_strategy("zero9", 2)


# --- a GPT's blocks --------------------------------------------------------------------------


def _gpt_workload(shape: GPTShape = SHAPE, **kw) -> Workload:
    return Workload(params=shape.num_params(), shape=shape, seq_len=4, micro_batch=2, **kw)


SHAPE4 = replace(SHAPE, n_layer=4)


def test_block_and_root_params_by_hand():
    # A block: 2 layernorms 2x(8+8) = 32; attention 8x8 + 2x8x8 + 8x8 = 256 weights and
    # 8 + 16 + 8 = 32 biases; MLP 8x32 + 32x8 = 512 weights and 32 + 8 biases: 872.
    # Root: token embedding 16x8 + positions 4x8 + final norm 16 = 176 (the head is tied).
    assert SHAPE.num_params() == 2 * 872 + 176
    assert block_params(_gpt_workload()) == (872, 176)


def test_fsdp_full_and_grad_op_by_hand():
    # SHAPE4, fp32, world 4: states 3664 x (4 + 4 + 8) / 4 = 3664 + 3664 + 7328.
    # full: two gathered blocks 2x872x4 = 6976 + the root 176x4 = 704, one block's grads
    # 872x4 = 3488 -> buffers 11168. Activations (next section): head 18688, block 18944,
    # below the top block 12480. Phases: head 3664 + 7328 + 704 + 18688 = 30384; block
    # 11696 + 6976 + 18944 = 37616; end of a block's backward 14656 + 7680 + 3488 + 12480
    # = 38304 (the peak); optimizer step 14656.
    w = _gpt_workload(SHAPE4)
    full = memory_of(w, "fsdp", 4, shard="full")
    assert (full.params, full.grads, full.optimizer) == (3664, 3664, 7328)
    assert (full.buffers, full.activations) == (11168, 12480)  # as held at the peak
    assert (full.total, full.phase) == (38304, "end of a block's backward")
    # grad_op: every block stays gathered (3664 - 176) x 4 = 13952: buffers 13952 + 704 +
    # 3488 = 18144; end of a block's backward 14656 + 14656 + 3488 + 12480 = 45280.
    grad_op = memory_of(w, "fsdp", 4, shard="grad_op")
    assert (grad_op.buffers, grad_op.total) == (18144, 45280)


# --- activations -----------------------------------------------------------------------------


def test_activation_bytes_per_token_by_hand_fp32():
    # Per token, fp32 (4 bytes), h=8, q=kv=8, f=32, a=2, V=16, layernorm, no rope or GQA:
    # attention: norm in 32 + the linears' input 32 + SDPA's q, k, v (the projection
    #   outputs) 4x(8+16) = 96 + SDPA output 32 (the out projection's input: a view of it)
    #   + log-sum-exp 4x2 = 8 -> 200; MLP: norm 64 + gelu in and out 2x4x32 = 256 -> 320;
    #   block 520.
    # Head: norm 64 + log-softmax and two gradients of the fp32 loss 3x4x16 = 192 -> 256.
    # Working set of a block's backward: 2x4x32 + 4x8 = 288.
    # The parts tensor parallelism alone keeps whole: the two norms 2 x 64 = 128, the
    # head's norm 64, the residual 32; what sequence parallelism all-gathers: a norm's
    # output 4x8 = 32; one loss tensor 4x16 = 64; what a norm keeps of its own (its input)
    # 32.
    per = activation_bytes_per_token(SHAPE, "fp32", autocast=False)
    assert per == {
        "layer": 520, "block_input": 32, "head": 256, "working_set": 288,
        "norms": 128, "head_norm": 64, "residual": 32, "gathered": 32, "loss": 64,
        "norm_own": 32,
    }


def test_activation_bytes_by_hand_fp32():
    # 8 tokens; head backward 8 x (2x520 + 256) = 10368; the top block's backward
    # 8 x (2x520 + 288) = 10624, the peak.
    profile = activation_profile(_gpt_workload())
    assert (profile.head, profile.block, profile.rest) == (10368, 10624, 8 * 520)
    assert activation_bytes(_gpt_workload()) == 10624


def test_activation_bytes_by_hand_bf16():
    # FSDP mixed precision runs all in bf16: attention 16+16+48+16+8 = 104, MLP
    # 32+128 = 160, head 32 + 3x2x16 = 128, working set 128 + 16 = 144:
    # 8 x (2x264 + 144) = 5376.
    assert activation_bytes(_gpt_workload(precision="bf16")) == 5376
    # Autocast keeps the residual stream, the norms and the loss in fp32, and each linear
    # its own bf16 cast of a norm's output (q, k and v three): attention 32+3x16+48+16+8
    # = 152, MLP 32+16+128 = 176, head 48 + 3x4x16 = 240 -> 8 x (2x328 + 240) = 7168.
    assert activation_bytes(_gpt_workload(precision="bf16"), autocast=True) == 8 * (2 * (152 + 176) + 240)


def test_gpt_block_matches_korthikanti_without_scores_and_dropout():
    # Korthikanti et al. 2022, eq. 1: 34·s·b·h + 5·a·s²·b bytes per layer at 16-bit for a
    # GPT block (f = 4h, no GQA, learned positions) with dropout and unfused attention; of
    # the 34, two are dropout masks (sbh each, the attention's and the MLP's). SDPA drops
    # the a·s² terms and keeps q, k, v (their 4 + 2) and its output, which is the out
    # projection's input (2): without dropout 32h per token, plus the log-sum-exp (4 bytes
    # per head).
    for h, a in ((768, 12), (1024, 16), (4096, 32)):
        shape = replace(SHAPE, d_model=h, n_head=a, n_kv_head=a, d_ff=4 * h)
        per = activation_bytes_per_token(shape, "bf16", autocast=False)
        assert per["layer"] == 32 * h + 4 * a


def test_rope_and_gqa_change_what_sdpa_keeps():
    base = activation_bytes_per_token(SHAPE, "fp32", False)["layer"]
    # rope: SDPA keeps the rotated q and k and v, q + 2kv = 24 values as without it, but
    # the rotation's concatenation leaves q [B, H, T, D], so SDPA's output is too and the
    # out projection reads a contiguous copy of it: +8 x 4 bytes.
    rope = replace(SHAPE, pos="rope")
    assert activation_bytes_per_token(rope, "fp32", False)["layer"] == base + 32
    # GQA (one kv head of 4): SDPA keeps q and the repeated k and v, 3 x 8 = 24 values.
    gqa = replace(rope, n_kv_head=1)
    assert activation_bytes_per_token(gqa, "fp32", False)["layer"] == base + 32


def _saved_bytes_per_token(shape: GPTShape) -> float:
    """What autograd saves for one of trainwise's GPT blocks in bf16 (FSDP's compute, no
    autocast), a token: every tensor a backward node keeps, once per storage, less the
    block's parameters and buffers."""
    import torch

    from trainwise.models.gpt import Block

    block = Block(shape).to(torch.bfloat16)
    x = torch.randn(2, 32, shape.d_model, dtype=torch.bfloat16, requires_grad=True)
    own = {t.untyped_storage().data_ptr() for t in (*block.parameters(), *block.buffers())}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in own:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(x)
    return sum(saved.values()) / (2 * 32)


@pytest.mark.parametrize("pos, kv_heads", [("learned", 4), ("rope", 4), ("rope", 1)])
def test_a_blocks_activations_are_what_autograd_saves(pos: str, kv_heads: int):
    # The plan's `layer` against the tensors trainwise's block saves, measured: SDPA's output
    # is the out projection's input (a view) unless rope's concatenation reordered q (a
    # copy then), and SDPA keeps q, k, v (the repeated k and v with GQA). The plan had
    # counted a copy always and a fourth kv-sized tensor with rope: 2h bytes too many a
    # token for MPT's and Llama 2's blocks.
    shape = replace(SHAPE, d_model=256, n_head=4, n_kv_head=kv_heads, d_ff=1024,
                    vocab_size=512, max_seq_len=32, pos=pos,
                    norm="layernorm" if pos == "learned" else "rmsnorm",
                    mlp="gelu" if pos == "learned" else "swiglu", bias=pos == "learned")
    planned = activation_bytes_per_token(shape, "bf16", autocast=False, device="cpu")["layer"]
    assert planned == pytest.approx(_saved_bytes_per_token(shape), rel=0.002)


@pytest.mark.parametrize("kernel", ["standard", "fp32"])
def test_the_losss_tensors_at_its_backward_are_measured(kernel: str):
    # F.cross_entropy on bf16 logits (trainwise's under FSDP) or on their fp32 upcast
    # (torchtitan's loss of 2024: `pred.flatten(0, 1).float()`, the logits deleted before
    # backward): PyTorch's memory tracker's peak beyond the logits' own leaf is LOSS_TENSORS
    # of loss_bytes a vocabulary entry (3 x 2 and 3 x 4), at the log-softmax's backward.
    import torch
    import torch.nn.functional as F
    from torch.distributed._tools.mem_tracker import MemTracker

    tokens, vocab = 256, 2048
    leaf = torch.randn(tokens, vocab, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, vocab, (tokens,))
    tracker = MemTracker()
    tracker.track_external(leaf)
    with tracker:
        logits = leaf * 1  # the head's output
        loss = F.cross_entropy(logits.float() if kernel == "fp32" else logits, labels)
        del logits
        loss.backward()
    peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    per_entry = (peak - leaf.nbytes) / (tokens * vocab)
    assert per_entry == pytest.approx(LOSS_TENSORS[kernel] * loss_bytes(kernel, "bf16", False),
                                      rel=1e-3)


def test_the_loss_kernels_head_by_hand():
    # SHAPE in bf16 under FSDP (no autocast), per token: the final norm 16 + its output 16,
    # and over the vocabulary (16): standard 3 x 2 x 16 = 96; fp32 3 x 4 x 16 = 192; fused
    # 2 x 2 x 16 = 64 (the 16-bit logits kept and their new gradient).
    heads = {k: activation_bytes_per_token(SHAPE, "bf16", False, loss=k)["head"]
             for k in LOSS_TENSORS}
    assert heads == {"standard": 32 + 96, "fp32": 32 + 192, "fused": 32 + 64}
    # Under autocast the standard loss is fp32 already: fp32 changes nothing.
    autocast = {k: activation_bytes_per_token(SHAPE, "bf16", True, loss=k)["head"]
                for k in ("standard", "fp32")}
    assert autocast["standard"] == autocast["fp32"]


def test_cpu_rmsnorm_keeps_more_than_cuda():
    # CPU runs RMSNorm as composite ops: + 4h + 4 bytes per norm and token in fp32.
    rms = replace(SHAPE, norm="rmsnorm", bias=False)
    cuda = activation_bytes_per_token(rms, "fp32", False, device="cuda")
    cpu = activation_bytes_per_token(rms, "fp32", False, device="cpu")
    assert cpu["layer"] - cuda["layer"] == 2 * (4 * 8 + 4)


def test_activation_bytes_with_checkpointing_by_hand():
    # SHAPE4, fp32: block 520, block input 32, head 256, working set 288, 8 tokens.
    none = activation_bytes(_gpt_workload(SHAPE4, ac="none"))
    selective = activation_bytes(_gpt_workload(SHAPE4, ac="selective"))
    full = activation_bytes(_gpt_workload(SHAPE4, ac="full"))
    assert none == 8 * (4 * 520 + 288)
    # selective checkpoints blocks 0 and 2: the top block's backward holds 32 + 520 + 32 +
    # 520 + 288 = 1392; recomputing block 2 holds 32 + 520 + 520 + 288 = 1360.
    assert selective == 8 * 1392
    # full: recomputing block 3 holds three inputs 96 + 520 + 288 = 904, the peak.
    assert full == 8 * 904
    assert full < selective < none


def test_no_shape_means_no_activations():
    assert activation_bytes(W) is None
    assert memory_of(W, "single", 1).activations is None


def test_activations_enter_the_estimate():
    # SHAPE on fsdp x2 peaks at the end of the top block's backward (states 15360, gathered
    # and in-flight 11168, the bottom block's activations 4160 = 30688) rather than in it
    # (states without gradients 11520 + root and two blocks 7680 + 10624 = 29824).
    est = memory_of(_gpt_workload(), "fsdp", 2)
    assert (est.phase, est.activations, est.total) == ("end of a block's backward", 4160, 30688)


# --- decide_auto (the runtime's auto: the planner's search on the job's own knobs) ----------


def _auto(w: Workload, world: int, device_bytes: float, headroom: float, **kw):
    """`auto` on a device the catalog does not know (links free: the simplest that fits)."""
    device = kw.pop("device", "cpu")
    cfg = load_config(overrides=[f"parallel.headroom={headroom}"])
    inputs = unknown_device_inputs(cfg, w, world, 1, device_bytes, device)
    return decide_auto(inputs, runtime_allowed(kw.get("shard", "full"), None))


def test_world_1_that_fits_is_single():
    # Replica 16000 bytes; budget 100000 x (1 - 0.2) = 80000.
    d = _auto(W, 1, 100_000, 0.2)
    assert (d.strategy, d.cpu_offload) == ("single", False)
    assert d.budget_bytes == 80_000
    assert d.estimate == d.replica == memory_of(W, "single", 1)
    assert fmt_bytes(16000) in d.reason  # "16.0 KB"
    assert fmt_bytes(80_000) in d.reason  # "80.0 KB"


def test_world_2_that_fits_is_ddp():
    # Replica with its buckets 16000 bytes <= budget 80000; fsdp fits too but is not simpler.
    d = _auto(W, 2, 100_000, 0.2)
    assert (d.strategy, d.cpu_offload) == ("ddp", False)
    assert d.estimate.total == 16000
    assert "16.0 KB" in d.reason  # fmt_bytes(16000)
    assert "80.0 KB" in d.reason and "100.0 KB" in d.reason


def test_replica_too_big_but_sharded_fits_is_fsdp():
    # World 4: replica 16000 > budget 15000 >= fsdp full 12000 (over 2: 16000, no).
    d = _auto(W, 4, 15_000, 0.0)
    assert (d.strategy, d.cpu_offload, d.replicate) == ("fsdp", False, 1)
    assert d.estimate.total == 12000
    assert d.replica.total == 16000
    assert fmt_bytes(16000) in d.reason and fmt_bytes(12000) in d.reason


def test_shard_mode_is_passed_through():
    # SHAPE4 on world 4: grad_op 45280 (above) fits 50000; the replica (ddp: params and
    # optimizer 43968 + buckets 14656 + activations 18944 in backward) does not.
    d = _auto(_gpt_workload(SHAPE4), 4, 50_000, 0.0, shard="grad_op")
    assert (d.strategy, d.cpu_offload) == ("fsdp", False)
    assert not d.choice.dims.reshard_after_forward
    assert d.estimate.total == 45280


# What a GPU holds besides the model's own tensors: 1 GB of CUDA context, and cuBLAS's
# workspaces with their 5 % of fragmentation.
GPU_FIXED = 1e9 + 1.05 * CUBLAS_WORKSPACE_BYTES


def test_neither_fits_offloads_on_a_gpu():
    # On a GPU, GPU_FIXED + 5000 bytes: sharded needs GPU_FIXED + 12600, offloaded
    # GPU_FIXED + 8400: nothing fits, offload needs the least.
    d = _auto(W, 4, GPU_FIXED + 5_000, 0.0, device="cuda")
    assert (d.strategy, d.cpu_offload) == ("fsdp", True)
    assert d.estimate == memory_of(W, "fsdp", 4, cpu_offload=True, device="cuda")
    assert "may still not fit" in d.reason


def test_offload_that_fits_says_so():
    # SHAPE on 4 GPUs: fsdp full needs GPU_FIXED + 1.05 x 24576; offloaded GPU_FIXED +
    # 1.05 x 18816 (the states leave the device): GPU_FIXED + 20000 holds only the latter.
    w = _gpt_workload()
    full = memory_of(w, "fsdp", 4, device="cuda").total
    offloaded = memory_of(w, "fsdp", 4, cpu_offload=True, device="cuda").total
    assert offloaded < GPU_FIXED + 20_000 < full
    d = _auto(w, 4, GPU_FIXED + 20_000, 0.0, device="cuda")
    assert (d.strategy, d.cpu_offload, d.choice.fits) == ("fsdp", True, True)
    assert d.estimate.total == offloaded
    assert d.reason.startswith("fsdp with cpu offload: ")


def test_neither_fits_on_cpu_workers_says_it_may_not_fit():
    d = _auto(W, 4, 5_000, 0.0)
    assert (d.strategy, d.cpu_offload) == ("fsdp", False)  # nowhere to offload to
    assert d.estimate.total == 12000
    assert "may still not fit" in d.reason


def test_world_1_on_cpu_does_not_offload():
    d = _auto(W, 1, 5_000, 0.0)
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
