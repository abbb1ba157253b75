"""Mixed precision per strategy: autocast for single/DDP, FSDP2's MixedPrecisionPolicy
for sharded strategies (applied in parallelize), loss scaling for fp16."""

from __future__ import annotations

import contextlib

import torch

from trainwise.dtypes import TORCH_DTYPES


def autocast_context(sharded: bool, precision: str, device: torch.device):
    """FSDP (`sharded`) casts parameters itself; single and DDP run the forward under
    autocast."""
    if precision == "fp32" or sharded:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=TORCH_DTYPES[precision])


def build_grad_scaler(sharded: bool, precision: str, device: torch.device, init_scale: float):
    """fp16 needs loss scaling; sharded gradients need the scaler that agrees on inf/nan
    across ranks. None for fp32 and bf16."""
    if precision != "fp16":
        return None
    if sharded:
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(device.type, init_scale=init_scale)
    return torch.amp.GradScaler(device.type, init_scale=init_scale)
