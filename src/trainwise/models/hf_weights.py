"""Pretrained Hugging Face weights (safetensors in a model directory) into a model as it
runs: plain, DDP-wrapped or sharded by FSDP2.

The model's own state dict (DCP's state-dict API: clean names, DTensors for sharded
parameters) is renamed to the checkpoint's names and filled by
torch.distributed.checkpoint's HuggingFaceStorageReader, which reads from each
safetensors file only the slice of each tensor that this rank holds, and converts the
dtype on the copy. The names and shapes are checked against the files' headers first
(no tensor data read), so a mismatch is one line naming the key, before any worker starts.
"""

from __future__ import annotations

import functools
import json
import math
import re
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from trainwise.checksum import digest_file, new_hasher
from trainwise.errors import ModelError
from trainwise.models.lora import is_adapter

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
# Stored by some older checkpoints, rebuilt by every model: never a weight to load.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def weight_files(folder: str | Path) -> list[Path]:
    """The safetensors files of a model directory: the index's shards, model.safetensors,
    or none (a config-only directory). ModelError when the index names a missing file."""
    folder = Path(folder)
    index = folder / INDEX
    if index.is_file():
        try:
            names = sorted(
                set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values())
            )
        except (OSError, ValueError, KeyError, AttributeError) as exc:
            raise ModelError(f"{index}: cannot read its weight_map ({exc}); fix the file") from None
        missing = [n for n in names if not (folder / n).is_file()]
        if missing:
            raise ModelError(f"{index} names {missing[0]}, which is not in {folder}; copy it there")
        return [folder / n for n in names]
    return [folder / SINGLE] if (folder / SINGLE).is_file() else []


def weights_digest(folder: str | Path) -> str:
    """What identifies a model directory's weights, `ALGO:HEX` (the frozen base a LoRA run
    was trained on): from the Hugging Face hub cache's blob names when every file is one
    (nothing read), else an xxh3 of each file's content, in name order (one full read)."""
    files = weight_files(folder)
    named = hub_digest(files)
    if named is not None:
        return named
    digest = new_hasher()
    for f in files:
        digest.update(f"{f.name}:{_file_digest(f, f.stat().st_size, f.stat().st_mtime_ns)};".encode())
    return f"xxh3:{digest.hexdigest()}"


_SHA256_NAME = re.compile(r"[0-9a-f]{64}")


def hub_digest(files: list[Path]) -> str | None:
    """The weights' id from the hub cache's own names, reading no byte of them; None unless
    every file is a snapshot's symlink to `blobs/<sha256>`.

    Trustworthy because the cache is content-addressed: huggingface_hub stores a file
    under its ETag, which for an LFS file (every safetensors file of a model repository) is
    the sha256 of its content as the hub computed it, and points each snapshot's file at
    that blob. Another revision's changed weights are another blob, hence another name; two
    snapshots of the same weights share blobs, hence the id. Editing a blob in place (the
    cache never does) is what this cannot see."""
    if not files:
        return None
    digest = new_hasher("sha256")
    for f in files:
        blob = f.resolve()
        if not f.is_symlink() or blob.parent.name != "blobs" or not _SHA256_NAME.fullmatch(blob.name):
            return None
        digest.update(f"{f.name}:{blob.name};".encode())
    return f"sha256:{digest.hexdigest()}"


@functools.lru_cache(maxsize=64)
def _file_digest(path: Path, size: int, mtime_ns: int) -> str:
    """Once per process and file version (the launcher's check and an in-process worker
    both ask)."""
    return digest_file(path)


def stored_shapes(files: list[Path]) -> dict[str, tuple[int, ...]]:
    """{name: shape} from the safetensors headers (no tensor data is read)."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as handle:
                for key in handle.keys():  # noqa: SIM118 (not iterable)
                    shapes[key] = tuple(handle.get_slice(key).get_shape())
        except Exception as exc:  # SafetensorError: not importable on every version
            raise ModelError(f"{f}: not a safetensors file ({exc}); fix or remove it") from None
    return {k: v for k, v in shapes.items() if not k.endswith(_IGNORED_SUFFIXES)}


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _named_for_checkpoint(
    state: dict[str, Any], rename: Callable[[str], str], stored: dict[str, Any]
) -> dict[str, torch.Tensor]:
    """The model's tensors under the checkpoint's names. A tied weight (the same tensor as
    one already named) that the checkpoint does not store is left out: it loads once; so
    are LoRA's adapters (they are not the pretrained model's: the converter fills them)."""
    out: dict[str, torch.Tensor] = {}
    seen_ids: set[int] = set()
    seen_ptrs: set[tuple[int, tuple[int, ...]]] = set()
    for name, tensor in state.items():
        if not isinstance(tensor, torch.Tensor) or is_adapter(name):
            continue
        key = rename(name)
        # Parameters (keep_vars) are the same object; detached tensors share memory. Meta
        # tensors have no memory to compare, so the object it is.
        local = _local(tensor)
        ptr = (local.data_ptr(), tuple(tensor.shape))
        real = not tensor.is_meta and local.numel() > 0
        tied = id(tensor) in seen_ids or (real and ptr in seen_ptrs)
        seen_ids.add(id(tensor))
        if real:
            seen_ptrs.add(ptr)
        if tied and key not in stored:
            continue
        out[key] = tensor
    return out


def check_against(
    expected: dict[str, tuple[int, ...]], stored: dict[str, tuple[int, ...]], where: str
) -> None:
    """One line for the first missing key, unexpected key or shape mismatch."""
    check_present(expected, stored, where)
    extra = sorted(set(stored) - set(expected))
    if extra:
        raise ModelError(
            f"{where}: the weights hold {extra[0]!r}, which the model does not have "
            f"({len(extra)} such); the weights do not belong to this config.json"
        )


def check_present(
    expected: dict[str, tuple[int, ...]], stored: dict[str, tuple[int, ...]], where: str
) -> None:
    """One line for the first of `expected` missing from the weights or of another shape
    (a pipeline stage expects its own tensors, a subset of the weights)."""
    for key, shape in expected.items():
        if key not in stored:
            raise ModelError(
                f"{where}: the weights have no {key!r}, which the model needs; the weights do "
                "not belong to this config.json, or set model.init = 'random'"
            )
        if tuple(stored[key]) != tuple(shape):
            raise ModelError(
                f"{where}: {key!r} has shape {list(stored[key])} in the weights but "
                f"{list(shape)} in the model; the weights do not match config.json "
                "(or model.vocab_size / the data's vocabulary changed it)"
            )


def check_weights(
    module: nn.Module, folder: str | Path, rename: Callable[[str], str], where: str
) -> None:
    """Names and shapes of `module` (any device, meta too) against the files of `folder`."""
    stored = stored_shapes(weight_files(folder))
    named = _named_for_checkpoint(module.state_dict(keep_vars=True), rename, stored)
    check_against({k: tuple(t.shape) for k, t in named.items()}, stored, where)


def load_weights(
    model: nn.Module, folder: str | Path, rename: Callable[[str], str], where: str
) -> dict[str, int]:
    """Fill `model` (wrapped or sharded as it runs; every rank calls this) from the
    safetensors of `folder`: the whole model, or one of its parts (a pipeline stage keeps
    the whole model's names), which reads only its own tensors. Returns {"bytes_read":
    this rank's, "bytes_total": the files', "tensors_read": how many tensors it opened}.
    The weights' keys the model lacks are refused by check_weights on the whole model,
    before any worker starts."""
    return read_into(model, folder, lambda state, stored: _named_for_checkpoint(
        state, rename, stored), where)


def read_into(model: nn.Module, folder: str | Path,
              names: Callable[[dict[str, Any], dict[str, tuple[int, ...]]], dict[str, Any]],
              where: str) -> dict[str, int]:
    """Every family's loader: `names(state, stored)` gives the files' name for each tensor
    of the model's state dict (`stored`: the files' shapes), DCP reads them in, and the
    model is set from that state. Returns the counts load_weights documents."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    files = weight_files(folder)
    stored = stored_shapes(files)
    state = get_model_state_dict(model)
    named = names(state, stored)
    check_present({k: tuple(t.shape) for k, t in named.items()}, stored, where)
    reader = counting_reader(folder)
    alone = not (dist.is_available() and dist.is_initialized())
    with warnings.catch_warnings():  # DCP warns that one process loads alone: intended
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.load(named, storage_reader=reader, no_dist=alone)
    set_model_state_dict(model, state)  # a no-op copy when `state` holds the parameters
    total = sum(f.stat().st_size for f in files)
    return {"bytes_read": reader.bytes_read, "bytes_total": total,
            "tensors_read": len(reader.tensors_read)}


def counting_reader(path: str | Path) -> Any:
    """DCP's Hugging Face reader of `path`, counting the bytes of the slices this rank asks
    for (`bytes_read`) and the tensors they come from (`tensors_read`)."""
    return _counting_reader_class()(str(path))


@functools.cache
def _counting_reader_class() -> type:
    """The reader's class, made on first use: DCP's imports (FSDP's, DTensor's) cost the
    launcher, which checks weights without reading them, a second of CPU."""
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    class CountingReader(HuggingFaceStorageReader):
        def __init__(self, path: str):
            super().__init__(path)
            self.bytes_read = 0
            self.tensors_read: set[str] = set()

        def read_data(self, plan: Any, planner: Any) -> Any:
            for item in plan.items:
                info = self.storage_data[item.storage_index]
                self.bytes_read += math.prod(item.lengths) * info.dtype.itemsize
                self.tensors_read.add(item.storage_index.fqn)
            return super().read_data(plan, planner)

    return CountingReader
