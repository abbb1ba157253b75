"""Writing a prepared directory's streams (token shards, a prompt/response corpus's mask
shards and example offsets), in a way that can be committed and resumed: `state()` says
how much is durably written, `restore(state)` cuts the files back to it after a kill."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from trainwise.data.shards import DTYPES, shard_facts, shard_name

STARTS = "documents.bin"  # uint64 start offset of every example, then the end


class ShardWriter:
    """Appends values to `part` shards of at most `shard_tokens` values in `folder`."""

    def __init__(self, folder: Path, dtype: np.dtype, shard_tokens: int, part: str = "tokens"):
        self.folder, self.dtype, self.limit, self.part = folder, dtype, shard_tokens, part
        self.shards: list[dict[str, Any]] = []
        self._file: Any = None

    def write(self, ids: np.ndarray) -> None:
        while len(ids):
            if self._file is None or self.shards[-1]["tokens"] == self.limit:
                self._open_next()
            room = self.limit - self.shards[-1]["tokens"]
            self._file.write(ids[:room].astype(self.dtype).tobytes())
            self.shards[-1]["tokens"] += len(ids[:room])
            ids = ids[room:]

    def _open_next(self) -> None:
        self.close()
        name = shard_name(len(self.shards), self.part)
        self.shards.append({"file": name, "tokens": 0})
        self._file = (self.folder / name).open("wb")

    def flush(self) -> None:
        """Make what was written durable (a commit point)."""
        if self._file is not None:
            self._file.flush()
            os.fsync(self._file.fileno())

    def close(self) -> None:
        if self._file is not None:
            self.flush()
            self._file.close()
            self._file = None

    def restore(self, shards: list[dict[str, Any]]) -> None:
        """Continue after `shards` (a committed state): each cut back to its committed
        length, shards written after the commit deleted, the last one reopened."""
        self.shards = [dict(s) for s in shards]
        for shard in self.shards:
            with (self.folder / shard["file"]).open("r+b") as f:
                f.truncate(shard["tokens"] * self.dtype.itemsize)
        for stray in self.folder.glob(f"{self.part}-*.bin"):
            if stray.name not in {s["file"] for s in self.shards}:
                stray.unlink()
        if self.shards:
            self._file = (self.folder / self.shards[-1]["file"]).open("ab")


class Output:
    """The streams of one prepared directory: token ids, and for prompt/response examples the
    loss mask (same shards) and every example's start offset."""

    def __init__(self, folder: Path, dtype: str, shard_tokens: int, examples: bool):
        folder.mkdir(parents=True, exist_ok=True)
        self.folder = folder
        self.tokens = ShardWriter(folder, DTYPES[dtype], shard_tokens)
        self.mask = ShardWriter(folder, np.dtype("u1"), shard_tokens, "mask") if examples else None
        self.documents = 0
        self.end = 0  # tokens written
        self._starts = None
        if examples:  # appended to: a resumed prepare cuts it back first (restore)
            if not (folder / STARTS).exists():
                (folder / STARTS).write_bytes(np.asarray([0], dtype="<u8").tobytes())
            self._starts = (folder / STARTS).open("ab")

    def add(self, ids: list[int], mask: list[int] | None = None) -> None:
        self.tokens.write(np.asarray(ids, dtype=np.int64))
        self.documents += 1
        self.end += len(ids)
        if self.mask is not None and self._starts is not None:
            self.mask.write(np.asarray(mask, dtype=np.int64))
            self._starts.write(np.asarray([self.end], dtype="<u8").tobytes())

    def state(self) -> dict[str, Any]:
        """What is durably written, for a commit (files flushed first)."""
        for writer in (self.tokens, self.mask):
            if writer is not None:
                writer.flush()
        if self._starts is not None:
            self._starts.flush()
            os.fsync(self._starts.fileno())
        return {
            "documents": self.documents, "end": self.end, "tokens": self.tokens.shards,
            "mask": self.mask.shards if self.mask else None,
        }

    def restore(self, state: dict[str, Any]) -> None:
        self.documents, self.end = state["documents"], state["end"]
        self.tokens.restore(state["tokens"])
        if self.mask is not None and self._starts is not None:
            self.mask.restore(state["mask"])
            self._starts.close()
            with (self.folder / STARTS).open("r+b") as f:
                f.truncate((self.documents + 1) * 8)
            self._starts = (self.folder / STARTS).open("ab")

    def close(self) -> list[dict[str, Any]]:
        """The shard entries of index.json (after the files are flushed), each with its
        checksum and largest token id, which training checks before it starts."""
        self.tokens.close()
        shards = [
            {**s, **shard_facts(self.folder / s["file"], self.tokens.dtype)}
            for s in self.tokens.shards
        ]
        if self.mask is not None and self._starts is not None:
            self.mask.close()
            for shard, mask in zip(shards, self.mask.shards, strict=True):
                shard["mask"] = mask["file"]
            self._starts.close()
        return shards
