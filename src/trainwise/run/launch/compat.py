"""Before any worker: whether another lineage's checkpoint, taken with
`checkpoint.resume_from_other`, fits this job. Its model's tensor shapes (DCP's .metadata
holds them) must be the job's model's, and 'all' (the optimizer state too) needs the same
optimizer. A misfit is one line and exit 2 here, not a DCP error on every worker."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainwise.run.checkpoint.resume_rules import (
    LineageError,
    other_lineage_checkpoint,
    recorded_lineage,
)

if TYPE_CHECKING:
    from trainwise.run.job.resolve import Job

_MODEL = "model."  # the checkpoint's prefix of the model's entries


def saved_model_shapes(path: Path) -> dict[str, tuple[int, ...]] | None:
    """{model entry: shape} from a checkpoint's DCP metadata; None when it cannot be read
    (the worker's load then says why)."""
    import pickle

    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    try:
        metadata = FileSystemReader(str(path)).read_metadata()
    except (OSError, EOFError, pickle.UnpicklingError):
        return None
    return {
        key[len(_MODEL) :]: tuple(md.size)
        for key, md in metadata.state_dict_metadata.items()
        if key.startswith(_MODEL) and isinstance(md, TensorStorageMetadata)
    }


def job_model_shapes(job: Job) -> dict[str, tuple[int, ...]] | None:
    """{state-dict entry: shape} of the job's model as its checkpoints hold it, built on
    the meta device (no memory, no weights read) and converted (LoRA: its adapters and
    what else trains, not the frozen base); None when it cannot be built so (the worker's
    load judges then)."""
    import torch

    from trainwise.models import build_model
    from trainwise.models.converters import build_converters, convert

    try:
        with torch.device("meta"):
            module = build_model(job.model_spec).module
            convert(module, build_converters(job.cfg))
    except Exception:  # noqa: BLE001 - a pre-check only: the worker's load stays the judge
        return None
    unsaved = set() if not job.cfg.lora.rank else {
        n for n, p in module.named_parameters() if not p.requires_grad
    }
    return {
        k: tuple(v.shape)
        for k, v in module.state_dict().items()
        if hasattr(v, "shape") and k not in unsaved
    }


def misfits(saved: dict[str, tuple[int, ...]], ours: dict[str, tuple[int, ...]]) -> list[str]:
    """One phrase per entry of our model the checkpoint lacks or holds in another shape."""
    found = []
    for name, shape in ours.items():
        if name not in saved:
            found.append(f"{name} is not in it")
        elif saved[name] != shape:
            found.append(f"{name} is {list(saved[name])} there, {list(shape)} here")
    return found


def check_other_fits(cfg: Any, job: Job, root: Path, keys: dict[str, Any]) -> None:
    """Raise LineageError (exit 2) when the checkpoint resume_from_other would take does
    not fit this job's model, or (for 'all') its optimizer."""
    ckpt = cfg.checkpoint
    if ckpt.resume_from_other == "no":
        return
    other = other_lineage_checkpoint(ckpt, root, keys)
    if other is None:
        return
    path = other[0]
    saved, ours = saved_model_shapes(path), job_model_shapes(job)
    found = misfits(saved, ours) if saved is not None and ours is not None else []
    if found:
        more = f" (+{len(found) - 1} more)" if len(found) > 1 else ""
        raise LineageError(
            f"checkpoint.resume_from_other = '{ckpt.resume_from_other}': the model in {path} "
            f"does not fit this job's model ({found[0]}{more}); take weights only from a "
            "checkpoint of the same model, or start a new lineage with checkpoint.resume = "
            "'never'"
        )
    theirs = (recorded_lineage(path) or {}).get("optim.name")
    if ckpt.resume_from_other == "all" and theirs not in (None, cfg.optim.name):
        raise LineageError(
            f"checkpoint.resume_from_other = 'all': {path} holds the state of optimizer "
            f"{theirs!r}, this job uses {cfg.optim.name!r}; take its weights only with "
            "checkpoint.resume_from_other = 'weights', or use optim.name = "
            f"'{theirs}'"
        )
