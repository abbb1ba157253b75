"""Model converters: functions that rewrite a model's modules in place before it is split
and parallelized (LoRA adapters, float8 linears), as torchtitan's `ModelConverter`.

A feature adds one factory to `CONVERTERS`; the factory reads its own section of the
job's config and returns its converter, or None when the job did not ask for it. The
engine builds the model on the meta device (or whole, for a model without per-parameter
init), calls every selected converter's `convert` in the order of `CONVERTERS`, then
splits and parallelizes (run/engine/parts.py). A converter that needs to act after each
optimizer step (float8's scale update) also has `post_optimizer_hook(parts)`, and one that
keeps something computed from the weights has `weights_set(parts)`, called after the
weights are set otherwise (built, loaded from a checkpoint); one whose
rewrite depends on the layout or the device (float8: FSDP's float8 all-gather, CPU
emulation) has `place(dims, device_type)`, which the engine calls before `convert`.

Keep parameter names and module types a tensor-parallel plan matches: swap a Linear's
class for a subclass (as torchtitan's LoRA does) rather than wrap it in a new module, so
that checkpoint keys and the model's TP plan still apply.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch
from torch import Tensor, nn

if TYPE_CHECKING:
    from trainwise.config import JobConfig
    from trainwise.config.parallel_dims import ParallelDims


class ModelConverter(Protocol):
    name: str  # for logs and errors: "lora", "float8"

    def convert(self, model: nn.Module) -> None:
        """Rewrite `model`'s modules in place (on the meta device: no values yet)."""
        ...


@runtime_checkable
class PostOptimizerHook(Protocol):
    """What a converter that acts after each optimizer step also has (float8's scales)."""

    def post_optimizer_hook(self, parts: list[nn.Module]) -> None: ...


@runtime_checkable
class WeightsFollower(Protocol):
    """What a converter that keeps something computed from the weights also has (float8's
    scales): `weights_set(parts)`, called when the weights were set otherwise than by an
    optimizer step (initialised, loaded from pretrained weights or from a checkpoint)."""

    def weights_set(self, parts: list[nn.Module]) -> None: ...


@runtime_checkable
class ParameterOwner(Protocol):
    """What a converter that adds parameters also has: which names are its own and how to
    fill one at full size (run.materialize draws each from its own seeded generator, so
    every layout starts from the same values; LoRA's adapters)."""

    def owns(self, name: str) -> bool: ...

    def init_parameter(self, name: str, tensor: Tensor, generator: torch.Generator) -> None: ...


@runtime_checkable
class TPPlanAdapter(Protocol):
    """What a converter whose modules need their own tensor-parallel styles also has."""

    def adapt_tp_plan(self, model: nn.Module, plans: list[dict[str, Any]]) -> list[dict[str, Any]]: ...


@runtime_checkable
class LayoutAware(Protocol):
    """What a converter whose rewrite depends on the job's layout and device also has."""

    def place(self, dims: ParallelDims, device_type: str) -> None: ...


ConverterFactory = Callable[["JobConfig"], ModelConverter | None]  # None: not asked for


def _lora(config: JobConfig) -> ModelConverter | None:
    from trainwise.models.lora import lora_converter  # imports torch's TP styles: lazily

    return lora_converter(config)


def _moe_balance(config: JobConfig) -> ModelConverter | None:
    from trainwise.models.moe.balance import balance_converter

    return balance_converter(config)


def _float8(config: JobConfig) -> ModelConverter | None:
    from trainwise.models.float8.convert import float8_converter

    return float8_converter(config)


# each feature adds its factory
CONVERTERS: list[ConverterFactory] = [_lora, _moe_balance, _float8]


def build_converters(config: JobConfig) -> list[ModelConverter]:
    """The converters the job asks for, in the order of CONVERTERS."""
    return [c for factory in CONVERTERS if (c := factory(config)) is not None]


def place(converters: list[ModelConverter], dims: ParallelDims, device_type: str) -> None:
    """Tell the converters that ask (LayoutAware) the layout and device they convert for."""
    for c in converters:
        if isinstance(c, LayoutAware):
            c.place(dims, device_type)


def convert(model: nn.Module, converters: list[ModelConverter]) -> None:
    """Apply each converter in turn."""
    for converter in converters:
        converter.convert(model)


def post_optimizer_hooks(converters: list[ModelConverter]) -> list[Callable[[list[nn.Module]], None]]:
    """The hooks the step calls after each optimizer step, in the converters' order."""
    return [c.post_optimizer_hook for c in converters if isinstance(c, PostOptimizerHook)]


def weights_set_hooks(converters: list[ModelConverter]) -> list[Callable[[list[nn.Module]], None]]:
    """The hooks to call once the weights were set otherwise than by the optimizer."""
    return [c.weights_set for c in converters if isinstance(c, WeightsFollower)]


InitParameter = Callable[[str, Tensor, torch.Generator], None]


def owners(converters: list[ModelConverter]) -> list[ParameterOwner]:
    return [c for c in converters if isinstance(c, ParameterOwner)]


def owned(converters: list[ModelConverter]) -> Callable[[str], bool]:
    """Whether a parameter name belongs to a converter (not to the model's own init)."""
    mine = owners(converters)
    return lambda name: any(o.owns(name) for o in mine)


def with_converters(init: InitParameter | None, converters: list[ModelConverter]) -> InitParameter:
    """The model's per-parameter init, with the converters' parameters filled as each
    converter says."""

    def fill(name: str, tensor: Tensor, generator: torch.Generator) -> None:
        for o in owners(converters):
            if o.owns(name):
                return o.init_parameter(name, tensor, generator)
        if init is None:
            raise ValueError(f"no init for parameter {name!r}")
        init(name, tensor, generator)

    return fill


def adapt_tp_plan(
    model: nn.Module, plans: list[dict[str, Any]], converters: list[ModelConverter]
) -> list[dict[str, Any]]:
    """The model's tensor-parallel plans as the converters lay out their modules."""
    for c in converters:
        if isinstance(c, TPPlanAdapter):
            plans = c.adapt_tp_plan(model, plans)
    return plans
