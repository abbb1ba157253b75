"""Prepared token directories (what `trainwise data prepare` writes) and how they are read.

A directory holds token shards (``tokens-00000.bin``, ...: flat little-endian uint16 or
uint32 ids, the dtype fixed by the tokenizer's vocabulary) and ``index.json``, written last:
a directory without it is not a prepared corpus. Documents are separated by the
tokenizer's EOS id. `TokenShards` maps the shards read-only and reads them as one stream,
so the windows, the split and the sampler work on it as on a single token file.

Prompt/response corpora (``kind = "prompt_response"`` in the index) add, per token shard, a
``mask-NNNNN.bin`` of uint8 (1 where the token is part of a response, so predicted and
counted in the loss) and ``documents.bin``: uint64 start offsets of every example plus the
end, so an example is one training sample.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from trainwise.checksum import CHECKSUM, new_hasher
from trainwise.errors import DataError
from trainwise.whole_file import write_whole

INDEX = "index.json"
FORMAT = "trainwise-tokens"
VERSION = 1
DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}


def dtype_for_vocab(vocab_size: int) -> str:
    """The smallest dtype holding every id of a vocabulary: uint16 up to 65,536 ids."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def shard_name(i: int, part: str = "tokens") -> str:
    return f"{part}-{i:05d}.bin"


def is_prepared_dir(path: str | os.PathLike[str]) -> bool:
    return Path(path).is_dir() and (Path(path) / INDEX).is_file()


def read_index(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The checked index of a prepared directory; DataError (one line) when it is not one."""
    p = Path(path)
    where = f"data.path: {str(p)!r}"
    if not (p / INDEX).is_file():
        raise DataError(
            f"{where} is a directory without {INDEX}, so not a prepared corpus (a prepare that "
            "did not finish leaves none); run `trainwise data prepare ... --out` again"
        )
    try:
        index = json.loads((p / INDEX).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise DataError(f"{where}: cannot read {INDEX} ({exc}); prepare the corpus again") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise DataError(f"{where}: {INDEX} is not a trainwise token index; prepare it again")
    if index.get("dtype") not in DTYPES or not index.get("shards"):
        raise DataError(f"{where}: {INDEX} names no shards or an unknown dtype; prepare it again")
    return index


class TokenShards:
    """The shards of a prepared directory as one read-only 1-D token stream. A slice is a
    view (nothing read); numpy reads it on demand (np.asarray, np.max), joining shards
    where the range spans them. So the split and the windows never load the corpus."""

    ndim = 1

    def __init__(self, path: str | os.PathLike[str], part: str = "file"):
        """`part`: "file" for the token ids, "mask" for a prompt/response corpus's mask."""
        self.path = Path(path)
        self.index = read_index(self.path)
        self.dtype = DTYPES[self.index["dtype"]] if part == "file" else np.dtype("u1")
        self.vocab_size = int(self.index["vocab_size"])
        self._maps: list[np.memmap] = []
        for shard in self.index["shards"]:
            if part not in shard:
                raise DataError(f"data.path: {str(self.path)!r} has no {part} shards")
            f = self.path / shard[part]
            expected = int(shard["tokens"]) * self.dtype.itemsize
            if not f.is_file() or f.stat().st_size != expected:
                raise DataError(
                    f"data.path: shard {str(f)!r} is missing or not {expected} bytes as "
                    f"{INDEX} says; prepare the corpus again"
                )
            self._maps.append(np.memmap(f, dtype=self.dtype, mode="r"))
        self._starts = np.cumsum([0] + [len(m) for m in self._maps])
        self._lo, self._hi = 0, int(self._starts[-1])

    @property
    def shape(self) -> tuple[int]:
        return (len(self),)

    def __len__(self) -> int:
        return self._hi - self._lo

    def __getitem__(self, key: slice) -> TokenShards:
        if not isinstance(key, slice):
            raise TypeError("TokenShards supports slices only")
        start, stop, step = key.indices(len(self))
        if step != 1:
            raise TypeError("TokenShards supports contiguous slices only")
        view = object.__new__(TokenShards)
        view.__dict__.update(self.__dict__)
        view._lo, view._hi = self._lo + start, self._lo + max(start, stop)
        return view

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        pieces, pos = [], self._lo
        i = max(0, int(np.searchsorted(self._starts, pos, side="right")) - 1)
        while pos < self._hi:
            base, end = int(self._starts[i]), min(self._hi, int(self._starts[i + 1]))
            pieces.append(self._maps[i][pos - base : end - base])
            pos, i = end, i + 1
        out = np.concatenate(pieces) if pieces else np.empty(0, dtype=self.dtype)
        return out if dtype is None else out.astype(dtype, copy=False)


VERIFY_CHUNK = 1 << 24  # bytes read at a time by the checks


def shard_facts(path: Path, dtype: np.dtype) -> dict[str, Any]:
    """A token shard's checksum (xxh3, as checkpoint files) and largest id, in one read."""
    digest, top = new_hasher(CHECKSUM), 0
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(VERIFY_CHUNK - VERIFY_CHUNK % dtype.itemsize):
            digest.update(chunk)
            top = max(top, int(np.frombuffer(chunk, dtype=dtype).max()))
    return {CHECKSUM: digest.hexdigest(), "max_id": top}


def verify_shards(path: str | os.PathLike[str]) -> None:
    """Before any worker starts: every token shard of a prepared directory (and of its
    held-out val/) holds what `data prepare` wrote, by its checksum, and no id at or above
    the vocabulary. One read of the corpus; DataError (one line) naming the shard."""
    folder = Path(path)
    for where in [folder] + ([folder / "val"] if is_prepared_dir(folder / "val") else []):
        index = read_index(where)
        dtype, vocab = DTYPES[index["dtype"]], int(index["vocab_size"])
        for shard in index["shards"]:
            _verify_shard(where / shard["file"], shard, dtype, vocab)


def _verify_shard(file: Path, shard: dict[str, Any], dtype: np.dtype, vocab: int) -> None:
    expected = int(shard["tokens"]) * dtype.itemsize
    if not file.is_file() or file.stat().st_size != expected:
        raise DataError(
            f"data.path: shard {str(file)!r} is missing or not {expected} bytes as {INDEX} "
            "says; prepare the corpus again"
        )
    found = shard_facts(file, dtype)
    if shard.get(CHECKSUM) not in (None, found[CHECKSUM]):
        raise DataError(
            f"data.path: shard {str(file)!r} does not match the checksum {INDEX} recorded "
            "(the file was changed or damaged since `data prepare`): prepare the corpus again"
        )
    if found["max_id"] >= vocab:
        raise DataError(
            f"data.path: shard {str(file)!r} holds token id {found['max_id']}, outside the "
            f"vocabulary of {vocab} ids {INDEX} declares: prepare the corpus again"
        )


def write_index(out: Path, index: dict[str, Any]) -> None:
    """index.json, written to a temporary name and renamed: it marks the directory done."""
    write_whole(out / INDEX, json.dumps(index, indent=2, sort_keys=True) + "\n")


IGNORE = -100  # the target id cross entropy skips (torch's default ignore_index)


class PromptResponseExamples:
    """One prompt/response example per sample (data.packing = false), cut to seq_len + 1
    tokens: x the inputs padded with EOS, y the next tokens where they are response tokens
    (or the EOS) and IGNORE elsewhere (prompt, padding), so only responses count in the
    loss. An example alone in its sample attends to nothing else."""

    def __init__(
        self, path: str | os.PathLike[str], seq_len: int, first: int = 0, last: int | None = None
    ):
        self.tokens, self.mask = TokenShards(path), TokenShards(path, "mask")
        starts = np.fromfile(Path(path) / "documents.bin", dtype="<u8")
        self.starts = starts[first : (len(starts) - 1 if last is None else last) + 1]
        self.seq_len, self.eos = seq_len, int(self.tokens.index["eos_id"])

    def __len__(self) -> int:
        return len(self.starts) - 1

    def example(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """Example i's (inputs, targets), at most seq_len of each: targets IGNORE where the
        token is not counted."""
        lo = int(self.starts[i])
        hi = min(int(self.starts[i + 1]), lo + self.seq_len + 1)
        ids = np.asarray(self.tokens[lo:hi], dtype=np.int64)
        counted = np.asarray(self.mask[lo:hi], dtype=bool)
        return ids[:-1], np.where(counted[1:], ids[1:], IGNORE)

    def __getitem__(self, i: int) -> tuple[Any, Any]:
        import torch

        inputs, targets = self.example(i)
        x = np.full(self.seq_len, self.eos, dtype=np.int64)
        y = np.full(self.seq_len, IGNORE, dtype=np.int64)
        x[: len(inputs)], y[: len(targets)] = inputs, targets
        return torch.from_numpy(x), torch.from_numpy(y)


class PackedExamples(PromptResponseExamples):
    """Whole examples packed into sequences of seq_len (data.packing = true), in order: a
    sample takes examples while they fit. Each sample is (x, y, doc): `doc` numbers the
    example each position belongs to (-1: padding), and the model keeps attention inside
    an example and restarts its positions there (models.gpt.packed_layout)."""

    def __init__(
        self, path: str | os.PathLike[str], seq_len: int, first: int = 0, last: int | None = None
    ):
        super().__init__(path, seq_len, first, last)
        sizes = np.minimum(np.diff(self.starts.astype(np.int64)), seq_len + 1) - 1
        groups, fill = [0], 0
        for i, size in enumerate(sizes.tolist()):
            if fill + size > seq_len and fill:
                groups.append(i)
                fill = 0
            fill += size
        groups.append(len(sizes))
        self.groups = np.asarray(groups)  # sample j holds examples groups[j] .. groups[j+1]-1

    def __len__(self) -> int:
        return len(self.groups) - 1

    def __getitem__(self, j: int) -> tuple[Any, Any, Any]:
        import torch

        x = np.full(self.seq_len, self.eos, dtype=np.int64)
        y = np.full(self.seq_len, IGNORE, dtype=np.int64)
        doc = np.full(self.seq_len, -1, dtype=np.int64)
        pos = 0
        for k, i in enumerate(range(int(self.groups[j]), int(self.groups[j + 1]))):
            inputs, targets = self.example(i)
            end = pos + len(inputs)
            x[pos:end], y[pos:end], doc[pos:end] = inputs, targets, k
            pos = end
        return torch.from_numpy(x), torch.from_numpy(y), torch.from_numpy(doc)
