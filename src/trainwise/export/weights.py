"""Export the model weights of a sharded checkpoint to one file a plain model can load.

A checkpoint holds the DCP (torch.distributed.checkpoint) shards of
``{"model": ..., "optim": ...}``, written by every rank. Export reads only the "model" part,
in this one process, with DCP's own planner and reader: no process group, no model built,
so a checkpoint of any strategy or world size becomes a flat ``{fqn: full tensor}`` that
``model.load_state_dict(..., strict=True)`` accepts on the unwrapped model. The "model"
part holds the weights of every model part under the whole model's names
(run/checkpoint/states.py:ModelState), so a model split into parts (pipeline stages)
exports the same way.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from trainwise.config import read_toml
from trainwise.errors import ConfigError, TrainwiseError
from trainwise.run.checkpoint.store import (
    MANIFEST,
    CheckpointError,
    find_latest_valid,
    list_checkpoints,
    parse_step,
    read_manifest,
    root_cause,
    root_for,
    verify,
)

if TYPE_CHECKING:
    import torch

ExportFormat = Literal["safetensors", "torch"]

_MODEL_KEY = "model"
_DCP_METADATA = ".metadata"


def checkpoint_root(run_dir: Path) -> Path:
    """Where a run keeps its checkpoints: config.toml's ``checkpoint.dir`` (relative paths
    resolve against the cwd, as the trainer wrote them) or ``RUN/checkpoints``."""
    run_dir = Path(run_dir)
    config = run_dir / "config.toml"
    if config.is_file():
        # Only this key is read: validating the whole job could fail for reasons unrelated to
        # finding checkpoints (a config written by another trainwise version, say).
        try:
            section = read_toml(config).get("checkpoint", {})
        except ConfigError as err:
            raise CheckpointError(
                f"cannot find the checkpoints of {run_dir}: {err.problems[0]}"
            ) from None
        if isinstance(section, dict) and isinstance(section.get("dir"), str) and section["dir"]:
            return root_for(run_dir, section["dir"])
    return root_for(run_dir, None)


def is_checkpoint_dir(path: Path) -> bool:
    """A directory that looks like one checkpoint (rather than a run or a checkpoint root)."""
    path = Path(path)
    return (
        (path / MANIFEST).is_file()
        or (path / _DCP_METADATA).is_file()
        or parse_step(path.name) is not None
    )


def resolve_checkpoint(run_or_ckpt: Path, step: int | None = None) -> Path:
    """The checkpoint directory to read (see choose_checkpoint), without the notes."""
    return choose_checkpoint(run_or_ckpt, step)[0]


def choose_checkpoint(run_or_ckpt: Path, step: int | None = None) -> tuple[Path, list[str]]:
    """The checkpoint directory to read and one note per newer checkpoint passed over as
    invalid: ``run_or_ckpt`` itself when it is a checkpoint, else the newest valid
    checkpoint of the run (``step=None``) or the one of ``step``. Every file is checked
    against the manifest's checksums ("full" verification: what a user gets is never
    what a resume would refuse). Raises CheckpointError (one line) when nothing valid
    matches."""
    path = Path(run_or_ckpt)
    if not path.is_dir():
        raise CheckpointError(
            f"{path} is not a directory: give a run directory (runs/NAME) or a checkpoint "
            "directory (runs/NAME/checkpoints/step-XXXXXXXX)"
        )

    if is_checkpoint_dir(path):
        own = read_manifest(path)
        own_step = own.step if own is not None else parse_step(path.name)
        if step is not None and own_step is not None and step != own_step:
            raise CheckpointError(
                f"{path} is the checkpoint of step {own_step}, not {step}: drop --step or "
                "give the run directory"
            )
        problems = verify(path, "full")
        if problems:
            raise CheckpointError(
                f"checkpoint {path} is not valid: {problems[0]}; pick another checkpoint"
            )
        return path, []

    # A run directory, or a checkpoint root given directly.
    root = checkpoint_root(path) if not _has_step_dirs(path) else path
    if step is None:
        found, skipped = find_latest_valid(root, "full")
        if found is not None:
            notes = [
                f"{info.path.name} is invalid and skipped "
                f"({info.problems[0] if info.problems else 'invalid'})"
                for info in skipped
            ]
            return found.path, notes
        if skipped:
            newest = skipped[0]
            why = newest.problems[0] if newest.problems else "invalid"
            raise CheckpointError(
                f"no valid checkpoint in {root}: all {len(skipped)} are broken (newest, step "
                f"{newest.step}: {why}); train again to write a new one"
            )
        raise CheckpointError(
            f"no checkpoints in {root}: train with checkpoint.enabled = true (the default) "
            "or give the run directory that has them"
        )

    infos = list_checkpoints(root, "none")
    match = next((info for info in infos if info.step == step), None)
    if match is None:
        available = ", ".join(str(info.step) for info in infos) or "none"
        raise CheckpointError(
            f"no checkpoint of step {step} in {root} (steps available: {available}); "
            "pick one of those or drop --step for the newest"
        )
    problems = verify(match.path, "full")
    if problems:
        raise CheckpointError(
            f"checkpoint of step {step} in {root} is not valid: {problems[0]}; pick another step"
        )
    return match.path, []


def _has_step_dirs(path: Path) -> bool:
    """Whether ``path`` is itself a checkpoint root (holds step-XXXXXXXX directories)."""
    return any(parse_step(child.name) is not None and child.is_dir() for child in path.iterdir())


def checkpoint_step(checkpoint: Path) -> int | None:
    """The step a checkpoint holds: its manifest, else trainer.json, else its name."""
    checkpoint = Path(checkpoint)
    manifest = read_manifest(checkpoint)
    if manifest is not None:
        return manifest.step
    try:
        return int(json.loads((checkpoint / "trainer.json").read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return parse_step(checkpoint.name)


def load_model_state(checkpoint: Path) -> dict[str, Any]:
    """The "model" part of a DCP checkpoint as a flat ``{fqn: value}`` on the CPU, read in this
    process alone; every sharded tensor comes back whole."""
    # Private DCP helpers, as torch's own dcp_to_torch_save uses them: the public dcp.load
    # needs a pre-built state dict to fill (i.e. a model); this planner builds one from the
    # checkpoint metadata instead, and keys= skips reading the optimizer state.
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    checkpoint = Path(checkpoint)
    if not (checkpoint / _DCP_METADATA).is_file():
        raise CheckpointError(
            f"{checkpoint} has no {_DCP_METADATA}: not a DCP checkpoint; give a checkpoint "
            "directory written by trainwise train"
        )
    state: dict[str, Any] = {}
    try:
        _load_state_dict(
            state,
            storage_reader=FileSystemReader(checkpoint),
            planner=_EmptyStateDictLoadPlanner(keys={_MODEL_KEY}),
            no_dist=True,
        )
    except (Exception, CheckpointException) as err:  # CheckpointException is a BaseException
        raise CheckpointError(
            f"cannot read the model weights of {checkpoint}: {root_cause(err)}; verify it with "
            "`trainwise checkpoints RUN --verify full` and pick a valid one"
        ) from None
    model = state.get(_MODEL_KEY)
    if not isinstance(model, dict) or not model:
        raise CheckpointError(
            f"{checkpoint} holds no model weights (no '{_MODEL_KEY}' entry); "
            "give a checkpoint written by trainwise train"
        )
    return model


def _independent(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous tensors that each own their whole storage: safetensors refuses tensors
    sharing memory (tied weights) or views into a larger buffer."""
    seen: set[int] = set()
    out = {}
    for name, tensor in tensors.items():
        t = tensor.detach().cpu().contiguous()
        storage = t.untyped_storage()
        if t.numel() and (
            storage.data_ptr() in seen or storage.nbytes() != t.nbytes or t.storage_offset() != 0
        ):
            t = t.clone()
            storage = t.untyped_storage()
        if t.numel():
            seen.add(storage.data_ptr())
        out[name] = t
    return out


def written_dtype(trained: Any, dtype: str | None) -> Any:
    """The torch dtype a tensor of dtype `trained` is written in: `dtype` (fp32, bf16 or
    fp16) for a floating-point one, else (integer buffers, or dtype None) as trained."""
    if dtype is None or not trained.is_floating_point:
        return trained
    from trainwise.dtypes import TORCH_DTYPES

    return TORCH_DTYPES[dtype]


def cast_floats(tensors: dict[str, Any], dtype: str | None) -> dict[str, Any]:
    """The tensors as written_dtype says (non-tensors as they are)."""
    if dtype is None:
        return tensors
    return {k: v.to(written_dtype(v.dtype, dtype)) if hasattr(v, "dtype") else v
            for k, v in tensors.items()}


def export_weights(
    checkpoint: Path, out: Path, fmt: ExportFormat, force: bool = False,
    dtype: str | None = None,
) -> dict[str, int | None]:
    """Write the model weights of ``checkpoint`` to ``out`` as safetensors or a torch.save'd
    state dict, atomically (``out.part`` then rename), floating-point tensors as `dtype`
    (None: as trained). Returns
    ``{"tensors": n, "bytes": size of the file written, "step": s}``. An existing ``out`` is
    refused unless `force` (then replaced atomically), and an output that cannot be
    written fails (see unwritable), both before the checkpoint is read."""
    import torch  # here, so that finding checkpoints (the CLI listing) needs no torch

    if fmt not in ("safetensors", "torch"):
        raise CheckpointError(f"export format {fmt!r} is unknown; use safetensors or torch")
    checkpoint, out = Path(checkpoint), Path(out)
    part = claim_output(out, force)
    try:
        step = checkpoint_step(checkpoint)
        state = load_model_state(checkpoint)
        tensors = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
        others = sorted(k for k in state if k not in tensors)
        if others and fmt == "safetensors":
            raise CheckpointError(
                f"{checkpoint}: model entries {', '.join(others[:3])} are not tensors and "
                "safetensors holds tensors only; export with --format torch"
            )
        tensors = cast_floats(_independent(tensors), dtype)
        try:
            if fmt == "safetensors":
                from safetensors.torch import save_file

                metadata = {"format": "trainwise"}
                if step is not None:
                    metadata["step"] = str(step)  # safetensors metadata values are strings
                save_file(tensors, str(part), metadata=metadata)
            else:
                # Non-tensor entries (module extra state) stay: load_state_dict expects them.
                torch.save({k: tensors.get(k, state[k]) for k in state}, part)
            publish(part, out)
        except Exception as err:  # OSError, SafetensorError, torch's RuntimeError: all I/O
            raise unwritable(out, err) from None
    except BaseException:
        _discard(part)  # never leave a half-written .part behind
        raise
    return {"tensors": len(tensors), "bytes": out.stat().st_size, "step": step}


def refuse_existing(out: Path, force: bool) -> None:
    """The one rule of every export: an existing output is replaced only with --force."""
    if out.exists() and not force:
        what = "directory" if out.is_dir() else "file"
        raise ConfigError(
            f"-o {out}: the {what} exists; remove it, choose another path, or give --force "
            "to replace it"
        )


def claim_output(out: Path, force: bool = False) -> Path:
    """Create ``out``'s folder and its empty ``.part`` file, so that an output that cannot
    be written fails at once, before a long checkpoint read; the part file is returned."""
    if out.is_dir():
        raise ConfigError(f"-o {out} is a directory: give a file path, e.g. {out / 'model'}")
    refuse_existing(out, force)
    part = out.with_suffix(out.suffix + ".part")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        part.open("wb").close()
    except OSError as err:
        raise unwritable(out, err) from None
    return part


def publish(part: Path, out: Path) -> None:
    """Rename a finished ``.part`` to ``out`` (replacing it atomically), with the mode a
    new file gets (writers that go through a temporary file leave 0600)."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(part, 0o666 & ~umask)
    os.replace(part, out)


class ExportIOError(TrainwiseError):
    """An export that could not be written for want of space: an I/O fault (exit 1, as a
    full disk in training), not bad input."""


def unwritable(out: Path, err: BaseException) -> TrainwiseError:
    """One line for an output that cannot be written: a full disk is an I/O fault (exit
    1, as in training); anything else (permissions, a read-only path) is a bad -o (2)."""
    from trainwise.run.checkpoint.dcp import disk_full

    where = out.parent if str(out.parent) else Path(".")
    if disk_full(err, where):
        return ExportIOError(
            f"-o {out}: no space left on the device of {where}; nothing was written (the "
            "partial output is removed): free space or give -o a path on another disk"
        )
    why = err.strerror if isinstance(err, OSError) and err.strerror else root_cause(err)
    return ConfigError(
        f"-o {out}: cannot write a file in {where} ({why}): "
        "give -o a path in a folder you can write to"
    )


def _discard(path: Path) -> None:
    with contextlib.suppress(OSError):  # the original error is the one worth reporting
        path.unlink(missing_ok=True)
