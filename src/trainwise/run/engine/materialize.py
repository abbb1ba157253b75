"""Models that never exist whole on one rank: built on the meta device, parallelized, then
materialised (`to_empty`) and initialised shard by shard.

Every parameter is drawn from its own generator, seeded by (train.seed, its name): the
full values of one parameter at a time are generated and each rank keeps only its shard
(a view of the block the rank holds: every rank computed the same full tensor, nothing is
sent).
One process uses the same per-parameter draws, so every layout starts from the same
model and trains the same losses. A rank holds at most its shards plus one full
parameter (the largest: the embedding). A model whose weights load next (pretrained) is
only allocated: each rank then reads just its shards (models.hf_weights).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.nn.parallel import DistributedDataParallel

if TYPE_CHECKING:
    from trainwise.models import ModelBundle, ModelSpec
    from trainwise.models.converters import InitParameter, ModelConverter

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


def local_block(full: torch.Tensor, param: DTensor) -> torch.Tensor:
    """This rank's shard of `full` for `param`'s placements, as a view (no copy): the block
    DTensor says the rank holds, the same rule DCP writes checkpoints by. (The public
    `distribute_tensor` gives the same values but copies the whole tensor once more for
    FSDP's strided shards of a tensor-parallel dim.)"""
    shape, offset = compute_local_shape_and_global_offset(
        param.shape, param.device_mesh, param.placements
    )
    return full[tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))]


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
    allocate(model, device)
    fill(model, init_parameter, seed)


@torch.no_grad()
def fill(
    model: nn.Module,
    init_parameter: Callable[[str, torch.Tensor, torch.Generator], None],
    seed: int,
    only: Callable[[str], bool] | None = None,
) -> None:
    """Fill each parameter (those whose name `only` accepts) of an allocated model with
    its share of the full initial values, drawn in float32 whatever the parameter's dtype
    (a frozen bf16 weight gets the same values, rounded)."""
    if isinstance(model, DistributedDataParallel):  # its "module." prefix is no name part
        model = model.module
    for name, param in model.named_parameters():
        name = plain_name(name)
        if only is not None and not only(name):
            continue
        dtype = torch.float32 if param.is_floating_point() else param.dtype
        full = torch.empty(param.shape, dtype=dtype)  # the global shape of a DTensor
        init_parameter(name, full, torch.Generator().manual_seed(parameter_seed(seed, name)))
        if isinstance(param, DTensor):
            param.to_local().copy_(local_block(full, param))
        else:
            param.copy_(full)


@torch.no_grad()
def allocate(model: nn.Module, device: torch.device) -> None:
    """Give a meta-built (and parallelized) model storage for its local shards only, with
    undefined values, and rebuild computed buffers (modules with `reset_buffers`, e.g.
    rope tables). For weights about to be loaded (a pretrained model): drawing random
    values first would cost a full tensor per parameter for nothing."""
    shared = shared_parameters(model)
    model.to_empty(device=device)
    for first, *others in shared:  # to_empty gave each holder a Parameter of its own
        for module, name in others:
            setattr(module, name, getattr(*first))
    for module in model.modules():
        reset = getattr(module, "reset_buffers", None)
        if callable(reset):
            reset()


def shared_parameters(model: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """The holders (module, attribute) of each parameter that several modules share (a
    head tied to the embedding), the first as named_parameters() names it."""
    holders: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None:
                holders.setdefault(id(param), []).append((module, name))
    return [group for group in holders.values() if len(group) > 1]


# -- the steps of a build that the runtime (run.engine.parts) and a one-process rebuild of
# a trained model (export.trained) share, in this order: build, convert, storage, weights.


def build_unparallelized(spec: ModelSpec, seed: int, device: torch.device) -> ModelBundle:
    """On the meta device when the model initialises parameter by parameter; otherwise
    whole on `device`, seeded."""
    from trainwise.models import build_model

    with torch.device("meta"):
        bundle = build_model(spec)
    if bundle.init_parameter is None:
        torch.manual_seed(seed)  # the same initial weights whatever the layout
        bundle = build_model(spec)
        bundle.module.to(device)
    return bundle


def convert_built(
    bundle: ModelBundle, converters: list[ModelConverter], seed: int
) -> tuple[InitParameter, Callable[[str], bool]]:
    """Apply the converters; the init of every parameter (the model's and the converters'
    own) and which names are the converters'. A model built whole has storage already:
    its converters' parameters (LoRA's adapters) are filled now."""
    from trainwise.models.converters import convert, owned, with_converters

    convert(bundle.module, converters)
    init, added = with_converters(bundle.init_parameter, converters), owned(converters)
    if bundle.init_parameter is None:
        fill(bundle.module, init, seed, only=added)
    return init, added


def fill_storage(
    bundle: ModelBundle, part: nn.Module, init: InitParameter, seed: int, device: torch.device
) -> None:
    """Storage for a meta-built part's shards: random values, or none yet when the
    pretrained weights load next (they fill every parameter of the model's own:
    load_weights checks)."""
    if bundle.load_weights is not None:
        allocate(part, device)
    else:
        materialize(part, init, seed, device)


def load_pretrained(
    bundle: ModelBundle, part: nn.Module, init: InitParameter, added: Callable[[str], bool],
    seed: int,
) -> None:
    """The pretrained weights into `part` (each rank reads its own shards), then, for a
    meta-built model, the converters' parameters (the weights are the model's own only)."""
    assert bundle.load_weights is not None
    bundle.load_weights(part)
    if bundle.init_parameter is not None:  # meta-built: the adapters still empty
        fill(part, init, seed, only=added)
