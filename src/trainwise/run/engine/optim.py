"""Optimizer and learning-rate schedule from the config."""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor

from trainwise.config.schema import OptimConfig, ScheduleConfig


def build_optimizer(parts: list[torch.nn.Module], cfg: OptimConfig) -> torch.optim.Optimizer:
    """One optimizer over the trainable parameters of every model part (a converter may
    freeze some: LoRA trains only its adapters), run as optim.implementation says, with a
    parameter group per device mesh (by_mesh): the fused and foreach kernels take a group's
    tensors in one call, and DTensor's ops take one mesh and no plain tensors beside it.
    The checkpoint keys its state by parameter, so any grouping loads any other."""
    params = [p for part in parts for p in part.parameters() if p.requires_grad]
    groups = [{"params": group} for group in by_mesh(params)]
    step = cfg.implementation  # None: torch's choice (SGD's default)
    step_kwargs = {"fused": True} if step == "fused" else {
        "foreach": None if step is None else step == "foreach"
    }
    if cfg.name == "sgd":
        return torch.optim.SGD(
            groups, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay,
            **step_kwargs,
        )
    return torch.optim.AdamW(
        groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=cfg.weight_decay,
        **step_kwargs,
    )


def by_mesh(params: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Parameters grouped by where they live: one group per device mesh (FSDP's dp mesh,
    the 2-D dp x tp mesh), plain tensors in their own. DTensor's ops take one mesh at a
    time: a norm left off the tensor-parallel plan lives on the dp mesh alone."""
    groups: dict[object, list[torch.Tensor]] = {}
    for p in params:
        key = p.device_mesh if isinstance(p, DTensor) else None
        groups.setdefault(key, []).append(p)
    return list(groups.values())


def lr_factor(step: int, total: int, cfg: ScheduleConfig) -> float:
    """Multiplier of the peak lr at `step` (0-based): linear warmup, then decay to
    min_lr_ratio at the last step."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.decay == "constant":
        return 1.0
    span = max(total - cfg.warmup_steps - 1, 1)
    progress = min((step - cfg.warmup_steps) / span, 1.0)
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    shape = 1.0 - progress if cfg.decay == "linear" else cosine
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * shape


def build_scheduler(
    optimizer: torch.optim.Optimizer, total_steps: int, cfg: ScheduleConfig
) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, total_steps, cfg)
    )
