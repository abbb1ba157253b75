"""`trainwise checkpoints`: list a run's checkpoints with their size, timing and validity."""

from __future__ import annotations

import argparse
import json
from datetime import datetime
from pathlib import Path
from typing import Any

from trainwise.errors import ConfigError

_TMP = ".tmp"
INCOMPLETE = "incomplete (ignored)"

# Exit statuses, for scripts (docs/train.md): 2 is bad input, as everywhere.
NEWEST_INVALID = 3  # the newest checkpoint is invalid; an older one is valid (resume takes it)
NONE_VALID = 4  # no checkpoint is valid: a resume would stop


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "checkpoints",
        help="list a run's checkpoints and verify them",
        description="List the checkpoints of a run (or of a checkpoint folder) and verify "
        "them against their manifests: fast = file sizes, full = sizes and checksums. Exit "
        f"status: 0 the newest checkpoint is valid, {NEWEST_INVALID} the newest is invalid "
        f"but an older one is valid, {NONE_VALID} none is valid, 2 bad input.",
    )
    # dest is not "run": the dispatcher calls args.run.
    p.add_argument("target", metavar="RUN", help="run directory or checkpoint folder")
    p.add_argument(
        "--verify",
        choices=("fast", "full"),
        default="fast",
        help="fast: sizes only (default); full: also the checksum (xxh3) of every file",
    )
    p.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    p.set_defaults(run=run)


def _root_of(target: Path) -> Path:
    """The checkpoint root: the run's (config.toml's checkpoint.dir or RUN/checkpoints),
    ``target`` itself when it already holds step directories, or the parent of a checkpoint."""
    from trainwise.export.weights import checkpoint_root, is_checkpoint_dir
    from trainwise.run.checkpoint.store import parse_step

    if is_checkpoint_dir(target):  # one checkpoint given: list it beside its siblings
        return target.parent
    if any(parse_step(child.name) is not None for child in target.iterdir()):
        return target
    return checkpoint_root(target)


def _incomplete_step(name: str) -> int | None:
    """The step of an interrupted save's ``step-XXXXXXXX[.del].tmp`` directory, else None."""
    from trainwise.run.checkpoint.store import parse_step

    if not name.endswith(_TMP):
        return None
    stem = name[: -len(_TMP)]
    stem = stem.removesuffix(".del")
    return parse_step(stem)


def _row(step: int, path: Path, manifest: Any, valid: bool, problems: list[str]) -> dict:
    """One listing record; the manifest fields are None when there is no readable manifest."""
    from trainwise.run.checkpoint.store import dir_bytes

    m = manifest
    return {
        "step": step,
        "path": str(path),
        "status": _status(path, m),
        "created": m.created if m else None,
        "time": _local_time(m.created) if m else None,
        "bytes": m.total_bytes if m else dir_bytes(path),
        "tokens": m.tokens if m else None,
        "world_size": m.world_size if m else None,
        "dp_size": m.dp_size if m else None,
        "strategy": m.strategy if m else None,
        "async_save": m.async_save if m else None,
        "stall_s": m.stall_s if m else None,
        "save_s": m.save_s if m else None,
        "valid": valid,
        "problems": list(problems),
    }


def _status(path: Path, manifest: Any) -> str:
    """complete (a readable manifest), damaged (a manifest that cannot be read: resume
    skips it as invalid) or incomplete (no manifest: an interrupted save, cleaned later)."""
    from trainwise.run.checkpoint.store import MANIFEST

    if manifest is not None:
        return "complete"
    return "damaged" if (path / MANIFEST).is_file() else "incomplete"


def exit_status(rows: list[dict[str, Any]]) -> int:
    """0 when the newest checkpoint is valid, NEWEST_INVALID when an older one is, else
    NONE_VALID. Interrupted saves do not count: resume ignores them."""
    counted = [row for row in rows if row["status"] != "incomplete"]
    if counted and counted[-1]["valid"]:
        return 0
    return NEWEST_INVALID if any(row["valid"] for row in counted) else NONE_VALID


def collect(root: Path, verify_mode: str) -> list[dict[str, Any]]:
    """One record per checkpoint directory under ``root`` (incomplete ones included), by step."""
    from trainwise.run.checkpoint.store import list_checkpoints

    rows = [
        _row(info.step, info.path, info.manifest, info.valid, info.problems)
        for info in list_checkpoints(root, verify_mode)  # type: ignore[arg-type]
    ]
    if root.is_dir():
        # Interrupted saves: never loaded (resume ignores them), shown so the space is explained.
        for child in root.iterdir():
            step = _incomplete_step(child.name)
            if step is not None and child.is_dir():
                rows.append(_row(step, child, None, False, [INCOMPLETE]))
    rows.sort(key=lambda row: (row["step"], row["path"]))
    return rows


def _local_time(unix: float) -> str:
    return datetime.fromtimestamp(unix).astimezone().isoformat(timespec="seconds")


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _problem(row: dict[str, Any]) -> str:
    """The first problem of a row; paths inside the checkpoint are shown relative to it."""
    problem = row["problems"][0] if row["problems"] else "invalid"
    return problem.replace(row["path"] + "/", "")


def render(console: Any, root: Path, rows: list[dict[str, Any]], verify_mode: str) -> None:
    """The listing as a rich table. The first problem of each invalid checkpoint is printed
    under the table, one line each: inside a cell it would squeeze the table at 80 columns."""
    from rich import box
    from rich.markup import escape
    from rich.table import Table

    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False, collapse_padding=True)
    for name, justify in (
        ("step", "right"),
        ("time", "left"),
        ("MB", "right"),
        ("world", "right"),
        ("strategy", "left"),
        ("async", "left"),
        ("stall s", "right"),
        ("save s", "right"),
        ("verified", "left"),
    ):
        # Only the last column may wrap, so narrow terminals never truncate the numbers.
        last = name == "verified"
        table.add_column(name, justify=justify, no_wrap=not last)  # type: ignore[arg-type]
    notes = []
    for row in rows:
        if row["problems"] == [INCOMPLETE]:
            verified = f"[yellow]{INCOMPLETE}[/]"
        elif row["valid"]:
            verified = "[green]✓[/]"
        else:
            verified = "[red]✗[/] (below)"
            notes.append(f"  step {row['step']}: [red]✗[/] {escape(_problem(row))}")
        async_save = row["async_save"]
        table.add_row(
            str(row["step"]),
            row["time"].replace("T", " ")[:16] if row["time"] else "-",  # to the minute
            f"{row['bytes'] / 1e6:.1f}",
            _num(row["world_size"], "d"),
            row["strategy"] or "-",
            "-" if async_save is None else ("yes" if async_save else "no"),
            _num(row["stall_s"], ".2f"),
            _num(row["save_s"], ".2f"),
            verified,
        )
    console.print(f"checkpoints in {escape(str(root))} (verify: {verify_mode})", soft_wrap=True)
    console.print(table)
    for note in notes:
        console.print(note, soft_wrap=True)


def run(args: argparse.Namespace) -> int:
    target = Path(args.target)
    if not target.is_dir():
        raise ConfigError(f"{target}: no such run directory; give runs/NAME")
    from trainwise.run.checkpoint.store import CheckpointError

    try:
        root = _root_of(target)
    except CheckpointError as err:
        raise ConfigError(str(err)) from None
    rows = collect(root, args.verify)
    if not rows:
        raise ConfigError(
            f"no checkpoints in {root}: train with checkpoint.enabled = true (the default) "
            "or give the run directory that has them"
        )
    if args.json:
        print(json.dumps(rows, indent=2))
        return exit_status(rows)
    from rich.console import Console

    render(Console(), root, rows, args.verify)
    return exit_status(rows)
