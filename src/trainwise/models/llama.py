"""trainwise's GPT and Hugging Face Llama: the shape a Llama config.json describes, the
config.json a Llama-style shape writes, and the one-to-one names of their weights.

The layouts agree tensor for tensor (separate q/k/v projections, rotate-half rotary, SwiGLU,
RMSNorm), so a checkpoint converts by renaming alone. No torch here.
"""

from __future__ import annotations

import re
from typing import Any

from trainwise.errors import ModelError
from trainwise.models.shapes import GPTShape

# trainwise name -> Hugging Face name; {i} is the layer.
_BLOCK = {
    "norm1.weight": "input_layernorm.weight",
    "norm2.weight": "post_attention_layernorm.weight",
    "attn.q_proj.weight": "self_attn.q_proj.weight",
    "attn.k_proj.weight": "self_attn.k_proj.weight",
    "attn.v_proj.weight": "self_attn.v_proj.weight",
    "attn.out_proj.weight": "self_attn.o_proj.weight",
    "mlp.gate.weight": "mlp.gate_proj.weight",
    "mlp.up.weight": "mlp.up_proj.weight",
    "mlp.down.weight": "mlp.down_proj.weight",
}
_TOP = {
    "tok_emb.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "lm_head.weight": "lm_head.weight",
}
_BLOCK_NAME = re.compile(r"blocks\.(\d+)\.(.+)")


def gpt_to_hf(name: str) -> str:
    """The Hugging Face Llama name of a GPT weight; ModelError for one Llama does not have."""
    if name in _TOP:
        return _TOP[name]
    m = _BLOCK_NAME.fullmatch(name)
    if m and m.group(2) in _BLOCK:
        return f"model.layers.{m.group(1)}.{_BLOCK[m.group(2)]}"
    raise ModelError(
        f"weight {name!r} has no Hugging Face Llama name: only Llama-style GPTs (rmsnorm, "
        "swiglu, rope, no bias) convert"
    )


def is_llama_style(shape: GPTShape) -> bool:
    return (shape.norm, shape.mlp, shape.pos, shape.bias) == ("rmsnorm", "swiglu", "rope", False)


def shape_from_llama(config: dict[str, Any], where: str) -> GPTShape:
    """The GPTShape of a Llama config.json; ModelError (one line each) for what the GPT
    cannot reproduce (another architecture, biases, rope scaling, another activation)."""
    problems = []
    if config.get("model_type") != "llama":
        problems.append(
            f"{where}: model_type {config.get('model_type')!r} is not 'llama'; model.impl = "
            "'trainwise' builds Llama configs only, use model.impl = 'transformers'"
        )
    rope = config.get("rope_parameters") or {}  # transformers 5; 4 has rope_theta / _scaling
    if rope.get("rope_type", "default") != "default":
        problems.append(
            f"{where}: rope_type {rope['rope_type']!r} is not supported by trainwise's GPT "
            "(plain rope only); use model.impl = 'transformers'"
        )
    for key, want in (("hidden_act", "silu"), ("rope_scaling", None)):
        if config.get(key, want) != want:
            problems.append(
                f"{where}: {key} = {config[key]!r} is not supported by trainwise's GPT (needs "
                f"{want!r}); use model.impl = 'transformers'"
            )
    for key in ("attention_bias", "mlp_bias"):
        if config.get(key):
            problems.append(f"{where}: {key} = true is not supported by trainwise's GPT")
    heads = config.get("num_attention_heads", 0)
    head_dim = config.get("head_dim")
    if head_dim and heads and head_dim * heads != config.get("hidden_size"):
        problems.append(
            f"{where}: head_dim {head_dim} x {heads} heads != hidden_size; trainwise's GPT "
            "needs head_dim = hidden_size / num_attention_heads"
        )
    if problems:
        raise ModelError(problems)
    try:
        return GPTShape(
            n_layer=config["num_hidden_layers"],
            d_model=config["hidden_size"],
            n_head=heads,
            n_kv_head=config.get("num_key_value_heads") or heads,
            d_ff=config["intermediate_size"],
            vocab_size=config["vocab_size"],
            max_seq_len=config.get("max_position_embeddings", 2048),
            norm="rmsnorm",
            mlp="swiglu",
            pos="rope",
            tie_embeddings=bool(config.get("tie_word_embeddings", False)),
            bias=False,
            rope_theta=float(rope.get("rope_theta", config.get("rope_theta", 10000.0))),
            norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        )
    except KeyError as exc:
        raise ModelError(f"{where}: config.json has no {exc.args[0]!r}; fix the file") from None


def llama_config(shape: GPTShape, dtype: str = "float32") -> dict[str, Any]:
    """A Hugging Face LlamaForCausalLM config.json for a Llama-style shape."""
    if not is_llama_style(shape):
        raise ModelError(
            "export --format hf: this GPT is GPT-2 style (layernorm, gelu or learned "
            "positions); only Llama-style GPTs (rmsnorm, swiglu, rope, no bias) export to "
            "Hugging Face format, use --format safetensors"
        )
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": shape.d_model,
        "intermediate_size": shape.d_ff,
        "num_hidden_layers": shape.n_layer,
        "num_attention_heads": shape.n_head,
        "num_key_value_heads": shape.n_kv_head,
        "head_dim": shape.head_dim,
        "vocab_size": shape.vocab_size,
        "max_position_embeddings": shape.max_seq_len,
        "rms_norm_eps": shape.norm_eps,
        "rope_theta": shape.rope_theta,  # transformers 4 reads this, 5 the next
        "rope_parameters": {"rope_type": "default", "rope_theta": shape.rope_theta},
        "hidden_act": "silu",
        "tie_word_embeddings": shape.tie_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": dtype,
    }
