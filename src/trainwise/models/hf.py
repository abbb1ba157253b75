"""A Hugging Face transformers causal LM, randomly initialised from a local config.json (no
hub access), wrapped so it looks like our GPT: forward(idx) -> logits, plus `blocks`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from trainwise.errors import ModelError

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

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=idx, use_cache=False).logits


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


def build_hf(path: str, vocab_size: int | None = None) -> HFCausalLM:
    """Random-init causal LM from the local config at `path`; `vocab_size` overrides the
    config's (the data decides it)."""
    config = read_hf_config(path)
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
