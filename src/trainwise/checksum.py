"""File checksums, for whatever trainwise writes and later trusts (checkpoint files,
prepared token shards). Lowest floor: imports nothing from trainwise."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import xxhash

# xxh3-128 hashes at several GB/s on one core, about 10x sha256: a corruption check needs
# no cryptographic strength, and the hash was a third of a synchronous save's time.
CHECKSUM = "xxh3"
_HASHERS = {"xxh3": xxhash.xxh3_128, "sha256": hashlib.sha256}


def new_hasher(algo: str = CHECKSUM) -> Any:
    """A fresh hash object of `algo` (update(), hexdigest())."""
    return _HASHERS[algo]()


def digest_file(path: Path, algo: str = CHECKSUM, chunk: int = 1 << 20) -> str:
    """The hex digest of a file, read in chunks so large shards fit in memory."""
    digest = new_hasher(algo)
    buffer = bytearray(chunk)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            digest.update(view[:n])
    return digest.hexdigest()
