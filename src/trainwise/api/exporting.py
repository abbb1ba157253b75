"""`export()`: a run's trained weights out of its sharded checkpoint, in one process: one
safetensors or torch file the plain model loads with load_state_dict(strict=True), a
Hugging Face model directory (a LoRA run's adapters merged in), or a LoRA run's adapters
as PEFT loads them. Written whole or not at all."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from trainwise.errors import ConfigError

if TYPE_CHECKING:
    from trainwise.config import JobConfig

Format = Literal["safetensors", "torch", "hf", "peft"]
SUFFIX_FORMATS: dict[str, Format] = {
    ".safetensors": "safetensors",
    ".pt": "torch",
    ".pth": "torch",
    ".bin": "torch",
}
DEFAULT_SUFFIX = {"safetensors": ".safetensors", "torch": ".pt"}
ExportDtype = Literal["fp32", "bf16", "fp16"]
EXPORT_DTYPES: tuple[ExportDtype, ...] = ("fp32", "bf16", "fp16")


@dataclass(frozen=True)
class Exported:
    """What export() wrote: `path` (a file, or a directory for hf and peft), its `format`,
    the checkpoint it came from and its `step`, the tensors written; `bytes` for one file,
    `files` for an hf directory, `targets` (the adapted modules) for peft; `merged`: a
    LoRA run's adapters merged into an hf export; `skipped`: newer checkpoints passed
    over, each with why."""

    path: Path
    format: Format
    checkpoint: Path
    step: int | None
    tensors: int
    bytes: int | None = None
    files: int | None = None
    targets: int | None = None
    merged: bool = False
    skipped: tuple[str, ...] = ()


def output_format(
    out: Path | None, fmt: str | None, flag: str = "format=", out_flag: str = "output="
) -> Format:
    """The format to write: `fmt` when given, else the one the output's suffix names
    (`flag`, `out_flag`: how messages name the two, a keyword or the CLI's flags)."""
    if fmt is not None:
        return fmt  # type: ignore[return-value]
    if out is None:
        return "safetensors"
    suffix = out.suffix.lower()
    if suffix not in SUFFIX_FORMATS:
        raise ConfigError(
            f"{out_flag} {out}: cannot tell the format from the suffix {suffix or '(none)'!r}; end it "
            f"in .safetensors, .pt, .pth or .bin, or give {flag}"
        )
    return SUFFIX_FORMATS[suffix]


def export(
    run_dir: str | Path,
    output: str | Path | None = None,
    *,
    format: Format | None = None,
    step: int | None = None,
    shard_size: str = "5GB",
    force: bool = False,
    dtype: ExportDtype | None = None,
) -> Exported:
    """Export the newest valid checkpoint of `run_dir` (a run or a checkpoint directory;
    `step`: that checkpoint instead) to `output`. `format`: safetensors or torch (default:
    from the suffix; .safetensors when no output is named: RUN/model-step-N.safetensors),
    hf (a Hugging Face directory; `shard_size` its largest file) or peft (a LoRA run's
    adapters). An existing output is refused unless `force` (replaced once the new one is
    whole). `dtype`: the floating-point weights' (fp32, bf16 or fp16; default: as trained,
    the master weights' dtype). Bad input is a ConfigError before anything is written."""
    from trainwise.export.weights import choose_checkpoint
    from trainwise.run.checkpoint.store import CheckpointError

    source = Path(run_dir)
    out = Path(output) if output is not None else None
    fmt = output_format(out, format)
    if dtype is not None and dtype not in EXPORT_DTYPES:
        raise ConfigError(f"dtype={dtype!r} is not one an export writes: give one of "
                          f"{', '.join(EXPORT_DTYPES)} (or None: as trained)")
    if fmt in ("hf", "peft") and out is None:
        raise ConfigError(f"format {fmt} writes a directory: name it, e.g. output='out/model'")
    if not source.is_dir():
        raise ConfigError(f"{source}: no such run directory; give runs/NAME (or a checkpoint "
                          "directory)")
    try:
        checkpoint, skipped = choose_checkpoint(source, step)
    except CheckpointError as err:  # nothing to export from what was asked: bad input
        raise ConfigError(str(err)) from None
    if fmt in ("hf", "peft"):
        from trainwise.export.adapters import lora_run_config

        lora = lora_run_config(source, checkpoint)
        assert out is not None
        if fmt == "peft":
            return _peft(lora, source, checkpoint, out, force, tuple(skipped), dtype)
        return _hf(lora, checkpoint, out, shard_size, force, tuple(skipped), dtype)
    return _file(source, checkpoint, out, fmt, force, tuple(skipped), dtype)


def _file(
    source: Path, checkpoint: Path, out: Path | None, fmt: Format, force: bool,
    skipped: tuple[str, ...], dtype: ExportDtype | None,
) -> Exported:
    from trainwise.export.weights import checkpoint_step, export_weights

    if out is None:
        step = checkpoint_step(checkpoint)
        name = f"model-step-{step:08d}" if step is not None else f"model-{checkpoint.name}"
        # Beside the run's other outputs; a checkpoint directory given directly is left
        # untouched (an extra file there is not in its manifest), so the cwd gets it.
        base = Path(".") if checkpoint.resolve() == source.resolve() else source
        out = base / (name + DEFAULT_SUFFIX[fmt])
    result = export_weights(checkpoint, out, fmt, force, dtype)  # type: ignore[arg-type]
    return Exported(out, fmt, checkpoint, result["step"], int(result["tensors"] or 0),
                    bytes=result["bytes"], skipped=skipped)


def _hf(
    lora: JobConfig | None, checkpoint: Path, out: Path, shard_size: str, force: bool,
    skipped: tuple[str, ...], dtype: ExportDtype | None,
) -> Exported:
    from trainwise.export.adapters import merged_state
    from trainwise.export.hf import export_hf, parse_size
    from trainwise.export.weights import refuse_existing

    size = parse_size(shard_size)
    refuse_existing(out, force)  # before building a LoRA run's model
    state = merged_state(lora, checkpoint) if lora is not None else None
    result = export_hf(checkpoint, out, size, force, state, dtype)
    return Exported(out, "hf", checkpoint, result["step"], result["tensors"],
                    files=result["files"], merged=lora is not None, skipped=skipped)


def _peft(
    lora: JobConfig | None, source: Path, checkpoint: Path, out: Path, force: bool,
    skipped: tuple[str, ...], dtype: ExportDtype | None,
) -> Exported:
    from trainwise.export.adapters import export_peft, not_lora

    if lora is None:
        raise ConfigError(not_lora(source))
    result = export_peft(lora, checkpoint, out, force, dtype)
    return Exported(out, "peft", checkpoint, result["step"], result["tensors"],
                    targets=result["targets"], skipped=skipped)


def say_skipped(exported: Exported) -> None:
    """The checkpoints passed over, on stderr (what is exported, and why not the newest)."""
    for note in exported.skipped:
        print(f"trainwise: checkpoint {note}", file=sys.stderr)
    if exported.skipped:
        print(f"trainwise: exported {exported.checkpoint.name}, the newest valid one",
              file=sys.stderr)
