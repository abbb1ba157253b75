"""Model converters: functions that rewrite a model's modules in place before it is split
and parallelized (LoRA adapters, float8 linears), as torchtitan's `ModelConverter`.

A feature adds one factory to `CONVERTERS`; the factory reads its own section of the
job's config and returns its converter, or None when the job did not ask for it. The
engine builds the model on the meta device (or whole, for a model without per-parameter
init), calls every selected converter's `convert` in the order of `CONVERTERS`, then
splits and parallelizes (run/engine/parts.py). A converter that needs to act after each
optimizer step (float8's scale update) also has `post_optimizer_hook(parts)`.

Keep parameter names and module types a tensor-parallel plan matches: swap a Linear's
class for a subclass (as torchtitan's LoRA does) rather than wrap it in a new module, so
that checkpoint keys and the model's TP plan still apply.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from torch import nn

if TYPE_CHECKING:
    from trainwise.config import JobConfig


class ModelConverter(Protocol):
    name: str  # for logs and errors: "lora", "float8"

    def convert(self, model: nn.Module) -> None:
        """Rewrite `model`'s modules in place (on the meta device: no values yet)."""
        ...


@runtime_checkable
class PostOptimizerHook(Protocol):
    """What a converter that acts after each optimizer step also has (float8's scales)."""

    def post_optimizer_hook(self, parts: list[nn.Module]) -> None: ...


ConverterFactory = Callable[["JobConfig"], ModelConverter | None]  # None: not asked for
CONVERTERS: list[ConverterFactory] = []  # each feature appends its factory


def build_converters(config: JobConfig) -> list[ModelConverter]:
    """The converters the job asks for, in the order of CONVERTERS."""
    return [c for factory in CONVERTERS if (c := factory(config)) is not None]


def convert(model: nn.Module, converters: list[ModelConverter]) -> None:
    """Apply each converter in turn."""
    for converter in converters:
        converter.convert(model)


def post_optimizer_hooks(converters: list[ModelConverter]) -> list[Callable[[list[nn.Module]], None]]:
    """The hooks the step calls after each optimizer step, in the converters' order."""
    return [c.post_optimizer_hook for c in converters if isinstance(c, PostOptimizerHook)]
