"""Which checkpoints a run may resume from: those of its own lineage (config.lineage).

Pure file reads, no torch: the launcher checks before any worker starts (one line, exit
2), and rank 0 applies the same rule when it picks the checkpoint to load.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from trainwise.config.lineage import lineage_differences
from trainwise.config.schema import CheckpointConfig
from trainwise.run.checkpoint import store as store
from trainwise.run.checkpoint.store import CheckpointError

TRAINER_FILE = "trainer.json"  # the trainer's progress and the lineage's keys, per checkpoint


class LineageError(CheckpointError):
    """A checkpoint written by a run with other training settings; bad input, not a fault."""

    exit_status = 2


def recorded_lineage(path: Path) -> dict[str, Any] | None:
    """The lineage keys a checkpoint was written with; None for one of an earlier release."""
    try:
        return json.loads((Path(path) / TRAINER_FILE).read_text()).get("lineage")
    except (OSError, ValueError):
        return None


def differences(path: Path, keys: dict[str, Any]) -> list[str]:
    """How the checkpoint's lineage differs from `keys` ([] when it is the same or unknown)."""
    recorded = recorded_lineage(path)
    return lineage_differences(recorded, keys) if recorded else []


def refusal(path: Path, found: list[str]) -> LineageError:
    more = f" ({len(found) - 1} more differ)" if len(found) > 1 else ""
    return LineageError(
        f"the checkpoint {path} was written by a run with other training settings: "
        f"{found[0]}{more}; resume with that run's settings, start a new lineage with "
        "checkpoint.resume = 'never' (earlier checkpoints are moved aside, not deleted), or "
        "take its weights with checkpoint.resume_from_other = 'weights' ('all' with the "
        "optimizer)"
    )


def check_before_launch(cfg: CheckpointConfig, root: Path, keys: dict[str, Any]) -> None:
    """Raise LineageError when the run would resume from another run's checkpoint: an
    explicit `checkpoint.resume` path of another lineage, or, for `auto`, committed
    checkpoints of which none is of this lineage."""
    if cfg.resume_from_other != "no":
        return
    found = other_lineage_checkpoint(cfg, root, keys)
    if found:
        raise refusal(*found)


def other_lineage_checkpoint(
    cfg: CheckpointConfig, root: Path, keys: dict[str, Any]
) -> tuple[Path, list[str]] | None:
    """The checkpoint of another lineage the run would resume from, with how its settings
    differ: an explicit `checkpoint.resume` path of another lineage, or, for `auto`, the
    newest committed checkpoint when none is of this lineage. None otherwise."""
    if cfg.resume == "never":
        return None
    if cfg.resume != "auto":
        found = differences(Path(cfg.resume), keys)
        return (Path(cfg.resume), found) if found else None
    committed = [info for info in store.list_checkpoints(root) if info.manifest is not None]
    newest_other = None
    for info in reversed(committed):
        found = differences(info.path, keys)
        if not found:
            return None  # the run's own lineage has a checkpoint: resume picks among those
        newest_other = newest_other or (info.path, found)
    return newest_other
