"""Bring your own model: a factory (named by an import path "package.module:factory", or
given as a Python callable) that returns an nn.Module, or a tuple (module, loss_fn)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from trainwise.errors import ModelError
from trainwise.models.blocks import NAMED_BLOCKS
from trainwise.objects import first_line, load_callable

LossFn = Callable[[Any, Any], Any]


def load_factory(path: str) -> Callable[..., Any]:
    """Import "package.module:factory" (the attribute may be dotted, e.g. "mod:Cls.build")."""
    return load_callable(
        path, "model.name", ModelError, "a function or class that returns an nn.Module"
    )


def build_custom(
    path: str, kwargs: dict[str, Any] | None = None
) -> tuple[nn.Module, LossFn | None]:
    """Call the factory with `kwargs`; return (module, loss_fn or None)."""
    return call_factory(load_factory(path), kwargs, f"model.name = {path!r}")


def factory_name(factory: Callable[..., Any]) -> str:
    """How a factory given as a Python object is named in messages: module.qualname."""
    module = getattr(factory, "__module__", None)
    name = getattr(factory, "__qualname__", None) or type(factory).__name__
    return f"{module}.{name}" if module else name


def call_factory(
    factory: Callable[..., Any], kwargs: dict[str, Any] | None, where: str
) -> tuple[nn.Module, LossFn | None]:
    """Call `factory` with `kwargs`; (module, loss_fn or None), or one line (ModelError)
    naming the factory by `where` ("model.name = 'pkg.mod:build'") and the fix."""
    kwargs = dict(kwargs or {})
    try:
        result = factory(**kwargs)
    except TypeError as exc:
        # Most often model.kwargs not matching the factory's signature.
        raise ModelError(
            f"{where}: calling it with model.kwargs "
            f"{sorted(kwargs)} failed ({first_line(exc)}); match model.kwargs "
            "to the factory's parameters"
        ) from exc
    except Exception as exc:  # the user's code failed: one line, not a traceback
        raise ModelError(
            f"{where}: the factory raised {first_line(exc)}; fix the factory or model.kwargs"
        ) from exc
    if isinstance(result, nn.Module):
        return result, None
    if (
        isinstance(result, tuple)
        and len(result) == 2
        and isinstance(result[0], nn.Module)
        and (result[1] is None or callable(result[1]))
    ):
        return result[0], result[1]
    what = (
        f"a tuple of ({', '.join(type(r).__name__ for r in result)})"
        if isinstance(result, tuple)
        else f"a {type(result).__name__}"
    )
    raise ModelError(
        f"{where}: the factory returned {what}; it must return an "
        "nn.Module or a tuple (nn.Module, loss_fn)"
    )


def blocks_container(module: nn.Module) -> str | None:
    """The name of the child holding `module`'s repeated blocks: the first of
    NAMED_BLOCKS (models.blocks) that is a ModuleList, ModuleDict or Sequential; None when it has none.
    What pipeline stages are cut along (models.pipeline.module_cut)."""
    for name in NAMED_BLOCKS:
        child = module._modules.get(name)
        if isinstance(child, (nn.ModuleList, nn.ModuleDict, nn.Sequential)):
            return name
    return None
