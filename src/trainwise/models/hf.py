"""Models from a local Hugging Face model directory (no hub access): a transformers causal
LM wrapped so it looks like our GPT (forward(idx) -> logits, plus `blocks`), or, with
model.impl = 'trainwise', trainwise's own GPT built from a Llama config.json. When the
directory holds safetensors weights they load into the model after it is wrapped or
sharded (models.hf_weights); otherwise, or with model.init = 'random', it starts random."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from trainwise.errors import ModelError
from trainwise.models.gpt import GPT, packed_layout
from trainwise.models.hf_weights import check_weights, load_weights, weight_files
from trainwise.models.llama import gpt_to_hf, shape_from_llama
from trainwise.models.shapes import GPTShape

# Where common architectures keep their decoder layers.
_LAYER_PATHS = (("model", "layers"), ("transformer", "h"), ("gpt_neox", "layers"))


class HFCausalLM(nn.Module):
    """forward(idx[B, T]) -> logits[B, T, vocab] around a transformers causal LM."""

    def __init__(self, model: nn.Module, vocab_size: int):
        super().__init__()
        self.model = model
        self.vocab_size = vocab_size

    @property
    def blocks(self) -> nn.ModuleList:
        # A property, not a submodule: registering the layers twice would duplicate them
        # in state_dict.
        for path in _LAYER_PATHS:
            obj: Any = self.model
            for part in path:
                obj = getattr(obj, part, None)
            if isinstance(obj, nn.ModuleList):
                return obj
        return nn.ModuleList()

    def forward(self, idx: torch.Tensor, doc: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of idx[B, T]; with `doc` (packed examples' ids) each example attends to
        itself only and its positions restart, through a custom 4-D attention mask."""
        if doc is None:
            return self.model(input_ids=idx, use_cache=False).logits
        positions, allowed = packed_layout(doc)
        return self.model(
            input_ids=idx, attention_mask=self._mask(allowed), position_ids=positions,
            use_cache=False,
        ).logits

    def _mask(self, allowed: torch.Tensor) -> torch.Tensor:
        """The 4-D mask as the attention implementation takes it: sdpa a boolean one (True:
        attend), eager an additive one (added to the scores)."""
        impl = getattr(self.model.config, "_attn_implementation", None)
        if impl == "sdpa":
            return allowed
        if impl == "eager":
            blocked = torch.finfo(torch.float32).min
            return torch.zeros(allowed.shape, device=allowed.device).masked_fill(~allowed, blocked)
        raise ModelError(
            f"data.packing = true needs a custom 4-D attention mask, which attention "
            f"implementation {impl!r} does not take; set data.packing = false"
        )


def read_hf_config(path: str) -> dict[str, Any]:
    """The parsed config.json at `path` (a file, or a folder holding config.json)."""
    where = f"model.name = 'hf:{path}'"
    p = Path(path).expanduser()
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise ModelError(
            f"{where}: no config file at {str(p)!r}; give a config.json or a folder containing one"
        )
    try:
        config = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelError(f"{where}: cannot read {str(p)!r} as JSON ({exc}); fix the file") from exc
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        raise ModelError(
            f'{where}: {str(p)!r} has no "model_type"; it must be a '
            'transformers config.json (e.g. "model_type": "llama")'
        )
    return config


def build_hf(
    path: str, vocab_size: int | None = None, config: dict[str, Any] | None = None
) -> HFCausalLM:
    """Random-init causal LM from the local config at `path` (or `config`, its contents);
    `vocab_size` overrides the config's (the data decides it)."""
    config = dict(config or read_hf_config(path))
    try:
        import transformers
    except ImportError as exc:
        raise ModelError(
            f"model 'hf:{path}' needs the optional extra: pip install 'trainwise[hf]'"
        ) from exc
    if vocab_size is not None:
        config["vocab_size"] = vocab_size
    # Build fp32 weights whatever dtype the checkpoint was saved in; the runtime picks the
    # training precision (autocast / FSDP mixed precision).
    for key in ("torch_dtype", "dtype"):
        config.pop(key, None)
    model_type = config.pop("model_type")
    try:
        # for_model builds the config class locally: nothing is fetched from the hub.
        cfg = transformers.AutoConfig.for_model(model_type, **config)
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    except (ValueError, KeyError, TypeError) as exc:
        reason = " ".join(str(exc).split()) or type(exc).__name__
        if len(reason) > 160:  # transformers lists every known model_type; keep one line short
            reason = reason[:157] + "..."
        raise ModelError(
            f"model 'hf:{path}': transformers cannot build a causal LM from it "
            f"({reason}); check model_type and the config fields"
        ) from exc
    return HFCausalLM(model, int(cfg.vocab_size))


def hf_takes_example_ids(path: str) -> bool:
    """Whether the transformers causal LM of the config at `path` can keep packed examples
    apart: the models on transformers' attention interface take a custom 4-D attention
    mask (as it is) and position ids; older ones build their own mask."""
    try:
        import transformers
    except ImportError:
        return False  # building the model asks for the optional extra

    config = {
        k: v for k, v in read_hf_config(path).items() if k not in ("torch_dtype", "dtype")
    }
    try:
        cfg = transformers.AutoConfig.for_model(config.pop("model_type"), **config)
    except (ValueError, KeyError, TypeError):
        return False  # building the model says why, in its own line
    if getattr(cfg, "_attn_implementation", None) not in (None, "sdpa", "eager"):
        return False  # config.json asks for flash or flex attention: no custom 4-D mask
    cls = transformers.MODEL_FOR_CAUSAL_LM_MAPPING.get(type(cfg), None)
    return bool(getattr(cls, "_supports_attention_backend", False))


def _strip_wrapper(name: str) -> str:
    """HFCausalLM keeps the transformers model as `.model`: its names are the checkpoint's."""
    return name.removeprefix("model.")


@dataclass
class HFBuild:
    module: nn.Module
    blocks: list[nn.Module]
    shape: GPTShape | None  # model.impl = 'trainwise'
    load_weights: Callable[[nn.Module], dict[str, int]] | None  # None: random init


def model_dir(path: str) -> Path:
    """The model directory of model.name = 'hf:PATH' (PATH, or the folder of a config.json)."""
    p = Path(path).expanduser()
    return p if p.is_dir() else p.parent


def wants_pretrained(path: str, init: str) -> bool:
    """Whether the weights of the directory load: model.init 'pretrained' (they must
    exist), 'random' (never) or 'auto' (when there are any)."""
    has = bool(weight_files(model_dir(path)))
    if init == "pretrained" and not has:
        raise ModelError(
            f"model.init = 'pretrained' but 'hf:{path}' holds no model.safetensors or "
            "model.safetensors.index.json; add the weights or set model.init = 'random'"
        )
    return has and init != "random"


def hf_shape(path: str, vocab_size: int | None, seq_len: int | None, init: str) -> GPTShape:
    """trainwise's GPT shape for the Llama config at `path` (model.impl = 'trainwise')."""
    where = f"model.name = 'hf:{path}'"
    shape = shape_from_llama(read_hf_config(path), where)
    vocab = _vocab(shape.vocab_size, vocab_size, wants_pretrained(path, init), path)
    return GPTShape(
        **{**shape.__dict__, "vocab_size": vocab, "max_seq_len": seq_len or shape.max_seq_len}
    )


def _vocab(model_vocab: int, data_vocab: int | None, pretrained: bool, path: str) -> int:
    """Pretrained weights fix the vocabulary: the data's ids must fit in it."""
    if not pretrained:
        return data_vocab or model_vocab
    if data_vocab is not None and data_vocab > model_vocab:
        raise ModelError(
            f"model.name = 'hf:{path}': the data has token ids up to {data_vocab - 1} but the "
            f"model's vocab_size is {model_vocab}; prepare the data with the model's tokenizer"
        )
    return model_vocab


def build_from_dir(
    path: str, vocab_size: int | None, seq_len: int | None, dropout: float, init: str, impl: str,
    norm_impl: str = "fused",
) -> HFBuild:
    """The model of a Hugging Face directory, and how to load its weights once wrapped
    (`norm_impl`: the RMSNorm kernels of trainwise's GPT, model.impl = 'trainwise')."""
    where = f"model.name = 'hf:{path}'"
    pretrained = wants_pretrained(path, init)
    if impl == "trainwise":
        shape = hf_shape(path, vocab_size, seq_len, init)
        gpt = GPT(shape, dropout=dropout, norm_impl=norm_impl)
        module, blocks, shape, rename = gpt, list(gpt.blocks), gpt.shape, gpt_to_hf
    else:
        config = read_hf_config(path)
        vocab = _vocab(int(config.get("vocab_size") or 0), vocab_size, pretrained, path)
        lm = build_hf(path, vocab_size=vocab, config=config)
        module, blocks, shape, rename = lm, list(lm.blocks), None, _strip_wrapper
    if not pretrained:
        return HFBuild(module, blocks, shape, None)
    folder = model_dir(path)
    check_weights(module, folder, rename, where)  # before any worker: names and shapes
    return HFBuild(
        module, blocks, shape, partial(load_weights, folder=folder, rename=rename, where=where)
    )
