"""`trainwise data prepare`: text and JSONL documents tokenized into a prepared directory.

Documents are read in the order given (a text file is one document, a JSONL line one
document: its ``field``), tokenized with Hugging Face ``tokenizers`` without special
tokens, and written as one stream with the tokenizer's EOS id after every document, cut
into shards of at most ``shard_tokens`` ids. Everything goes to ``OUT.partial`` first and
is renamed to ``OUT`` only when index.json is written, so a killed prepare never leaves a
directory that looks complete. The output depends only on the inputs, the tokenizer and the
options: the same command writes the same bytes.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from trainwise.data.shards import DTYPES, FORMAT, VERSION, dtype_for_vocab, shard_name, write_index
from trainwise.errors import DataError

BYTES = "bytes"  # the built-in tokenizer: UTF-8 bytes 0..255, EOS = 256
_EOS_NAMES = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "<|eos|>", "[SEP]")
_BATCH = 512  # documents tokenized together (tokenizers parallelises a batch)


@dataclass
class Tokenizer:
    """What prepare needs of a tokenizer: encode a batch, its vocabulary and EOS id."""

    spec: str
    vocab_size: int
    eos_id: int
    sha256: str
    _tok: Any = None  # a tokenizers.Tokenizer; None for bytes

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        if self._tok is None:
            return [list(t.encode("utf-8")) for t in texts]
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        if self._tok is None:
            return bytes(ids).decode("utf-8")
        return self._tok.decode(list(ids), skip_special_tokens=False)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _eos_from_config(folder: Path) -> str | None:
    """The eos_token of a tokenizer_config.json beside tokenizer.json, when there is one."""
    cfg = folder / "tokenizer_config.json"
    try:
        eos = json.loads(cfg.read_text(encoding="utf-8")).get("eos_token")
    except (OSError, ValueError, AttributeError):
        return None
    return eos.get("content") if isinstance(eos, dict) else eos


def load_tokenizer(spec: str, eos: str | None = None) -> Tokenizer:
    """`spec` is "bytes", a tokenizer.json, or "hf:DIR" (DIR/tokenizer.json). The EOS token is
    `eos`, else the eos_token of tokenizer_config.json beside it, else a common name."""
    if spec == BYTES:
        return Tokenizer(BYTES, 257, 256, hashlib.sha256(b"bytes").hexdigest())
    path = Path(spec[3:] if spec.startswith("hf:") else spec).expanduser()
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise DataError(
            f"--tokenizer {spec}: no tokenizer file at {str(path)!r}; give a tokenizer.json, "
            "hf:MODEL_DIR (holding tokenizer.json) or 'bytes'"
        )
    try:
        from tokenizers import Tokenizer as HFTokenizer
    except ImportError:
        raise DataError(
            f"--tokenizer {spec} needs Hugging Face tokenizers: pip install 'trainwise[hf]' "
            "(or use --tokenizer bytes)"
        ) from None

    try:
        tok = HFTokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises a bare Exception on bad JSON
        why = " ".join(str(exc).split())[:160]
        raise DataError(
            f"--tokenizer {spec}: {str(path)!r} is not a Hugging Face tokenizer.json ({why})"
        ) from None
    names = [eos] if eos else [n for n in (_eos_from_config(path.parent), *_EOS_NAMES) if n]
    eos_id = next((i for i in map(tok.token_to_id, names) if i is not None), None)
    if eos_id is None:
        raise DataError(
            f"--tokenizer {spec}: no end-of-document token found (tried {', '.join(names)}); "
            "name the tokenizer's EOS token with --eos"
        )
    vocab = tok.get_vocab_size(with_added_tokens=True)
    return Tokenizer(spec, vocab, eos_id, _sha256(path), tok)


def read_documents(paths: Sequence[Path], field: str) -> Iterator[str]:
    """The documents of every input in order: a .jsonl/.json-lines file gives each line's
    `field`, any other file is one document. DataError naming file and line on bad input."""
    for path in paths:
        if not path.is_file():
            raise DataError(f"input {str(path)!r} is not a file; give text or JSONL files")
        if path.suffix.lower() not in (".jsonl", ".ndjson"):
            yield path.read_text(encoding="utf-8")
            continue
        with path.open(encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                yield _field_of(line, field, f"{path}:{lineno}")


def read_examples(paths: Sequence[Path], prompt: str, response: str) -> Iterator[tuple[str, str]]:
    """(prompt, response) of every line of JSONL files, in order."""
    for path in paths:
        if not path.is_file() or path.suffix.lower() not in (".jsonl", ".ndjson"):
            raise DataError(
                f"input {str(path)!r} is not a .jsonl file; prompt/response examples are "
                "JSONL lines with both fields"
            )
        with path.open(encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if line.strip():
                    where = f"{path}:{lineno}"
                    yield _field_of(line, prompt, where), _field_of(line, response, where)


def _field_of(line: str, field: str, where: str) -> str:
    try:
        record = json.loads(line)
    except ValueError as exc:
        raise DataError(f"{where} is not JSON ({exc}); fix or remove the line") from None
    if not isinstance(record, dict) or field not in record:
        have = ", ".join(sorted(record)) if isinstance(record, dict) else type(record).__name__
        raise DataError(
            f"{where} has no field {field!r} (it has: {have or 'nothing'}); choose --field"
        )
    value = record[field]
    if not isinstance(value, str):
        raise DataError(f"{where}: field {field!r} is {type(value).__name__}, not text")
    return value


class _ShardWriter:
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

    def close(self) -> None:
        if self._file is not None:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            self._file = None


class _Output:
    """The streams of a prepared directory: token ids, and for prompt/response examples the
    loss mask (same shards) and every example's start offset."""

    def __init__(self, folder: Path, dtype: str, shard_tokens: int, examples: bool):
        self.tokens = _ShardWriter(folder, DTYPES[dtype], shard_tokens)
        self.mask = _ShardWriter(folder, np.dtype("u1"), shard_tokens, "mask") if examples else None
        self.starts: list[int] = [0]

    def add(self, ids: list[int], mask: list[int] | None = None) -> None:
        self.tokens.write(np.asarray(ids, dtype=np.int64))
        if self.mask is not None:
            self.mask.write(np.asarray(mask, dtype=np.int64))
            self.starts.append(self.starts[-1] + len(ids))

    def close(self) -> list[dict[str, Any]]:
        """The shard entries of index.json (after the files are flushed)."""
        self.tokens.close()
        shards = self.tokens.shards
        if self.mask is not None:
            self.mask.close()
            for shard, mask in zip(shards, self.mask.shards, strict=True):
                shard["mask"] = mask["file"]
            starts = np.asarray(self.starts, dtype="<u8")
            starts.tofile(self.tokens.folder / "documents.bin")
        return shards


def prepare(
    inputs: Sequence[str | os.PathLike[str]],
    out: str | os.PathLike[str],
    tokenizer: Tokenizer,
    *,
    field: str = "text",
    response_field: str | None = None,
    shard_tokens: int = 1 << 27,
    command: Sequence[str] = (),
) -> dict[str, Any]:
    """Tokenize `inputs` into the prepared directory `out`; returns its index. With
    `response_field`, every JSONL line is a (`field`, `response_field`) example whose loss
    counts the response tokens and the EOS only."""
    out, paths = Path(out), [Path(p) for p in inputs]
    if not paths:
        raise DataError("data prepare: no input files given; name text or JSONL files")
    if out.exists():
        raise DataError(f"--out {out} exists; remove it or choose another folder")
    if shard_tokens < 1:
        raise DataError(f"--shard-tokens {shard_tokens}: must be a positive number of tokens")
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)  # what a killed prepare left
    partial.mkdir(parents=True)
    dtype = dtype_for_vocab(tokenizer.vocab_size)
    output = _Output(partial, dtype, shard_tokens, examples=response_field is not None)
    try:
        if response_field is None:
            docs = _write_documents(output, tokenizer, read_documents(paths, field))
        else:
            docs = _write_examples(output, tokenizer, read_examples(paths, field, response_field))
    finally:
        shards = output.close()
    tokens = sum(s["tokens"] for s in shards)
    if docs == 0 or tokens == docs:  # nothing but separators
        shutil.rmtree(partial, ignore_errors=True)
        raise DataError(
            f"data prepare: the inputs ({', '.join(map(str, paths))}) hold no text under "
            f"field {field!r}; check the files and --field"
        )
    index = {
        "format": FORMAT, "version": VERSION, "dtype": dtype, "vocab_size": tokenizer.vocab_size,
        "eos_id": tokenizer.eos_id, "documents": docs, "tokens": tokens, "shards": shards,
        "kind": "text" if response_field is None else "prompt_response",
        "tokenizer": {"spec": tokenizer.spec, "sha256": tokenizer.sha256}, "field": field,
        "response_field": response_field,
        "sources": [{"path": str(p), "sha256": _sha256(p)} for p in paths],
        "command": list(command),
    }
    write_index(partial, index)
    os.replace(partial, out)
    return index


def _batches(items: Iterator[Any]) -> Iterator[list[Any]]:
    batch: list[Any] = []
    for item in items:
        batch.append(item)
        if len(batch) == _BATCH:
            yield batch
            batch = []
    if batch:
        yield batch


def _write_documents(output: _Output, tokenizer: Tokenizer, docs: Iterator[str]) -> int:
    n = 0
    for batch in _batches(docs):
        for ids in tokenizer.encode_batch(batch):
            output.add([*ids, tokenizer.eos_id])
        n += len(batch)
    return n


def _write_examples(
    output: _Output, tokenizer: Tokenizer, examples: Iterator[tuple[str, str]]
) -> int:
    """Prompt and response tokenized apart (so the boundary is exact), then one sequence:
    prompt, response, EOS; the mask marks the response and the EOS."""
    n = 0
    for batch in _batches(examples):
        prompts = tokenizer.encode_batch([p for p, _ in batch])
        responses = tokenizer.encode_batch([r for _, r in batch])
        for p, r in zip(prompts, responses, strict=True):
            output.add([*p, *r, tokenizer.eos_id], [0] * len(p) + [1] * (len(r) + 1))
        n += len(batch)
    return n
