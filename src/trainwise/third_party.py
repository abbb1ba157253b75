"""What third-party packages say at import that a trainwise user cannot act on.

torchao (float8 training) is imported by trainwise's float8 converter, and by transformers
whenever it is installed and a model is loaded. At import it says two things on stderr, a
line each, before a command's own output (which breaks the one-line answer a bad input
gets):
- on a machine without CUDA, that each of its compiled CUDA kernels cannot load (on a GPU
  machine, where a kernel that does not load is news, this stays);
- through torch's pytree logger, that registering its Enums (KernelPreference) is
  deprecated: a note to torchao's authors.
Both are dropped by a filter on the logger that says them, for these messages only."""

from __future__ import annotations

import logging
import sys

# The beginnings of torchao's import-time warnings about its compiled extensions
# (torchao/__init__.py: a library that fails to load; the extensions skipped).
_EXTENSION_WARNINGS = ("Failed to load ", "Skipping import of cpp extensions")


def _no_cuda() -> bool:
    torch = sys.modules.get("torch")  # torchao imports torch before it warns
    return torch is not None and not torch.cuda.is_available()


class _KernelsWithoutCuda(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not (str(record.msg).startswith(_EXTENSION_WARNINGS) and _no_cuda())


class _TorchaoEnums(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        cls = record.args[0] if isinstance(record.args, tuple) and record.args else None
        return not (isinstance(cls, type) and cls.__module__.startswith("torchao")
                    and "is an Enum subclass" in str(record.msg))


def quiet_torchao() -> None:
    """Drop torchao's import-time notes a user cannot act on (idempotent)."""
    for name, kind in (("torchao", _KernelsWithoutCuda), ("torch.utils._pytree", _TorchaoEnums)):
        log = logging.getLogger(name)
        if not any(isinstance(f, kind) for f in log.filters):
            log.addFilter(kind())
