"""`trainwise export`: write a checkpoint's model weights to one safetensors or torch file,
or (--format hf) a Hugging Face model directory (a LoRA run's adapters merged in), or
(--format peft) a LoRA run's adapters as PEFT loads them."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from trainwise.errors import ConfigError

if TYPE_CHECKING:
    from trainwise.config import JobConfig

_SUFFIX_FORMATS = {
    ".safetensors": "safetensors",
    ".pt": "torch",
    ".pth": "torch",
    ".bin": "torch",
}
_DEFAULT_SUFFIX = {"safetensors": ".safetensors", "torch": ".pt"}


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "export",
        help="export checkpoint weights to safetensors, torch.save or a Hugging Face directory",
        description="Read the model weights of a sharded checkpoint (any strategy, any world "
        "size) in this one process and write them as one file that the plain model loads "
        "with load_state_dict(strict=True), or with --format hf as a Hugging Face model "
        "directory (config.json, safetensors shards and their index) that transformers' "
        "from_pretrained loads; a LoRA run's adapters are merged into their base weights. "
        "--format peft writes a LoRA run's adapters (adapter_config.json and "
        "adapter_model.safetensors) for peft.PeftModel.from_pretrained(base, OUT).",
    )
    # dest is not "run": the dispatcher calls args.run.
    p.add_argument("target", metavar="RUN", help="run directory or checkpoint directory")
    p.add_argument("--step", type=int, help="checkpoint step (default: the newest valid one)")
    p.add_argument(
        "--format",
        choices=("safetensors", "torch", "hf", "peft"),
        help="file format (default: from the -o suffix; .safetensors, or .pt/.pth/.bin); hf: "
        "a Hugging Face model directory (-o names it); peft: a LoRA run's adapter directory",
    )
    p.add_argument(
        "--shard-size",
        default="5GB",
        help="hf: the largest safetensors file, e.g. 500MB (default 5GB)",
    )
    p.add_argument(
        "-o",
        "--output",
        metavar="OUT",
        help="output file (default: RUN/model-step-XXXXXXXX.safetensors; in the current "
        "directory when RUN is a checkpoint directory)",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="replace an existing OUT (file or --format hf directory) once the new one is "
        "complete; without it an existing OUT is refused",
    )
    p.set_defaults(run=run)


def output_format(out: Path | None, fmt: str | None) -> str:
    """The format to write: --format when given, else the one the OUT suffix names."""
    if fmt is not None:
        return fmt
    if out is None:
        return "safetensors"
    suffix = out.suffix.lower()
    if suffix not in _SUFFIX_FORMATS:
        raise ConfigError(
            f"-o {out}: cannot tell the format from the suffix {suffix or '(none)'!r}; "
            "end it in .safetensors, .pt, .pth or .bin, or give --format"
        )
    return _SUFFIX_FORMATS[suffix]


def run(args: argparse.Namespace) -> int:
    # Imported here so that `trainwise --help` does not import torch.
    from trainwise.export.weights import checkpoint_step, choose_checkpoint, export_weights
    from trainwise.run.checkpoint.store import CheckpointError

    source = Path(args.target)
    out = Path(args.output) if args.output else None
    fmt = output_format(out, args.format)
    if fmt in ("hf", "peft") and out is None:
        raise ConfigError(f"--format {fmt} writes a directory: name it with -o, e.g. -o out/model")
    if not source.is_dir():
        raise ConfigError(
            f"{source}: no such run directory; give runs/NAME (or a checkpoint directory)"
        )
    try:
        checkpoint, skipped = choose_checkpoint(source, args.step)
    except CheckpointError as err:
        # Nothing to export from what was asked: bad input, like a wrong path.
        raise ConfigError(str(err)) from None
    for note in skipped:  # said before the export: what is exported, and why not the newest
        print(f"trainwise: checkpoint {note}", file=sys.stderr)
    if skipped:
        print(f"trainwise: exporting {checkpoint.name}, the newest valid one", file=sys.stderr)
    if fmt in ("hf", "peft"):
        from trainwise.export.adapters import lora_run_config, not_lora

        lora = lora_run_config(source, checkpoint)
        if fmt == "peft":
            if lora is None:
                raise ConfigError(not_lora(source))
            return _export_peft(lora, checkpoint, out, args.force)
        return _export_hf(checkpoint, out, args.shard_size, args.force, lora)
    if out is None:
        step = checkpoint_step(checkpoint)
        name = f"model-step-{step:08d}" if step is not None else f"model-{checkpoint.name}"
        # Beside the run's other outputs; a checkpoint directory given directly is left
        # untouched (an extra file there is not in its manifest), so the cwd gets it.
        base = Path(".") if checkpoint.resolve() == source.resolve() else source
        out = base / (name + _DEFAULT_SUFFIX[fmt])
    result = export_weights(checkpoint, out, fmt, args.force)  # type: ignore[arg-type]
    mb = result["bytes"] / 1e6
    print(
        f"trainwise: wrote {out} ({result['tensors']} tensors, {mb:.1f} MB, {fmt}) "
        f"from step {result['step']} ({checkpoint})"
    )
    return 0


def _export_hf(
    checkpoint: Path, out: Path, shard_size: str, force: bool, lora: JobConfig | None
) -> int:
    from trainwise.export.adapters import merged_state
    from trainwise.export.hf import export_hf, parse_size
    from trainwise.export.weights import refuse_existing

    size = parse_size(shard_size)
    refuse_existing(out, force)  # before building a LoRA run's model
    state = merged_state(lora, checkpoint) if lora is not None else None
    result = export_hf(checkpoint, out, size, force, state)
    merged = ", LoRA adapters merged" if lora is not None else ""
    print(
        f"trainwise: wrote {out} ({result['tensors']} tensors in {result['files']} safetensors "
        f"file(s), Hugging Face format{merged}) from step {result['step']} ({checkpoint})"
    )
    return 0


def _export_peft(lora: JobConfig, checkpoint: Path, out: Path, force: bool) -> int:
    from trainwise.export.adapters import export_peft

    result = export_peft(lora, checkpoint, out, force)
    print(
        f"trainwise: wrote {out} (PEFT adapter: {result['targets']} LoRA modules, "
        f"{result['tensors']} tensors) from step {result['step']} ({checkpoint})"
    )
    return 0
