"""`trainwise data prepare`: documents (text files; JSONL, Parquet or saved-dataset records)
or prompt/response examples tokenized into a prepared directory.

Inputs are read in the order given (data.sources), tokenized with Hugging Face
`tokenizers` without special tokens, a batch at a time (in a pool of worker processes when
there is more than one batch; the output keeps the input order), and written as one stream
with the tokenizer's EOS id after every document, cut into shards of at most
`shard_tokens` ids. With `val_fraction`, whole documents are held out (chosen by a hash of
their position) into `OUT/val`, a prepared directory of its own.

Everything goes to `OUT.partial` first and is renamed to `OUT` only when index.json is
written, so a killed prepare never leaves a directory that looks complete. Every
COMMIT_BATCHES batches the files are flushed and `progress.json` records how far they are
durable; the same command run again resumes from there (the files cut back to the commit)
and writes the same bytes as a run never killed. The output depends only on the inputs,
the tokenizer and the options.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import shutil
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from trainwise.data.progress_line import ProgressLine
from trainwise.data.shard_writer import Output
from trainwise.data.shards import DTYPES, FORMAT, VERSION, dtype_for_vocab, write_index
from trainwise.data.sources import (
    TEXT,
    decode,
    field_of,
    read_records,
    source_kind,
    source_sha256,
    text_of,
)
from trainwise.data.tokenizer import BYTES, Tokenizer, chat_renderer, load_tokenizer
from trainwise.errors import DataError
from trainwise.faults import Faults
from trainwise.whole_file import write_whole

__all__ = ["BYTES", "Options", "Tokenizer", "load_tokenizer", "prepare"]

BATCH = 512  # documents tokenized together
COMMIT_BATCHES = 8  # batches between commit points (each flushes and fsyncs the shards)
PROGRESS = "progress.json"


@dataclass(frozen=True)
class Options:
    """What, besides the inputs and the tokenizer, decides the bytes written."""

    field: str = "text"
    response_field: str | None = None
    shard_tokens: int = 1 << 27
    val_fraction: float = 0.0
    messages_field: str | None = None
    errors: str = "strict"  # bytes that are not UTF-8: strict (stop), replace or ignore

    @property
    def examples(self) -> bool:
        """Records are examples whose loss counts some tokens only (a response, the
        assistant's turns)."""
        return self.response_field is not None or self.messages_field is not None


def prepare(
    inputs: Sequence[str | os.PathLike[str]],
    out: str | os.PathLike[str],
    tokenizer: Tokenizer,
    *,
    field: str = "text",
    response_field: str | None = None,
    shard_tokens: int = 1 << 27,
    val_fraction: float = 0.0,
    messages_field: str | None = None,
    errors: str = "strict",
    workers: int = 1,
    command: Sequence[str] = (),
    say: Callable[[str], None] | None = None,
    progress: bool = False,
) -> dict[str, Any]:
    """Tokenize `inputs` into the prepared directory `out`; returns its index. With
    `response_field`, every record is a (`field`, `response_field`) example whose loss
    counts the response tokens and the EOS only; with `messages_field`, a conversation
    rendered by the tokenizer's chat template whose loss counts the assistant's turns.
    `errors` says what bytes that are not UTF-8 do: strict (one line naming the file and
    the byte offset), replace (U+FFFD) or ignore (dropped)."""
    if response_field and messages_field:
        raise DataError("--response-field and --messages-field were both given: give one")
    opts = Options(field, response_field, shard_tokens, val_fraction, messages_field, errors)
    chat = chat_renderer(tokenizer.spec) if messages_field else None
    out, paths = Path(out), [Path(p) for p in inputs]
    _check(paths, out, opts, workers)
    kinds = [source_kind(p) for p in paths]
    sources = [{"path": str(p), "sha256": source_sha256(p)} for p in paths]
    dtype = dtype_for_vocab(tokenizer.vocab_size)
    key = _key(sources, tokenizer, opts, dtype)
    partial = out.with_name(out.name + ".partial")
    done = _resume_point(partial, key, say or (lambda _: None))
    train = Output(partial, dtype, shard_tokens, opts.examples)
    val = Output(partial / "val", dtype, shard_tokens, opts.examples) if val_fraction else None
    if done:
        train.restore(done["train"])
        if val is not None:
            val.restore(done["val"])
    skip = done["items"] if done else 0  # records already written
    items = _items(paths, kinds, opts, chat, skip)
    meter = ProgressLine(progress)
    try:
        _write(items, tokenizer, opts, (train, val), workers, partial, key, skip, meter)
    finally:
        meter.close()
        parts = (train.close(), val.close() if val else None)
    index = _index(train, parts[0], tokenizer, opts, dtype, sources, command, partial, paths)
    if val is not None and parts[1] is not None:
        write_index(partial / "val", _split_index(val, parts[1], index))
        index["val"] = {"path": "val", "documents": val.documents, "tokens": val.end}
    (partial / PROGRESS).unlink(missing_ok=True)
    write_index(partial, index)
    os.replace(partial, out)
    return index


def _check(paths: list[Path], out: Path, opts: Options, workers: int) -> None:
    if not paths:
        raise DataError("data prepare: no inputs given; name text, JSONL or Parquet files")
    if out.exists():
        raise DataError(f"--out {out} exists; remove it or choose another folder")
    if opts.shard_tokens < 1:
        raise DataError(f"--shard-tokens {opts.shard_tokens}: must be a positive number of tokens")
    if not 0.0 <= opts.val_fraction < 0.5:
        raise DataError(f"--val-fraction {opts.val_fraction}: give a share in [0, 0.5)")
    if workers < 1:
        raise DataError(f"--workers {workers}: give at least 1 tokenizer process")


def _key(sources: list[dict], tokenizer: Tokenizer, opts: Options, dtype: str) -> str:
    """The identity of a prepare's output: a partial output resumes only under the same."""
    what = {"sources": sources, "tokenizer": tokenizer.sha256, "eos": tokenizer.eos_id,
            "options": asdict(opts), "dtype": dtype, "version": VERSION}
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()


def _resume_point(partial: Path, key: str, say: Callable[[str], None]) -> dict | None:
    """The last commit of an earlier prepare of the same command into `partial`, or None
    (what is there is removed: another command's, or nothing committed yet)."""
    try:
        progress = json.loads((partial / PROGRESS).read_text())
    except (OSError, ValueError):
        progress = None
    if progress and progress.get("key") == key:
        say(f"trainwise: resuming the prepare in {partial} after {progress['items']} records")
        return progress
    if partial.exists():
        what = "another command's" if progress else "an unfinished"
        say(f"trainwise: removing {what} partial output {partial}; starting over")
        shutil.rmtree(partial)
    partial.mkdir(parents=True)
    return None


def _items(
    paths: list[Path], kinds: list[str], opts: Options, chat: Callable | None, skip: int = 0
) -> Iterator[Any]:
    """Documents (str) or examples (Segments: text parts, counted or not) of every input,
    in order, after the first `skip` records (a resume: those are counted, not rendered)."""
    position = 0
    for path, kind in zip(paths, kinds, strict=True):
        if kind == TEXT and not opts.examples:
            position += 1
            if position > skip:
                yield decode(path.read_bytes(), opts.errors, str(path))
            continue
        field = opts.messages_field or opts.field
        fields = [field] + ([opts.response_field] if opts.response_field else [])
        for where, record in read_records(path, kind, fields, opts.errors):
            position += 1
            if position <= skip:
                continue
            if chat is not None:
                yield chat(field_of(record, field, where, "--messages-field"), where)
            elif opts.response_field is None:
                yield text_of(record, opts.field, where)
            else:
                yield [(text_of(record, opts.field, where), False),
                       (text_of(record, opts.response_field, where, "--response-field"), True)]


def _write(
    items: Iterator[Any],
    tokenizer: Tokenizer,
    opts: Options,
    outputs: tuple[Output, Output | None],
    workers: int,
    partial: Path,
    key: str,
    skip: int,
    meter: ProgressLine,
) -> None:
    """Tokenize and write the items (those after the resume point), committing as it goes."""
    position, commits = skip, 0
    faults = Faults.from_env()
    batches = _batches(meter.read(item) for item in items)
    for encoded in _encoded(batches, tokenizer, opts.examples, workers):
        for ids, mask in encoded:
            held = opts.val_fraction and _held_out(position, opts.val_fraction)
            target = outputs[1] if held and outputs[1] is not None else outputs[0]
            target.add(ids, mask)
            position += 1
            meter.add(len(ids))
        if (position - skip) // BATCH % COMMIT_BATCHES == 0:
            commits += 1
            _commit(partial, key, position, outputs)
            faults.in_prepare(partial, commits)  # a test's kill lands here


def _commit(partial: Path, key: str, items: int, outputs: tuple[Output, Output | None]) -> None:
    train, val = outputs
    state = {"key": key, "items": items, "train": train.state(),
             "val": val.state() if val else None}
    write_whole(partial / PROGRESS, json.dumps(state))


def _held_out(position: int, fraction: float) -> bool:
    """Whether the document at `position` is held out: a hash, so the choice is spread over
    the corpus and the same on every run."""
    digest = hashlib.blake2b(position.to_bytes(8, "little"), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2**64 < fraction


def _batches(items: Iterator[Any]) -> Iterator[list[Any]]:
    batch: list[Any] = []
    for item in items:
        batch.append(item)
        if len(batch) == BATCH:
            yield batch
            batch = []
    if batch:
        yield batch


# -- tokenizing, in this process or a pool --------------------------------------------------

_worker_tokenizer: Tokenizer | None = None


def _init_worker(tokenizer: Tokenizer) -> None:
    global _worker_tokenizer
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the pool is the parallelism
    _worker_tokenizer = tokenizer


def _encode_in_worker(job: tuple[bool, list[Any]]) -> list[tuple[np.ndarray, np.ndarray | None]]:
    """`encode` in a pool process; arrays, since pickling lists of ints back costs more
    than tokenizing."""
    assert _worker_tokenizer is not None
    dtype = DTYPES[dtype_for_vocab(_worker_tokenizer.vocab_size)]  # the shards' own
    return [(np.asarray(ids, dtype), None if mask is None else np.asarray(mask, np.uint8))
            for ids, mask in encode(_worker_tokenizer, *job)]


def encode(
    tokenizer: Tokenizer, examples: bool, batch: list[Any]
) -> list[tuple[list[int], list[int] | None]]:
    """(ids, loss mask) of each item. A document: its ids then EOS (no mask). An example:
    its parts tokenized apart (so the boundaries are exact: prompt and response, or the
    turns of a conversation) and joined, then EOS; the mask marks the counted parts, and
    the EOS when the last part is counted."""
    eos = tokenizer.eos_id
    if not examples:
        return [([*ids, eos], None) for ids in tokenizer.encode_batch(batch)]
    encoded = iter(tokenizer.encode_batch([text for parts in batch for text, _ in parts]))
    out = []
    for parts in batch:
        ids: list[int] = []
        mask: list[int] = []
        for _, counted in parts:
            piece = next(encoded)
            ids += piece
            mask += [int(counted)] * len(piece)
        out.append(([*ids, eos], [*mask, int(parts[-1][1])]))
    return out


def _encoded(
    batches: Iterator[list[Any]], tokenizer: Tokenizer, examples: bool, workers: int
) -> Iterator[list[tuple[list[int], list[int] | None]]]:
    """Each batch encoded, in order: the first here, the rest in a pool of `workers`
    processes when there are more (starting processes costs more than a small corpus)."""
    first = next(batches, None)
    if first is None:
        return
    yield encode(tokenizer, examples, first)
    if workers <= 1:
        yield from (encode(tokenizer, examples, b) for b in batches)
        return
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(workers, initializer=_init_worker, initargs=(tokenizer,)) as pool:
        yield from pool.imap(_encode_in_worker, ((examples, b) for b in batches))


# -- the index --------------------------------------------------------------------------------


def _index(
    train: Output,
    shards: list[dict[str, Any]],
    tokenizer: Tokenizer,
    opts: Options,
    dtype: str,
    sources: list[dict],
    command: Sequence[str],
    partial: Path,
    paths: list[Path],
) -> dict[str, Any]:
    if train.documents == 0 or train.end == train.documents:  # nothing but separators
        shutil.rmtree(partial, ignore_errors=True)
        raise DataError(
            f"data prepare: the inputs ({', '.join(map(str, paths))}) hold no text under "
            f"field {opts.field!r}; check the files and --field"
        )
    return {
        "format": FORMAT, "version": VERSION, "dtype": dtype, "vocab_size": tokenizer.vocab_size,
        "eos_id": tokenizer.eos_id, "documents": train.documents, "tokens": train.end,
        "shards": shards, "kind": "prompt_response" if opts.examples else "text",
        "tokenizer": {"spec": tokenizer.spec, "sha256": tokenizer.sha256},
        "field": opts.field, "response_field": opts.response_field,
        "messages_field": opts.messages_field,
        "val_fraction": opts.val_fraction, "sources": sources, "command": list(command),
    }


def _split_index(val: Output, shards: list[dict[str, Any]], index: dict) -> dict[str, Any]:
    """The held-out directory's own index: the same corpus, its documents."""
    if val.documents == 0:
        raise DataError(
            f"--val-fraction {index['val_fraction']} held out no document of "
            f"{index['documents']}; raise it or prepare more documents"
        )
    return {**index, "documents": val.documents, "tokens": val.end, "shards": shards,
            "split": "val"}
