"""The versions every rank runs with, gathered and compared: a job whose ranks differ in
torch, CUDA, NCCL or the training code tends to hang in its first collective or to
crash far from the cause. Cheap enough that `trainwise train` checks it at start-up."""

from __future__ import annotations

import hashlib
import platform
import socket
from functools import cache
from pathlib import Path

import torch
import torch.distributed as dist

import trainwise
from trainwise.errors import TrainwiseError
from trainwise.faults import Faults

# The fields compared between ranks, in the order the table shows them.
FIELDS = (
    "python",
    "torch",
    "cuda",
    "cudnn",
    "nccl",
    "driver",
    "gpu",
    "gpu_memory",
    "trainwise",
    "config",
    "code",
)


class VersionMismatch(TrainwiseError):
    """Ranks run with different versions; training would hang or crash later."""

    exit_status = 2


@cache
def code_hash() -> str:
    """sha256 (16 hex) of trainwise's own source files: an edited copy on one machine
    shows here even when the version string is the same."""
    root = Path(trainwise.__file__).parent
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def _driver() -> str:
    path = Path("/proc/driver/nvidia/version")
    try:
        first = path.read_text().splitlines()[0]
    except (OSError, IndexError):
        return "-"
    words = [w for w in first.split() if w[:1].isdigit() and "." in w]
    return words[0] if words else first.strip()


def local_versions(config_hash: str = "-", device_index: int = 0) -> dict[str, str]:
    """This process's versions (every field a string; '-' where it does not apply)."""
    cuda = torch.cuda.is_available()
    gpu, memory = "-", "-"
    if cuda:
        props = torch.cuda.get_device_properties(device_index)
        gpu, memory = props.name, f"{props.total_memory / 2**30:.1f} GiB"
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    nccl = "-"
    if cuda and dist.is_nccl_available():
        nccl = ".".join(str(x) for x in torch.cuda.nccl.version())
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda or "-",
        "cudnn": str(cudnn) if cudnn else "-",
        "nccl": nccl,
        "driver": _driver() if cuda else "-",
        "gpu": gpu,
        "gpu_memory": memory,
        "trainwise": trainwise.__version__,
        "config": config_hash,
        "code": code_hash(),
    }


def gather_versions(
    config_hash: str, device_index: int = 0, group: dist.ProcessGroup | None = None
) -> list[dict[str, str]]:
    """Every rank's versions (index = rank), plus its host; on every rank. `group` should
    be a gloo group: NCCL itself may be what differs."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    mine = {
        # a test's `versions` fault changes what this rank reports, nothing else
        **Faults.from_env(rank).versions(local_versions(config_hash, device_index)),
        "host": socket.gethostname(),
    }
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [mine]
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine, group=group)
    return everyone


def differences(per_rank: list[dict[str, str]]) -> dict[str, dict[str, list[int]]]:
    """field -> value -> ranks, for the fields on which ranks differ."""
    out: dict[str, dict[str, list[int]]] = {}
    for field in FIELDS:
        by_value: dict[str, list[int]] = {}
        for rank, versions in enumerate(per_rank):
            by_value.setdefault(versions.get(field, "?"), []).append(rank)
        if len(by_value) > 1:
            out[field] = by_value
    return out


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ",".join(str(r) for r in ranks)


def mismatch_lines(diffs: dict[str, dict[str, list[int]]]) -> list[str]:
    """One line per differing field: `torch: 2.13.0 on ranks 0,2,3; 2.12.1 on rank 1`."""
    return [
        f"{field}: " + "; ".join(f"{value} on {_ranks(r)}" for value, r in values.items())
        for field, values in diffs.items()
    ]


def require_same_versions(
    config_hash: str, device_index: int = 0, group: dist.ProcessGroup | None = None
) -> None:
    """`trainwise train`'s start-up check: raise VersionMismatch (exit 2) when ranks differ."""
    diffs = differences(gather_versions(config_hash, device_index, group))
    if diffs:
        raise VersionMismatch(
            "ranks run different versions (" + " | ".join(mismatch_lines(diffs)) + "): install "
            "the same on every machine (trainwise env shows them), or pass "
            "--allow-version-mismatch to train anyway"
        )
