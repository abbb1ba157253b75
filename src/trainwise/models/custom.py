"""Bring your own model: a factory named by an import path "package.module:factory" that
returns an nn.Module, or a tuple (module, loss_fn)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from trainwise.errors import ModelError
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
    factory = load_factory(path)
    kwargs = dict(kwargs or {})
    try:
        result = factory(**kwargs)
    except TypeError as exc:
        # Most often model.kwargs not matching the factory's signature.
        raise ModelError(
            f"model.name = {path!r}: calling it with model.kwargs "
            f"{sorted(kwargs)} failed ({first_line(exc)}); match model.kwargs "
            "to the factory's parameters"
        ) from exc
    except Exception as exc:  # the user's code failed: one line, not a traceback
        raise ModelError(
            f"model.name = {path!r}: the factory raised {first_line(exc)}; "
            "fix the factory or model.kwargs"
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
        f"model.name = {path!r}: the factory returned {what}; it must return an "
        "nn.Module or a tuple (nn.Module, loss_fn)"
    )


# The attribute names under which a user's module keeps its repeated blocks, in the order
# they are looked for (torchtitan's models: `layers`; nanoGPT-style: `blocks`).
BLOCK_CONTAINERS = ("blocks", "layers")


def blocks_container(module: nn.Module) -> str | None:
    """The name of the child holding `module`'s repeated blocks: the first of
    BLOCK_CONTAINERS that is a ModuleList, ModuleDict or Sequential; None when it has none.
    What pipeline stages are cut along (models.pipeline.module_cut)."""
    for name in BLOCK_CONTAINERS:
        child = module._modules.get(name)
        if isinstance(child, (nn.ModuleList, nn.ModuleDict, nn.Sequential)):
            return name
    return None
