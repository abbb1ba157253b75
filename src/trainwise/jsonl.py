"""Reading the project's append-only JSON-lines files (events.jsonl, metrics.jsonl): the
one lenient reader, for the parts of any floor that read them (plan, run, report)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_objects(path: Path) -> list[dict[str, Any]]:
    """The JSON objects of a .jsonl file in file order; [] when there is no file. A line
    that is not a JSON object is skipped: a writer killed mid-line leaves one."""
    try:
        raw = Path(path).read_bytes()
    except FileNotFoundError:
        return []
    out: list[dict[str, Any]] = []
    for line in raw.decode("utf-8", errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError:
            continue
        if isinstance(obj, dict):
            out.append(obj)
    return out
