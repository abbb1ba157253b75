"""Training FLOPs per token of a decoder-only transformer.

6N + 12·L·H·Q·T (Chinchilla/PaLM appendix B, as in nanoGPT's estimate_mfu): 6 FLOPs per
matmul parameter per token for forward + backward, plus the attention score and value
matmuls. N counts parameters that multiply activations: the token embedding lookup is
free, the LM head is not (tied or not).
"""

from __future__ import annotations

from trainwise.models.shapes import GPTShape


def matmul_params(shape: GPTShape) -> int:
    n = shape.num_params()
    if not shape.tie_embeddings:
        n -= shape.vocab_size * shape.d_model  # the input embedding is a lookup
    if shape.pos == "learned":
        n -= shape.max_seq_len * shape.d_model
    return n


def flops_per_token(shape: GPTShape, seq_len: int) -> float:
    return 6.0 * matmul_params(shape) + 12.0 * shape.n_layer * shape.d_model * seq_len


def mfu(tokens_per_s: float, flops_token: float, peak_flops_total: float) -> float:
    """Model FLOPs utilisation: achieved model FLOP/s over the peak of all devices."""
    return tokens_per_s * flops_token / peak_flops_total


def model_flops_per_token(params: int, shape: GPTShape | None, seq_len: int) -> float:
    """Model FLOPs per token (what MFU counts): the GPT formula above, or 6N for a bare
    parameter count (Kaplan et al., 2020, eq. 2.1: C = 6N per token)."""
    return flops_per_token(shape, seq_len) if shape is not None else 6.0 * params


def recompute_factor(ac: str, n_layer: int) -> float:
    """Hardware FLOPs over model FLOPs: activation checkpointing runs the forward of a
    checkpointed block again in backward, 2N of the 6N (Korthikanti et al., 2022, section
    5: full recomputation costs 33 % more); `selective` checkpoints every other block."""
    if ac == "full":
        return 4.0 / 3.0
    if ac == "selective":
        return 1.0 + ((n_layer + 1) // 2) / n_layer / 3.0
    return 1.0
