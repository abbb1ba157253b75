"""Your own Python objects, named in a job by an import path "package.module:attr" (the
attribute may be dotted: "mod:Cls.build"): a model factory (model.name), a dataset or
its factory (data.dataset), a collate function (data.collate), a loss (model.loss).

One resolver for all of them, so that every key reports a bad path the same way: one line
naming the key, the path and the fix. Below every floor: imports nothing of trainwise's
but its errors.
"""

from __future__ import annotations

import importlib
import re
from typing import Any

from trainwise.errors import ConfigError

_DOTTED = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")


def is_import_path(text: str) -> bool:
    """Whether `text` has the form "package.module:attr" (nothing is imported)."""
    module, sep, attr = text.partition(":")
    return bool(sep) and bool(_DOTTED.match(module)) and bool(_DOTTED.match(attr))


def first_line(exc: BaseException) -> str:
    """`Type: first line of the message`, for one-line reports of the user's errors."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


def load_object(
    path: str, key: str, error: type[ConfigError] = ConfigError, what: str = "an object"
) -> Any:
    """Import "package.module:attr" and return the attribute. `key` names the job key in
    the message (`model.name`, `data.dataset`, ...); `what` says what the key wants;
    `error` is the ConfigError subclass raised."""
    module_name, _, attr = path.partition(":")
    if not is_import_path(path):
        raise error(
            f"{key} = {path!r}: not an import path; write it as 'package.module:attr' "
            "(a module, one colon, an attribute)"
        )
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # any import-time failure is the user's module: report it
        raise error(
            f"{key} = {path!r}: cannot import module {module_name!r} ({first_line(exc)}); "
            "check it is installed or on PYTHONPATH"
        ) from exc
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise error(
                f"{key} = {path!r}: module {module_name!r} has no attribute {attr!r}; "
                f"check the name after the colon (it should be {what})"
            )
        obj = getattr(obj, part)
    return obj


def load_callable(
    path: str, key: str, error: type[ConfigError] = ConfigError, what: str = "a callable"
) -> Any:
    """load_object, and the object must be callable (one line naming `what` if not)."""
    obj = load_object(path, key, error, what)
    if not callable(obj):
        attr = path.partition(":")[2]
        raise error(
            f"{key} = {path!r}: {attr!r} is a {type(obj).__name__}, not a callable; "
            f"point to {what}"
        )
    return obj
