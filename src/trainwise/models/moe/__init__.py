"""The Mixture-of-Experts model family, in one place (the pattern later families follow):
its shapes and presets (`shapes`, plain data, no torch), the model (router, routed and
shared experts, the balancing losses), its tensor-parallel plan and pipeline stages, its
Hugging Face weights in and out, and its cost description for the planner (torch-free).

Shapes load without torch, so the planner stays instant; everything else loads on first
use."""

from __future__ import annotations

import importlib
from typing import Any

from trainwise.models.moe.shapes import MOE_PRESETS, MoEShape, MoESpec, moe_job_shape

_LAZY = {
    "MoEModel": "model",
    "MoELoss": "model",
    "MoE": "layers",
    "Router": "layers",
    "GroupedExperts": "layers",
    "moe_tp_plan": "parallel",
    "moe_ep_plan": "parallel",
    "ExpertParallel": "expert_parallel",
    "step_load": "load",
    "token_gemms": "cost",
    "param_split": "cost",
    "moe_flops_per_token": "cost",
    "layer_activation_bytes": "cost",
}

__all__ = ["MOE_PRESETS", "MoEShape", "MoESpec", "moe_job_shape", *_LAZY]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'trainwise.models.moe' has no attribute {name!r}")
    return getattr(importlib.import_module(f"trainwise.models.moe.{_LAZY[name]}"), name)
