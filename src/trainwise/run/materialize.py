"""Models that never exist whole on one rank: built on the meta device, parallelized, then
materialised (`to_empty`) and initialised shard by shard.

Every parameter is drawn from its own generator, seeded by (train.seed, its name): the
full values of one parameter at a time are generated and each rank keeps only its shard
(`distribute_tensor` without communication: every rank computed the same full tensor).
One process uses the same per-parameter draws, so every layout starts from the same
model and trains the same losses. A rank holds at most its shards plus one full
parameter (the largest: the embedding).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

# Wrappers' name parts (activation checkpointing, torch.compile): the seed of a parameter
# is that of its name in the plain model, whatever wraps it.
_WRAPPER_PARTS = ("_checkpoint_wrapped_module.", "_orig_mod.")


def plain_name(name: str) -> str:
    for part in _WRAPPER_PARTS:
        name = name.replace(part, "")
    return name


def parameter_seed(seed: int, name: str) -> int:
    """A generator seed from the run's seed and a parameter's name (stable across runs
    and Python versions: crc32, not hash())."""
    return (seed * 0x9E3779B1 + zlib.crc32(name.encode())) % (2**63)


@torch.no_grad()
def materialize(
    model: nn.Module,
    init_parameter: Callable[[str, torch.Tensor, torch.Generator], None],
    seed: int,
    device: torch.device,
) -> None:
    """Allocate a meta-built (and parallelized) model on `device` and fill every
    parameter's local shard with its share of the full initial values; rebuild computed
    buffers (modules with `reset_buffers`, e.g. rope tables)."""
    model.to_empty(device=device)
    for name, param in model.named_parameters():
        name = plain_name(name)
        full = torch.empty(param.shape, dtype=param.dtype)  # the global shape of a DTensor
        init_parameter(name, full, torch.Generator().manual_seed(parameter_seed(seed, name)))
        if isinstance(param, DTensor):
            # src_data_rank=None: no scatter, each rank cuts its shard from its own copy.
            shard = distribute_tensor(
                full, param.device_mesh, param.placements, src_data_rank=None
            ).to_local()
            param.to_local().copy_(shard)
        else:
            param.copy_(full)
    for module in model.modules():
        reset = getattr(module, "reset_buffers", None)
        if callable(reset):
            reset()
