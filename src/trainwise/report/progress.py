"""A progress bar for a run started from Python (trainwise.train): the launcher follows the
run directory's metrics.jsonl as rank 0 flushes it and moves a tqdm bar (tqdm.auto: a
widget in a notebook, text in a terminal). The workers' own output may not reach a
notebook's cell at all (they write to the kernel's terminal); the file does."""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path
from typing import Any

POLL_S = 0.5  # how often the file is looked at: a step record is flushed every few steps


def attached() -> bool:
    """Whether someone watches: a terminal on stderr, or a Jupyter kernel."""
    if "ipykernel" in sys.modules:
        return True
    isatty = getattr(sys.stderr, "isatty", None)
    return bool(isatty and isatty())


class Follower:
    """Follows `RUN/metrics.jsonl` from its end at start(run_dir) (a resumed run's earlier
    records are not this launch's), in a daemon thread, until stop()."""

    def __init__(self, total: int):
        self.total = total
        self.bar: Any = None
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, run_dir: Path) -> None:
        from tqdm.auto import tqdm

        path = run_dir / "metrics.jsonl"
        offset = path.stat().st_size if path.is_file() else 0
        self.bar = tqdm(total=self.total, desc="train", unit="step", dynamic_ncols=True)
        self._thread = threading.Thread(
            target=self._follow, args=(path, offset), name="trainwise-progress", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        """Read what is left, then close the bar."""
        self._done.set()
        if self._thread is not None:
            self._thread.join()
        if self.bar is not None:
            self.bar.close()

    def _follow(self, path: Path, offset: int) -> None:
        tail = b""
        while True:
            done = self._done.wait(POLL_S)  # the last read comes after the run's end
            try:
                with path.open("rb") as f:
                    f.seek(offset)
                    chunk = f.read()
            except OSError:
                chunk = b""
            offset += len(chunk)
            *lines, tail = (tail + chunk).split(b"\n")  # a line not yet whole waits
            for line in lines:
                self._show(line)
            if done:
                return

    def _show(self, line: bytes) -> None:
        try:
            record = json.loads(line)
        except ValueError:
            return  # a torn line of a failed attempt: the next whole one says more
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            return
        self.bar.n = min(record["step"], self.total)
        loss = record.get("loss")
        if isinstance(loss, (int, float)):
            self.bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
        self.bar.refresh()
