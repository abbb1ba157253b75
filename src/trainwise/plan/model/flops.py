"""Training FLOPs per token of a decoder-only transformer.

6N + 12·L·H·Q·T (Chinchilla/PaLM appendix B, as in nanoGPT's estimate_mfu): 6 FLOPs per
matmul parameter per token for forward + backward, plus the attention score and value
matmuls. N counts parameters that multiply activations: the token embedding lookup is
free, the LM head is not (tied or not).

With LoRA (plan.model.lora) a frozen parameter skips its weight gradient, 2 of its 6:
forward (2) and the input gradient the layers below need (2) remain, so a step does
2 x (frozen matmul parameters) fewer FLOPs a token, and its adapters add 6 each.
"""

from __future__ import annotations

from trainwise.models.moe.cost import moe_flops_per_token
from trainwise.models.moe.shapes import MoEShape
from trainwise.models.shapes import GPTShape, ModelProfile
from trainwise.plan.model.lora import LoraPlan, adapter_params, trained_matmul_params
from trainwise.plan.model.selective_op import SELECTIVE_OP, recompute_flops_per_token


def matmul_params(shape: GPTShape) -> int:
    n = shape.num_params()
    if not shape.tie_embeddings:
        n -= shape.vocab_size * shape.d_model  # the input embedding is a lookup
    if shape.pos == "learned":
        n -= shape.max_seq_len * shape.d_model
    return n


def flops_per_token(shape: GPTShape, seq_len: int, lora: LoraPlan | None = None) -> float:
    n = matmul_params(shape)
    full = 6.0 * n + 12.0 * shape.n_layer * shape.d_model * seq_len
    if lora is None:
        return full
    frozen = n - trained_matmul_params(shape, lora)
    return full - 2.0 * frozen + 6.0 * adapter_params(shape, lora)


def head_flops_per_token(shape: GPTShape, lora: LoraPlan | None = None) -> float:
    """The head's matmul's share of flops_per_token (what a pipeline stage without the
    head does not run): 6 a parameter, 4 when LoRA freezes it."""
    frozen = lora is not None and trained_matmul_params(shape, lora) == 0
    return (4.0 if frozen else 6.0) * shape.vocab_size * shape.d_model


def mfu(tokens_per_s: float, flops_token: float, peak_flops_total: float) -> float:
    """Model FLOPs utilisation: achieved model FLOP/s over the peak of all devices."""
    return tokens_per_s * flops_token / peak_flops_total


def model_flops_per_token(
    params: int, shape: GPTShape | None, seq_len: int, lora: LoraPlan | None = None,
    profile: ModelProfile | None = None, moe: MoEShape | None = None,
) -> float:
    """Model FLOPs per token (what MFU counts): the GPT formula above (with LoRA's, when
    `lora`); a Mixture-of-Experts model's, each routed row counted (models.moe.cost); a
    profiled model's (profile_flops_per_token); or 6N for a bare parameter count (Kaplan
    et al., 2020, eq. 2.1: C = 6N)."""
    if moe is not None:
        return moe_flops_per_token(moe, seq_len)
    if shape is not None:
        return flops_per_token(shape, seq_len, lora)
    if profile is not None:
        return profile_flops_per_token(profile)
    return 6.0 * params


def profile_flops_per_token(profile: ModelProfile) -> float:
    """A profiled model's FLOPs per token: 6 a weight of each Linear for every row it
    multiplies per token (forward, the input and the weight gradients), and the other
    matmuls' (attention, convolutions) its sample run counted."""
    layers = [*profile.block_linears * profile.blocks, *profile.outer_linears]
    gemms = sum(6.0 * s.rows * s.in_features * s.out_features for s in layers)
    return gemms + (profile.run.other_flops if profile.run is not None else 0.0)


def model_layers(
    shape: GPTShape | None, profile: ModelProfile | None = None, moe: MoEShape | None = None
) -> int:
    """The blocks activation checkpointing wraps: a GPT's or a MoE model's layers, a
    profiled model's blocks; 1 for a bare count."""
    if shape is not None:
        return shape.n_layer
    if moe is not None:
        return moe.n_layer
    return max(1, profile.blocks) if profile is not None else 1


def recompute_factor(ac: str, n_layer: int, lora: bool = False,
                     op_share: float | None = None) -> float:
    """Hardware FLOPs over model FLOPs: activation checkpointing runs the forward of a
    checkpointed block again in backward, 2N of the 6N (Korthikanti et al., 2022, section
    5: full recomputation costs 33 % more); `selective` checkpoints every other block;
    `selective-op` runs again the share `op_share` of the forward's FLOPs
    (selective_op_share: its recomputed matmuls; without a shape half, every other
    matmul). With LoRA the step is about 4N (frozen weights: no weight gradient), so the
    forward again costs 50 % more."""
    again = 2.0 / (4.0 if lora else 6.0)  # the forward's share of a step
    if ac == "full":
        return 1.0 + again
    if ac == "selective":
        return 1.0 + ((n_layer + 1) // 2) / n_layer * again
    if ac == SELECTIVE_OP:
        return 1.0 + (0.5 if op_share is None else op_share) * again
    return 1.0


def selective_op_share(
    shape: GPTShape | None, seq_len: int, lora: LoraPlan | None = None
) -> float | None:
    """The share of the forward's FLOPs that selective-op runs again (recompute_factor's
    `op_share`): a GPT's recomputed matmuls (plan.model.selective_op) over the forward's
    model FLOPs; None without a shape."""
    if shape is None:
        return None
    again = 2.0 / (4.0 if lora is not None else 6.0)
    return recompute_flops_per_token(shape, lora) / (again * flops_per_token(shape, seq_len, lora))
