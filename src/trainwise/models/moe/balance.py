"""Auxiliary-loss-free load balancing (DeepSeek-V3, section 2.1.2; Wang et al., 2024): after
each optimizer step every MoE layer's per-expert routing bias moves by `rate` towards
balance, up for the experts that got fewer tokens than the mean over the step's global
batch, down for those that got more (b_e += rate x sign(mean load - load_e)). The bias
only picks experts (layers.Router): the weights stay the scores'.

A model converter (models.converters) with nothing to convert: its post-optimizer hook
is the update. The loads are summed over every rank in one all-reduce ([layers, experts]:
each rank fills the layers it holds, so pipeline stages add their own and the data-
parallel ranks theirs; the ranks of a tensor-parallel group route the same tokens and add
the same counts, a factor that the sign does not see), so every rank updates the same
biases as one process would on the whole batch.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from trainwise.models.moe.layers import Router
from trainwise.models.moe.model import MoEModel

if TYPE_CHECKING:
    from trainwise.config import JobConfig

_LAYER = re.compile(r"blocks\.(\d+)\.")


class ExpertBalance:
    """The bias update as a converter's post-optimizer hook."""

    name = "moe-balance"

    def __init__(self, rate: float):
        self.rate = rate

    def convert(self, model: nn.Module) -> None:
        """Nothing to rewrite: the routers already hold their biases."""

    def post_optimizer_hook(self, parts: list[nn.Module]) -> None:
        update_biases(parts, self.rate)


def balance_converter(config: JobConfig) -> ExpertBalance | None:
    """The converter when the job asks for the bias update (moe.bias_update_rate > 0)."""
    rate = config.moe.bias_update_rate
    return ExpertBalance(rate) if rate > 0 else None


def routers(parts: list[nn.Module]) -> dict[int, Router]:
    """The routers the parts hold, by their layer (the block index in their name)."""
    found = {}
    for part in parts:
        for name, module in part.named_modules():
            if isinstance(module, Router):
                found[int(_LAYER.search(name).group(1))] = module
    return found


def model_layers(parts: list[nn.Module]) -> int:
    for part in parts:
        for module in part.modules():
            if isinstance(module, MoEModel):
                return module.shape.n_layer
    raise ValueError("no MoE model among the parts")


@torch.no_grad()
def update_biases(parts: list[nn.Module], rate: float) -> None:
    """Move every router's bias by `rate` towards balance, from the loads of every rank,
    and start the next step's count."""
    held = routers(parts)
    if not held:
        return
    first = next(iter(held.values()))
    loads = torch.zeros(model_layers(parts), first.experts, device=first.expert_bias.device)
    for layer, router in held.items():
        if router.load is not None:
            loads[layer] = router.load
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(loads)
    for layer, router in held.items():
        load = loads[layer]
        router.expert_bias += rate * torch.sign(load.mean() - load)
        router.load = None
