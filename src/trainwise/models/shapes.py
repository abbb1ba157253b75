"""GPT shapes as plain data: the dimensions of a decoder-only transformer, its exact
parameter count, and the named presets; and the profile of any other model (its blocks,
their GEMMs, what a sample of it measured). No torch here, so that the planner can size a
70B model without importing it."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Literal

from trainwise.errors import ModelError

_NORMS = ("layernorm", "rmsnorm")
_MLPS = ("gelu", "swiglu")
_POS = ("learned", "rope")


@dataclass(frozen=True)
class GPTShape:
    """Everything that decides a GPT's parameters and FLOPs."""

    n_layer: int
    d_model: int
    n_head: int
    n_kv_head: int
    d_ff: int
    vocab_size: int
    max_seq_len: int
    norm: Literal["layernorm", "rmsnorm"]
    mlp: Literal["gelu", "swiglu"]
    pos: Literal["learned", "rope"]
    tie_embeddings: bool
    bias: bool
    # Rotary base frequency; only read when pos == "rope" (Llama 2: 1e4, Llama 3: 5e5).
    rope_theta: float = 10000.0
    # The norms' epsilon (Hugging Face Llama: rms_norm_eps); no effect on sizes.
    norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        problems: list[str] = []
        for name in (
            "n_layer",
            "d_model",
            "n_head",
            "n_kv_head",
            "d_ff",
            "vocab_size",
            "max_seq_len",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                problems.append(f"model shape {name} = {value!r}: must be a positive integer")
        for name, allowed in (("norm", _NORMS), ("mlp", _MLPS), ("pos", _POS)):
            if getattr(self, name) not in allowed:
                problems.append(
                    f"model shape {name} = {getattr(self, name)!r}: "
                    f"must be one of {', '.join(allowed)}"
                )
        if problems:  # the divisibility checks below need valid integers
            raise ModelError(problems)
        if self.d_model % self.n_head:
            problems.append(
                f"model shape d_model = {self.d_model} is not divisible by "
                f"n_head = {self.n_head}; pick n_head dividing d_model"
            )
        elif self.pos == "rope" and self.head_dim % 2:
            problems.append(
                f"model shape head_dim = d_model / n_head = {self.head_dim} is odd; "
                "rope needs an even head_dim, change d_model or n_head"
            )
        if self.n_head % self.n_kv_head:
            problems.append(
                f"model shape n_head = {self.n_head} is not divisible by "
                f"n_kv_head = {self.n_kv_head}; pick n_kv_head dividing n_head"
            )
        if not self.norm_eps > 0:
            problems.append(f"model shape norm_eps = {self.norm_eps!r}: must be > 0")
        if not self.rope_theta > 0:
            problems.append(f"model shape rope_theta = {self.rope_theta!r}: must be > 0")
        if problems:
            raise ModelError(problems)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    def num_params(self) -> int:
        """Exact parameter count of `GPT(self)`, tied weights counted once."""
        d, f, v, hd = self.d_model, self.d_ff, self.vocab_size, self.head_dim
        q_dim, kv_dim = self.n_head * hd, self.n_kv_head * hd
        norm = d * (2 if self.norm == "layernorm" and self.bias else 1)
        attn = d * q_dim + 2 * d * kv_dim + q_dim * d
        n_in = 2 if self.mlp == "swiglu" else 1  # swiglu has a gate and an up projection
        mlp = n_in * d * f + f * d
        if self.bias:
            attn += q_dim + 2 * kv_dim + d
            mlp += n_in * f + d
        block = 2 * norm + attn + mlp
        total = v * d + self.n_layer * block + norm
        if self.pos == "learned":
            total += self.max_seq_len * d
        if not self.tie_embeddings:
            total += v * d
        return total


def _gpt2(n_layer: int, d_model: int, n_head: int) -> GPTShape:
    return GPTShape(
        n_layer=n_layer,
        d_model=d_model,
        n_head=n_head,
        n_kv_head=n_head,
        d_ff=4 * d_model,
        vocab_size=50257,
        max_seq_len=1024,
        norm="layernorm",
        mlp="gelu",
        pos="learned",
        tie_embeddings=True,
        bias=True,
    )


def _mpt(n_layer: int, d_model: int, n_head: int) -> GPTShape:
    """MosaicML's MPT as llm-foundry's pretraining yamls build it: learned positions (no
    ALiBi), biases and LayerNorm (its no_bias = False default), a GELU MLP of 4 d_model,
    tied embeddings, vocabulary 50,368; 2,048 tokens. The count is the benchmark tables'
    NumParams to the parameter (mpt-7b: 6,658,859,008 at 2,048 tokens)."""
    return replace(_gpt2(n_layer, d_model, n_head), vocab_size=50368, max_seq_len=2048)


def _llama(
    n_layer: int,
    d_model: int,
    n_head: int,
    n_kv_head: int,
    d_ff: int,
    vocab_size: int,
    max_seq_len: int,
    tie: bool,
    rope_theta: float = 10000.0,
) -> GPTShape:
    return GPTShape(
        n_layer=n_layer,
        d_model=d_model,
        n_head=n_head,
        n_kv_head=n_kv_head,
        d_ff=d_ff,
        vocab_size=vocab_size,
        max_seq_len=max_seq_len,
        norm="rmsnorm",
        mlp="swiglu",
        pos="rope",
        tie_embeddings=tie,
        bias=False,
        rope_theta=rope_theta,
    )


PRESETS: dict[str, GPTShape] = {
    # CPU-sized, for tests and smoke runs (byte vocabulary).
    "tiny": GPTShape(
        n_layer=2,
        d_model=64,
        n_head=4,
        n_kv_head=4,
        d_ff=256,
        vocab_size=256,
        max_seq_len=128,
        norm="layernorm",
        mlp="gelu",
        pos="learned",
        tie_embeddings=True,
        bias=True,
    ),
    # CPU-friendly, Llama-style so the rmsnorm/swiglu/rope/GQA path gets real use (~6M).
    "small": GPTShape(
        n_layer=6,
        d_model=256,
        n_head=8,
        n_kv_head=4,
        d_ff=1024,
        vocab_size=256,
        max_seq_len=256,
        norm="rmsnorm",
        mlp="swiglu",
        pos="rope",
        tie_embeddings=True,
        bias=False,
    ),
    # openai-community/gpt2 config.json: n_layer 12, n_embd 768, n_head 12, n_positions 1024.
    "gpt2-124m": _gpt2(12, 768, 12),
    # openai-community/gpt2-medium config.json: n_layer 24, n_embd 1024, n_head 16.
    "gpt2-350m": _gpt2(24, 1024, 16),
    # meta-llama/Llama-3.2-1B config.json: 16 layers, hidden 2048, 32 heads, 8 kv heads,
    # intermediate 8192, vocab 128256, tied, rope_theta 5e5 (context cut to 2048 for planning).
    "llama-1b": _llama(16, 2048, 32, 8, 8192, 128256, 2048, tie=True, rope_theta=500000.0),
    # meta-llama/Llama-2-7b-hf config.json: 32 layers, hidden 4096, 32 heads, inter. 11008.
    "llama-7b": _llama(32, 4096, 32, 32, 11008, 32000, 4096, tie=False),
    # meta-llama/Llama-2-13b-hf config.json: 40 layers, hidden 5120, 40 heads, inter. 13824.
    "llama-13b": _llama(40, 5120, 40, 40, 13824, 32000, 4096, tie=False),
    # meta-llama/Llama-2-70b-hf config.json: 80 layers, hidden 8192, 64 heads, 8 kv heads,
    # intermediate 28672.
    "llama-70b": _llama(80, 8192, 64, 8, 28672, 32000, 4096, tie=False),
    # meta-llama/Llama-3.1-8B, -70B, -405B config.json: layers, hidden, heads, 8 kv heads,
    # intermediate, vocab 128256, untied, rope_theta 5e5 (context cut to 8192 for planning).
    "llama3-8b": _llama(32, 4096, 32, 8, 14336, 128256, 8192, tie=False, rope_theta=5e5),
    "llama3-70b": _llama(80, 8192, 64, 8, 28672, 128256, 8192, tie=False, rope_theta=5e5),
    "llama3-405b": _llama(126, 16384, 128, 8, 53248, 128256, 8192, tie=False, rope_theta=5e5),
    # mosaicml/llm-foundry scripts/train/yamls/pretrain/mpt-*.yaml: n_layers, d_model,
    # n_heads (d_head 128 for FlashAttention).
    "mpt-760m": _mpt(24, 1536, 12),
    "mpt-1b": _mpt(24, 2048, 16),
    "mpt-3b": _mpt(32, 2560, 20),
    "mpt-7b": _mpt(32, 4096, 32),
    "mpt-13b": _mpt(40, 5120, 40),
    "mpt-30b": _mpt(48, 7168, 56),
    "mpt-70b": _mpt(80, 8192, 64),
}


def norm_impl_problem(shape: GPTShape, impl: str) -> str | None:
    """Why `impl` (model.norm_impl) cannot run on `shape`, or None: the composite chain is
    RMSNorm's; a LayerNorm is one kernel (F.layer_norm) either way."""
    if impl == "composite" and shape.norm != "rmsnorm":
        return (
            "model.norm_impl = 'composite' is RMSNorm's fp32 chain, but this model's norm is "
            f"{shape.norm} (one kernel either way); use model.norm_impl = 'fused'"
        )
    return None


def job_shape(name: str, vocab_size: int | None = None, seq_len: int | None = None) -> GPTShape:
    """Preset `name` as a job builds it: the job's vocabulary and sequence length replace
    the preset's (learned positions are parameters, one row per position). Training and
    the planner both size the model here, so their parameter counts agree."""
    overrides: dict[str, int] = {}
    if vocab_size is not None:
        overrides["vocab_size"] = vocab_size
    if seq_len is not None:
        overrides["max_seq_len"] = seq_len
    # replace() re-runs GPTShape validation on the overridden values.
    return replace(PRESETS[name], **overrides)


@dataclass(frozen=True)
class LinearShape:
    """One matrix multiplication of a module: a Linear's (in, out, bias), and the rows it
    multiplies per token (its calls' input rows over the tokens of the batch: 1 for a
    transformer's projections, more where a layer runs on several rows a token; 1 as an
    assumption when no sample ran)."""

    in_features: int
    out_features: int
    bias: bool
    rows: float = 1.0

    @property
    def params(self) -> int:
        return self.in_features * self.out_features + (self.out_features if self.bias else 0)


@dataclass(frozen=True)
class SampleRun:
    """What one micro-batch of the module measured on fake tensors (models.profile): its
    real forward and backward under PyTorch's memory tracker, FLOP counter and dispatcher.
    Per token: per ModelProfile.tokens of a sample."""

    precision: str  # the job's, as measured
    ac: str  # the job's checkpointing of the blocks, as measured
    micro_batch: int
    # Bytes of saved activations and backward's temporaries per sample: at their largest
    # (single / DDP: the forward under autocast in 16-bit), the same with the parameters
    # in the 16-bit dtype (FSDP's mixed precision; = `activations` in fp32), and what is
    # left of them once the last block has run its backward (the blocks below hold it).
    activations: float
    activations_sharded: float
    activations_late: float
    other_flops: float  # per token, forward + backward: matmuls outside the Linears
    moved_bytes: float  # per token, forward + backward: what the other operations write, x2
    forward_ops: int  # operations a micro-batch's forward dispatches
    backward_ops: int


@dataclass(frozen=True)
class ModelProfile:
    """A model as the planner prices it, read from the module itself on the meta device
    (models.profile.profile_model): its parameters, its repeated blocks (the FSDP and
    checkpointing units the runtime wraps) with their Linear shapes, and, when the module
    is a decoder-only transformer of trainwise's GPT structure, its GPTShape. Plain data:
    the planner imports it without torch."""

    source: str  # what the user named: "pkg.mod:factory", "hf:DIR" or a callable's name
    params: int  # tied weights counted once
    trainable: int
    blocks: int  # repeated blocks found (0: none; the model is one unit)
    block_params: int  # of one block (the largest, where they differ)
    block_path: str  # where they are ("layers", "transformer.h"; "" when none)
    block_rule: str  # how they were found (models.blocks.find_blocks)
    in_blocks: int = 0  # parameters of all the blocks
    # One block's Linears (none where the blocks differ: then each is among the others).
    block_linears: tuple[LinearShape, ...] = ()
    outer_linears: tuple[LinearShape, ...] = ()  # the others: a head, a stem
    param_tensors: int = 0  # parameter tensors of the whole model
    # Tokens a sample holds: the sequence length of a module that takes token ids, else 1
    # (a token is then a sample: throughput reads as samples/s).
    tokens: int = 1
    shape: GPTShape | None = None  # inferred: the model is priced as this GPT
    run: SampleRun | None = None  # None: no sample input could be built
    tp_plan: bool = False  # the module gives a tensor-parallel plan (`tp_plan` method)
    stages: bool = False  # the runtime can cut it into pipeline stages (trainwise's GPT)
    notes: tuple[str, ...] = ()  # what was assumed, for the plan's notes
    # How to build the module again (on the current device) and one micro-batch of its
    # input, for a simulation: () -> (module, loss_fn, blocks) and (micro_batch) -> (x, y).
    # Not part of the profile's identity.
    rebuild: Any = field(default=None, compare=False, repr=False)
    sample: Any = field(default=None, compare=False, repr=False)

    @property
    def outer_params(self) -> int:
        """Parameters outside the blocks (embeddings, stem, head, final norm)."""
        return self.params - self.in_blocks


def indivisible_by_tp(sizes: dict[str, int], tp: int) -> list[str]:
    """One line for each of `sizes` (what, its size) that `tp` does not divide: what keeps
    a model from splitting `tp` ways (tp_problems, the MoE family's)."""
    return [
        f"parallel.tp = {tp} does not divide the {what} = {n}: choose a tp that divides it"
        for what, n in sizes.items()
        if n % tp
    ]


def tp_problems(s: GPTShape, tp: int, seq_len: int, sequence_parallel: bool) -> list[str]:
    """What keeps a GPT shape from splitting `tp` ways, one line each (empty: it splits)."""
    sizes = {
        "model heads (n_head)": s.n_head,
        "key/value heads (n_kv_head)": s.n_kv_head,
        "FFN width (d_ff)": s.d_ff,
        "vocabulary (vocab_size)": s.vocab_size,
    }
    if sequence_parallel:
        sizes["sequence length (data.seq_len)"] = seq_len
    return indivisible_by_tp(sizes, tp)
