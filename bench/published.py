"""The planner against published training runs, each run a `trainwise plan` command line a
user can type: its model, GPUs, layout, micro-batch, accumulation (as the global batch),
sequence, activation checkpointing and precision as published, and the kernels and
hardware figures the run names as job keys (model.norm_impl, optim.implementation,
plan.loss_kernel, cluster.hbm_gbps, cluster.gpu_tflops, ...). Each line is parsed by the
CLI's own parser and planned by trainwise.api.plan_job in this process, at the default
headroom; the configuration it recommends (everything pinned, so the published one: the
bench checks that) is compared with the run: tokens/s per GPU, memory per GPU where
published, and whether a run that ran fits (and one that ran out of memory does not).

    python bench/published.py             # every row, the held-out ones apart
    python bench/published.py --tuning    # without the held-out rows (see below)
    python bench/published.py --compact   # one line a run

Needs nothing but the repository (no GPU, no network). Every line ends in `--calibrate
none`: the formulas, not a calibration this machine may hold. Prints each command with
its result, the mean absolute error of tokens/s over the runs, the largest memory error
where published, and the runs that ran but would not fit. Exits 1 when a judged check
fails: a run the source reports out of memory planned to fit, or a pinned figure that the
published pair it comes from no longer gives (QWEN3_235B_DROPLESS, printed STALE).

HELD-OUT rows (`held_out=True`) judge the model: they were chosen before the model changed
and not looked at while it did (`--tuning` leaves them out); their error is printed apart.
The float8 rows are FLOAT8_RUNS (precision.float8 = "tensorwise", as torchtitan ran them
and `trainwise train` runs it).

The runs, each with its source:

- torchtitan, benchmarks/llama3_h100_202412_torchtitan.md (torch 1963fc8, torchtitan
  9dec370): Llama 3.1 8B, FSDP, bf16, seq 8192, local batch 2, 5,762 tokens/s/GPU and
  82.4 GiB on 8 H100 (Table 1), 5,605 and 67.0 GiB on 128 (Table 3); with torch.compile
  6,667 / 77.0 and 6,514 / 62.0. Their H100s: "96GB HBM2e with 2.4 TB/sec", "the default
  500W power limit", "the actual peak TFLOPs number is between SXM and NVL" (989 and 835
  dense bf16, the H100 datasheets): --gpu-tflops 912, the middle (an assumption: the clock
  those GPUs hold at 500 W is not published; cluster.sustained_clock_mhz would take it),
  --gpu-mem-gb 96, cluster.hbm_gbps = 2400. train_configs/llama3_8b.toml at 9dec370:
  norm_type "rmsnorm" (torchtitan/models/norms.py: the composite fp32 chain,
  model.norm_impl = composite), activation_checkpoint mode "selective" with
  selective_ac_option "op" (per-operation: `--ac selective-op`), AdamW foreach (torch's
  CUDA default: `--optimizer.fused` was off unless typed until torchtitan's 6e4988550,
  2025-02-24, "use Fused AdamW as default": optim.implementation = foreach),
  mixed_precision_reduce float32. Its loss (train.py at 9dec370): F.cross_entropy on the
  logits upcast to fp32, `pred.flatten(0, 1).float()`, eager: e8977b0 (2024-12-18,
  "turning off compile on loss function") had commented its compile out, so even the
  compiled rows keep three fp32 tensors over the vocabulary at the head's backward
  (plan.loss_kernel = fp32). Its memory column is what train.py logs as memory,
  torchtitan/metrics.py's max_reserved_gib: the caching allocator's peak reserved bytes
  (`reserved_bytes.all.peak`), which count no CUDA context; the bench compares it with the
  plan's estimate less the context (MemoryEstimate.reserved).
- torchtitan, docs/performance.md at 157a12c56 (April 2024; 3faaa1a0d adds the 405B
  table), FSDP2 on 64 A100 80GB, bf16, reduce fp32, no compile: Llama 2 13B (seq 4096,
  local batch 2; train_configs/llama_13b.toml: norm_type "fused_rmsnorm", a Triton
  kernel: fused) without AC 2,162 tokens/s/GPU, selective layer 1,914 (every other
  block: trainwise's "selective"; the int option's value is not in the table, 2 assumed),
  selective op 1,904; Llama 2 70B (llama_70b.toml: "rmsnorm", composite) local batch 2 full
  AC 353, local batch 1 selective op 355, local batch 2 selective layer and selective op
  "OOM" (they did not run: the planner must say they do not fit); Llama 3 8B (seq 8192,
  local batch 1, "fused_rmsnorm") selective op 2,973, selective layer 2,904 (held out);
  Llama 3 70B ("rmsnorm") local batch 1 full AC 331. The interconnect of that A100 cluster
  is not stated: the planner's default (400 Gb/s a GPU). Llama 3.1 405B on 128 H100
  ("94GB", "HBM2e based lower TDP SXM H100", as above: 912 TFLOPS, 2.4 TB/s), FSDP 16 x
  TP 8, local batch 2, full AC, train_configs/llama3_405b.toml at 3faaa1a0d: compile on,
  norm "rmsnorm", no float8 in the first row: 109 tokens/s/GPU. Those models upcast their
  logits to fp32 in forward (`self.output(h).float()`, models/llama/model.py at 157a12c56
  and 3faaa1a0d; moved into the loss by e10cb94): plan.loss_kernel = fp32. At 157a12c56
  train.py also kept the fp32 logits referenced through backward (no `del pred`), 4 bytes
  an entry the key does not count: only those rows' fit is published.
- Float8 (FLOAT8_RUNS; torchao's tensorwise recipe, FSDP's float8 all-gather, the output
  head left in bf16): benchmarks/llama3_h100_202412_torchtitan.md, as above, "FSDP +
  torch.compile + Float8": Llama 3.1 8B 8,532 tokens/s/GPU and 76.8 GiB on 8 H100 (Table
  1), 8,380 and 61.8 GiB on 128 (Table 3); Table 4, Llama 3.1 70B on 256 H100, FSDP 32 x
  TP 8, local batch 16, full AC, compile, Float8, "2D": 829 and 71.9 GiB
  (train_configs/llama3_70b.toml at 9dec370: seq 8192, norm "rmsnorm"). docs/performance.md
  at 3faaa1a0d, as the 405B row above with "Float8": 177 (its toml: float8 all-gather and
  precomputed scales on). benchmarks/llama3-8b_h200_202506_trainy-whitefiber.md (torchtitan
  e7c0cae, torchao 0afa4c1): Llama 3.1 8B on 4 and 8 nodes of 8 H200 (400 Gb/s a GPU
  between nodes: the planner's default), local batch 2, compile, float8 with FSDP float8
  all-gather, precomputed scales and force_recompute_fp8_weight_in_bwd (its memory effect
  is not modelled), train_configs/llama3_8b.toml at e7c0cae: seq 8192, selective op AC:
  10,938 tokens/s/GPU and 47.96 GiB on 32, 10,753 and 46.97 on 64. At e7c0cae the loss is
  compiled with training.compile (torchtitan/components/loss.py, build_cross_entropy_loss):
  the 16-bit logits kept and one gradient written, plan.loss_kernel = fused; AdamW is
  fused (the default since 6e4988550, as trainwise's); the memory is max_reserved_gib as
  above (components/metrics.py).
- mosaicml/llm-foundry, scripts/train/benchmarking/README.md at 5e85bd62d (Composer,
  FSDP FULL_SHARD; each row's table named in its source): MPT (the presets mpt-*: their
  counts are the tables' NumParams to the parameter), flash-attn's fused cross-entropy
  (modeling_mpt.py: loss_fn "fused_crossentropy", flash-attn's CrossEntropyLoss built
  without inplace_backward: the 16-bit logits kept and a gradient written, plan.loss_kernel
  = fused; its Triton attention, attn_impl "triton" in mpt-*.yaml and submit_benchmarks.py,
  writes its output [B, T, H, D], which the out projection reads as a view), Composer's
  DecoupledAdamW (composer/optim/decoupled_weight_decay.py: a per-parameter loop:
  optim.implementation = for-loop), LayerNorm as one kernel (low_precision_layernorm). Composer
  syncs every micro-batch of a model that is not DDP (composer/trainer/trainer.py), so FSDP
  reduce-scatters each micro-batch (parallel.accumulate = sharded). H100 80GB BF16 and A100
  80GB tables: amp_bf16, FSDP mixed precision DEFAULT (gradients reduced in fp32); A100
  40GB table: bf16 PURE (reduced in bf16), "1600 Gbps node-node interconnect (RoCE)":
  200 GB/s a node of 8, --inter-node-gbps 25 a GPU (the A100 80GB table's runs are on
  one node).
- Llama 3 405B (Dubey et al., 2024, arXiv 2407.21783, Table 4): 16,384 H100 at TP 8 x PP 16
  x DP 128, seq 8192, 16 sequences per data-parallel rank, 400 TFLOPs per GPU (41 % MFU):
  400e12 over the planner's model FLOPs a token is the published tokens/s per GPU. Priced
  on its layout (a pipeline, beside the others, not in their mean), from section 3.3.2:
  FSDP that shards gradients and optimizer state but does not reshard the parameters
  after forward (parallel.shard = grad_op); 16 micro-batches of one sequence; an
  interleaved schedule (Interleaved1F1B, 4 stages a rank: the paper's first and last
  stages hold only the embeddings and the head, trainwise gives every stage a block,
  models/stage_split.py). The paper trains without activation checkpointing, having freed
  what it does not need; trainwise's runtime keeps more a token and block, so the row
  checkpoints every other block (selective).
- Mixture of Experts (their mean printed apart): NVIDIA-NeMo/Automodel,
  docs/performance-summary.mdx (DGX-H100, BF16; the 12,040 first published at 8d9bfb90e,
  with examples/benchmark/configs/qwen3_moe_30b_te_deepep.yaml, later moved to
  examples/llm_benchmark/qwen/): Qwen3-30B-A3B on 8 H100, FSDP2 over the 8 with experts
  split 8 ways, local batch 4 x 16 accumulated, seq 4096, full AC, reduced in fp32,
  gradients kept unsharded between micro-batches (enable_fsdp_optimization: no reshard
  after backward nor reduction until the last micro-batch, moe/fsdp_mixin.py), FSDP
  without resharding after forward (parallel.shard = grad_op: components/moe/
  parallelizer.py parallelize_model's reshard_after_forward=False, which the config does
  not set), a balanced gate (moe.imbalance = 1), Transformer Engine's attention (its
  grouped k/v heads read natively) and DeepEP's dispatch (plan.attention_kernel and
  plan.routing_kernel = fused): 12,040 tokens/s/GPU. Its optimizer keeps bf16 states, the
  planner fp32: the fit verdict is not judged (no memory is published). The config's
  torch.optim.Adam sets neither foreach nor fused: torch's foreach step on CUDA
  (optim.implementation = foreach).
  pytorch/torchtitan, torchtitan/distributed/deepep/README.md at 022f885f3, "Strong
  Scaling", 1 node: Qwen3-30B-A3B on 8 B200 (its 167.93 GiB are "94.15%" of 178.4: the
  B200), DeepEP (plan.routing_kernel = fused), 14,796 tokens/s/GPU and 167.93 GiB. The
  table names no config: the README's own diff (flavor "30B-A3B-deepep", EP 8,
  debug_moe_force_load_balance) is torchtitan's
  torchtitan/models/qwen3/train_configs/qwen3_30b_a3b_with_deepep.toml (a8560ae35),
  assumed to be the run: local batch 8 (the weak-scaling table's LBS 8 row on 16 nodes is
  the strong-scaling 16-node row, 13,856), seq 4096, FSDP over the 8, EP 8, full AC,
  compile on, the gate forced balanced (moe.imbalance = 1), AdamW (fused, torchtitan's
  default since 6e4988550, as trainwise's), reduced in fp32. The
  published memory says otherwise: the weak-scaling table adds 13.7 GiB a sequence (LBS
  8 -> 10), where full AC holds 4.3 GiB a sequence in the plan (per-op selective AC
  15.7), while the strong-scaling differences are the experts' states halving as planned:
  what ran is not known, and the row cannot be judged until it is.
  Megatron-Core's MoE benchmarks, yanring/Megatron-MoE-ModelZoo
  best_practice/Qwen3/readme.md (c1ad0b5c8), "Intra-node EP strategy": Qwen3-235B-A22B on
  256 H100 (InfiniBand 8 x 50 GB/s a node), BF16, DeepEP (plan.routing_kernel = fused),
  Transformer Engine's attention (plan.attention_kernel = fused), seq 4096, GBS 2048,
  ETP 1 (the experts split by EP alone, as trainwise's runtime leaves them whole under
  tp): Megatron-FSDP x TP 2, EP 8, MBS 4 (4 accumulated), full recompute, 17.6 s a step
  (1,862 tokens/s/GPU); TP 4 x PP 8 (VPP 4: Interleaved1F1B, 4 stages a rank), EP 8, DP 8,
  MBS 1 (256 micro-batches), no recompute, 29.0 s (1,130). Megatron's distributed
  optimizer (ZeRO-1) beside pipeline stages is written as FSDP without resharding
  (parallel.shard = grad_op), as the Llama 3 405B row. The model config
  (model_configs/benchmarking/Qwen3-235B-A22B.yaml at c1ad0b5c8) fuses the cross-entropy
  (--cross-entropy-loss-fusion, --cross-entropy-fusion-impl te: plan.loss_kernel = fused),
  steps with Transformer Engine's FusedAdam (megatron/core/optimizer/__init__.py at
  1e057005: trainwise's default optim.implementation, fused)
  and routes with the auxiliary loss from the pretrained checkpoint (PRETRAIN=0 loads
  it): the table does not say the gate was forced balanced, and its long-context section's
  command is dropless (forced balance is the flag it adds to test it), so routing is
  dropless: the FSDP row keeps the default moe.imbalance, the TP 4 x PP 8 row takes what
  the same table's long-context pair on its layout measures (DROPLESS_PAIR).
  Megatron-Core folds tp into the expert group and splits the tokens over it, and so does
  trainwise's runtime (models.moe.parallel, priced by plan.moe.parallel).
  The FSDP row's flags are not published (its sharding strategy, the gradients' reduce
  dtype): with Megatron-Core's documented custom FSDP at its commit 1e057005
  (optim_grads_params, docs/source/api-guide/custom_fsdp.md; gradients reduced in fp32
  under bf16 unless --grad-reduce-in-bf16, training/arguments.py; a reduce-scatter every
  micro-batch, custom_fsdp grad_reduce_every_bprop), a rank's experts (28.4B parameters
  over 32 ranks, one a node) move 880 GB a step through its NIC: 17.6 s at the 50 GB/s
  line rate, the whole published step. The run moved less than that; the row is planned
  with the documented defaults and cannot be judged until the flags are known.

Left out, and why: torchtitan's context-parallel rows (Tables 2 and 6 of the December 2024
benchmarks: not modelled), its rows with async TP (Table 4's "2D + AsyncTP", 876; Table 5,
Llama 3.1 405B on 512 H100, FSDP 8 x TP 8 x PP 8, local batch 32, full AC, compile,
Float8 and AsyncTP in both rows, 1F1B 100 and Interleaved 1F1B 128 tokens/s/GPU; the 405B
"Float8 + Async TP" row of docs/performance.md at 3faaa1a0d, 185: async TP is not
modelled) and its async-TP tables (benchmarks/asyncTP_llama3_h100_2025-06: the
figures are in an image only, and async TP is not modelled); NeMo's and Megatron-Bridge's
Llama tables (NVIDIA/NeMo docs/source/performance/performance_summary.md,
NVIDIA-NeMo/Megatron-Bridge docs/performance-summary.md, every release): FP8 for every
dense Llama row, most with context parallelism; their B200 rows (Llama 3 8B on 8 B200,
29,994 tokens/s/GPU in 25.09) are FP8 too: no bf16 dense Blackwell run with complete
inputs was found (the catalog's B200 memory was fixed meanwhile: 191.5 GB as CUDA
reports it, not 180); IBM's FSDP blog (its own selective checkpointing, not expressible);
the same Automodel table's DeepSeek-V3, Kimi K2 (multi-head latent attention, pipeline
stages), GPT-OSS (attention sinks) and Nemotron (Mamba) rows. MoE: the Megatron MoE
ModelZoo table's other Qwen3 rows (priced above: its two with complete inputs): they
recompute "norm, act" (Megatron's per-module recompute, not expressible)
or overlap the all-to-all with another micro-batch ("1f1b overlap"), its long-context rows
use context parallelism, Qwen3-Next has no preset; its GB200 and GB300 rows (HybridEP
over a 72-GPU NVLink domain, CUDA graphs, MXFP8; no GB200 in the catalog); Megatron-LM's
megatron/core/transformer/moe/README.md ("438" and "468 TFLOPS" for Mixtral 8x7B bf16
without the layout, batch or recompute that ran them; TP or PP besides); NeMo's and
Megatron-Bridge's performance summaries (Mixtral 8x7B and 8x22B, Qwen3-30B-A3B and
Qwen3-235B-A22B on H100: FP8 in the releases read, NeMo 25.04 and 25.07, Megatron-Bridge
25.11; its BF16 Qwen3-235B rows are GB200/GB300, their recompute not in the table;
DeepSeek-V3 and GPT-OSS as above); torchtitan's torchtitan/distributed/deepep/README.md
(its rows on 2 to 16 nodes, strong and weak scaling: the network between their nodes is
not stated); torchtitan's DeepSeek-V3 16B and 671B (multi-head latent attention);
DeepSeek-V3's report (multi-head latent attention, FP8 training) and DeepSeekMoE 16B (no
training throughput with its layout found). Read in December 2026 (the notes of that
search are summarised here): NVIDIA-NeMo/Megatron-Bridge's H100 Qwen3 MoE rows of
releases 26.04 to 26.06 are FP8 (per-tensor current scaling, presets
*_H100_FP8_CS_* at v0.4.0 to v0.5.0), and trainwise runs float8 on its GPT only (a MoE's
grouped expert GEMMs have no float8 path: refused), so neither runtime nor planner prices
them; of them only Qwen3-30B-A3B on 16 H100 (EP 16, MBS 1, GBS 1024, no recompute, 8,901 /
8,960 / 8,826 tokens/s/GPU) has its inputs complete, the Qwen3-235B-A22B rows overlap the
all-to-all with another micro-batch (moe_a2a_overlap), and 26.02.01's 30B row prints a
layout its preset does not have. yanring/Megatron-MoE-ModelZoo
best_practice/mixtral/run_mixtral_8x22B.sh (e8650517d): Mixtral-8x22B on 128 H100, TP 2 x
PP 8 (VPP 7) x EP 8, "around 465 TFLOPS" forced balanced in BF16: an approximate figure,
with Transformer Engine's TP communication overlap on (--tp-comm-overlap, not modelled, as
async TP), and blockwise FP8 beside it. Read later in December 2026: the BF16 twin of that
30B row, Megatron-Bridge's model-verification card
(examples/model_verification_cards/qwen3-30b-a3b/card.yaml, `pretrain` on H100, run at
5b9d9cf5: 16 H100 on 2 nodes, EP 16, MBS 1, GBS 1024, no recompute, ZeRO-1, HybridEP, no
all-to-all overlap, 8,654.602 tokens/s/GPU): its network between the nodes is not stated
(EP 16 spans them), its routing is natural on real data over steps 91-100 of a run from
scratch (the card calls its functional figures sanity checks), and it needs what the
planner does not price: HybridEP's hierarchical dispatch (a token crosses the network once
per remote node, then NVLink) and a distributed optimizer without FSDP's per-micro-batch
work (the nearest trainwise layout, FSDP grad_op with ep 16, plans 4,569, host-bound on
FSDP2's hooks). Its `pretrain_performance` item (13,011) overlaps the all-to-all. The
MoE Parallel Folding paper (arXiv 2504.14960: Mixtral-8x22B and Qwen2-57B-A14B on 64 to
1024 H100) states no micro-batch, virtual stages or recompute, and trains with token
dropping at capacity factor 1.
"""

from __future__ import annotations

import shlex
import statistics
import sys
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from trainwise.api import plan_job  # noqa: E402
from trainwise.cli.main import build_parser  # noqa: E402
from trainwise.cli.plan import job_spec  # noqa: E402
from trainwise.config import JobConfig  # noqa: E402
from trainwise.plan.estimate import StrategyPlan  # noqa: E402
from trainwise.plan.inputs import PLAN_DEFAULTS, PlanInputs  # noqa: E402
from trainwise.plan.model.flops import model_flops_per_token  # noqa: E402

GIB = 2**30
MEMORY_WITHIN = 0.10  # the check: memory within 10 % where published
# torchtitan's eager rows of December 2024 (Tables 1 and 3, FSDP without torch.compile)
# report 5.4 GiB (8 GPUs) and 5.0 GiB (128) more than their compiled twins of the same
# tables: the same layout, batch, checkpointing and loss. The plan holds the same tensors
# for both at their peak (the head's backward, outside the compiled blocks), and what the
# tables publish is the caching allocator's reserved memory (torchtitan logs the peak of
# its active memory beside it, not published): what eager adds is not in the job's inputs.
# Their memory is printed, not judged; their compiled twins are.
TITAN_EAGER_MEMORY = ("torchtitan's eager rows report 5.4 and 5.0 GiB more than their "
                      "compiled twins of the same tables, which the plan holds alike (the "
                      "head's backward peaks outside the compiled blocks); the published "
                      "figure is the allocator's reserved memory, its active memory unpublished")


@dataclass(frozen=True)
class Published:
    """A published run: `line`, the `trainwise plan` command that plans it; its tokens/s
    per GPU (None: it ran out of memory) and peak memory per GPU in GiB where published."""

    name: str
    source: str
    line: str
    tokens_per_s_per_gpu: float | None
    memory_gib: float | None = None
    held_out: bool = False
    # Why its published memory is printed but not judged (a gap the row does not cause).
    memory_unjudged: str = ""


COMMON = "--calibrate none"


def cmd(*parts: str) -> str:
    """A command line from its parts (each a few flags), with the common tail."""
    return " ".join(["trainwise plan", *(p for p in parts if p), COMMON])


# torchtitan's Grand Teton H100s (96GB HBM2e, 2.4 TB/s, 500 W; see above).
TITAN_H100 = "--gpu H100-SXM --gpu-mem-gb 96 --gpu-tflops 912 --gpu-hbm-gbps 2400"
TITAN_405B_H100 = "--gpu H100-SXM --gpu-mem-gb 94 --gpu-tflops 912 --gpu-hbm-gbps 2400"
COMPOSITE = "--norm composite"
# torchtitan's loss in 2024: F.cross_entropy on logits upcast to fp32, eager (the model's
# `self.output(h).float()` at 157a12c56 and 3faaa1a0d; train.py's loss_fn
# `pred.flatten(0, 1).float()` from e10cb94, its compile commented out by e8977b0 on
# 2024-12-18, so at 9dec370): its log-softmax and two gradients in fp32.
TITAN_LOSS_2024 = "--set plan.loss_kernel=fp32"
# torchtitan's loss at e7c0cae (June 2025): the same, compiled with training.compile
# (torchtitan/components/loss.py, build_cross_entropy_loss): the 16-bit logits kept.
TITAN_LOSS_COMPILED = "--set plan.loss_kernel=fused"
# torchtitan's AdamW until 6e4988550 (2025-02-24): torch's foreach step (`--optimizer.fused`
# off unless typed, config_manager.py at 3faaa1a0d and 9dec370); fused since, as trainwise.
TITAN_ADAMW_2024 = "--set optim.implementation=foreach"
TITAN_2412 = "pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md"
TITAN_DOCS = "pytorch/torchtitan docs/performance.md @157a12c56"
TITAN_405B = "pytorch/torchtitan docs/performance.md @3faaa1a0d"
FOUNDRY = "mosaicml/llm-foundry scripts/train/benchmarking/README.md @5e85bd62d"
# Composer's runs (see above): the kernels and accumulation it runs.
COMPOSER = ("--strategy fsdp-full --set parallel.tp=1 --set parallel.accumulate=sharded "
            "--set plan.loss_kernel=fused --set optim.implementation=for-loop")
A100_40_NET = "--inter-node-gbps 25 --set precision.reduce_dtype=bf16"


def titan_8b(gpus: int, compile_: bool, float8: bool = False) -> str:
    return cmd(f"--model llama3-8b --gpus {gpus} --seq 8192 --micro-batch 2 "
               f"--global-batch {2 * gpus} --strategy fsdp-full --set parallel.tp=1 "
               "--ac selective-op",
               TITAN_H100, COMPOSITE, "--set train.compile=true" if compile_ else "",
               FLOAT8 if float8 else "", TITAN_LOSS_2024, TITAN_ADAMW_2024)


def titan_a100(model: str, seq: int, micro: int, ac: str, composite: bool = False) -> str:
    return cmd(f"--model {model} --gpus 64 --gpu A100-80GB --seq {seq} --micro-batch {micro} "
               f"--global-batch {64 * micro} --strategy fsdp-full --set parallel.tp=1 --ac {ac}",
               COMPOSITE if composite else "", TITAN_LOSS_2024, TITAN_ADAMW_2024)


def mpt(size: str, gpu: str, gpus: int, seq: int, micro: int, accum: int, ac: bool,
        extra: str = "") -> str:
    return cmd(f"--model mpt-{size} --gpus {gpus} --gpu {gpu} --seq {seq} --micro-batch {micro} "
               f"--global-batch {micro * accum * gpus} --ac {'full' if ac else 'none'}",
               COMPOSER, extra)


H100_T, A100_80_T = ", H100 80GB BF16", ", A100 80GB (1600 Gbps RoCE)"
A100_40_T = ", A100 40GB (1600 Gbps RoCE)"
RUNS = [
    Published("Llama 3.1 8B, 8 H100, FSDP, sel-op AC", TITAN_2412 + " Table 1",
              titan_8b(8, False), 5762, 82.4,
              memory_unjudged=TITAN_EAGER_MEMORY),
    Published("Llama 3.1 8B, 8 H100, FSDP, sel-op AC, compile", TITAN_2412 + " Table 1",
              titan_8b(8, True), 6667, 77.0),
    Published("Llama 3.1 8B, 128 H100, FSDP, sel-op AC", TITAN_2412 + " Table 3",
              titan_8b(128, False), 5605, 67.0,
              memory_unjudged=TITAN_EAGER_MEMORY),
    Published("Llama 3.1 8B, 128 H100, FSDP, sel-op AC, compile", TITAN_2412 + " Table 3",
              titan_8b(128, True), 6514, 62.0),
    Published("Llama 2 13B, 64 A100 80GB, FSDP, no AC", TITAN_DOCS,
              titan_a100("llama-13b", 4096, 2, "none"), 2162),
    Published("Llama 2 13B, 64 A100 80GB, FSDP, sel. AC", TITAN_DOCS,
              titan_a100("llama-13b", 4096, 2, "selective"), 1914),
    Published("Llama 2 13B, 64 A100 80GB, FSDP, sel-op AC", TITAN_DOCS,
              titan_a100("llama-13b", 4096, 2, "selective-op"), 1904),
    Published("Llama 2 70B, 64 A100 80GB, FSDP, full AC, mb 2", TITAN_DOCS,
              titan_a100("llama-70b", 4096, 2, "full", composite=True), 353),
    Published("Llama 2 70B, 64 A100 80GB, FSDP, sel-op AC, mb 1", TITAN_DOCS,
              titan_a100("llama-70b", 4096, 1, "selective-op", composite=True), 355),
    Published("Llama 3 8B, 64 A100 80GB, FSDP, sel-op AC", TITAN_DOCS,
              titan_a100("llama3-8b", 8192, 1, "selective-op"), 2973),
    Published("Llama 3 70B, 64 A100 80GB, FSDP, full AC", TITAN_DOCS,
              titan_a100("llama3-70b", 8192, 1, "full", composite=True), 331),
    Published("Llama 3.1 405B, 128 H100, FSDP 16 x TP 8, full AC", TITAN_405B,
              cmd("--model llama3-405b --gpus 128 --seq 8192 --micro-batch 2 --global-batch 32 "
                  "--strategy fsdp-full --set parallel.tp=8 --ac full --set train.compile=true",
                  TITAN_405B_H100, COMPOSITE, TITAN_LOSS_2024, TITAN_ADAMW_2024), 109),
    Published("MPT-7B, 8 H100, no AC, mb 6", FOUNDRY + H100_T,
              mpt("7b", "H100-SXM", 8, 2048, 6, 1, False), 10643),
    Published("MPT-13B, 64 H100, no AC, mb 2", FOUNDRY + H100_T,
              mpt("13b", "H100-SXM", 64, 2048, 2, 1, False), 4800),
    Published("MPT-13B, 8 H100, no AC, mb 2", FOUNDRY + H100_T,
              mpt("13b", "H100-SXM", 8, 2048, 2, 1, False), 4792),
    Published("MPT-1B, 8 H100, no AC, mb 14", FOUNDRY + H100_T,
              mpt("1b", "H100-SXM", 8, 2048, 14, 1, False), 45455),
    Published("MPT-1B, 64 H100, no AC, mb 20", FOUNDRY + H100_T,
              mpt("1b", "H100-SXM", 64, 2048, 20, 1, False), 44402),
    Published("MPT-3B, 16 H100, no AC, mb 10 x 3", FOUNDRY + H100_T,
              mpt("3b", "H100-SXM", 16, 2048, 10, 3, False), 24142),
    Published("MPT-7B, 8 H100, seq 8192, full AC, mb 8 x 2", FOUNDRY + H100_T,
              mpt("7b", "H100-SXM", 8, 8192, 8, 2, True), 6935),
    Published("MPT-30B, 8 H100, full AC, mb 3 x 21", FOUNDRY + H100_T,
              mpt("30b", "H100-SXM", 8, 2048, 3, 21, True), 2002),
    Published("MPT-30B, 16 H100, full AC, mb 10 x 3", FOUNDRY + H100_T,
              mpt("30b", "H100-SXM", 16, 2048, 10, 3, True), 2263),
    Published("MPT-70B, 64 H100, full AC, mb 8 x 4", FOUNDRY + H100_T,
              mpt("70b", "H100-SXM", 64, 2048, 8, 4, True), 1039),
    Published("MPT-1B, 8 A100 80GB, no AC, mb 14 x 4", FOUNDRY + A100_80_T,
              mpt("1b", "A100-80GB", 8, 2048, 14, 4, False), 20513),
    Published("MPT-3B, 8 A100 80GB, no AC, mb 10 x 2", FOUNDRY + A100_80_T,
              mpt("3b", "A100-80GB", 8, 2048, 10, 2, False), 10811),
    Published("MPT-7B, 8 A100 80GB, no AC, mb 6 x 2", FOUNDRY + A100_80_T,
              mpt("7b", "A100-80GB", 8, 2048, 6, 2, False), 4641),
    Published("MPT-13B, 8 A100 80GB, no AC, mb 2 x 3", FOUNDRY + A100_80_T,
              mpt("13b", "A100-80GB", 8, 2048, 2, 3, False), 2262),
    Published("MPT-7B, 8 A100 80GB, seq 8192, full AC, mb 8 x 2", FOUNDRY + A100_80_T,
              mpt("7b", "A100-80GB", 8, 8192, 8, 2, True), 3206),
    Published("MPT-7B, 64 A100 40GB, full AC, mb 18", FOUNDRY + A100_40_T,
              mpt("7b", "A100-40GB", 64, 2048, 18, 1, True, A100_40_NET), 3665),
    Published("MPT-13B, 32 A100 40GB, full AC, mb 14", FOUNDRY + A100_40_T,
              mpt("13b", "A100-40GB", 32, 2048, 14, 1, True, A100_40_NET), 1998),
    Published("MPT-3B, 32 A100 40GB, no AC, mb 6", FOUNDRY + A100_40_T,
              mpt("3b", "A100-40GB", 32, 2048, 6, 1, False, A100_40_NET), 9914),
    Published("MPT-13B, 128 A100 40GB, full AC, mb 16", FOUNDRY + A100_40_T,
              mpt("13b", "A100-40GB", 128, 2048, 16, 1, True, A100_40_NET), 1972),
    # Held out: chosen before the model changed, not looked at while it did.
    Published("Llama 3 8B, 64 A100 80GB, FSDP, sel. AC", TITAN_DOCS,
              titan_a100("llama3-8b", 8192, 1, "selective"), 2904, held_out=True),
    Published("MPT-7B, 8 H100, seq 4096, full AC, mb 16 x 2", FOUNDRY + H100_T,
              mpt("7b", "H100-SXM", 8, 4096, 16, 2, True), 8611, held_out=True),
    Published("MPT-3B, 8 H100, seq 8192, no AC, mb 3 x 6", FOUNDRY + H100_T,
              mpt("3b", "H100-SXM", 8, 8192, 3, 6, False), 16578, held_out=True),
    Published("MPT-13B, 32 H100, no AC, mb 2", FOUNDRY + H100_T,
              mpt("13b", "H100-SXM", 32, 2048, 2, 1, False), 4811, held_out=True),
    Published("MPT-760M, 16 H100, no AC, mb 24", FOUNDRY + H100_T,
              mpt("760m", "H100-SXM", 16, 2048, 24, 1, False), 68551, held_out=True),
    Published("MPT-760M, 8 A100 80GB, no AC, mb 24 x 2", FOUNDRY + A100_80_T,
              mpt("760m", "A100-80GB", 8, 2048, 24, 2, False), 32434, held_out=True),
    Published("MPT-7B, 16 A100 40GB, full AC, mb 16", FOUNDRY + A100_40_T,
              mpt("7b", "A100-40GB", 16, 2048, 16, 1, True, A100_40_NET), 3645, held_out=True),
]
# Runs the source reports out of memory: the plan must say they do not fit.
OUT_OF_MEMORY = [
    Published("Llama 2 70B, 64 A100 80GB, FSDP, sel. AC, mb 2", TITAN_DOCS,
              titan_a100("llama-70b", 4096, 2, "selective", composite=True), None),
    Published("Llama 2 70B, 64 A100 80GB, FSDP, sel-op AC, mb 2", TITAN_DOCS,
              titan_a100("llama-70b", 4096, 2, "selective-op", composite=True), None),
]
# torchtitan's float8 tables (precision.float8), as command lines (sources: FLOAT8_SOURCES).
# torchao's tensorwise recipe (the only one in 2024) with FSDP's float8 all-gather
# (precision.float8_all_gather, true by default), as torchtitan's docs/float8.md at 9dec370
# has it typed (--float8.enable_fsdp_float8_all_gather, an assumption for the December 2024
# tables, which do not say) and train_configs/llama3_405b.toml at 3faaa1a0d sets it.
FLOAT8 = "--set precision.float8=tensorwise"
TRAINY = "pytorch/torchtitan benchmarks/llama3-8b_h200_202506_trainy-whitefiber.md"
FLOAT8_RUNS: list[Published] = [
    Published("Llama 3.1 8B, 8 H100, FSDP, sel-op AC, compile, float8", TITAN_2412 + " Table 1",
              titan_8b(8, True, float8=True), 8532, 76.8),
    Published("Llama 3.1 8B, 128 H100, FSDP, sel-op AC, compile, float8",
              TITAN_2412 + " Table 3", titan_8b(128, True, float8=True), 8380, 61.8),
    Published("Llama 3.1 70B, 256 H100, FSDP 32 x TP 8, full AC, compile, float8",
              TITAN_2412 + " Table 4 (2D)",
              cmd("--model llama3-70b --gpus 256 --seq 8192 --micro-batch 16 --global-batch 512 "
                  "--strategy fsdp-full --set parallel.tp=8 --ac full --set train.compile=true",
                  TITAN_H100, COMPOSITE, FLOAT8, TITAN_LOSS_2024, TITAN_ADAMW_2024), 829, 71.9),
    Published("Llama 3.1 405B, 128 H100, FSDP 16 x TP 8, full AC, compile, float8", TITAN_405B,
              cmd("--model llama3-405b --gpus 128 --seq 8192 --micro-batch 2 --global-batch 32 "
                  "--strategy fsdp-full --set parallel.tp=8 --ac full --set train.compile=true",
                  TITAN_405B_H100, COMPOSITE, FLOAT8, TITAN_LOSS_2024, TITAN_ADAMW_2024),
              177),
    *(Published(f"Llama 3.1 8B, {gpus} H200, FSDP, sel-op AC, compile, float8", TRAINY,
                cmd(f"--model llama3-8b --gpus {gpus} --gpu H200 --seq 8192 --micro-batch 2 "
                    f"--global-batch {2 * gpus} --strategy fsdp-full --set parallel.tp=1 "
                    "--ac selective-op --set train.compile=true", FLOAT8, TITAN_LOSS_COMPILED),
                tokens, memory)
      for gpus, tokens, memory in ((32, 10938, 47.96), (64, 10753, 46.97))),
]

LLAMA3_405B = Published(
    "Llama 3 405B, 16384 H100, TP8 x PP16 x DP128", "arXiv 2407.21783 Table 4",
    cmd("--model llama3-405b --gpus 16384 --seq 8192 --micro-batch 1 --global-batch 2048 "
        "--strategy fsdp --set parallel.shard=grad_op --set parallel.tp=8 --set parallel.pp=16 "
        "--set parallel.pp_schedule=Interleaved1F1B --set parallel.pp_virtual=4 "
        "--set parallel.pp_microbatches=16 --ac selective"),
    None,
)
LLAMA3_405B_TFLOPS_PER_GPU = 400.0  # arXiv 2407.21783, Table 4, 16,384 GPUs

# What dropless routing costs, from a published pair of runs that differ in nothing else:
# Megatron-MoE-ModelZoo's long-context table (best_practice/Qwen3/readme.md @c1ad0b5c8,
# "Long Context", the intra-node rows' file; MBS 1 and SlimPajama from
# runtime_configs/benchmarking/runtime.conf, the pretrained router loaded): Qwen3-235B-A22B on 32 nodes of 8 H100, TP 4 x PP 8 (VPP 4) x
# EP 8, CP 1, seq 16384, global batch 256, DeepEP, BF16, the norms and MoE layers
# recomputed: 295 TFLOPS a GPU with the gate forced balanced, 237 dropless. Same layout,
# same FLOPs: the dropless step is 295 / 237 times the balanced one, whatever FLOPs count
# the figures use. dropless_imbalance() solves the planner's moe.imbalance for that ratio;
# the recompute the pair ran (norms and MoE layers) is not expressible, so ac none and full
# bracket it. The 4096-token row on this layout (MOE_RUNS) uses the pair's figure: the same
# model, data, router and dispatch group (2 sequences an ep group: dp 2 within it x tp 4),
# with a quarter of the tokens to average over.
DROPLESS_PAIR = ("yanring/Megatron-MoE-ModelZoo best_practice/Qwen3/readme.md @c1ad0b5c8, "
                 "Long Context, H100, seq 16384, TP 4, CP 1")
DROPLESS_PAIR_TFLOPS = (295.0, 237.0)  # forced balance, dropless
# The layout and kernels of the pair and of the 4096-token row that takes its imbalance
# (Megatron's distributed optimizer beside pipeline stages written as parallel.shard=grad_op).
QWEN3_235B_TP4_PP8 = (
    "--strategy fsdp --set parallel.shard=grad_op --set parallel.tp=4 --set parallel.pp=8 "
    "--set parallel.pp_schedule=Interleaved1F1B --set parallel.pp_virtual=4 "
    "--set parallel.ep=8 --set plan.attention_kernel=fused --set plan.routing_kernel=fused "
    "--set plan.loss_kernel=fused")
DROPLESS_PAIR_LINE = cmd(
    "--model qwen3-235b-a22b --gpus 256 --seq 16384 --micro-batch 1 --global-batch 256",
    QWEN3_235B_TP4_PP8, "--set parallel.pp_microbatches=32")
QWEN3_235B_DROPLESS = 1.8  # within dropless_imbalance()'s bracket (pin_holds)

MOE_ZOO = ("yanring/Megatron-MoE-ModelZoo best_practice/Qwen3/readme.md @c1ad0b5c8, "
           "Intra-node EP strategy")
AUTOMODEL = ("NVIDIA-NeMo/Automodel docs/performance-summary.mdx, DGX-H100 BF16 "
             "(examples/llm_benchmark/qwen/qwen3_moe_30b_te_deepep.yaml)")
MOE_RUNS = [
    Published("Qwen3-30B-A3B, 8 H100, FSDP 8 x EP 8, full AC", AUTOMODEL,
              cmd("--model qwen3-30b-a3b --gpus 8 --seq 4096 --micro-batch 4 --global-batch 512 "
                  "--ac full --strategy fsdp --set parallel.shard=grad_op --set parallel.tp=1 "
                  "--set parallel.ep=8 --set moe.imbalance=1 "
                  "--set parallel.accumulate=unsharded --set plan.attention_kernel=fused "
                  "--set plan.routing_kernel=fused --set optim.implementation=foreach"), 12040),
    Published("Qwen3-30B-A3B, 8 B200, FSDP 8 x EP 8, full AC, compile",
              "pytorch/torchtitan torchtitan/distributed/deepep/README.md @022f885f3, Strong "
              "Scaling, 1 node (train_configs/qwen3_30b_a3b_with_deepep.toml @a8560ae35)",
              cmd("--model qwen3-30b-a3b --gpus 8 --gpu B200 --seq 4096 --micro-batch 8 "
                  "--global-batch 64 --ac full --strategy fsdp-full --set parallel.tp=1 "
                  "--set parallel.ep=8 "
                  "--set moe.imbalance=1 --set train.compile=true --set plan.routing_kernel=fused"),
              14796, 167.93),
    Published("Qwen3-235B-A22B, 256 H100, FSDP x TP 2 x EP 8, full AC", MOE_ZOO,
              cmd("--model qwen3-235b-a22b --gpus 256 --seq 4096 --micro-batch 4 "
                  "--global-batch 2048 --ac full --strategy fsdp-full --set parallel.tp=2 "
                  "--set parallel.ep=8 --set plan.attention_kernel=fused "
                  "--set plan.routing_kernel=fused --set plan.loss_kernel=fused"), 1862),
    Published("Qwen3-235B-A22B, 256 H100, TP 4 x PP 8 (VPP 4) x EP 8, no AC", MOE_ZOO,
              cmd("--model qwen3-235b-a22b --gpus 256 --seq 4096 --micro-batch 1 "
                  "--global-batch 2048 --ac none", QWEN3_235B_TP4_PP8,
                  "--set parallel.pp_microbatches=256",
                  f"--set moe.imbalance={QWEN3_235B_DROPLESS}"), 1130),
]


@dataclass(frozen=True)
class Planned:
    run: Published
    plan: StrategyPlan
    fits: bool
    why: str  # the recommendation's reason (the headroom's line when it decides)
    inputs: PlanInputs

    @property
    def tokens(self) -> float:
        return self.plan.tokens_per_s / self.plan.gpus

    @property
    def error(self) -> float | None:
        published = self.run.tokens_per_s_per_gpu
        return None if published is None else self.tokens / published - 1

    @property
    def memory_error(self) -> float | None:
        """The plan against the published memory: the caching allocator's peak reserved
        bytes (torchtitan logs `reserved_bytes.all.peak` of torch.cuda.memory_stats as
        "memory": torchtitan/metrics.py at 9dec370, components/metrics.py at e7c0cae), so
        the plan's estimate without the CUDA context (MemoryEstimate.reserved)."""
        if self.run.memory_gib is None:
            return None
        return self.plan.memory.reserved / GIB / self.run.memory_gib - 1


def plan_line(run: Published) -> Planned:
    """`run.line` parsed by the CLI's parser and planned by the API, as `trainwise plan`
    runs it; the configuration it recommends."""
    words = shlex.split(run.line)
    assert words[:2] == ["trainwise", "plan"], run.line
    args = build_parser().parse_args(words[1:])
    spec = job_spec(args)
    plan = plan_job(spec, calibrate=args.calibrate).planned
    choice = plan.recommendation.choice
    check_pinned(run, spec.load(base=PLAN_DEFAULTS)[0], choice.plan)
    return Planned(run, choice.plan, choice.fits, choice.why, plan.inputs)


def check_pinned(run: Published, cfg: JobConfig, plan: StrategyPlan) -> None:
    """The plan is the run as published: the search changed nothing the line pins (the
    layout's tensor and pipeline degrees, the micro-batch, the checkpointing)."""
    setup = plan.setup
    assert setup is not None
    p = cfg.parallel
    asked = (p.tp, p.pp, cfg.data.micro_batch, p.ac)
    got = (setup.dims.tp, setup.dims.pp, setup.micro_batch, setup.ac)
    if got != asked:
        raise SystemExit(f"{run.name}: planned (tp, pp, micro-batch, ac) {got}, the line "
                         f"pins {asked}")


def row(p: Planned) -> str:
    run = p.run
    published = run.tokens_per_s_per_gpu
    text = f"  published {published:,.0f}" if published else "  published: out of memory"
    text += f", planned {p.tokens:,.0f}"
    if p.error is not None:
        text += f" ({p.error:+.1%})"
    verdict = "fits" if p.fits else "does NOT fit"
    text += f"; {verdict}: {p.plan.memory.total / GIB:.1f} of {p.plan.budget_bytes / GIB:.1f} GiB"
    if p.memory_error is not None:
        text += (f" (reserved {p.plan.memory.reserved / GIB:.1f}, published "
                 f"{run.memory_gib:.1f}: {p.memory_error:+.1%})")
    if run.memory_unjudged:
        text += f" [memory not judged: {run.memory_unjudged}]"
    if not p.fits and "headroom" in p.why:
        text += "\n  " + p.why.split("; ", 1)[1]
    return text


COMPACT = "--compact" in sys.argv  # one line a run, without its command and source


def compact(p: Planned) -> str:
    published = p.run.tokens_per_s_per_gpu
    error = f"{p.error:+7.1%}" if p.error is not None else f"{'-':>7}"
    memory = f"{p.plan.memory.total / GIB:5.1f} of {p.plan.budget_bytes / GIB:5.1f}"
    if p.memory_error is not None:
        memory += f" (reserved {p.plan.memory.reserved / GIB:.1f}, published {p.run.memory_gib:.1f})"
    shown = f"{published:>8,.0f}" if published else f"{'OOM':>8}"
    return (f"{p.run.name:52} {shown} {p.tokens:>8,.0f} {error}  "
            f"{'yes' if p.fits else 'NO ':3}  {memory}")


def report(title: str, runs: list[Published]) -> list[Planned]:
    print(f"\n== {title}")
    if COMPACT:
        print(f"{'run':52} "
              f"{'published':>8} {'planned':>8} {'error':>7}  fits  memory GiB")
    planned = []
    for run in runs:
        p = plan_line(run)
        planned.append(p)
        print(compact(p) if COMPACT else f"{run.name}  [{run.source}]\n  $ {run.line}\n{row(p)}")
    return planned


def summary(label: str, planned: list[Planned]) -> None:
    errors = [abs(p.error) for p in planned if p.error is not None]
    if errors:
        print(f"{label}: mean absolute error of tokens/s {statistics.mean(errors):.1%} over "
              f"{len(errors)} run{'s' if len(errors) > 1 else ''}, largest {max(errors):.1%}")


def judge_memory(planned: list[Planned]) -> None:
    memory = [(p.run.name, p.memory_error) for p in planned
              if p.memory_error is not None and not p.run.memory_unjudged]
    unjudged = [p for p in planned if p.memory_error is not None and p.run.memory_unjudged]
    for reason in dict.fromkeys(p.run.memory_unjudged for p in unjudged):
        print(f"memory not judged, {reason}:")
        for p in unjudged:
            if p.run.memory_unjudged == reason:
                print(f"  {p.run.name}: {p.memory_error:+.1%}")
    if memory:
        name, worst = max(memory, key=lambda t: abs(t[1]))
        within = sum(abs(e) <= MEMORY_WITHIN for _, e in memory)
        print(f"memory where published: {within} of {len(memory)} within "
              f"{MEMORY_WITHIN:.0%}, largest {worst:+.1%} ({name})")
    ran = [p for p in planned if p.run.tokens_per_s_per_gpu is not None]
    unfit = [p.run.name for p in ran if not p.fits]
    print(f"runs that ran and fit at the default headroom: {len(ran) - len(unfit)} of {len(ran)}"
          + (f"; not: {', '.join(unfit)}" if unfit else ""))


def llama3_405b() -> None:
    """The 405B run on its published layout, its tokens/s from the published TFLOPs."""
    p = plan_line(LLAMA3_405B)
    w = p.inputs.workload
    published = LLAMA3_405B_TFLOPS_PER_GPU * 1e12 / model_flops_per_token(
        w.params, w.shape, w.seq_len
    )
    print(f"\n== A pipeline on its published layout\n{LLAMA3_405B.name}  [{LLAMA3_405B.source}]"
          f"\n  $ {LLAMA3_405B.line}")
    print(f"  published {published:,.0f} (400 TFLOPs, MFU 41 %), planned {p.tokens:,.0f} "
          f"({p.tokens / published - 1:+.1%}, MFU {p.plan.mfu:.0%}); "
          f"{'fits' if p.fits else 'does NOT fit'}: {p.plan.memory.total / GIB:.1f} of "
          f"{p.plan.budget_bytes / GIB:.1f} GiB")
    if not p.fits and "headroom" in p.why:
        print("  " + p.why.split("; ", 1)[1])
    m = p.plan.memory
    parts = [("parameters", m.params), ("gradients", m.grads), ("optimizer", m.optimizer),
             ("activations", m.activations or 0.0), ("buffers", m.buffers),
             ("CUDA context and fragmentation", m.overhead)]
    print(f"  its peak, at {m.phase}: "
          + ", ".join(f"{k} {v / GIB:.1f}" for k, v in parts) + " GiB")


@lru_cache(maxsize=256)  # the balanced step is asked for by each bisection and the ratio
def pair_step(ac: str, imbalance: float) -> float:
    """The planned step, in seconds, of the dropless pair's layout at `ac` and `imbalance`."""
    line = f"{DROPLESS_PAIR_LINE} --ac {ac} --set moe.imbalance={imbalance:.4f}"
    return plan_line(Published("dropless pair", DROPLESS_PAIR, line, None)).plan.step.total


def dropless_imbalance(ac: str, tolerance: float = 0.005) -> float:
    """The moe.imbalance at which the pair's planned step at `ac` is the published
    forced / dropless ratio longer than at 1 (bisection: the step grows with it)."""
    forced, dropless = DROPLESS_PAIR_TFLOPS
    target = forced / dropless * pair_step(ac, 1.0)
    low, high = 1.0, 4.0
    if pair_step(ac, high) < target:
        raise ValueError(f"no moe.imbalance up to {high} plans the pair's ratio at ac {ac}")
    while high - low > tolerance:
        mid = (low + high) / 2
        low, high = (mid, high) if pair_step(ac, mid) < target else (low, mid)
    return (low + high) / 2


def pin_holds(solved: list[float], slack: float = 0.05) -> bool:
    """Whether QWEN3_235B_DROPLESS lies in the bracket the pair solves (one per ac mode),
    give or take `slack` (the bisection's tolerance and a rounded pin)."""
    return min(solved) - slack <= QWEN3_235B_DROPLESS <= max(solved) + slack


def dropless_pair() -> bool:
    """The published cost of dropless routing against the planner's at its default;
    whether the pinned imbalance still lies in the bracket the pair solves."""
    forced, dropless = DROPLESS_PAIR_TFLOPS
    default = JobConfig().moe.imbalance
    planned = pair_step("none", default) / pair_step("none", 1.0)
    solved = {ac: dropless_imbalance(ac) for ac in ("none", "full")}
    inside = pin_holds(list(solved.values()))
    print(f"\n== Dropless against forced balance  [{DROPLESS_PAIR}]\n"
          f"  published step ratio {forced / dropless:.3f} ({forced:.0f} / {dropless:.0f} "
          f"TFLOPS); planned at the default moe.imbalance {default}: {planned:.3f}\n"
          f"  the imbalance that plans the published ratio: {solved['full']:.2f} (ac full) to "
          f"{solved['none']:.2f} (ac none); the 4096-token row uses {QWEN3_235B_DROPLESS}"
          + ("" if inside else "  STALE: outside the bracket, update QWEN3_235B_DROPLESS"))
    return inside


def main(argv: list[str]) -> int:
    tuning = "--tuning" in argv
    runs = [r for r in RUNS if not r.held_out]
    planned = report("Published runs", runs + FLOAT8_RUNS)
    summary("published runs", planned)
    judge_memory(planned)
    out = report("Runs the source reports out of memory (must not fit)", OUT_OF_MEMORY)
    wrong = [p.run.name for p in out if p.fits]
    print(f"out-of-memory runs planned as not fitting: {len(out) - len(wrong)} of {len(out)}"
          + (f"; wrongly fit: {', '.join(wrong)}" if wrong else ""))
    if not tuning:
        held = report("HELD-OUT runs (not looked at while the model changed)",
                      [r for r in RUNS if r.held_out])
        summary("held-out runs", held)
        judge_memory(held)
        summary("all runs together", planned + held)
    llama3_405b()
    moe = report("Mixture-of-Experts runs (the fit not judged: bf16 optimizer states)",
                 MOE_RUNS)
    for p in moe:
        a2a = sum(c.seconds for c in p.plan.collectives if c.name.startswith("ep all-to-all"))
        print(f"  {p.run.name}: the all-to-all, exposed, is {a2a / p.plan.step.total:.0%} "
              "of the step")
    summary("Mixture-of-Experts runs", moe)
    pinned = dropless_pair()
    return 0 if pinned and not wrong else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
