"""The planner prices Mixture-of-Experts models (plan/moe): memory by hand for three
layouts, the activations and the imbalance, the all-to-all on each link class, grouped
GEMMs, expert parallelism in the search (a case it wins and one it does not), and what it
refuses in one line."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from trainwise.cli.main import main
from trainwise.config import load_config
from trainwise.config.lineage import moe_keys
from trainwise.config.parallel_dims import ParallelDims
from trainwise.errors import ConfigError, ModelError
from trainwise.models.moe import MOE_PRESETS
from trainwise.models.moe.cost import layer_activation_bytes, param_split, routed_row_bytes
from trainwise.plan.estimate import Setup, price
from trainwise.plan.inputs import PLAN_DEFAULTS, resolve_inputs
from trainwise.plan.model.gemm import GENERATIONS, gemm_seconds, grouped_gemm_seconds
from trainwise.plan.model.memory import Workload, estimate_memory
from trainwise.plan.model.network import Fabric, Group, collective
from trainwise.plan.moe.comm import ALL_TO_ALL
from trainwise.plan.moe.memory import expert_layout, moe_activations
from trainwise.plan.search import recommend
from trainwise.plan.space import EVERYTHING, expert_degrees

TINY = MOE_PRESETS["moe-tiny"]
DENSE, EXPERTS = param_split(TINY).dense, TINY.expert_total()  # 70,976 and 98,304


def tiny(micro_batch: int = 8, ac: str = "none", imbalance: float = 1.0) -> Workload:
    return Workload(TINY.num_params(), None, 128, micro_batch, ac=ac, moe=TINY,
                    imbalance=imbalance)


def memory(dims: ParallelDims, w: Workload | None = None):
    w = w or tiny()
    return estimate_memory(w, Setup.of(dims, w), "cpu")


def test_model_states_of_three_layouts_by_hand():
    """fp32 AdamW: 16 bytes a parameter the rank holds."""
    single = memory(ParallelDims())
    assert single.states == 16 * (DENSE + EXPERTS)
    # DDP over 4 with the experts split 2 ways: each rank holds the dense parameters and
    # half of the experts, and DDP's buckets hold their gradients (as views) in every phase.
    ddp = memory(ParallelDims(dp_replicate=4, ep=2))
    assert ddp.states == 16 * (DENSE + EXPERTS / 2)
    assert (ddp.grads, ddp.buffers) == (4 * (DENSE + EXPERTS / 2), 0)
    # FSDP over 4, ep 2: the dense ones sharded 4 ways, each half of the experts over the
    # 4 / 2 = 2 ranks of its efsdp group; at the head's backward the root (embeddings,
    # final norm, head: 32,832) is gathered, and the last of the 2 blocks, kept gathered
    # since its forward: half of the blocks' dense 70,976 - 32,832 and of the rank's
    # 98,304 / 2 experts.
    fsdp = memory(ParallelDims(1, 4, ep=2, fsdp=True))
    assert expert_layout(ParallelDims(1, 4, ep=2, fsdp=True)).shard == 2
    assert fsdp.states == 16 * (DENSE / 4 + EXPERTS / 2 / 2)
    last_block = ((DENSE - 32_832) + EXPERTS / 2) / 2
    assert (fsdp.phase, fsdp.buffers) == ("head backward", 4 * (32_832 + last_block))


def test_activations_are_the_layers_and_the_head_per_token():
    w = tiny()

    def cpu_row(width: int) -> int:  # a CPU's composite RMSNorm in fp32: input, copy, rstd
        return 4 * width + 4 * width + 4

    layer = layer_activation_bytes(TINY, 1, compute_bytes=4, norm_row=cpu_row, micro_batch=8,
                                   seq_len=128)
    head = cpu_row(64) + 4 * 64 + 3 * 4 * 256  # the final norm, its output, the loss
    tokens = 128 * 8
    assert memory(ParallelDims()).activations == tokens * (2 * layer + head)
    # The busiest rank holds `imbalance` times the routed copies of the mean one.
    skewed = moe_activations(replace(w, imbalance=1.5), False, "cpu")
    extra = tokens * 2 * TINY.moe.top_k * 0.5 * routed_row_bytes(TINY, 4)
    assert skewed.head - moe_activations(w, False, "cpu").head == pytest.approx(extra)
    # Full checkpointing keeps each block's input, and recomputes one block at a time.
    full = moe_activations(replace(w, ac="full"), False, "cpu")
    assert full.head == tokens * (2 * 4 * 64 + head)
    assert full.block < moe_activations(w, False, "cpu").block


def test_all_to_all_on_each_link_class():
    """nccl-tests' bus bytes (n-1)/n x S; inside a node over NVLink, across the NICs."""
    fabric = Fabric(8, 400e9, 50e9, 8)
    inside = collective("all_to_all", 8e9, Group(8, 8), fabric)
    assert inside.bus_bytes == pytest.approx(7e9)
    assert inside.bandwidth_s == pytest.approx(7e9 / 400e9)
    across = collective("all_to_all", 8e9, Group(16, 8), fabric)
    # each of a node's 8 GPUs sends 8/16 of its 8 GB off the node through its 8 NICs
    assert across.inter_bytes == pytest.approx(8 * 8e9 * 8 / 16)
    assert across.bandwidth_s == pytest.approx(8 * 4e9 / (8 * 50e9))
    assert across.seconds > inside.seconds


def test_grouped_gemms_run_fewer_rows_an_expert_less_efficiently():
    gen, peak, hbm = GENERATIONS["hopper"], 989e12, 3.35e12
    one = grouped_gemm_seconds(1, 8192, 8192, 8192, peak, hbm, 2, gen)
    assert one == pytest.approx(gemm_seconds(8192, 8192, 8192, peak, hbm, 2, gen))
    # The same 8192 rows over 128 experts (64 each) against 8 experts (1024 each): the
    # small ones pad their tiles and read their weights for few rows.
    per_row_small = grouped_gemm_seconds(128, 64, 1536, 4096, peak, hbm, 2, gen) / (128 * 64)
    per_row_large = grouped_gemm_seconds(8, 1024, 1536, 4096, peak, hbm, 2, gen) / (8 * 1024)
    assert per_row_small > 2 * per_row_large


def plan_inputs(**keys):
    return resolve_inputs(load_config(None, {**PLAN_DEFAULTS, **keys}))


def test_imbalance_slows_the_step_and_the_all_to_all():
    inputs = plan_inputs(**{"model.name": "qwen3-30b-a3b", "plan.gpus": 8, "data.seq_len": 4096,
                            "data.global_batch": 64, "data.micro_batch": 2})
    setup = Setup(ParallelDims(1, 8, ep=8, fsdp=True), "full", 2, 4)
    even = price(replace(inputs, workload=replace(inputs.workload, imbalance=1.0)), setup)
    skew = price(replace(inputs, workload=replace(inputs.workload, imbalance=1.5)), setup)
    assert skew.step.compute > even.step.compute
    def a2a(plan):
        return next(c for c in plan.collectives if c.name == ALL_TO_ALL)

    assert a2a(skew).wire_bytes == pytest.approx(1.5 * a2a(even).wire_bytes)
    assert skew.step.exposed_comm > even.step.exposed_comm


def best_and_without_ep(ac: str | None = None, **keys):
    """The best plan and the best without ep, both without pipeline stages (what ep does
    to a layout's data-parallel ranks, not whether stages would serve better)."""
    inputs = plan_inputs(**keys)
    allowed = replace(EVERYTHING, pp_degree=1)
    allowed = replace(allowed, ac=ac) if ac else allowed
    return recommend(inputs, allowed), recommend(inputs, replace(allowed, ep_degree=1))


def test_expert_parallelism_wins_when_each_rank_routes_few_tokens():
    """Qwen3-30B-A3B on 64 H100, one 1024-token sequence a GPU: without ep each rank runs
    all 128 experts on 64 rows each (the grouped GEMMs read every expert's weights for few
    rows) and FSDP gathers every expert; ep splits the experts, so each of a rank's
    experts sees ep times the rows and only its slice is gathered, for an all-to-all of
    the rank's few tokens over NVLink."""
    best, flat = best_and_without_ep(**{"model.name": "qwen3-30b-a3b", "plan.gpus": 64,
                                        "data.seq_len": 1024, "data.global_batch": 64})
    assert best.fits and best.dims.ep > 1 and flat.dims.ep == 1
    assert best.plan.tokens_per_s > 1.3 * flat.plan.tokens_per_s


def test_expert_parallelism_does_not_win_with_few_large_experts():
    """Mixtral 8x7B on 64 H100, 8 x 4096 tokens a GPU: each of the 8 experts already sees
    8,192 rows (efficient GEMMs) and FSDP's gathers hide behind the compute, so ep only
    adds the all-to-all: within 1 % at best, and the simpler layout, ep 1, is chosen.
    Checkpointing is held at full, as both sides choose it without selective-op: with
    selective-op's larger activations, parameters kept gathered (fsdp-grad-op) fit beside
    ep's eighth of the experts only, a gain of memory rather than of the all-to-all's."""
    best, flat = best_and_without_ep("full", **{"model.name": "mixtral-8x7b", "plan.gpus": 64,
                                                "data.seq_len": 4096, "data.global_batch": 512})
    assert best.dims.ep == 1 and best.plan.tokens_per_s == flat.plan.tokens_per_s
    with_ep = [s for s in best.alternatives if s.setup is not None and s.setup.dims.ep > 1]
    assert with_ep and max(s.tokens_per_s for s in with_ep) < 1.01 * best.plan.tokens_per_s


def test_plan_json_gives_total_and_active_parameters(capsys):
    args = ["plan", "--model", "mixtral-8x7b", "--gpus", "16", "--json"]
    assert main(args) == 0
    record = json.loads(capsys.readouterr().out)
    moe = record["inputs"]["moe"]
    assert (moe["experts"], moe["top_k"]) == (8, 2)
    assert moe["total_params"] == record["inputs"]["params"] == 46_702_792_704
    assert moe["active_params"] == 12_879_925_248
    assert moe["imbalance"] == 1.25  # moe.imbalance's default
    assert record["inputs"]["shape"] is None


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--model", "mixtral-8x7b", "--set", "parallel.ep=3", "--gpus", "6"],
         "parallel.ep = 3 does not divide the 8 experts"),
        (["--model", "qwen3-30b-a3b", "--set", "parallel.ep=16", "--gpus", "8"],
         "parallel.ep = 16 does not divide the 8 data- and tensor-parallel ranks"),
        (["--model", "llama-7b", "--set", "parallel.ep=2"], "has none: use parallel.ep = 1"),
        (["--model", "qwen3-30b-a3b", "--gpus", "8", "--set", "parallel.tp=8"],
         "parallel.tp = 8 does not divide the key/value heads (n_kv_head) = 4"),
        (["--model", "qwen3-30b-a3b", "--layers", "4"], "drop them"),
        # Under tp and pp too (plan.moe.parallel): what the runtime cannot split.
        (["--model", "qwen3-235b-a22b", "--gpus", "16", "--set", "parallel.tp=8"],
         "parallel.tp = 8 does not divide the key/value heads (n_kv_head) = 4"),
        (["--model", "moe-tiny", "--gpus", "6", "--set", "parallel.pp=3"],
         "do not split the 2 blocks"),
        (["--model", "qwen3-30b-a3b", "--gpus", "16", "--set", "parallel.tp=2",
          "--set", "parallel.pp=2", "--set", "parallel.ep=16"],
         "parallel.ep = 16 does not divide the 8 data- and tensor-parallel"),
    ],
)
def test_what_the_planner_refuses_of_a_moe_is_one_line_and_exit_2(flags, words, capsys):
    assert main(["plan", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0]


def test_top_k_above_the_experts_is_refused_by_the_shape():
    with pytest.raises(ModelError, match="top_k = 9 exceeds the moe.experts = 8"):
        replace(TINY, moe=replace(TINY.moe, top_k=9))


def test_a_dense_model_with_ep_is_refused_from_python_too():
    with pytest.raises(ConfigError, match="has none"):
        plan_inputs(**{"model.name": "tiny", "parallel.ep": 2})


def test_the_imbalance_is_a_planner_key_outside_the_lineage():
    cfg = load_config(None, {"moe.imbalance": 1.6, "moe.aux_loss_coef": 0.01})
    assert moe_keys(cfg) == {"moe.aux_loss_coef": 0.01}
    with pytest.raises(ConfigError, match="moe.imbalance"):
        load_config(None, {"moe.imbalance": 0.5})  # the busiest rank has at least the mean


def test_an_hf_moe_directory_trainwise_builds_is_planned_by_its_shape(tmp_path, capsys):
    from helpers import tiny_moe

    folder = tiny_moe(tmp_path / "qwen3moe")
    args = ["plan", "--model", f"hf:{folder}", "--set", "model.impl=trainwise", "--gpus", "2",
            "--seq", "16", "--global-batch", "4", "--json"]
    assert main(args) == 0
    moe = json.loads(capsys.readouterr().out)["inputs"]["moe"]
    # tests/helpers.tiny_moe: 2 layers of 4 experts, top 2, heads of 16 on a width of 32
    assert (moe["layers"], moe["experts"], moe["top_k"], moe["head_dim"]) == (2, 4, 2, 16)
    assert moe["active_params"] < moe["total_params"]


def test_the_headline_says_total_and_active(capsys):
    assert main(["plan", "--model", "moe-tiny", "--gpus", "2", "--gpu", "cpu"]) == 0
    assert "moe-tiny (169,280 parameters, 95,552 active: 8 experts, top 2, imbalance 1.25)" in (
        " ".join(capsys.readouterr().out.split()))


def test_the_search_borrows_ep_from_tensor_parallel_ranks_as_the_runtime_does():
    """ep is borrowed from a stage's data- and tensor-parallel ranks (every tp rank routes
    its share of the tokens): FSDP over 4 x tp 2 offers ep 8 of 8 experts; a tp group with
    no data-parallel wrapper offers only what the runtime runs (ep 1 and ep = tp)."""
    inputs = plan_inputs(**{"model.name": "moe-tiny", "plan.gpus": 8})
    experts = inputs.workload.moe.moe.experts
    assert experts % 8 == 0
    assert 8 in expert_degrees(inputs, ParallelDims(1, 4, tp=2, fsdp=True), EVERYTHING)
    tp_only = ParallelDims(tp=4)
    offered = expert_degrees(inputs, tp_only, EVERYTHING)
    assert offered == [1, 4]
    with pytest.raises(ConfigError):  # the runtime refuses the one left out
        replace(tp_only, ep=2)


def test_fsdp_copies_of_a_moe_stage_once_a_step():
    """moe_per_step follows plan.model.compute.fsdp_rounds: every micro-batch without
    stages, once a step with them (the stage's experts and dense parameters stay gathered)."""
    from trainwise.plan.moe.compute import moe_per_step

    job = plan_inputs(**{"model.name": "moe-tiny", "plan.gpus": 8,
                         "cluster.gpu": "H100-SXM", "precision.dtype": "bf16"})
    w, hw = job.workload, job.hardware
    flat = ParallelDims(1, 8, ep=2, fsdp=True)
    staged = ParallelDims(1, 4, pp=2, ep=2, fsdp=True, reshard_after_forward=False)
    one, two, many = (moe_per_step(hw, w, flat, m) for m in (1, 2, 16))
    assert many.host_ops - one.host_ops == 15 * (two.host_ops - one.host_ops) > 0
    assert many.device_s - one.device_s == pytest.approx(15 * (two.device_s - one.device_s))
    assert moe_per_step(hw, w, staged, 16) == moe_per_step(hw, w, staged, 1)


def test_a_fused_attention_kernel_prices_no_gqa_repeat_in_a_moe_layer():
    """Qwen3-30B-A3B (32 query heads over 4): the fused kernel's layer moves 2 x 2 x 2
    bytes a query element less a token than SDPA's, which repeats k and v."""
    from trainwise.plan.moe.compute import Kernels, _layer_bytes

    shape = MOE_PRESETS["qwen3-30b-a3b"]
    q = shape.n_head * shape.head_dim
    sdpa, fused = (_layer_bytes(shape, True, 1.0, "bf16", False, Kernels(attention=a))
                   for a in ("sdpa", "fused"))
    assert sdpa - fused == 8 * q
