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
from trainwise.models.moe.shapes import MoEShape

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


def moe_shape(parts: list[nn.Module]) -> MoEShape | None:
    """The shape of the MoE model the parts belong to (None: not a MoE model)."""
    for part in parts:
        for module in part.modules():
            if isinstance(module, MoEModel):
                return module.shape
    return None


def load_matrix(held: dict[int, Router], layers: int, experts: int,
                device: torch.device) -> torch.Tensor:
    """This rank's routers' loads since the last update as one [layers, experts] tensor
    (rows of the layers it does not hold, or that routed nothing, zero)."""
    loads = torch.zeros(layers, experts, device=device)
    for layer, router in held.items():
        if router.load is not None:
            loads[layer] = router.load
    return loads


class LoadCounter:
    """A step's tokens per expert, for the telemetry: the parts' routers found once;
    `read` gives this rank's count since the last `clear` ([layers, experts] on the device,
    nothing synchronised), `clear` starts the next one (after the bias update read it)."""

    def __init__(self, parts: list[nn.Module], shape: MoEShape, device: torch.device):
        self.held = routers(parts)
        self.shape = (shape.n_layer, shape.moe.experts)
        self.device = device

    @torch.no_grad()
    def read(self) -> torch.Tensor:
        return load_matrix(self.held, *self.shape, self.device)

    def clear(self) -> None:
        for router in self.held.values():
            router.load = None


@torch.no_grad()
def update_biases(parts: list[nn.Module], rate: float) -> None:
    """Move every router's bias by `rate` towards balance, from the loads of every rank,
    and start the next step's count."""
    held = routers(parts)
    if not held:
        return
    first = next(iter(held.values()))
    loads = load_matrix(held, model_layers(parts), first.experts, first.expert_bias.device)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(loads)
    for layer, router in held.items():
        load = loads[layer]
        router.expert_bias += rate * torch.sign(load.mean() - load)
        router.load = None
