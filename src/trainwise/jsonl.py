"""The project's append-only JSON-lines files (events.jsonl, metrics.jsonl): the one reader,
for the parts of any floor that read them (plan, run, report), and the cut that a resumed
run makes before it appends.

A writer stopped mid-record (killed, or out of disk space) leaves a torn LAST line: the
reader skips it with a warning, and the next launch in the directory cuts it off, so that
its own records start on a line of their own. A line in the middle that is not a JSON
object is damage no writer of ours leaves: one line naming the file and the line.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from trainwise.errors import ConfigError

TAIL_BLOCK = 1 << 16  # bytes read at a time from the end, looking for the last newline
_warned: set[tuple[str, int]] = set()  # (file, size): one warning per torn file, not per read


class JsonlError(ConfigError):
    """A JSON-lines file damaged in the middle (exit status 2)."""


def read_objects(path: Path) -> list[dict[str, Any]]:
    """The JSON objects of a .jsonl file in file order; [] when there is no file. A torn
    last line is skipped with a warning; any other line that is not a JSON object raises
    JsonlError."""
    try:
        raw = Path(path).read_bytes()
    except FileNotFoundError:
        return []
    lines = raw.decode("utf-8", errors="replace").splitlines()
    last = max((n for n, line in enumerate(lines) if line.strip()), default=-1)
    out: list[dict[str, Any]] = []
    for n, line in enumerate(lines):
        if not line.strip():
            continue
        obj = _object(line)
        if obj is None and n == last:
            _warn_torn(Path(path), len(raw))
            break
        if obj is None:
            raise JsonlError(
                f"{path} line {n + 1}: not JSON (the file is damaged); remove that line or "
                "restore the file"
            )
        out.append(obj)
    return out


def _object(line: str) -> dict[str, Any] | None:
    try:
        obj = json.loads(line)
    except ValueError:
        return None
    return obj if isinstance(obj, dict) else None


def _warn_torn(path: Path, size: int) -> None:
    if (str(path), size) in _warned:
        return
    _warned.add((str(path), size))
    logging.getLogger("trainwise").warning(
        "trainwise: warning: %s: its last line is cut off mid-record (a write stopped by a "
        "crash or a full disk) and is skipped; the next run in this directory removes it",
        path,
    )


def cut_torn_tail(path: Path) -> int:
    """Cut `path` back to its last whole record before anything appends to it: the bytes
    after its last newline are removed, or, when they are a whole JSON object that lost
    only its newline, the newline is added. Returns the bytes removed (0: nothing torn)."""
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return 0
    try:
        size = os.fstat(fd).st_size
        start = _after_last_newline(fd, size)
        if start == size:
            return 0
        tail = os.pread(fd, size - start, start).decode("utf-8", errors="replace")
        if _object(tail) is not None:
            os.pwrite(fd, b"\n", size)
            return 0
        os.ftruncate(fd, start)
        return size - start
    finally:
        os.close(fd)


def _after_last_newline(fd: int, size: int) -> int:
    """The offset just after the file's last newline (0 when it has none)."""
    end = size
    while end > 0:
        begin = max(0, end - TAIL_BLOCK)
        found = os.pread(fd, end - begin, begin).rfind(b"\n")
        if found >= 0:
            return begin + found + 1
        end = begin
    return 0


def cut_torn_files(folder: Path) -> list[str]:
    """Every *.jsonl of `folder` cut back to its last whole record (see cut_torn_tail); one
    line for each file that was cut, to say so."""
    said = []
    for path in sorted(Path(folder).glob("*.jsonl")):
        cut = cut_torn_tail(path)
        if cut:
            said.append(
                f"trainwise: cut {path} back to its last whole record ({cut} bytes of a "
                "record cut off mid-write, by a crash or a full disk)"
            )
    return said
