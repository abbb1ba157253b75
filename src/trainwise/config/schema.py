"""The schema of a job: every key a user can set, its type, default and meaning.

Each field is documented once, here, where it is declared. Values are checked on their
own here; checks that need the machine (device, world size) live in `trainwise.run.job.resolve`.
Unknown keys are rejected (``extra="forbid"``).
"""

from __future__ import annotations

import math
from fnmatch import fnmatchcase
from typing import Annotated, Literal, get_args

from pydantic import (
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from trainwise.config.parallel_dims import STRATEGY_WORDS, read_strategy
from trainwise.errors import ConfigError
from trainwise.hardware.catalog import find_gpu, gpu_names
from trainwise.objects import is_object_reference

# data.dataset's built-in words (trainwise.data builds them); anything else is an import path.
BUILTIN_DATASETS = ("synthetic", "digits", "tokens")
# parallel.strategy: train's shortcuts and the planner's row names (config.parallel_dims).
Strategy = Literal[STRATEGY_WORDS]  # type: ignore[valid-type]
Beta = Annotated[float, Field(ge=0.0, lt=1.0)]
Precision = Literal["fp32", "bf16", "fp16"]
# parallel.pp_schedule: the schedules of torch.distributed.pipelining we run (its names).
PIPELINE_SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble")
PipelineSchedule = Literal[PIPELINE_SCHEDULES]  # type: ignore[valid-type]


# The most a whole-number key holds: the largest integer JSON readers (and floats) keep
# exactly. A count beyond it is a typo, never a job.
MAX_WHOLE = 2**53 - 1
# Optimizer steps beyond this are no real run (large published runs take about a million).
MAX_STEPS = 10**9


def whole_number(value: object) -> object:
    """A number given for a whole-number key as an int (1e3 -> 1000); a fraction, a
    boolean or an absurd size is an error that says so. Other values go on to the schema."""
    if isinstance(value, bool):
        raise ValueError("must be a whole number, not true or false")
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError("must be a finite whole number")
        if value != int(value):
            raise ValueError(f"must be a whole number (e.g. {int(value)} or {int(value) + 1})")
        value = int(value)
    if isinstance(value, int) and abs(value) > MAX_WHOLE:
        raise ValueError(f"is beyond any real job: give a whole number up to {MAX_WHOLE:,}")
    return value


def _takes_int(annotation: object) -> bool:
    return annotation is int or int in get_args(annotation)


# optim.implementation's values (torch.optim's three ways to run a step).
OptimizerStep = Literal["fused", "foreach", "for-loop"]


class Section(BaseModel):
    # No inf or nan anywhere: every figure of a job is a finite number.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _whole(cls, value: object, info: ValidationInfo) -> object:
        # pydantic takes 1e15 as an int and words 1e23 and 2.5 as parse failures.
        field = cls.model_fields.get(info.field_name or "")
        return whole_number(value) if field and _takes_int(field.annotation) else value


class ModelConfig(Section):
    name: str = Field(
        "tiny",
        description="A GPT preset (tiny, small, gpt2-124m, llama-1b, llama-7b, ...), a "
        "Mixture-of-Experts preset (moe-tiny, mixtral-8x7b, qwen3-30b-a3b, ...), 'mlp', "
        "'package.module:factory' for your own model, or 'hf:DIR' (a Hugging Face model "
        "directory: config.json, and safetensors weights when pretrained).",
    )
    vocab_size: int | None = Field(
        None, gt=0, description="LM vocabulary; default: the data's vocabulary."
    )
    init: Literal["auto", "pretrained", "random"] = Field(
        "auto",
        description="hf: models: 'pretrained' loads the directory's safetensors weights (each "
        "rank reads its shard), 'random' ignores them; auto: pretrained when there are any.",
    )
    impl: Literal["transformers", "trainwise"] = Field(
        "transformers",
        description="hf: models: build the transformers model, or trainwise's own GPT from a "
        "Llama config.json (same weights, renamed).",
    )
    hidden: list[int] = Field(
        default_factory=lambda: [128, 128], description="Hidden layer widths of the 'mlp' model."
    )
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout probability.")
    kwargs: dict = Field(
        default_factory=dict, description="Keyword arguments passed to a custom factory."
    )
    loss: str | None = Field(
        None,
        description="'package.module:fn': the loss, fn(output, target) -> a scalar tensor "
        "(mean over the micro-batch); default: the factory's own (a factory may return "
        "(module, loss_fn)), else cross entropy.",
    )
    norm_impl: Literal["fused", "composite"] = Field(
        "fused",
        description="How trainwise's GPT runs its RMSNorm: 'fused', torch's F.rms_norm (one "
        "kernel each way on CUDA); 'composite', the fp32 chain torchtitan's RMSNorm of 2024 "
        "ran (upcast, pow, mean, rsqrt, scale, cast back, weight: each op a kernel that "
        "keeps its fp32 intermediates for backward). The same weights and, to rounding, the "
        "same values; the planner prices each. LayerNorm models are one kernel either way "
        "(composite is refused for them). Not part of the lineage.",
    )


class DataConfig(Section):
    dataset: str = Field(
        "synthetic",
        description="synthetic: built-in generated language; digits: sklearn's digits "
        "(for the mlp); tokens: a .bin file of uint16 token ids, or a directory written by "
        "`trainwise data prepare` (data.path); or your own, 'package.module:attr': a "
        "torch Dataset (map-style or iterable), a Hugging Face datasets.Dataset or streaming "
        "IterableDataset, or a function returning one.",
    )

    @field_validator("dataset")
    @classmethod
    def _known_or_import_path(cls, value: str) -> str:
        if value in BUILTIN_DATASETS or is_object_reference(value):
            return value
        raise ValueError(
            f"is neither a built-in dataset ({', '.join(BUILTIN_DATASETS)}) nor an import "
            "path 'package.module:attr' of your own dataset"
        )

    collate: str | None = Field(
        None,
        description="Your own dataset: 'package.module:fn', the collate function that turns a "
        "list of samples into a batch (inputs, target); default: torch's default_collate.",
    )
    path: str | None = Field(
        None, description="The token file or prepared directory for dataset = 'tokens'."
    )
    format: Literal["auto", "text", "prompt_response"] = Field(
        "auto",
        description="tokens: how a prepared directory is read. prompt_response: examples whose "
        "loss counts the responses (or assistant turns) only; text: one token stream; auto: "
        "as the directory was prepared.",
    )
    packing: bool = Field(
        True,
        description="prompt_response: pack several whole examples into each sequence "
        "(attention never crosses an example); false: one example per sequence, padded.",
    )
    verify: Literal["full", "fast"] = Field(
        "full",
        description="tokens, a prepared directory: checked before any worker starts. full: "
        "every shard's checksum (xxh3) and largest token id, one read of the corpus (about "
        "a second per GB from a warm cache; a 100 GB corpus read from disk takes minutes); "
        "fast: sizes only.",
    )
    seq_len: int = Field(64, gt=0, description="Tokens per training sequence.")
    micro_batch: int = Field(16, gt=0, description="Samples per worker per forward pass.")
    grad_accum: int = Field(1, gt=0, description="Micro-batches accumulated per optimizer step.")
    global_batch: int | None = Field(
        None,
        gt=0,
        description="Samples per optimizer step over all workers; must equal "
        "micro_batch x grad_accum x data-parallel size. Default: that product.",
    )
    val_fraction: float = Field(0.05, gt=0.0, lt=0.5, description="Held-out share for eval.")
    vocab_size: int = Field(256, ge=2, le=65536, description="Vocabulary of the synthetic corpus.")
    synthetic_tokens: int = Field(
        1_000_000, ge=1000, description="Length of the synthetic corpus in tokens."
    )
    num_workers: int = Field(0, ge=0, description="DataLoader worker processes per rank.")
    pin_memory: bool = Field(False, description="Pin host memory of batches (GPU only).")
    prefetch_factor: int = Field(
        2,
        gt=0,
        description="Batches each loader process prepares ahead (with num_workers > 0).",
    )


class TrainConfig(Section):
    steps: int = Field(200, gt=0, description="Optimizer steps to run.")

    @field_validator("steps")
    @classmethod
    def _real_run(cls, value: int) -> int:
        if value > MAX_STEPS:
            raise ValueError(f"is more steps than any real run: give at most {MAX_STEPS:,}")
        return value

    seed: int = Field(0, description="Seed for weights, data order and dropout.")
    grad_clip: float = Field(1.0, ge=0.0, description="Max global gradient norm; 0 disables.")
    eval_every: int = Field(
        50, ge=0, description="Evaluate every N steps (and at the end); 0: never."
    )
    eval_batches: int = Field(4, gt=0, description="Micro-batches per rank in one evaluation.")
    compile: bool = Field(False, description="torch.compile each block.")
    nonfinite: Literal["skip", "rollback", "stop"] = Field(
        "skip",
        description="On a non-finite loss or gradient norm: skip the update (stop after "
        "train.max_skips in a row), rollback to the last checkpoint, or stop.",
    )
    max_skips: int = Field(
        10, ge=1, description="Non-finite steps in a row tolerated before the run stops."
    )


class OptimConfig(Section):
    name: Literal["adamw", "sgd"] = Field("adamw", description="Optimizer.")
    lr: float = Field(3e-3, gt=0.0, description="Peak learning rate.")
    weight_decay: float = Field(0.0, ge=0.0, description="Decoupled (AdamW) or L2 (SGD) decay.")
    betas: tuple[Beta, Beta] = Field((0.9, 0.95), description="AdamW betas, each in [0, 1).")
    eps: float = Field(1e-8, gt=0.0, description="AdamW epsilon.")
    momentum: float = Field(0.9, ge=0.0, lt=1.0, description="SGD momentum.")
    implementation: OptimizerStep | None = Field(
        None,
        description="How torch.optim runs the step: 'fused' (one kernel per parameter group "
        "reading each tensor once: torchtitan's default since 2025), 'foreach' (a kernel per "
        "operation over every tensor of a kind, and a temporary the size of all of them) or "
        "'for-loop' (a kernel per operation and tensor, as Composer's DecoupledAdamW runs); "
        "default: fused for AdamW, torch's choice for SGD (foreach on CUDA; SGD's fused "
        "kernel has no DTensor rule, so 'fused' with SGD is refused). Not part of the "
        "lineage.",
    )

    @model_validator(mode="before")
    @classmethod
    def _foreach_renamed(cls, data: object) -> object:
        # optim.foreach before optim.implementation: true and false load as 'foreach' and
        # 'for-loop'; unset (torch's choice then) takes today's default.
        if not isinstance(data, dict) or "foreach" not in data:
            return data
        if "implementation" in data:
            raise ValueError(
                "optim.foreach and optim.implementation both set: foreach is the old name; "
                "keep optim.implementation ('fused', 'foreach' or 'for-loop') alone"
            )
        data = dict(data)
        foreach = data.pop("foreach")
        if foreach is not None:
            data["implementation"] = "foreach" if foreach else "for-loop"
        return data

    @model_validator(mode="after")
    def _resolve_implementation(self) -> OptimConfig:
        """AdamW's default is resolved to 'fused' (so the resolved config says what runs);
        SGD's stays torch's choice, which depends on the device."""
        if self.name == "adamw" and self.implementation is None:
            object.__setattr__(self, "implementation", "fused")  # (no re-validation)
        if self.name == "sgd" and self.implementation == "fused":
            raise ValueError(
                "optim.implementation = 'fused' runs AdamW only (torch's fused SGD has no "
                "DTensor rule): use 'foreach' or 'for-loop' with optim.name = 'sgd'"
            )
        return self


class ScheduleConfig(Section):
    warmup_steps: int = Field(10, ge=0, description="Linear warmup from 0 to optim.lr.")
    decay: Literal["cosine", "linear", "constant"] = Field(
        "cosine", description="Shape after warmup, down to min_lr_ratio x lr at the last step."
    )
    min_lr_ratio: float = Field(0.1, ge=0.0, le=1.0, description="Final lr as a share of lr.")


class ParallelConfig(Section):
    strategy: Strategy = Field(
        "auto",
        description="auto: the planner's choice (`trainwise plan`'s search over the layouts "
        "the runtime runs: the fastest that fits with headroom, the simplest within 1 %; the "
        "job's micro-batch, accumulation and checkpointing kept); single: one process; ddp; "
        "fsdp (FSDP2); hsdp: replicate x shard on a 2-D mesh.",
    )
    shard: Literal["full", "grad_op"] = Field(
        "full",
        description="fsdp: full = reshard parameters after forward (ZeRO-3); "
        "grad_op = keep them until backward ends (ZeRO-2). With pipeline stages (pp > 1) "
        "FSDP keeps each stage's parameters gathered through the step either way "
        "(torchtitan's default): full runs as grad_op.",
    )
    cpu_offload: bool = Field(False, description="fsdp: keep sharded state in CPU memory.")
    replicate: int | None = Field(
        None,
        gt=0,
        validation_alias=AliasChoices("replicate", "dp_replicate"),
        description="hsdp: replica groups (also written dp_replicate); default: the number "
        "of machines.",
    )
    dp_shard: int | None = Field(
        None,
        gt=0,
        description="FSDP shard group size (may span machines); default: the workers / (tp x "
        "replica groups).",
    )
    tp: int = Field(
        1,
        gt=0,
        description="Tensor-parallel degree, inside one machine; tp > 1 needs a model with a "
        "tensor-parallel plan.",
    )
    pp: int = Field(
        1,
        gt=0,
        description="Pipeline-parallel degree: the model's blocks split into this many stages "
        "(embeddings on the first, the final norm and head on the last), outermost in the "
        "mesh, so stages may sit on different machines and exchange only activations.",
    )
    ep: int = Field(
        1,
        gt=0,
        description="Expert-parallel degree of a Mixture-of-Experts model: its experts split "
        "this many ways over the data-parallel ranks (borrowed from them, as torchtitan does: "
        "it must divide world / (tp x pp)), tokens sent to their experts and back by "
        "all-to-all; 1: every rank holds every expert.",
    )
    pp_schedule: PipelineSchedule = Field(
        "1F1B",
        description="pp > 1: torch.distributed.pipelining's schedule. GPipe (all forwards, then "
        "all backwards), 1F1B, Interleaved1F1B and InterleavedZeroBubble (pp_virtual stages "
        "per rank), ZBVZeroBubble (two stages per rank in a V).",
    )
    pp_virtual: int = Field(
        1,
        gt=0,
        description="pp > 1: stages per rank (the interleaved schedules need 2 or more; "
        "ZBVZeroBubble exactly 2).",
    )
    pp_microbatches: int | None = Field(
        None,
        gt=0,
        description="pp > 1: micro-batches each rank's step is cut into for the pipeline "
        "(they must cut its data.micro_batch x data.grad_accum samples evenly); default: one "
        "sample each. 1F1B needs at least pp.",
    )
    sequence_parallel: bool | None = Field(
        None, description="With tp > 1, norms run sequence-parallel; default: on when tp > 1."
    )
    allow_tp_across_nodes: bool = Field(
        False, description="Let tp exceed the workers of one machine (slow: TP runs every layer)."
    )
    accumulate: Literal["auto", "sharded", "unsharded"] = Field(
        "auto",
        description="FSDP with accumulation: sharded = reduce-scatter every micro-batch "
        "(gradients stay sharded); unsharded = once per step (full gradients between "
        "micro-batches); auto = the planner's choice.",
    )
    ac: Literal["none", "selective", "full", "selective-op"] = Field(
        "none",
        description="Activation checkpointing: full = every block recomputed, selective = "
        "every other block, selective-op = every block keeps the outputs of attention, every "
        "other matmul and tensor parallelism's reduce-scatters and recomputes the rest "
        "(torchtitan's per-operation policy).",
    )
    headroom: float = Field(
        0.05,
        ge=0.0,
        lt=1.0,
        description="auto and plan: share of device memory kept free beyond the estimate, "
        "which already counts the CUDA context and 5 % for the allocator's fragmentation: "
        "the margin for the formula's own error (under 4 % against --simulate). Published "
        "runs ran at 91-94 % of their GPUs' memory by the estimate (bench/published.py).",
    )
    timeout_s: float = Field(
        600.0,
        gt=0.0,
        description="A collective that has not completed after this many seconds fails the "
        "step (and the elastic agent restarts the group).",
    )


    @model_validator(mode="after")
    def _shortcut(self) -> ParallelConfig:
        """A planner row name (fsdp-full, ...) becomes fsdp with its options."""
        given = self.model_fields_set
        try:
            kind, shard, offload = read_strategy(
                self.strategy,
                self.shard if "shard" in given else None,
                self.cpu_offload if "cpu_offload" in given else None,
            )
        except ConfigError as err:
            raise ValueError(str(err)) from None
        # object.__setattr__: an assignment would validate (and call this) again
        object.__setattr__(self, "strategy", kind)
        object.__setattr__(self, "shard", shard or self.shard)
        object.__setattr__(self, "cpu_offload", self.cpu_offload if offload is None else offload)
        return self


class PrecisionConfig(Section):
    dtype: Precision = Field(
        "fp32",
        description="Compute dtype: fp32, bf16 (autocast / FSDP mixed precision), "
        "fp16 (with gradient scaling; CUDA only).",
    )
    reduce_dtype: Literal["fp32", "bf16"] = Field(
        "fp32", description="fsdp: dtype of the gradient reduce-scatter."
    )
    init_scale: float = Field(65536.0, gt=0.0, description="fp16: initial loss scale.")
    float8: Literal["none", "tensorwise", "rowwise"] = Field(
        "none",
        description="Float8 training (torchao's convert_to_float8_training): the Linears whose "
        "dimensions are multiples of 16, the output head excepted, run their three GEMMs in "
        "float8 with dynamic scales, one per tensor (tensorwise) or per row (rowwise); the "
        "weights stay in high precision. With precision.dtype bf16 or fp32, not fp16. "
        "`trainwise plan` prices it (a GPU with an fp8 peak in the catalog); `trainwise "
        "train` runs torchao's kernels on a GPU of compute capability 8.9+ and emulates "
        "them on a CPU; not with LoRA or a Mixture-of-Experts model.",
    )
    float8_all_gather: bool = Field(
        True,
        description="precision.float8 = 'tensorwise' under FSDP: all-gather the weights in "
        "float8 (1 byte a parameter instead of 2), their scales computed once after each "
        "optimizer step; with tensor parallelism the activations are gathered in float8 too. "
        "Rowwise gathers in high precision (true is refused with it, false is implied).",
    )

    @model_validator(mode="after")
    def _float8(self) -> PrecisionConfig:
        """float8 with fp16 and rowwise with float8_all_gather set true are refused; rowwise
        leaves the default all-gather off (so the resolved config says what runs)."""
        if self.float8 == "none":
            return self
        if self.dtype == "fp16":
            raise ValueError(
                f"precision.float8 = '{self.float8}' with precision.dtype = 'fp16': float8 "
                "training keeps bf16 or fp32 weights and outputs (torchao has no fp16 "
                "scaling path); use precision.dtype = 'bf16'"
            )
        if self.float8 == "rowwise" and self.float8_all_gather:
            if "float8_all_gather" in self.model_fields_set:
                raise ValueError(
                    "precision.float8_all_gather = true with precision.float8 = 'rowwise': "
                    "FSDP's float8 all-gather takes one scale per tensor (tensorwise only); "
                    "set precision.float8 = 'tensorwise' or float8_all_gather = false"
                )
            object.__setattr__(self, "float8_all_gather", False)  # (no re-validation)
        return self


class CheckpointConfig(Section):
    """Sharded (torch.distributed.checkpoint), atomic, verified checkpoints and resume."""

    model_config = ConfigDict(
        extra="forbid", validate_assignment=True, populate_by_name=True, allow_inf_nan=False
    )

    enabled: bool = Field(True, description="Write checkpoints during training.")
    dir: str | None = Field(None, description="Checkpoint folder; default: <run_dir>/checkpoints.")
    interval: int | Literal["auto"] = Field(
        100,
        description="Save every N steps, or 'auto': the Young/Daly optimum from the measured "
        "save stall and cluster.mtbf_hours, recomputed as measurements come in.",
    )

    @field_validator("interval", mode="before")
    @classmethod
    def _steps_or_auto(cls, value: object) -> object:
        if value == "auto" or (
            isinstance(value, int) and not isinstance(value, bool) and value > 0
        ):
            return value
        raise ValueError("must be a whole number of steps >= 1 or 'auto'")

    every_minutes: float | None = Field(
        None, gt=0.0, description="Also save when this many minutes passed since the last save."
    )
    save_final: bool = Field(True, description="Save after the last step (for export).")
    keep_last: int = Field(
        2, ge=1, description="Keep the newest N checkpoints; older ones are deleted after a save."
    )
    keep_every: int | None = Field(
        None, gt=0, description="Also keep every checkpoint whose step is a multiple of N."
    )
    resume: str = Field(
        "auto",
        description="auto: from the newest valid checkpoint of the run's lineage, fresh when "
        "none ever existed; never: start a new lineage (earlier checkpoints are moved aside "
        "into previous/, not deleted; a restart of this launch resumes the new lineage); or "
        "the path of a checkpoint to start from.",
    )
    resume_from_other: Literal["no", "weights", "all"] = Field(
        "no",
        description="A checkpoint written with other training settings (model, optimizer, "
        "data, precision, seed: its lineage) is refused; 'weights' takes its model weights "
        "with a fresh optimizer, 'all' its optimizer state too; either continues from its "
        "step. true means 'weights'.",
    )

    @field_validator("resume_from_other", mode="before")
    @classmethod
    def _bool_means_weights(cls, value: object) -> object:
        return (
            {True: "weights", False: "no"}.get(value, value) if isinstance(value, bool) else value
        )

    async_save: bool = Field(
        False,
        alias="async",
        description="Save in the background (DCP async_save): the loop stalls only while the "
        "state is copied to host memory; at most one save in flight.",
    )
    verify: Literal["full", "fast"] = Field(
        "full",
        description="On load: full = sizes and checksums (xxh3) of every file; fast = sizes only.",
    )
    max_restarts: int = Field(
        3, ge=0, description="Times torchrun's elastic agent restarts the workers after a failure."
    )
    write_gbps: float = Field(
        2.0,
        gt=0.0,
        description="Plan: GB/s one node writes checkpoints at (an assumption; the doctor "
        "measures it).",
    )
    save_latency_s: float = Field(
        0.05,
        ge=0.0,
        description="Plan: fixed seconds of a save whatever its size (planning, metadata, the "
        "atomic commit; an assumption: the doctor measures it, --calibrate takes it).",
    )


class ClusterConfig(Section):
    nproc: int | None = Field(
        None, gt=0, description="Workers on this machine; default: one per GPU, or 2 on CPU."
    )
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto: cuda if available.")
    backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto", description="auto: nccl on cuda, gloo on cpu."
    )
    gpu: str | None = Field(
        None, description="GPU type from the hardware catalog; default: detected."
    )

    @field_validator("gpu")
    @classmethod
    def _known_gpu(cls, value: str | None) -> str | None:
        if value is not None and find_gpu(value) is None:
            raise ValueError(f"is not in the hardware catalog; known: {', '.join(gpu_names())}")
        return value

    allow_version_mismatch: bool = Field(
        False,
        description="Train even when ranks run different versions of Python, torch, CUDA, "
        "NCCL or trainwise (checked at start-up).",
    )
    oversubscribe: bool = Field(
        False,
        description="Start more CPU workers (cluster.nproc) than this machine has cores "
        "(they take turns on them: slower steps; for tests of a layout). Refused otherwise.",
    )
    device_memory_gb: float | None = Field(
        None,
        gt=0.0,
        description="Memory per device in GB for 'auto' and the plan; default: detected "
        "(train) or the catalog's figure for cluster.gpu (plan).",
    )
    gpu_tflops: float | None = Field(
        None,
        gt=0.0,
        description="Plan: dense peak TFLOP/s per GPU at precision.dtype, replacing the "
        "catalog's figure (a GPU the catalog lacks).",
    )
    hbm_gbps: float | None = Field(
        None,
        gt=0.0,
        description="Plan: device memory bandwidth in GB/s, replacing the catalog's figure "
        "for cluster.gpu (an HBM2e part of a GPU the catalog lists with HBM3, say).",
    )
    sustained_clock_mhz: float | None = Field(
        None,
        gt=0.0,
        description="Plan: the SM clock the GPUs hold under a training load (nvidia-smi's "
        "clocks.sm during a step; lower under a power cap); the planner scales its GEMM and "
        "attention rates by it over the clock the catalog's rates were measured at. Default: "
        "that clock (Hopper 1466 MHz, Blackwell 1319 MHz at 700 W / 1000 W, all 8 GPUs busy).",
    )
    intra_node_gbps: float | None = Field(
        None,
        gt=0.0,
        description="Plan: GB/s per GPU and direction within a node, as NCCL reaches it; "
        "default: the catalog's link of cluster.gpu.",
    )
    inter_node_gbps: float | None = Field(
        None,
        gt=0.0,
        description="Plan: GB/s per NIC and direction between nodes, as NCCL reaches it; "
        "default: InfiniBand NDR, 47 of its 50 GB/s (one 400 Gb/s port).",
    )
    nics_per_node: int | None = Field(
        None,
        gt=0,
        description="Plan: NICs per node between nodes; the node's collectives cross them "
        "in parallel. Default: one per GPU (rail-optimized nodes such as DGX H100).",
    )
    host_memory_gb: float | None = Field(
        None,
        gt=0.0,
        description="Plan: host memory per node in GB (cpu offload); default: 256 GB per GPU.",
    )
    restart_min: float = Field(
        10.0,
        gt=0.0,
        description="Plan: minutes from a failure to training again (detect, reschedule, "
        "restart, load the checkpoint); an assumption.",
    )
    master_port: int | None = Field(
        None, gt=0, lt=65536, description="Rendezvous port; default: a free one."
    )
    nodes: int = Field(
        1, gt=0, description="Machines in the job (the most, with min_nodes); --nnodes sets it."
    )
    min_nodes: int | None = Field(
        None,
        gt=0,
        description="Elastic: the fewest machines to train on (--nnodes MIN:MAX); default: nodes.",
    )
    rdzv_endpoint: str | None = Field(
        None,
        description="host:port of the c10d rendezvous, the same on every machine (the first "
        "machine's address); needed with nodes > 1.",
    )
    rdzv_id: str | None = Field(
        None, description="The job's id at the rendezvous, the same on every machine."
    )
    socket_ifname: str | None = Field(
        None,
        description="Network interface for gloo and NCCL (GLOO_SOCKET_IFNAME, "
        "NCCL_SOCKET_IFNAME); default: theirs.",
    )
    local_addr: str | None = Field(
        None,
        description="This machine's address as the others reach it (torchrun's --local-addr); "
        "default: its hostname. Set it where the hostname resolves to another network.",
    )
    node_rank: int | None = Field(
        None,
        ge=0,
        description="0 on the machine named by rdzv_endpoint, which then hosts the rendezvous "
        "store (torchrun's --node-rank); default: the machine whose address matches. The "
        "rendezvous numbers the workers itself.",
    )
    rdzv_timeout_s: int = Field(
        600, gt=0, description="How long a machine waits at the rendezvous for the others."
    )
    rdzv_last_call_s: int = Field(
        30,
        ge=0,
        description="Elastic: once min_nodes machines have joined, how long the rendezvous "
        "still waits for more before training starts without them.",
    )
    node_timeout_s: int = Field(
        15,
        ge=3,
        description="A machine whose agent is silent this long is dropped from the rendezvous "
        "(heartbeats every third of it); the others then carry on within min_nodes.",
    )

    @model_validator(mode="after")
    def _node_range(self) -> ClusterConfig:
        if self.min_nodes is not None and self.min_nodes > self.nodes:
            raise ValueError(
                f"cluster.min_nodes = {self.min_nodes} is more than cluster.nodes = "
                f"{self.nodes}: give --nnodes MIN:MAX with MIN <= MAX"
            )
        if self.node_rank is not None and self.node_rank >= self.nodes:
            raise ValueError(
                f"cluster.node_rank = {self.node_rank} needs cluster.nodes > {self.node_rank}: "
                "machines are numbered from 0"
            )
        return self

    mtbf_hours: float = Field(
        6000.0,
        gt=0.0,
        description="Mean time between failures of one node, in hours (Llama 3 saw 419 "
        "interruptions in 54 days on 2,048 nodes: about 6,300 h per node).",
    )


class CostConfig(Section):
    price_per_gpu_hour: float | None = Field(
        None, ge=0.0, description="USD per GPU-hour; default: the catalog's figure."
    )


class PlanConfig(Section):
    """Inputs only the planner reads (`trainwise plan`); the rest comes from the job."""

    params: int | None = Field(
        None,
        gt=0,
        description="A bare parameter count instead of model.name: model states "
        "only (activations need a shape).",
    )
    layers: int | None = Field(None, gt=0, description="Shape: transformer layers.")
    hidden: int | None = Field(None, gt=0, description="Shape: model width.")
    heads: int | None = Field(None, gt=0, description="Shape: attention heads.")
    kv_heads: int | None = Field(None, gt=0, description="Shape: key/value heads (GQA).")
    ffn: int | None = Field(None, gt=0, description="Shape: feed-forward width.")
    vocab: int | None = Field(None, gt=0, description="Shape: vocabulary.")
    tokens: float | Literal["chinchilla"] | None = Field(
        None,
        description="Tokens to train in total; 'chinchilla': 20 per parameter; default: "
        "train.steps x global batch x data.seq_len.",
    )

    @field_validator("tokens")
    @classmethod
    def _positive_tokens(cls, value: object) -> object:
        if isinstance(value, float) and not (math.isfinite(value) and value > 0):
            raise ValueError("must be a finite number > 0 or 'chinchilla'")
        return value

    gpus: int | None = Field(
        None, gt=0, description="GPUs in total; default: cluster.nproc x cluster.nodes."
    )
    objective: Literal["cost", "time"] = Field(
        "cost", description="Recommend the cheapest or the fastest strategy that fits."
    )
    max_pp: int | None = Field(
        None,
        gt=0,
        description="The most pipeline stages the search weighs when parallel.pp is not set "
        "(with their schedules, virtual stages and micro-batch counts); 1: none; default: "
        "every degree whose stages split the model's blocks.",
    )
    strategy: Strategy | None = Field(
        None,
        description="Plan only this strategy (train's words: single, ddp, fsdp with "
        "parallel.shard, hsdp, auto; or the plan's row names fsdp-full, fsdp-grad-op, "
        "fsdp-offload); the knobs the job does not set are still searched.",
    )
    efficiency: float | None = Field(
        None,
        gt=0.0,
        le=1.0,
        description="Achieved share of the GPU's peak FLOP/s in compute, overriding the "
        "planner's per-operation model (default: modelled per GEMM, attention, memory-bound "
        "op and kernel launch; --calibrate replaces it with a measured share).",
    )
    data_samples_per_s: float | None = Field(
        None, gt=0.0, description="Samples/s one GPU's loader delivers; default: unlimited."
    )
    loss_kernel: Literal["standard", "fp32", "fused"] = Field(
        "standard",
        description="The cross-entropy of the run planned: 'standard' (F.cross_entropy on the "
        "logits as they come, what trainwise runs: a log-softmax over the vocabulary kept for "
        "backward, fp32 under autocast, 16-bit under FSDP), 'fp32' (the same on logits upcast "
        "to fp32, eager, as torchtitan ran it in 2024) or 'fused' (one kernel each way that "
        "keeps the 16-bit logits and writes their gradient: flash-attn's cross_entropy that "
        "llm-foundry runs, or torch.compile's, as torchtitan compiles its loss). A planner "
        "key: trainwise trains 'standard'.",
    )
    attention_kernel: Literal["sdpa", "fused"] = Field(
        "sdpa",
        description="The attention kernel of the run planned: 'sdpa' (PyTorch's flash "
        "kernel, FlashAttention-2, what trainwise runs) or 'fused' (FlashAttention-3 or "
        "cuDNN's, as Transformer Engine runs; priced on Hopper only). A planner key.",
    )
    routing_kernel: Literal["eager", "fused"] = Field(
        "eager",
        description="A Mixture-of-Experts run's token routing: 'eager' (torchtitan's, what "
        "trainwise runs) or 'fused' (Transformer Engine's permutation and DeepEP's "
        "dispatch). A planner key.",
    )
    sweep: list[int] | None = Field(None, description="GPU counts to sweep, e.g. [1, 2, 4, 8].")
    calibration: str | None = Field(
        None,
        description="A calibration file or a trainwise train or doctor run directory whose "
        "measurements replace the plan's assumptions (efficiency, links, loader, checkpoint "
        "latency, runtime memory), as `trainwise plan --calibrate` does; `trainwise train` "
        "plans and chooses with them. Unset: this machine kind's file that `trainwise doctor` "
        "wrote, if any; 'none': the defaults.",
    )

    @field_validator("sweep")
    @classmethod
    def _counts(cls, value: list[int] | None) -> list[int] | None:
        if value is not None and (not value or any(n < 1 for n in value)):
            raise ValueError("must be a non-empty list of GPU counts >= 1")
        return value


# The doctor's checks, in the order they run (trainwise.doctor.checklist implements them).
CHECK_NAMES = ("versions", "bandwidth", "data", "scaling", "smoke", "memory", "disk")
CheckName = Literal["versions", "bandwidth", "data", "scaling", "smoke", "memory", "disk"]


class DoctorConfig(Section):
    """How much the doctor measures (`trainwise doctor`)."""

    checks: list[CheckName] | None = Field(
        None,
        description="Checks to run (versions, bandwidth, data, scaling, smoke, memory, "
        "disk); default: all. --only sets it.",
    )
    max_message_mb: float | None = Field(
        None,
        gt=0.0,
        description="Largest collective message timed, in MiB; default: 256 on GPU, 64 on CPU.",
    )
    iterations: int = Field(5, gt=0, description="Timed iterations per collective and size.")
    timed_steps: int = Field(4, gt=0, description="Timed training steps per measurement.")
    smoke_steps: int = Field(8, ge=2, description="Steps of the smoke test on one batch.")
    data_batches: int = Field(16, gt=0, description="Micro-batches read per loader timing.")


class LoggingConfig(Section):
    run_dir: str | None = Field(
        None, description="Run directory; default: runs/<date>-<time>-<model>."
    )

    @field_validator("run_dir")
    @classmethod
    def _named_run_dir(cls, value: str | None) -> str | None:
        if value is not None and not value.strip():
            raise ValueError(
                "an empty run directory: give a path, or leave the key out for "
                "runs/<date>-<time>-<model>"
            )
        return value
    flush_every: int = Field(
        10,
        gt=0,
        description="Average the losses over ranks and write the buffered per-step records "
        "every N steps (one collective per N steps, none per step, completed beside the "
        "next step; with 1, each record is written at its step); the ranks agree on a "
        "stop or save at least as often (and about every second of training in between).",
    )
    print_every: int = Field(10, gt=0, description="Plain progress line every N steps.")
    report: bool = Field(
        True,
        description="Write RUN/report.html when training ends (`trainwise report RUN` makes "
        "it again from the run directory).",
    )
    progress: Literal["auto", "bar", "lines", "none"] = Field(
        "auto", description="auto: a bar in a terminal, plain lines otherwise."
    )
    trackers: list[Literal["tensorboard", "mlflow", "wandb"]] = Field(
        default_factory=lambda: ["tensorboard"],
        description="Experiment trackers rank 0 also records to (the config, every step's "
        "figures, the events, the run's files at the end); a tracker that fails is one "
        "warning. mlflow and wandb need `pip install 'trainwise[mlflow]'` / `[wandb]`; "
        "wandb runs offline without WANDB_API_KEY.",
    )
    mlflow_uri: str | None = Field(
        None,
        description="MLflow tracking URI (a server URL, sqlite:///PATH or file:PATH); default: "
        "sqlite:///RUN/mlflow.db (MLflow's recommended local backend).",
    )
    tensorboard: bool = Field(
        True,
        description="false: leave 'tensorboard' out of logging.trackers (older job files).",
    )
    tensorboard_every: int = Field(
        10, gt=0, description="TensorBoard points every N steps (metrics.jsonl has every step)."
    )
    data_wait_warn: float = Field(
        0.1,
        ge=0.0,
        le=1.0,
        description="Warn once when the workers wait for data more than this share of the "
        "steps so far; 0: never.",
    )
    probe_every: int = Field(
        500,
        ge=0,
        description="Every N steps (and on steps 3-5), time one extra forward+backward of the "
        "last micro-batch without communication to split exposed gradient sync from compute: "
        "it costs 1 / (N x micro-batches) of the compute; 0: never.",
    )
    profile_steps: list[int] = Field(
        default_factory=list,
        description="[first, last]: trace these steps with torch.profiler on every rank "
        "(RUN/profile/: a Chrome trace per rank, a summary the report shows; on CUDA a "
        "memory snapshot); their timings are left out of the report's figures. []: off.",
    )

    @field_validator("profile_steps")
    @classmethod
    def _window(cls, v: list[int]) -> list[int]:
        if v and (len(v) != 2 or not 1 <= v[0] <= v[1]):
            raise ValueError("must be [first, last] steps with 1 <= first <= last, or []")
        return v

    @model_validator(mode="after")
    def _no_tensorboard(self) -> LoggingConfig:
        if not self.tensorboard and "tensorboard" in self.trackers:
            # object.__setattr__: an assignment would validate (and call this) again
            object.__setattr__(self, "trackers", [t for t in self.trackers if t != "tensorboard"])
        return self


# lora.targets' default, read by the runtime (models.lora) and the planner (plan.model.lora):
# the attention projections and the MLP of the built-in GPT (blocks.N.attn.*_proj,
# blocks.N.mlp.{up,gate,down}) and the Llama family (model.layers.N.self_attn.{q,k,v,o}_proj,
# model.layers.N.mlp.{gate,up,down}_proj).
LORA_DEFAULT_TARGETS = (
    "q_proj", "k_proj", "v_proj", "o_proj", "out_proj",
    "gate_proj", "up_proj", "down_proj", "*.mlp.up", "*.mlp.gate", "*.mlp.down",
)


def lora_target_matches(name: str, patterns: list[str] | tuple[str, ...]) -> bool:
    """lora.targets' rule: a module is targeted when a pattern matches (fnmatch, case
    sensitive) its full name or the last part of it."""
    last = name.rsplit(".", 1)[-1]
    return any(fnmatchcase(name, p) or fnmatchcase(last, p) for p in patterns)


class LoraConfig(Section):
    rank: int = Field(
        0,
        ge=0,
        description="LoRA's rank r: the targeted Linears are frozen and learn a low-rank "
        "update B @ A (A: r x in, B: out x r); 0 = off (every parameter trains).",
    )
    alpha: float = Field(
        16.0, gt=0.0, description="LoRA's alpha: the update is scaled by alpha / rank."
    )
    dropout: float = Field(
        0.0, ge=0.0, lt=1.0, description="Dropout on the adapters' input (PEFT's lora_dropout)."
    )
    targets: list[str] | None = Field(
        None,
        description="Module-name patterns (fnmatch, on the full name or its last part) of "
        "the Linears that get adapters; default: the attention projections and the MLP of "
        "the built-in GPT and the Llama family.",
    )

    @field_validator("targets")
    @classmethod
    def _some_targets(cls, value: list[str] | None) -> list[str] | None:
        # An empty list would give adapters to nothing (the runtime) while the planner,
        # reading it as unset, priced the defaults: refused, as a pattern matching nothing is.
        if value == []:
            raise ValueError("is empty: list at least one pattern, or leave it unset for "
                             "the default targets")
        return value

    train_embeddings: bool = Field(
        False, description="With LoRA: the token embeddings train fully too (else frozen)."
    )
    train_head: bool = Field(
        False, description="With LoRA: the output head trains fully too (else frozen)."
    )


class MoEConfig(Section):
    aux_loss_coef: float = Field(
        0.001,
        ge=0.0,
        description="A Mixture-of-Experts model's load-balancing loss, added to the training "
        "loss with this weight (metrics.jsonl logs `loss` with it and `aux_loss`, its part): "
        "per sequence and MoE layer E/(K T) x sum over experts of (tokens routed to it) x "
        "(its mean router score) (DeepSeek-V3's sequence-wise form of Switch's loss: 1 when "
        "balanced), averaged over the layers and the sequences; 0 = off. Qwen3-MoE and "
        "DeepSeekMoE train with 0.001.",
    )
    bias_update_rate: float = Field(
        0.0,
        ge=0.0,
        description="Auxiliary-loss-free balancing (DeepSeek-V3, Wang et al. 2024): each "
        "expert's routing bias, added to its score for the choice only, moves by this much "
        "after every optimizer step, up for experts that got fewer tokens than the mean over "
        "the step's global batch and down for those that got more; 0 = off (DeepSeek-V3: "
        "0.001).",
    )
    capacity_factor: float | None = Field(
        None,
        gt=0.0,
        description="Token dropping: each expert takes at most capacity_factor x tokens x "
        "top_k / experts of a micro-batch's tokens (in token order); the tokens beyond pass "
        "it by (its share of their output is zero; the computation still runs). None "
        "(default): no dropping, every token reaches its top_k experts.",
    )
    imbalance: float = Field(
        1.25,
        ge=1.0,
        description="For the planner: the routed tokens the busiest expert-parallel rank "
        "gets over the mean (1 = perfectly balanced). It scales the slowest rank's expert "
        "GEMMs, its all-to-all and its routed activations. Default 1.25, Switch "
        "Transformer's capacity factor (Fedus et al., 2022, section 2.2: the headroom over "
        "the mean load at which few tokens overflow with the balancing loss); measured by a "
        "run's tokens per expert (docs/planner.md). Not part of the lineage.",
    )


class JobConfig(Section):
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    schedule: ScheduleConfig = Field(default_factory=ScheduleConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    lora: LoraConfig = Field(default_factory=LoraConfig)
    moe: MoEConfig = Field(default_factory=MoEConfig)
    precision: PrecisionConfig = Field(default_factory=PrecisionConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    cost: CostConfig = Field(default_factory=CostConfig)
    plan: PlanConfig = Field(default_factory=PlanConfig)
    doctor: DoctorConfig = Field(default_factory=DoctorConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
