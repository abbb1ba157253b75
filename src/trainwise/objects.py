"""Your own Python objects, named in a job by an import path "package.module:attr" (the
attribute may be dotted: "mod:Cls.build") or, when no import path names them, by value
("pickled:<digest>", written by `object_reference`): a model factory (model.name), a
dataset or its factory (data.dataset), a collate function (data.collate), a loss
(model.loss).

One resolver for all of them, so that every key reports a bad path the same way: one line
naming the key, the path and the fix. Below every floor: imports nothing of trainwise's
but its errors (cloudpickle only when an object travels by value).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib
import io
import os
import pickle
import re
import sys
from pathlib import Path
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
    `error` is the ConfigError subclass raised. A reference by value ("pickled:<digest>")
    is loaded from objects_dir()."""
    if is_pickled_reference(path):
        return _load_pickled(path, key, error)
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


# -- objects by value ----------------------------------------------------------------------
# An object that no import path names (defined in a script's __main__, a notebook, inside a
# function) travels to the workers by value: pickled with cloudpickle into a file named by
# its content, `pickled:<digest>` in the job key. The file lives outside any one launch
# (OBJECTS_ENV, or the user's cache), so a worker restarted by the elastic agent, a rerun
# that resumes and `trainwise export` read it again.

PICKLED = "pickled:"
OBJECTS_ENV = "TRAINWISE_OBJECTS_DIR"
_DIGEST = re.compile(r"^[0-9a-f]{32}$")


def is_pickled_reference(text: str) -> bool:
    """Whether `text` has the form "pickled:<32 hex digits>" (an object by value)."""
    return text.startswith(PICKLED) and bool(_DIGEST.match(text[len(PICKLED) :]))


def is_object_reference(text: str) -> bool:
    """An import path or a reference to an object by value: what load_object resolves."""
    return is_import_path(text) or is_pickled_reference(text)


def objects_dir() -> Path:
    """Where objects by value are kept: $TRAINWISE_OBJECTS_DIR, else the user's cache
    ($XDG_CACHE_HOME or ~/.cache, then trainwise/objects). On several machines it must be
    a folder every machine reads (or give the objects import paths)."""
    given = os.environ.get(OBJECTS_ENV)
    if given:
        return Path(given)
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "trainwise" / "objects"


def import_path_of(obj: Any) -> str | None:
    """"module:qualname" when that path imports `obj` itself; None otherwise (defined in
    __main__ or a function, or a module attribute that is now another object)."""
    module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if not isinstance(module, str) or not isinstance(qualname, str) or module == "__main__":
        return None
    path = f"{module}:{qualname}"
    if not is_import_path(path):  # "<locals>", "<lambda>"
        return None
    try:
        found = load_object(path, "object")
    except ConfigError:
        return None
    return path if found is obj else None


def import_root(path: str) -> Path | None:
    """The folder on sys.path that the module of the import path `path` was found under
    (for the workers' PYTHONPATH); None for a built-in or namespace module."""
    module = sys.modules.get(path.partition(":")[0])
    file = getattr(module, "__file__", None)
    if module is None or not file:
        return None
    depth = module.__name__.count(".") + (2 if Path(file).name == "__init__.py" else 1)
    return Path(file).resolve().parents[depth - 1]


def object_reference(
    obj: Any, key: str, error: type[ConfigError] = ConfigError, what: str = "an object"
) -> str:
    """`obj` as the value of the job key `key`: its import path when importable as itself,
    else by value (`pickled:<digest>`, the file written now). The reference is the same
    for the same object in any process, so a rerun resumes its checkpoints. An object
    that cannot be pickled is `error`, one line naming `key` and the fix."""
    path = import_path_of(obj)
    return path if path is not None else pickle_by_value(obj, key, error, what)


def pickle_by_value(
    obj: Any, key: str, error: type[ConfigError] = ConfigError, what: str = "an object"
) -> str:
    """Pickle `obj` into objects_dir() under its content's digest; its reference."""
    name = getattr(obj, "__qualname__", None) or type(obj).__name__
    try:
        payload = stable_pickle(obj)
    except Exception as exc:  # anything cloudpickle meets: the user's object, one line
        raise error(
            f"{key}: {name} ({what}) cannot be sent to the workers ({first_line(exc)}); "
            "define it in an importable module (it is then named 'module:attr') or make "
            "what it holds picklable"
        ) from exc
    digest = hashlib.sha256(payload).hexdigest()[:32]
    folder = objects_dir()
    target = folder / f"{digest}.pkl"
    if not target.is_file():
        part = folder / f".{digest}.{os.getpid()}.part"
        try:
            folder.mkdir(parents=True, exist_ok=True)
            part.write_bytes(payload)
            os.replace(part, target)  # whole or not at all: a reader never sees half of it
        except OSError as err:
            with contextlib.suppress(OSError):  # nothing half-written left behind
                part.unlink(missing_ok=True)
            raise error(
                f"{key}: cannot keep {name} in {folder} ({err.strerror or err}); set "
                f"{OBJECTS_ENV} to a writable folder"
            ) from None
    return PICKLED + digest


def stable_pickle(obj: Any) -> bytes:
    """cloudpickle's bytes of `obj`, the same in every process: cloudpickle names each
    class it pickles by value with a random id (to recognise it when loaded twice); here
    the id is a digest of the class's name and of the whole payload, so that equal objects
    give equal bytes and different ones different ids."""
    first = _dumps(obj, b"")
    return _dumps(obj, hashlib.sha256(first).digest())


def _dumps(obj: Any, salt: bytes) -> bytes:
    buffer = io.BytesIO()
    _stable_pickler()(buffer, salt).dump(obj)
    return buffer.getvalue()


@functools.cache
def _stable_pickler() -> type:
    import cloudpickle
    from cloudpickle import cloudpickle as impl

    skeletons = (impl._make_skeleton_class, impl._make_skeleton_enum)

    class StablePickler(cloudpickle.Pickler):
        def __init__(self, file: io.BytesIO, salt: bytes):
            super().__init__(file)
            self.salt = salt

        def reducer_override(self, obj: Any) -> Any:
            reduced = super().reducer_override(obj)
            if isinstance(reduced, tuple) and reduced and reduced[0] in skeletons:
                args = list(reduced[1])  # (..., class_tracker_id, extra)
                name = f"{obj.__module__}.{obj.__qualname__}".encode()
                args[-2] = hashlib.sha256(self.salt + name).hexdigest()[:32]
                reduced = (reduced[0], tuple(args), *reduced[2:])
            return reduced

    return StablePickler


def _load_pickled(reference: str, key: str, error: type[ConfigError]) -> Any:
    path = objects_dir() / f"{reference[len(PICKLED) :]}.pkl"
    try:
        payload = path.read_bytes()
    except OSError:
        raise error(
            f"{key} = {reference!r}: no such object in {path.parent}: trainwise.train() "
            f"writes it on the machine that starts the run; on several machines set "
            f"{OBJECTS_ENV} to a folder they share, or name the object by an import path"
        ) from None
    try:
        return pickle.loads(payload)
    except Exception as exc:  # the user's object failed to rebuild here: one line
        raise error(
            f"{key} = {reference!r}: cannot be loaded here ({first_line(exc)}); the "
            "modules it uses must be importable in the workers (installed or on PYTHONPATH)"
        ) from exc
