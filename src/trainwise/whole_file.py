"""A file written whole or not at all: the one way the project writes a file that another
process (or machine) may read while it is written (run files, records, indexes, progress
marks). Light on purpose: no torch, so the verbs that only read and write files (plan,
report) start without it."""

from __future__ import annotations

import os
from pathlib import Path


def write_whole(path: Path, text: str) -> None:
    """`text` into `path` whole or not at all: written beside it, then renamed over it, so a
    reader (another process, another machine) never sees half a file. The temporary name
    carries the pid: several writers of the same file do not collide. A failed write (a
    full disk) removes its temporary file: nothing half-written is left behind."""
    part = path.with_name(f".{path.name}.{os.getpid()}.part")
    try:
        part.write_text(text, encoding="utf-8")
        os.replace(part, path)
    except BaseException:
        part.unlink(missing_ok=True)
        raise
