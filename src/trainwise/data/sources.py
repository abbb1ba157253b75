"""What `trainwise data prepare` reads: whole text files, and records from JSONL, Parquet
and Hugging Face datasets saved with `save_to_disk`, each record with where it came from
(`file:line`, `file row N`) so that a bad one is named in the error.

Parquet is read a row group batch at a time (pyarrow), a saved dataset through `datasets`
(memory-mapped Arrow): neither is loaded whole.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from trainwise.errors import DataError

TEXT, JSONL, PARQUET, DATASET = "text", "jsonl", "parquet", "dataset"
JSONL_SUFFIXES = (".jsonl", ".ndjson")
DATASET_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")
PARQUET_BATCH = 1024  # rows read at a time


def source_kind(path: Path) -> str:
    """What `path` is as an input: text, jsonl, parquet or a saved dataset folder."""
    if path.is_dir():
        if any((path / name).is_file() for name in DATASET_MARKERS):
            return DATASET
        raise DataError(
            f"input {str(path)!r} is a folder but not a saved Hugging Face dataset (no "
            f"{', '.join(DATASET_MARKERS)}); give files, or a folder written by save_to_disk"
        )
    if not path.is_file():
        raise DataError(
            f"input {str(path)!r} does not exist; give text, JSONL or Parquet files or a saved "
            "dataset folder"
        )
    suffix = path.suffix.lower()
    if suffix in JSONL_SUFFIXES:
        return JSONL
    return PARQUET if suffix == ".parquet" else TEXT


def read_records(
    path: Path, kind: str, fields: Sequence[str], errors: str = "strict"
) -> Iterator[tuple[str, Any]]:
    """(where, record) of every record of a JSONL, Parquet or dataset input, in order;
    `errors`: what bytes of a JSONL file that are not UTF-8 do (see decode)."""
    if kind == JSONL:
        yield from _jsonl(path, errors)
    elif kind == PARQUET:
        yield from _parquet(path, fields)
    elif kind == DATASET:
        yield from _dataset(path, fields)
    else:
        raise DataError(
            f"input {str(path)!r} is plain text, one document; records (prompt and response, "
            "chat messages) come from JSONL, Parquet or a saved dataset"
        )


def field_of(record: Any, field: str, where: str, flag: str = "--field") -> Any:
    """`record[field]`, or one line naming where, the field and the fields there are."""
    if not isinstance(record, dict) or field not in record:
        have = ", ".join(sorted(record)) if isinstance(record, dict) else type(record).__name__
        raise DataError(f"{where} has no field {field!r} (it has: {have or 'nothing'}); choose {flag}")
    return record[field]


def text_of(record: Any, field: str, where: str, flag: str = "--field") -> str:
    value = field_of(record, field, where, flag)
    if not isinstance(value, str):
        raise DataError(f"{where}: field {field!r} is {type(value).__name__}, not text")
    return value


def source_sha256(path: Path) -> str:
    """A file's sha256; a folder's over its files' names and contents, in sorted order."""
    h = hashlib.sha256()
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for f in files:
        if path.is_dir():
            h.update(str(f.relative_to(path)).encode() + b"\0")
        with f.open("rb") as stream:
            for block in iter(lambda: stream.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


def _jsonl(path: Path, errors: str = "strict") -> Iterator[tuple[str, Any]]:
    offset = 0  # of the line in the file, for a decoding error
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, 1):
            line = decode(raw, errors, f"{path}:{lineno}", offset)
            offset += len(raw)
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                yield where, json.loads(line)
            except ValueError as exc:
                raise DataError(f"{where} is not JSON ({exc}); fix or remove the line") from None


def decode(data: bytes, errors: str, where: str, offset: int = 0) -> str:
    """UTF-8 text of `data`; errors: strict (a DataError naming `where` and the byte
    offset in the file, `offset` being where `data` starts), replace or ignore."""
    try:
        return data.decode("utf-8", errors=errors)
    except UnicodeDecodeError as err:
        raise DataError(
            f"{where}: not UTF-8 at byte {offset + err.start} ({err.reason}); convert the file "
            "to UTF-8, or give --errors replace (or ignore) to replace (or drop) such bytes"
        ) from None


def _missing(where: str, fields: Sequence[str], columns: Sequence[str]) -> None:
    absent = [f for f in fields if f not in columns]
    if absent:
        raise DataError(
            f"{where} has no column {absent[0]!r} (it has: {', '.join(columns) or 'nothing'}); "
            "choose --field / --column"
        )


def _parquet(path: Path, fields: Sequence[str]) -> Iterator[tuple[str, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"input {path}: Parquet needs pyarrow: pip install pyarrow") from None
    try:
        reader = pq.ParquetFile(path)
    except Exception as exc:  # pyarrow raises ArrowInvalid and friends
        raise DataError(f"input {path} is not a Parquet file ({exc})") from None
    _missing(str(path), fields, reader.schema_arrow.names)
    row = 0
    for batch in reader.iter_batches(batch_size=PARQUET_BATCH, columns=list(fields)):
        for record in batch.to_pylist():
            row += 1
            yield f"{path} row {row}", record


def _dataset(path: Path, fields: Sequence[str]) -> Iterator[tuple[str, Any]]:
    try:
        import datasets
    except ImportError:
        raise DataError(f"input {path}: a saved dataset needs `datasets`: pip install datasets") from None
    data = datasets.load_from_disk(str(path))
    if isinstance(data, datasets.DatasetDict):
        if "train" not in data:
            raise DataError(
                f"input {path} is a dataset with splits {', '.join(data)} and no 'train'; give "
                "the folder of one split (DatasetDict[split].save_to_disk)"
            )
        data = data["train"]
    _missing(str(path), fields, data.column_names)
    for row, record in enumerate(data.select_columns(list(fields)), 1):
        yield f"{path} row {row}", record
