"""The progress line of `trainwise data prepare`: records, tokens and the input read (MB/s),
redrawn in place on a terminal. A pipe or a log file gets nothing (no carriage returns in
logs), nor does --quiet."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

INTERVAL = 0.5  # seconds between redraws


class ProgressLine:
    def __init__(
        self,
        enabled: bool,
        stream: TextIO | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled and self.stream.isatty()
        self.clock = clock
        self.records = self.tokens = self.bytes = 0
        self.start = self.last = clock()

    def read(self, item: Any) -> Any:
        """Count an input item's UTF-8 bytes (a document, or an example's text parts)."""
        if self.enabled:
            parts = [item] if isinstance(item, str) else [text for text, _ in item]
            self.bytes += sum(len(text.encode("utf-8")) for text in parts)
        return item

    def add(self, tokens: int) -> None:
        """One record written, `tokens` ids long."""
        self.records += 1
        self.tokens += tokens
        if self.enabled and self.clock() - self.last >= INTERVAL:
            self.last = self.clock()
            print(f"\r{self.line()}", end="", file=self.stream, flush=True)

    def line(self) -> str:
        seconds = max(self.clock() - self.start, 1e-9)
        return (f"prepare: {self.records:,} records, {self.tokens:,} tokens, "
                f"{self.bytes / seconds / 1e6:,.1f} MB/s")

    def close(self) -> None:
        if self.enabled and self.records:
            print(f"\r{self.line()}", file=self.stream, flush=True)
