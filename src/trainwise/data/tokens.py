"""Token files in the nanoGPT format: a flat binary file of little-endian uint16 token ids."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from trainwise.errors import DataError

TOKEN_DTYPE = np.dtype("<u2")
_MAX_ID = np.iinfo(np.uint16).max


def open_token_file(path: str | os.PathLike[str]) -> np.memmap:
    """Map a token file read-only; DataError if it is missing, empty or not whole uint16s."""
    p = Path(path)
    if not p.is_file():
        what = "is a directory, not a file" if p.is_dir() else "does not exist"
        raise DataError(
            f"data.path: token file {str(p)!r} {what}; point data.path at a flat uint16 .bin "
            "file (nanoGPT format)"
        )
    size = p.stat().st_size
    if size == 0:
        raise DataError(
            f"data.path: token file {str(p)!r} is empty; write the corpus's token ids into it "
            "(trainwise.data.write_token_file) or point data.path at another file"
        )
    if size % TOKEN_DTYPE.itemsize:
        raise DataError(
            f"data.path: token file {str(p)!r} has {size} bytes, not a multiple of 2, so it is not "
            "a flat uint16 token file; re-export it as uint16 ids (e.g. np.uint16 array .tofile())"
        )
    return np.memmap(p, dtype=TOKEN_DTYPE, mode="r")


def write_token_file(path: str | os.PathLike[str], tokens: np.ndarray | list[int]) -> Path:
    """Write token ids as a flat uint16 file (creating parent folders); return the path."""
    arr = np.asarray(tokens)
    if arr.ndim != 1 or arr.size == 0:
        raise DataError(
            f"tokens for {str(path)!r} must be a non-empty 1-D array, got shape {arr.shape}"
        )
    if not np.issubdtype(arr.dtype, np.integer):
        raise DataError(f"tokens for {str(path)!r} must be integers, got dtype {arr.dtype}")
    if arr.min() < 0 or arr.max() > _MAX_ID:
        raise DataError(
            f"tokens for {str(path)!r} must lie in 0..{_MAX_ID} to fit uint16, got "
            f"{arr.min()}..{arr.max()}; use a tokenizer with at most 65536 ids"
        )
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    arr.astype(TOKEN_DTYPE, copy=False).tofile(p)
    return p


def token_vocab_size(tokens: np.ndarray, chunk: int = 1 << 22) -> int:
    """Largest token id + 1, read in chunks so a large memmap is never loaded whole."""
    if len(tokens) == 0:
        raise DataError("cannot take the vocab size of an empty token array")
    top = 0
    for start in range(0, len(tokens), chunk):
        top = max(top, int(np.max(tokens[start : start + chunk])))
    return top + 1
