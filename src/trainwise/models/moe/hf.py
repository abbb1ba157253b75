"""Hugging Face MoE directories in and out: the MoE shape a Qwen3-MoE or Mixtral
config.json describes (`model.name = "hf:DIR"`, `model.impl = "trainwise"`), the
config.json a shape writes, and the names of the weights both ways.

On disk both families store each expert's projections as 2-D tensors of their own
(`mlp.experts.{e}.gate_proj.weight`, Mixtral's `block_sparse_moe.experts.{e}.w1.weight`):
what save_pretrained writes and every reader takes. transformers 5 fuses them at load
into one [E, 2f, d] `gate_up_proj` (its conversion mapping, undone at save); trainwise
keeps [E, f, d] `gate_proj` and `up_proj` and [E, d, f] `down_proj`, so expert e of a
weight is row e, a whole tensor of the files. Loading asks DCP's HuggingFaceStorageReader
for the experts this rank holds only (one entry per expert, the row of the local shard),
so an FSDP rank reads its experts' bytes and no other's.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainwise.errors import ModelError
from trainwise.models.moe.shapes import MoEShape, MoESpec

if TYPE_CHECKING:
    import torch
    from torch import nn

    from trainwise.models.registry import ModelBundle, ModelSpec

# model_type -> (the MoE feed-forward's module in a layer, the router's, each expert's
# gate / up / down projection names).
FAMILIES = {
    "qwen3_moe": ("mlp", "mlp.gate", ("gate_proj", "up_proj", "down_proj")),
    "mixtral": ("block_sparse_moe", "block_sparse_moe.gate", ("w1", "w3", "w2")),
}
_EXPERTS = ("gate_proj", "up_proj", "down_proj")  # trainwise's, in that order
_TOP = {
    "tok_emb.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "lm_head.weight": "lm_head.weight",
}
_BLOCK = {
    "norm1.weight": "input_layernorm.weight",
    "norm2.weight": "post_attention_layernorm.weight",
    "attn.q_proj.weight": "self_attn.q_proj.weight",
    "attn.k_proj.weight": "self_attn.k_proj.weight",
    "attn.v_proj.weight": "self_attn.v_proj.weight",
    "attn.out_proj.weight": "self_attn.o_proj.weight",
    "attn.q_norm.weight": "self_attn.q_norm.weight",
    "attn.k_norm.weight": "self_attn.k_norm.weight",
    "mlp.gate.weight": "mlp.gate_proj.weight",  # a leading dense layer (Qwen3 mlp_only_layers)
    "mlp.up.weight": "mlp.up_proj.weight",
    "mlp.down.weight": "mlp.down_proj.weight",
}
_NAME = re.compile(r"blocks\.(\d+)\.(.+)")
# Not in the files: the aux-loss-free balancing's biases (trainwise's training state).
_OWN = ("moe.router.expert_bias",)


def moe_family(config: dict[str, Any]) -> str | None:
    """The MoE family of a config.json this module reads; None for any other model."""
    kind = config.get("model_type")
    return kind if kind in FAMILIES else None


def _rope_theta(config: dict[str, Any]) -> float:
    rope = config.get("rope_parameters") or {}  # transformers 5; 4 has rope_theta
    return float(rope.get("rope_theta", config.get("rope_theta", 10000.0)))


def _problems(config: dict[str, Any], family: str, where: str) -> list[str]:
    """What trainwise's MoE model cannot reproduce of the config, one line each."""
    problems = []
    rope = config.get("rope_parameters") or {}
    fix = "use model.impl = 'transformers'"
    if rope.get("rope_type", "default") != "default" or config.get("rope_scaling"):
        problems.append(f"{where}: rope scaling is not supported by trainwise's MoE model; {fix}")
    if config.get("hidden_act", "silu") != "silu":
        problems.append(f"{where}: hidden_act = {config['hidden_act']!r} (needs 'silu'); {fix}")
    if config.get("attention_bias"):
        problems.append(f"{where}: attention_bias = true is not supported; {fix}")
    if config.get("router_jitter_noise"):
        problems.append(f"{where}: router_jitter_noise (Mixtral's) is not supported; {fix}")
    if config.get("use_sliding_window") or (family == "mixtral" and config.get("sliding_window")):
        problems.append(f"{where}: sliding-window attention is not supported; {fix}")
    if family == "qwen3_moe":
        dense = list(config.get("mlp_only_layers") or [])
        if config.get("decoder_sparse_step", 1) != 1 or dense != list(range(len(dense))):
            problems.append(
                f"{where}: MoE layers other than after leading dense ones (decoder_sparse_step"
                f" {config.get('decoder_sparse_step', 1)}, mlp_only_layers {dense}); {fix}"
            )
    return problems


def shape_from_config(config: dict[str, Any], where: str) -> MoEShape:
    """The MoEShape of a Qwen3-MoE or Mixtral config.json; ModelError (one line each) for
    what the model cannot reproduce, or for a bad shape (top-k above the experts)."""
    family = moe_family(config)
    if family is None:
        raise ModelError(f"{where}: model_type {config.get('model_type')!r} is no MoE family "
                         f"trainwise builds ({', '.join(FAMILIES)})")
    problems = _problems(config, family, where)
    if problems:
        raise ModelError(problems)
    qwen = family == "qwen3_moe"
    try:
        dense = len(config.get("mlp_only_layers") or []) if qwen else 0
        experts = config.get("num_experts") or config.get("num_local_experts")
        moe = MoESpec(
            experts=experts, top_k=config["num_experts_per_tok"],
            d_expert=config["moe_intermediate_size"] if qwen else config["intermediate_size"],
            dense_layers=dense, d_dense=config["intermediate_size"] if dense else 0,
            renormalize=bool(config.get("norm_topk_prob", False)) if qwen else True,
        )
        heads = config["num_attention_heads"]
        return MoEShape(
            n_layer=config["num_hidden_layers"], d_model=config["hidden_size"], n_head=heads,
            n_kv_head=config.get("num_key_value_heads") or heads,
            vocab_size=config["vocab_size"],
            max_seq_len=config.get("max_position_embeddings", 2048), moe=moe,
            d_head=config.get("head_dim") or 0, qk_norm=qwen,
            tie_embeddings=bool(config.get("tie_word_embeddings", False)),
            rope_theta=_rope_theta(config), norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            source=where,
        )
    except KeyError as exc:
        raise ModelError(f"{where}: config.json has no {exc.args[0]!r}; fix the file") from None
    except ModelError as err:
        raise ModelError([f"{where}: {p}" for p in err.problems]) from None


def is_moe_dir(path: str) -> bool:
    """Whether the hf: directory (or config.json) at `path` is a MoE family read here."""
    from trainwise.models.hf import read_hf_config

    return moe_family(read_hf_config(path)) is not None


def hf_moe_shape(path: str, vocab_size: int | None, seq_len: int | None,
                 init: str) -> MoEShape | None:
    """The MoE shape of the hf: directory at `path` as a job builds it (the data's
    vocabulary unless pretrained weights fix it; the job's sequence); None when the
    directory holds another kind of model."""
    from dataclasses import replace

    from trainwise.models.hf import _vocab, read_hf_config, wants_pretrained

    config = read_hf_config(path)
    if moe_family(config) is None:
        return None
    shape = shape_from_config(config, f"model.name = 'hf:{path}'")
    vocab = _vocab(shape.vocab_size, vocab_size, wants_pretrained(path, init), path)
    return replace(shape, vocab_size=vocab, max_seq_len=seq_len or shape.max_seq_len)


def hf_names(name: str, family: str, experts: int) -> list[str]:
    """The Hugging Face names of trainwise weight `name`: one, or one per expert for a
    routed experts' weight (in expert order); [] for what the files do not hold."""
    if name in _TOP:
        return [_TOP[name]]
    m = _NAME.fullmatch(name)
    if m is None:
        raise ModelError(f"weight {name!r} has no Hugging Face {family} name")
    layer, rest = f"model.layers.{m.group(1)}", m.group(2)
    ffn, gate, projections = FAMILIES[family]
    if rest in _OWN:
        return []
    if rest in _BLOCK:
        return [f"{layer}.{_BLOCK[rest]}"]
    if rest == "moe.router.gate.weight":
        return [f"{layer}.{gate}.weight"]
    if rest.startswith("moe.experts."):
        proj = projections[_EXPERTS.index(rest.removeprefix("moe.experts."))]
        return [f"{layer}.{ffn}.experts.{e}.{proj}.weight" for e in range(experts)]
    raise ModelError(f"weight {name!r} has no Hugging Face {family} name")


def split_for_hf(name: str, tensor: torch.Tensor, family: str) -> Iterator[tuple[str, Any]]:
    """(Hugging Face name, tensor) for a trainwise weight: an experts' weight [E, ...] as its
    E rows, a balancing bias as nothing."""
    if ".moe.experts." in name:
        yield from zip(hf_names(name, family, tensor.shape[0]), tensor.unbind(0), strict=True)
    else:
        yield from ((hf, tensor) for hf in hf_names(name, family, 1))


def _local_rows(tensor: torch.Tensor) -> tuple[torch.Tensor, int]:
    """This rank's rows of a weight [E, ...] (a plain tensor, or the local block of a
    DTensor sharded on its expert dim) and the first one's index."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not isinstance(tensor, DTensor):
        return tensor, 0
    _, offset = compute_local_shape_and_global_offset(
        tensor.shape, tensor.device_mesh, tensor.placements)
    return tensor.to_local(), offset[0]


def named_for_files(state: dict[str, Any], family: str,
                    experts: int) -> dict[str, torch.Tensor]:
    """The model's tensors under the files' names, the routed experts' as the rows this
    rank holds (each a view of its shard: DCP fills it in place)."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        names = hf_names(name, family, experts)
        if ".moe.experts." not in name:
            out.update(dict.fromkeys(names, tensor))
            continue
        rows, first = _local_rows(tensor)
        for i in range(rows.shape[0]):
            out[names[first + i]] = rows[i]
    return out


def check_moe_weights(model: nn.Module, folder: Path, family: str, experts: int,
                      where: str) -> None:
    """Names and shapes of `model` (on the meta device) against the files' headers."""
    from trainwise.models.hf_weights import check_against, stored_shapes, weight_files

    expected = {k: tuple(t.shape) for k, t in
                named_for_files(model.state_dict(), family, experts).items()}
    check_against(expected, stored_shapes(weight_files(folder)), where)


def load_moe_weights(model: nn.Module, folder: Path, family: str, experts: int,
                     where: str) -> dict[str, int]:
    """Fill `model` (wrapped or sharded as it runs; every rank calls this) from the files:
    each rank reads only the slices, and the experts, it holds (hf_weights' reader)."""
    from trainwise.models.hf_weights import read_into

    return read_into(model, folder, lambda state, _stored: named_for_files(
        state, family, experts), where)


def build_moe_dir(spec: ModelSpec, shape: MoEShape) -> ModelBundle:
    """trainwise's MoE model of the hf: directory of `spec`, and how to load its weights
    once wrapped (checked against the files first: names and shapes, one line)."""
    from trainwise.models.hf import model_dir, read_hf_config, wants_pretrained
    from trainwise.models.moe.build import moe_bundle

    path = spec.name[len("hf:") :]
    where = f"model.name = 'hf:{path}'"
    family = moe_family(read_hf_config(path))
    bundle = moe_bundle(shape, spec)
    if wants_pretrained(path, spec.init):
        folder, experts = model_dir(path), shape.moe.experts
        check_moe_weights(bundle.module, folder, family, experts, where)
        bundle.load_weights = partial(load_moe_weights, folder=folder, family=family,
                                      experts=experts, where=where)
    return bundle


def export_family(shape: MoEShape) -> str | None:
    """The Hugging Face family a shape exports as (None: none reproduces it): Qwen3-MoE
    for q/k-normed heads (leading dense layers as its mlp_only_layers), Mixtral for plain
    ones; neither has trainwise's ungated shared experts, sigmoid scores or a route
    scale."""
    m = shape.moe
    if m.shared_experts or m.score != "softmax" or m.route_scale != 1.0:
        return None
    if shape.qk_norm:
        return "qwen3_moe"
    plain = not m.dense_layers and m.renormalize and shape.head_dim * shape.n_head == shape.d_model
    return "mixtral" if plain else None


def moe_config(shape: MoEShape, family: str, aux_loss_coef: float) -> dict[str, Any]:
    """A Hugging Face config.json of `family` for `shape`."""
    m = shape.moe
    config: dict[str, Any] = {
        "hidden_size": shape.d_model, "num_hidden_layers": shape.n_layer,
        "num_attention_heads": shape.n_head, "num_key_value_heads": shape.n_kv_head,
        "head_dim": shape.head_dim, "vocab_size": shape.vocab_size,
        "max_position_embeddings": shape.max_seq_len, "rms_norm_eps": shape.norm_eps,
        "rope_theta": shape.rope_theta,  # transformers 4 reads this, 5 the next
        "rope_parameters": {"rope_type": "default", "rope_theta": shape.rope_theta},
        "tie_word_embeddings": shape.tie_embeddings, "hidden_act": "silu",
        "attention_bias": False, "num_experts_per_tok": m.top_k,
        "router_aux_loss_coef": aux_loss_coef,
    }
    if family == "mixtral":
        return {**config, "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
                "intermediate_size": m.d_expert, "num_local_experts": m.experts,
                "sliding_window": None}
    return {**config, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
            "intermediate_size": m.d_dense or m.d_expert, "moe_intermediate_size": m.d_expert,
            "num_experts": m.experts, "norm_topk_prob": m.renormalize,
            "decoder_sparse_step": 1, "mlp_only_layers": list(range(m.dense_layers)),
            "use_sliding_window": False}


def export_target(shape: MoEShape, source: dict[str, Any] | None, aux_loss_coef: float
                  ) -> tuple[dict[str, Any], Callable[[str, Any], Iterator[tuple[str, Any]]]]:
    """(config.json, trainwise weight -> its Hugging Face tensors) of a trained MoE model:
    the source directory's config (an hf: model, its vocabulary the trained one's) or one
    written for the shape."""
    from trainwise.errors import ConfigError

    if source is not None:
        family = moe_family(source)
        config = {**source, "vocab_size": shape.vocab_size}
    else:
        family = export_family(shape)
        if family is None:
            raise ConfigError(
                "export --format hf: this MoE shape has no Hugging Face family that "
                "reproduces it (shared experts, sigmoid scores, a route scale, or leading "
                "dense layers without Qwen3's q/k norms); use --format safetensors"
            )
        config = moe_config(shape, family, aux_loss_coef)
    return config, partial(split_for_hf, family=family)
