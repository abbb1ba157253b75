"""Map-style torch Datasets over token arrays and feature arrays, and train/val splits."""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import Dataset

from trainwise.errors import DataError


def _check_fraction(val_fraction: float) -> None:
    if not isinstance(val_fraction, (int, float)) or not 0.0 < val_fraction < 1.0:
        raise DataError(
            f"data.val_fraction={val_fraction!r} must be strictly between 0 and 1; use e.g. 0.1"
        )


class TokenWindows(Dataset):
    """Non-overlapping next-token windows: sample i is (x, y) with y = x shifted by one.

    x = tokens[i*seq_len : (i+1)*seq_len], y = tokens[i*seq_len+1 : (i+1)*seq_len+1], both
    int64. Windows do not overlap as inputs, so distinct sample ids are distinct data.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, *, source: str = "token array"):
        if not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len < 1:
            raise DataError(f"data.seq_len must be a positive integer, got {seq_len!r}")
        if np.ndim(tokens) != 1:
            raise DataError(f"{source} must be 1-D token ids, got shape {np.shape(tokens)}")
        if len(tokens) < seq_len + 1:
            raise DataError(
                f"{source} has {len(tokens)} tokens, too few for one window of data.seq_len="
                f"{seq_len} (needs {seq_len + 1}); lower data.seq_len or use more data"
            )
        self.tokens = tokens
        self.seq_len = seq_len
        self._len = (len(tokens) - 1) // seq_len

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        i = int(i)
        if i < 0:
            i += self._len
        if not 0 <= i < self._len:
            raise IndexError(f"window {i} out of range for {self._len} windows")
        start = i * self.seq_len
        # One copy (also out of a memmap) into int64, the dtype embedding lookups want.
        chunk = torch.from_numpy(
            np.array(self.tokens[start : start + self.seq_len + 1], dtype=np.int64)
        )
        return chunk[:-1], chunk[1:]


class ArrayDataset(Dataset):
    """Rows of a feature array with their labels: sample i is (X[i], y[i]) as tensors."""

    def __init__(self, X: np.ndarray, y: np.ndarray):
        if len(X) != len(y):
            raise DataError(
                f"features have {len(X)} rows but labels have {len(y)}; pass matching arrays"
            )
        if len(X) == 0:
            raise DataError("ArrayDataset got no rows; pass at least one sample")
        self.X = torch.as_tensor(np.asarray(X))
        self.y = torch.as_tensor(np.asarray(y))

    def __len__(self) -> int:
        return len(self.X)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.X[i], self.y[i]


def split_tokens(tokens: np.ndarray, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """Split a token stream into (train, val): the last val_fraction is held out.

    Returns views (slices of a memmap stay memmaps), so nothing is copied.
    """
    _check_fraction(val_fraction)
    n = len(tokens)
    n_val = int(round(n * val_fraction))
    if n_val < 1 or n_val >= n:
        raise DataError(
            f"data.val_fraction={val_fraction} of {n} tokens leaves an empty split; "
            "use more tokens or a val_fraction nearer 0.5"
        )
    return tokens[: n - n_val], tokens[n - n_val :]


def split_arrays(
    X: np.ndarray, y: np.ndarray, val_fraction: float, seed: int
) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """Split (X, y) into ((X_train, y_train), (X_val, y_val)) after a seeded shuffle.

    The last val_fraction of the permuted rows is held out.
    """
    _check_fraction(val_fraction)
    n = len(X)
    if len(y) != n:
        raise DataError(f"features have {n} rows but labels have {len(y)}; pass matching arrays")
    n_val = int(round(n * val_fraction))
    if n_val < 1 or n_val >= n:
        raise DataError(
            f"data.val_fraction={val_fraction} of {n} samples leaves an empty split; "
            "use a val_fraction nearer 0.5"
        )
    if not isinstance(seed, int) or seed < 0:
        raise DataError(f"data seed must be a non-negative integer, got {seed!r}")
    perm = np.random.default_rng([seed, 2]).permutation(n)
    train, val = perm[: n - n_val], perm[n - n_val :]
    return (X[train], y[train]), (X[val], y[val])
