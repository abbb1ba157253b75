"""Models: GPT shapes and presets and the profile of any other model (plain data, no
torch), the GPT, the Mixture-of-Experts family (`models.moe`: its own package), the MLP, your own model by import path (and its profile: its blocks, GEMMs
and a sample run), Hugging Face configs, and the registry that turns a config into a
module.

The rest of trainwise imports models only from here. Shapes load without torch, so the
planner stays instant; everything else loads on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

from trainwise.models.shapes import PRESETS, GPTShape, ModelProfile

_LAZY = {
    "profile_model": "profile",
    "find_blocks": "blocks",
    "GPT": "gpt",
    "Block": "gpt",
    "MLPClassifier": "mlp",
    "HFCausalLM": "hf",
    "base_weights_id": "registry",
    "build_custom": "custom",
    "load_factory": "custom",
    "ModelBundle": "registry",
    "ModelSpec": "registry",
    "build_model": "registry",
    "count_parameters": "registry",
    "cross_entropy_loss": "registry",
    "lora_model_problems": "registry",
    "float8_model_problems": "float8.convert",
    "model_kind": "registry",
    "norm_impl_problems": "registry",
    "preset_names": "registry",
    "resolve_shape": "registry",
    "resolve_moe_shape": "registry",
    "takes_example_ids": "registry",
    "tp_model_problems": "registry",
}

__all__ = ["PRESETS", "GPTShape", "ModelProfile", *_LAZY]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'trainwise.models' has no attribute {name!r}")
    return getattr(importlib.import_module(f"trainwise.models.{_LAZY[name]}"), name)
