"""Bring your own model: a factory named by an import path "package.module:factory" that
returns an nn.Module, or a tuple (module, loss_fn)."""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from typing import Any

from torch import nn

from trainwise.errors import ModelError

LossFn = Callable[[Any, Any], Any]

_DOTTED = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


def load_factory(path: str) -> Callable[..., Any]:
    """Import "package.module:factory" (the attribute may be dotted, e.g. "mod:Cls.build")."""
    module_name, sep, attr = path.partition(":")
    if not sep or not _DOTTED.match(module_name) or not _DOTTED.match(attr):
        raise ModelError(
            f"model.name = {path!r}: not an import path; write it as "
            "'package.module:factory' (a module, one colon, a callable)"
        )
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # any import-time failure is the user's module, report it
        raise ModelError(
            f"model.name = {path!r}: cannot import module {module_name!r} "
            f"({_first_line(exc)}); check it is installed or on PYTHONPATH"
        ) from exc
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ModelError(
                f"model.name = {path!r}: module {module_name!r} has no attribute "
                f"{attr!r}; check the name after the colon"
            )
        obj = getattr(obj, part)
    if not callable(obj):
        raise ModelError(
            f"model.name = {path!r}: {attr!r} is a {type(obj).__name__}, not a "
            "callable; point to a function or class that returns an nn.Module"
        )
    return obj


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
            f"{sorted(kwargs)} failed ({_first_line(exc)}); match model.kwargs "
            "to the factory's parameters"
        ) from exc
    except Exception as exc:  # the user's code failed: one line, not a traceback
        raise ModelError(
            f"model.name = {path!r}: the factory raised {_first_line(exc)}; "
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
