"""LoRA (Hu et al., 2021) in the planner: which parameters train, and the FLOPs a step
does. The one place for these formulas; memory, compute and communication read them.

A targeted Linear W (out x in) keeps its weight frozen and learns B @ A (A: r x in, B:
out x r), r (in + out) parameters. Every other parameter is frozen too, except the token
(and learned position) embeddings and the head when [lora] train_embeddings / train_head
say so. The frozen base is kept in the compute dtype only (no fp32 master copy, gradient
or optimizer state); the trainable parameters cost what every parameter costs in a full
fine-tune.

FLOPs per token (forward 2 per matmul parameter; backward 2 for the input gradient and 2
for the weight gradient): a frozen layer still passes the input gradient down (its
parameters are left out of the weight gradients only), so it costs 4 instead of 6 per
parameter; the adapters cost 6 per parameter like any trained layer. Attention's score
and value matmuls have no weights: unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from trainwise.config.schema import LORA_DEFAULT_TARGETS, lora_target_matches
from trainwise.models.shapes import GPTShape
from trainwise.plan.model.precision import MASTER_BYTES
from trainwise.plan.model.tensor_parallel import params_per_rank

# The Linears that get adapters by default: the config's (the runtime reads the same).
DEFAULT_TARGETS = LORA_DEFAULT_TARGETS
HEAD = "lm_head"  # the untied head's module name (models.gpt)


@dataclass(frozen=True)
class LoraPlan:
    """The [lora] keys the planner reads (rank > 0: LoRA is on)."""

    rank: int
    targets: tuple[str, ...] | None = None  # module-name patterns; None: DEFAULT_TARGETS
    dropout: float = 0.0
    train_embeddings: bool = False
    train_head: bool = False


def block_linears(shape: GPTShape, tp: int = 1) -> dict[str, tuple[int, int]]:
    """(out, in) of each Linear of one block, by its name in the block (models.gpt), on
    one of `tp` ranks: q, k, v, gate and up split their outputs, out_proj and down their
    inputs (the GPT's TP plan)."""
    h, f = shape.d_model, shape.d_ff
    q, kv = shape.n_head * shape.head_dim, shape.n_kv_head * shape.head_dim
    out = {
        "attn.q_proj": (q // tp, h), "attn.k_proj": (kv // tp, h),
        "attn.v_proj": (kv // tp, h), "attn.out_proj": (h, q // tp),
    }
    if shape.mlp == "swiglu":
        out["mlp.gate"] = (f // tp, h)
    return {**out, "mlp.up": (f // tp, h), "mlp.down": (h, f // tp)}


@lru_cache(maxsize=256)
def targeted(shape: GPTShape, lora: LoraPlan, tp: int = 1) -> tuple[tuple[int, int], ...]:
    """(out, in) on one of `tp` ranks of every Linear that gets an adapter, over the whole
    model: the blocks' (blocks.<i>.attn.q_proj, ...) and the untied head's."""
    found = [dims for _, dims in _targeted_in_blocks(shape, lora, tp)]
    if not shape.tie_embeddings and lora_target_matches(HEAD, lora.targets or DEFAULT_TARGETS):
        found.append((shape.vocab_size // tp, shape.d_model))
    return tuple(found)


def adapter_params(shape: GPTShape, lora: LoraPlan, tp: int = 1) -> int:
    """Parameters of the adapters, r (in + out) per targeted Linear, on one of `tp` ranks
    (an adapter is split where its base layer is: A with a row-parallel base, B with a
    column-parallel one)."""
    return lora.rank * sum(out + inp for out, inp in targeted(shape, lora, tp))


def fully_trained(shape: GPTShape, lora: LoraPlan) -> int:
    """Base parameters that train whole: the token embedding with train_embeddings, the
    head with train_head (one matrix when tied; learned positions stay frozen)."""
    emb = shape.vocab_size * shape.d_model
    n = emb if lora.train_embeddings else 0
    if lora.train_head and not (shape.tie_embeddings and lora.train_embeddings):
        n += emb
    return n


def trainable_params(shape: GPTShape, lora: LoraPlan, tp: int = 1) -> float:
    """Parameters with a gradient and optimizer state, on one of `tp` ranks (the fully
    trained embeddings and head are split over the vocabulary)."""
    return adapter_params(shape, lora, tp) + fully_trained(shape, lora) / tp


def total_params(shape: GPTShape, lora: LoraPlan | None) -> int:
    """The model's parameters with its adapters."""
    return shape.num_params() + (adapter_params(shape, lora) if lora else 0)


def rank_split(
    params: float, shape: GPTShape | None, lora: LoraPlan | None, tp: int = 1
) -> tuple[float, float]:
    """(frozen, trainable) parameters on one of `tp` ranks of a model of `params` base
    parameters: everything trains without LoRA (or without a shape to place it on)."""
    base = params_per_rank(params, shape, tp)
    if lora is None or shape is None:
        return 0.0, base
    return base - fully_trained(shape, lora) / tp, trainable_params(shape, lora, tp)


def trained_matmul_params(shape: GPTShape, lora: LoraPlan) -> int:
    """Base parameters that train whole and multiply activations (plan.flops counts the
    head's matmul, not the input embedding's lookup): the head when it trains (tied: when
    either the embeddings or the head train)."""
    trains = lora.train_head or (shape.tie_embeddings and lora.train_embeddings)
    return shape.vocab_size * shape.d_model if trains else 0


def lora_of(rank: int, targets: list[str] | None, dropout: float, train_embeddings: bool,
            train_head: bool) -> LoraPlan | None:
    """The planner's view of a [lora] section (None when rank is 0: LoRA is off)."""
    if rank <= 0:
        return None
    return LoraPlan(rank, tuple(targets) if targets else None, dropout, train_embeddings,
                    train_head)


# The Linears of a block that read each norm's output (models.gpt: q, k, v after the
# attention's norm; gate and up, or up alone, after the MLP's); out_proj and down read
# activations no other layer reads.
def norm_readers(shape: GPTShape) -> dict[str, tuple[str, ...]]:
    """The Linears that read each of a block's two norm outputs, by block_linears' names."""
    mlp = ("mlp.gate", "mlp.up") if shape.mlp == "swiglu" else ("mlp.up",)
    return {"attn": ("attn.q_proj", "attn.k_proj", "attn.v_proj"), "mlp": mlp}


def dropout_mask_bytes(device: str, input_bytes: int) -> int:
    """Bytes per element that nn.Dropout keeps for backward: CUDA's fused kernel
    (aten native_dropout) a bool mask; elsewhere ATen's dropout is input * noise
    (is_fused_kernel_acceptable is CUDA-only) and the product saves the noise, in the
    input's dtype."""
    return 1 if device == "cuda" else input_bytes


def adapter_activation_bytes(
    shape: GPTShape, lora: LoraPlan, element: int, tp: int = 1, autocast: bool = False,
    device: str = "cuda", norm_bytes: int | None = None,
) -> float:
    """Bytes per token and block that the adapters change in what autograd keeps, on one
    of `tp` ranks (`autocast`: single/DDP in 16 bits, where every Linear casts its input
    itself; `norm_bytes`: a norm output's element, default `element`).
    lora_B saves lora_A's r-wide output. A frozen Linear keeps no input (autograd saves a
    matmul input only for its weight's gradient); without dropout lora_A keeps the very
    tensor the base layer kept in a full fine-tune, so nothing else changes. With dropout
    each adapter keeps its dropped input (`element` bytes: lora_A's, or under autocast its
    16-bit cast) and dropout's mask (dropout_mask_bytes, in its input's dtype), and the
    undropped input is kept by no Linear any more: out_proj's and down's
    own inputs, each adapted reader's 16-bit cast of a norm output under autocast, else a
    norm output that only adapted Linears read. Checked per saved tensor against
    `trainwise plan --simulate` (small, rank 8, dropout 0.1)."""
    named = _targeted_in_blocks(shape, lora, tp)
    saved = sum(element * lora.rank for _ in targeted(shape, lora, tp))
    if lora.dropout > 0:
        readers = {n for names in norm_readers(shape).values() for n in names}
        for name, (_, inp) in named:
            mask = dropout_mask_bytes(device, (norm_bytes or element) if name in readers else element)
            saved += (element + mask) * inp
            if autocast or name not in readers:
                saved -= element * inp  # its own input or cast, kept by nobody now
        if not autocast:
            saved -= element * shape.d_model * shape.n_layer * _norm_outputs_released(shape, lora)
    return saved / shape.n_layer


def first_block_bytes(
    shape: GPTShape, lora: LoraPlan, norm_own: float, norm_bytes: int, device: str,
    split: int = 1,
) -> float:
    """Bytes per token that the first block does not keep under LoRA: with the embeddings
    frozen its input needs no gradient, so its attention norm (frozen too) saves nothing
    of its own (`norm_own`: what a norm keeps besides its readers' inputs), nor do the
    dropout masks of q, k, v (a product saves the noise only for its input's gradient;
    `norm_bytes`: the norm output's element size; `split`: sequence parallelism's degree,
    which splits the norms)."""
    if lora.train_embeddings:
        return 0.0
    freed = norm_own - frozen_norm_bytes(shape, device) / 2 / split
    if lora.dropout > 0:
        patterns = lora.targets or DEFAULT_TARGETS
        adapted = [n for n in norm_readers(shape)["attn"] if lora_target_matches(f"blocks.0.{n}", patterns)]
        freed += len(adapted) * dropout_mask_bytes(device, norm_bytes) * shape.d_model
    return freed


def head_input_bytes(
    shape: GPTShape, lora: LoraPlan, element: int, device: str, split: int = 1
) -> float:
    """Bytes per token that a frozen head does not keep: its matmul's input (the final
    norm's output, whole under tensor parallelism) and the final norm's part for its
    frozen weight (split over `split` sequence-parallel ranks); 0 when the head trains
    (train_head, or tied with train_embeddings) or carries an adapter."""
    if trained_matmul_params(shape, lora) or (
        not shape.tie_embeddings and lora_target_matches(HEAD, lora.targets or DEFAULT_TARGETS)
    ):
        return 0.0
    return element * shape.d_model + frozen_norm_bytes(shape, device) / 2 / split


def _targeted_in_blocks(
    shape: GPTShape, lora: LoraPlan, tp: int
) -> list[tuple[str, tuple[int, int]]]:
    """(name in the block, (out, in) on one of `tp` ranks) of every adapted Linear of
    every block."""
    patterns = lora.targets or DEFAULT_TARGETS
    linears = block_linears(shape, tp).items()
    return [
        (name, dims)
        for i in range(shape.n_layer)
        for name, dims in linears
        if lora_target_matches(f"blocks.{i}.{name}", patterns)
    ]


def _norm_outputs_released(shape: GPTShape, lora: LoraPlan) -> int:
    """How many of a block's two norm outputs only adapted Linears read."""
    patterns = lora.targets or DEFAULT_TARGETS
    return sum(
        all(lora_target_matches(f"blocks.0.{name}", patterns) for name in names)
        for names in norm_readers(shape).values()
    )


def lora_problems(shape: GPTShape | None, lora: LoraPlan) -> list[str]:
    """What the planner cannot plan of `lora` on `shape`, one line each: no shape to place
    adapters on, patterns that match no Linear, a rank above a targeted layer's width."""
    if shape is None:
        return [
            "lora.rank > 0 with a bare parameter count (plan.params): the planner places "
            "adapters on a model's Linears; give a preset (--model) or a shape (--layers ...)"
        ]
    problems = []
    names = [f"blocks.0.{n}" for n in block_linears(shape)] + [HEAD]
    for pattern in lora.targets or ():
        if not any(lora_target_matches(name, (pattern,)) for name in names):
            problems.append(
                f"lora.targets pattern {pattern!r} matches no Linear of the model (its "
                f"names: {', '.join(n.rsplit('.', 1)[-1] for n in names)}); fix the pattern"
            )
    found = targeted(shape, lora)
    if not found and not problems:
        problems.append("lora.targets match no Linear of the model; name the layers to adapt")
    narrowest = min((min(out, inp) for out, inp in found), default=lora.rank)
    if lora.rank > narrowest:
        problems.append(
            f"lora.rank = {lora.rank} is larger than a targeted layer's width ({narrowest}); "
            f"use at most {narrowest}"
        )
    return problems


def param_counts(params: int, shape: GPTShape | None, lora: LoraPlan | None) -> tuple[int, int]:
    """(trainable, total) parameters of the model with its adapters: (params, params)
    without LoRA."""
    if lora is None or shape is None:
        return params, params
    return int(trainable_params(shape, lora)), total_params(shape, lora)


def frozen_norm_bytes(shape: GPTShape, device: str) -> int:
    """Bytes per token and block that a full fine-tune's norms keep for their weight
    gradients and LoRA's frozen norms do not: CPU's composite RMSNorm saves an fp32
    normalised copy of its input for the product with the weight, whatever the residual
    stream's dtype; the fused kernels (CUDA's, and LayerNorm's) save only what the input
    gradient needs. Measured with `trainwise plan --simulate` (fp32, and bf16 under FSDP)."""
    return 2 * MASTER_BYTES * shape.d_model if device == "cpu" and shape.norm == "rmsnorm" else 0
