"""The digits classification set: sklearn's bundled 8x8 handwritten digits (no download)."""

from __future__ import annotations

import numpy as np


def load_digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """Return (X, y): X float32 [1797, 64] scaled to [0, 1], y int64 class ids 0..9."""
    # Imported here so the rest of trainwise.data does not pay sklearn's import time.
    from sklearn.datasets import load_digits

    bunch = load_digits()
    # Pixel values are integers 0..16.
    x = (np.asarray(bunch.data, dtype=np.float32) / np.float32(16.0)).astype(np.float32)
    y = np.asarray(bunch.target, dtype=np.int64)
    return x, y
