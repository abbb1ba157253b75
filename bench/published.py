"""The planner against published training runs: each run planned exactly as published
(model shape, GPUs, layout, micro-batch, sequence, activation checkpointing, precision)
on the named-strategy row, so that only the performance model is judged. Prints the
published and planned tokens/s per GPU, the fit verdict, memory where published, and the
mean absolute error of tokens/s.

    python bench/published.py

Needs nothing but the repository (no GPU, no network). The runs, each with its source:
- torchtitan, benchmarks/llama3_h100_202412_torchtitan.md: Llama 3.1 8B, FSDP, bf16,
  selective AC, seq 8192, local batch 2: 5,762 tokens/s/GPU and 82.4 GiB on 8 H100
  (Table 1), 5,605 and 67.0 GiB on 128 (Table 3); with torch.compile 6,667 / 77.0 GiB and
  6,514 / 62.0 GiB. Their H100s: 96 GB HBM2e at 2.4 TB/s, 500 W power limit, "the actual
  peak TFLOPs number is between SXM and NVL" (989 and 835 dense bf16, the H100 datasheet):
  planned at the middle, 912 (an assumption). Its RMSNorm is torchtitan's own composite
  fp32 chain (torchtitan/models/norms.py at the benchmark's commit 9dec370; the config's
  norm_type "rmsnorm"): eager runs it op by op, torch.compile fuses it. The Float8 and context-parallel rows are
  left out: the planner models neither.
- mosaicml/llm-foundry, scripts/train/benchmarking/README.md (Composer, FSDP FULL_SHARD,
  seq 2048; each row's table named in its source): on H100 80GB (amp_bf16, FSDP mixed
  precision DEFAULT: gradients reduced in fp32) MPT-7B at micro-batch 6 on 8 GPUs, 10,643
  tokens/s/GPU; MPT-13B at 2 on 64 GPUs, 4,800; MPT-1B at 14 on 8, 45,455; MPT-30B at 3 x
  21 accumulated, full AC, on 8, 2,002. On A100 80GB (amp_bf16, DEFAULT): MPT-1B 14 x 4,
  20,513; MPT-3B 10 x 2, 10,811; MPT-7B 6 x 2, 4,641 (8 GPUs each). On A100 40GB (bf16,
  PURE: reduced in bf16), full AC: MPT-7B at 18 on 64 GPUs, 3,665; MPT-13B at 14 on 32,
  1,998. MPT (scripts/train/yamls/pretrain/mpt-*.yaml): learned positions, LayerNorm without bias
  (the benchmark's low_precision_layernorm: one kernel), GELU MLP of 4d, tied embeddings,
  vocabulary 50,368; the loss is flash-attn's fused cross-entropy. Composer syncs every
  micro-batch of a model that is not DDP (composer/trainer/trainer.py: nullcontext, no
  no_sync), so FSDP reduce-scatters each micro-batch (`parallel.accumulate = sharded`).
- Llama 3 405B (Dubey et al., 2024, arXiv 2407.21783, Table 4): 16,384 H100 at TP 8 x PP 16
  x DP 128, seq 8192, 16 sequences per data-parallel rank, 400 TFLOPs per GPU (41 % MFU):
  400e12 over the planner's model FLOPs a token is the published tokens/s per GPU. Priced
  on its layout (a pipeline, so beside the named-row runs, not in their mean), from
  section 3.3.2: FSDP that shards gradients and optimizer state but does not reshard the
  parameters after forward; gradients accumulated over the micro-batches and
  reduce-scattered in fp32 (section 3.3.4); 16 micro-batches of one sequence (the
  micro-batch size is not published); an interleaved schedule (Interleaved1F1B) with 126
  blocks over the stages, the first and last rank one block fewer. Where the row departs
  from the paper, and why:
  - stages a rank: the paper's first stage on rank 0 holds only the embeddings and the
    last only the head, which with 126 blocks on 16 ranks means one block a stage, v = 8;
    trainwise's split gives every stage a block (models/stage_split.py), so v = 4, two
    blocks a stage (rank 0: 1 + 2 + 2 + 2 and the embeddings);
  - checkpointing: the paper trains "without activation checkpointing", having freed
    every stage's input and output tensors it does not need; trainwise's runtime keeps
    more a token and block (DTensor's sequence parallelism saves the gathered norm outputs
    whole, SDPA the repeated k and v of grouped-query attention), so without checkpointing
    the layout needs about 144 GiB a GPU; the row checkpoints every other block
    (selective), the lightest checkpointing trainwise offers short of none.

Mixture-of-Experts runs (MOE_RUNS), each priced on its published layout (plan.moe), their
mean error printed apart:
- NVIDIA-NeMo/Automodel, docs/performance-summary.mdx (DGX-H100, BF16; its recipe
  examples/llm_benchmark/qwen/qwen3_moe_30b_te_deepep.yaml): Qwen3-30B-A3B on 8 H100, FSDP2
  over the 8 with experts split 8 ways (EP 8), local batch 4 x 16 accumulated (global 512),
  seq 4096, activation checkpointing of every layer, bf16 parameters reduced in fp32
  (FSDP2Config's mixed precision), gradients kept unsharded between micro-batches
  (defer_fsdp_grad_sync), a balanced gate (its note: "Fake balanced gate is enabled",
  so moe.imbalance = 1), 12,040 tokens/s/GPU. Its kernels are Transformer Engine's
  (cuDNN attention, fused RMSNorm, the fused permutation) and DeepEP's dispatch: priced with
  attention = "fused" (FlashAttention-3's rate, plan.model.gemm.FUSED_ATTENTION_SHARE) and
  routing = "fused"; DeepEP's all-to-all as NCCL's (network.all_to_all). Its optimizer
  keeps bf16 states, which the planner's fp32 model states do not: the fit verdict is not
  judged (no memory is published).
Left out, and why: the same table's DeepSeek-V3 and Kimi K2 rows (multi-head latent
attention, not modelled by MoEShape, and pipeline stages, which the planner does not price
for a MoE model), GPT-OSS (attention sinks and sliding windows), Nemotron (Mamba layers);
Megatron-Core's Qwen3-235B and DeepSeek-V3 tables (yanring/Megatron-MoE-ModelZoo,
NVIDIA-NeMo/Megatron-Bridge docs/performance-summary.md: tensor parallelism or pipeline
stages, and FP8 for most); DeepSeek-V3's report (MLA, FP8, DualPipe, no per-GPU
throughput); torchtitan publishes no MoE table (its Llama 4 figure states no layout).
"""

from __future__ import annotations

import statistics
import sys
from dataclasses import dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from trainwise.config import load_config  # noqa: E402
from trainwise.config.parallel_dims import ParallelDims  # noqa: E402
from trainwise.models.shapes import GPTShape  # noqa: E402
from trainwise.plan.estimate import Setup, StrategyPlan, evaluate, price  # noqa: E402
from trainwise.plan.inputs import PLAN_DEFAULTS, resolve_inputs  # noqa: E402
from trainwise.plan.model.flops import model_flops_per_token  # noqa: E402


def _llama31_8b() -> GPTShape:
    # meta-llama/Llama-3.1-8B config.json: 32 layers, hidden 4096, 32 heads, 8 kv heads,
    # intermediate 14336, vocab 128256, untied, rope_theta 5e5.
    return GPTShape(32, 4096, 32, 8, 14336, 128256, 8192, "rmsnorm", "swiglu", "rope",
                    False, False, rope_theta=500000.0)


def _mpt(n_layer: int, d_model: int, n_head: int, seq: int = 2048) -> GPTShape:
    # Learned positions, no ALiBi: the benchmark's yamls set neither, and llm-foundry's
    # defaults are learned_pos_emb = True (models/mpt/configuration_mpt.py) and alibi =
    # False (models/utils/config_defaults.py).
    return GPTShape(n_layer, d_model, n_head, n_head, 4 * d_model, 50368, seq, "layernorm",
                    "gelu", "learned", True, False)


# llm-foundry's scripts/train/yamls/pretrain/mpt-*.yaml: (n_layers, d_model, n_heads).
MPT_1B, MPT_3B = _mpt(24, 2048, 16), _mpt(32, 2560, 20)
MPT_7B, MPT_13B, MPT_30B = _mpt(32, 4096, 32), _mpt(40, 5120, 40), _mpt(48, 7168, 56)


@dataclass(frozen=True)
class Run:
    name: str
    source: str
    shape: GPTShape
    gpu: str
    gpus: int
    strategy: str  # the planner's named row
    micro_batch: int
    seq_len: int
    ac: str
    tokens_per_s_per_gpu: float
    loss: str = "fused"  # the cross-entropy kernel the run used
    reduce_dtype: str = "bf16"  # FSDP's gradient reduction dtype
    norm_kernel: str = "fused"  # the run's norm: one kernel, or the composite fp32 chain
    device_memory_gb: float | None = None  # the run's GPUs, where not the catalog's
    peak_tflops: float | None = None
    hbm_gbps: float | None = None
    compile: bool = False  # torch.compile
    memory_gib: float | None = None  # published peak memory per GPU, GiB
    gpus_per_node: int = 8
    grad_accum: int = 1  # micro-batches per optimizer step
    # FSDP with grad_accum > 1: reduce-scatter every micro-batch ("sharded": Composer's
    # trainer syncs every micro-batch of a model that is not DDP) or once a step
    accumulate: str = "sharded"


GIB = 2**30
TORCHTITAN = "pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md"
FOUNDRY = "mosaicml/llm-foundry scripts/train/benchmarking/README.md"
H100_TABLE, A100_80_TABLE = ", H100 80GB BF16", ", A100 80GB (1600 Gbps RoCE)"
A100_40_TABLE = ", A100 40GB (1600 Gbps RoCE)"
# The torchtitan cluster's H100s (see above).
TITAN_GPU = {"device_memory_gb": 96, "peak_tflops": (989 + 835) / 2, "hbm_gbps": 2400}
TITAN_8B = {"shape": _llama31_8b(), "gpu": "H100-SXM", "strategy": "fsdp-full",
            "micro_batch": 2, "seq_len": 8192, "ac": "selective", "loss": "standard",
            "reduce_dtype": "fp32", "norm_kernel": "composite", **TITAN_GPU}
RUNS = [
    Run("Llama 3.1 8B, 8 H100, FSDP, selective AC", TORCHTITAN + " Table 1", gpus=8,
        tokens_per_s_per_gpu=5762, memory_gib=82.4, **TITAN_8B),
    Run("Llama 3.1 8B, 8 H100, FSDP, sel. AC, compile", TORCHTITAN + " Table 1", gpus=8,
        tokens_per_s_per_gpu=6667, memory_gib=77.0, compile=True, **TITAN_8B),
    Run("Llama 3.1 8B, 128 H100, FSDP, selective AC", TORCHTITAN + " Table 3", gpus=128,
        tokens_per_s_per_gpu=5605, memory_gib=67.0, **TITAN_8B),
    Run("Llama 3.1 8B, 128 H100, FSDP, sel. AC, compile", TORCHTITAN + " Table 3", gpus=128,
        tokens_per_s_per_gpu=6514, memory_gib=62.0, compile=True, **TITAN_8B),
    Run("MPT-7B, 8 H100, FSDP, no AC, mb 6", FOUNDRY + H100_TABLE, MPT_7B, "H100-SXM", 8,
        "fsdp-full", 6, 2048, "none", 10643, reduce_dtype="fp32"),
    Run("MPT-13B, 64 H100, FSDP, no AC, mb 2", FOUNDRY + H100_TABLE, MPT_13B, "H100-SXM", 64,
        "fsdp-full", 2, 2048, "none", 4800, reduce_dtype="fp32"),
    Run("MPT-1B, 8 H100, FSDP, no AC, mb 14", FOUNDRY + H100_TABLE, MPT_1B, "H100-SXM", 8,
        "fsdp-full", 14, 2048, "none", 45455, reduce_dtype="fp32"),
    Run("MPT-30B, 8 H100, FSDP, full AC, mb 3 x 21", FOUNDRY + H100_TABLE, MPT_30B,
        "H100-SXM", 8, "fsdp-full", 3, 2048, "full", 2002, reduce_dtype="fp32",
        grad_accum=21),
    Run("MPT-1B, 8 A100 80GB, FSDP, no AC, mb 14 x 4", FOUNDRY + A100_80_TABLE, MPT_1B,
        "A100-80GB", 8, "fsdp-full", 14, 2048, "none", 20513, reduce_dtype="fp32",
        grad_accum=4),
    Run("MPT-3B, 8 A100 80GB, FSDP, no AC, mb 10 x 2", FOUNDRY + A100_80_TABLE, MPT_3B,
        "A100-80GB", 8, "fsdp-full", 10, 2048, "none", 10811, reduce_dtype="fp32",
        grad_accum=2),
    Run("MPT-7B, 8 A100 80GB, FSDP, no AC, mb 6 x 2", FOUNDRY + A100_80_TABLE, MPT_7B,
        "A100-80GB", 8, "fsdp-full", 6, 2048, "none", 4641, reduce_dtype="fp32",
        grad_accum=2),
    Run("MPT-7B, 64 A100 40GB, FSDP, full AC, mb 18", FOUNDRY + A100_40_TABLE, MPT_7B,
        "A100-40GB", 64, "fsdp-full", 18, 2048, "full", 3665),
    Run("MPT-13B, 32 A100 40GB, FSDP, full AC, mb 14", FOUNDRY + A100_40_TABLE, MPT_13B,
        "A100-40GB", 32, "fsdp-full", 14, 2048, "full", 1998),
]


def plan_run(run: Run) -> StrategyPlan:
    """The named-strategy row of `run`, its inputs set as published."""
    keys = {
        **PLAN_DEFAULTS,
        "cluster.gpu": run.gpu,
        "cluster.nproc": run.gpus_per_node,
        "plan.gpus": run.gpus,
        "data.seq_len": run.seq_len,
        "data.micro_batch": run.micro_batch,
        "data.global_batch": run.micro_batch * run.grad_accum * run.gpus,
        "parallel.ac": run.ac,
        "precision.dtype": "bf16",
        "plan.strategy": run.strategy,
        # The fit verdict against the GPU's memory itself: a run that ran kept no margin
        # for later growth (the planner's default headroom is a user's safety choice).
        "parallel.headroom": 0.0,
        "parallel.accumulate": run.accumulate,
    }
    if run.device_memory_gb:
        keys["cluster.device_memory_gb"] = run.device_memory_gb
    if run.peak_tflops:
        keys["cluster.gpu_tflops"] = run.peak_tflops
    keys["train.compile"] = run.compile
    inputs = resolve_inputs(load_config(None, keys))
    if run.hbm_gbps:
        inputs = replace(inputs, hardware=replace(inputs.hardware, hbm_bps=run.hbm_gbps * 1e9))
    w = replace(
        inputs.workload, shape=run.shape, params=run.shape.num_params(), loss=run.loss,
        reduce_dtype=run.reduce_dtype, norm_kernel=run.norm_kernel,
    )
    inputs = replace(inputs, workload=w, model=run.name)
    return evaluate(inputs, run.strategy)


LLAMA3_405B = {
    "plan.layers": 126, "plan.hidden": 16384, "plan.heads": 128, "plan.kv_heads": 8,
    "plan.ffn": 53248, "plan.vocab": 128256, "data.seq_len": 8192, "data.global_batch": 2048,
    "plan.gpus": 16384, "cluster.gpu": "H100-SXM", "precision.dtype": "bf16",
    "parallel.headroom": 0.0,
}
LLAMA3_405B_TFLOPS_PER_GPU = 400.0  # arXiv 2407.21783, Table 4, 16,384 GPUs


def plan_llama3_405b() -> tuple[StrategyPlan, float]:
    """(the 405B run priced on its published layout, its published tokens/s per GPU)."""
    inputs = resolve_inputs(load_config(None, {**PLAN_DEFAULTS, **LLAMA3_405B}))
    w = inputs.workload
    dims = ParallelDims(1, 128, 8, 16, fsdp=True, reshard_after_forward=False)
    setup = Setup(dims, "selective", 1, 16, schedule="Interleaved1F1B", virtual=4)
    published = LLAMA3_405B_TFLOPS_PER_GPU * 1e12 / model_flops_per_token(
        w.params, w.shape, w.seq_len
    )
    return price(replace(inputs, model="Llama 3 405B"), setup), published


@dataclass(frozen=True)
class MoERun:
    """A published Mixture-of-Experts run: a MoE preset on its layout (ep included) and
    knobs, and the kernels it ran (memory.Workload's attention and routing)."""

    name: str
    source: str
    model: str  # a models.moe preset
    gpu: str
    gpus: int
    dims: ParallelDims
    micro_batch: int
    grad_accum: int
    seq_len: int
    ac: str
    tokens_per_s_per_gpu: float
    imbalance: float = 1.0  # a balanced gate, unless the run routed for real
    attention: str = "sdpa"
    routing: str = "eager"
    accumulate: str = "unsharded"
    reduce_dtype: str = "fp32"
    loss: str = "standard"


AUTOMODEL = ("NVIDIA-NeMo/Automodel docs/performance-summary.mdx, DGX-H100 BF16 "
             "(examples/llm_benchmark/qwen/qwen3_moe_30b_te_deepep.yaml)")
MOE_RUNS = [
    MoERun("Qwen3-30B-A3B, 8 H100, FSDP 8 x EP 8, full AC", AUTOMODEL, "qwen3-30b-a3b",
           "H100-SXM", 8, ParallelDims(1, 8, 1, ep=8, fsdp=True), 4, 16, 4096, "full", 12040,
           attention="fused", routing="fused"),
]


def plan_moe_run(run: MoERun) -> StrategyPlan:
    """`run` priced on its published layout and knobs."""
    keys = {
        **PLAN_DEFAULTS, "model.name": run.model, "cluster.gpu": run.gpu, "plan.gpus": run.gpus,
        "data.seq_len": run.seq_len, "data.micro_batch": run.micro_batch,
        "data.global_batch": run.micro_batch * run.grad_accum * run.dims.dp_size,
        "parallel.ac": run.ac, "precision.dtype": "bf16", "parallel.headroom": 0.0,
        "moe.imbalance": run.imbalance,
    }
    inputs = resolve_inputs(load_config(None, keys))
    w = replace(inputs.workload, loss=run.loss, reduce_dtype=run.reduce_dtype,
                attention=run.attention, routing=run.routing)
    setup = Setup(run.dims, run.ac, run.micro_batch, run.grad_accum, run.accumulate)
    return price(replace(inputs, workload=w, model=run.name), setup)


def print_moe_runs() -> None:
    """Each MoE run's published and planned tokens/s per GPU, and their mean error."""
    errors = []
    print(f"\n{'Mixture-of-Experts run':48} {'published':>9} {'planned':>9} {'error':>7}  "
          "fits  memory GiB  a2a exposed")
    for run in MOE_RUNS:
        plan = plan_moe_run(run)
        planned = plan.tokens_per_s / plan.gpus
        errors.append(abs(planned / run.tokens_per_s_per_gpu - 1))
        a2a = sum(c.seconds for c in plan.collectives if c.name.startswith("ep all-to-all"))
        print(
            f"{run.name:48} {run.tokens_per_s_per_gpu:>9,.0f} {planned:>9,.0f} "
            f"{planned / run.tokens_per_s_per_gpu - 1:>+7.1%}  {'yes' if plan.fits else 'NO ':4}  "
            f"{plan.memory.total / GIB:.1f} of {plan.budget_bytes / GIB:.1f}  "
            f"{a2a / plan.step.total:.0%} of the step"
        )
    print(f"mean absolute error of tokens/s over the MoE runs: {statistics.mean(errors):.1%} "
          f"over {len(MOE_RUNS)} run{'s' if len(MOE_RUNS) > 1 else ''}")


def main() -> int:
    errors, memory_errors = [], []
    print(f"{'run':48} {'published':>9} {'planned':>9} {'error':>7}  fits  memory GiB")
    for run in RUNS:
        plan = plan_run(run)
        planned = plan.tokens_per_s / plan.gpus
        error = planned / run.tokens_per_s_per_gpu - 1
        errors.append(abs(error))
        memory = f"{plan.memory.total / GIB:.1f} of {plan.budget_bytes / GIB:.1f}"
        if run.memory_gib:
            memory_errors.append(abs(plan.memory.total / GIB / run.memory_gib - 1))
            memory += f" (published {run.memory_gib:.1f}: {memory_errors[-1]:.1%} off)"
        print(
            f"{run.name:48} {run.tokens_per_s_per_gpu:>9,.0f} {planned:>9,.0f} "
            f"{error:>+7.1%}  {'yes' if plan.fits else 'NO ':4}  {memory}"
        )
    print(f"mean absolute error of tokens/s: {statistics.mean(errors):.1%} over {len(RUNS)} runs")
    if memory_errors:
        print(f"largest memory error where published: {max(memory_errors):.1%}")
    plan, published = plan_llama3_405b()
    planned = plan.tokens_per_s / plan.gpus
    print(
        f"{'Llama 3 405B, 16384 H100, TP8 x PP16 x DP128':48} {published:>9,.0f} "
        f"{planned:>9,.0f} {planned / published - 1:>+7.1%}  {'yes' if plan.fits else 'NO ':4}  "
        f"{plan.memory.total / GIB:.1f} of {plan.budget_bytes / GIB:.1f} (MFU {plan.mfu:.0%}, "
        "published 41 %)"
    )
    m = plan.memory
    parts = [("parameters", m.params), ("gradients", m.grads), ("optimizer", m.optimizer),
             ("activations", m.activations or 0.0), ("buffers", m.buffers),
             ("CUDA context and fragmentation", m.overhead)]
    print(f"  its peak, at {m.phase}: " + ", ".join(f"{k} {v / GIB:.1f}" for k, v in parts) + " GiB")
    print_moe_runs()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
