"""`trainwise export`: write a checkpoint's model weights to one safetensors or torch file,
or (--format hf) a Hugging Face model directory (a LoRA run's adapters merged in), or
(--format peft) a LoRA run's adapters as PEFT loads them: the flags parsed,
trainwise.api's export called, what it wrote printed."""

from __future__ import annotations

import argparse
from pathlib import Path

from trainwise.errors import ConfigError


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
        "--dtype",
        choices=("fp32", "bf16", "fp16"),
        help="the floating-point weights' dtype (default: as trained, the master weights'; "
        "with --format hf, config.json's torch_dtype follows)",
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


def run(args: argparse.Namespace) -> int:
    from trainwise.api.exporting import export, output_format, say_skipped

    out = args.output
    fmt = output_format(Path(out) if out else None, args.format, "--format", "-o")
    if fmt in ("hf", "peft") and out is None:
        raise ConfigError(f"--format {fmt} writes a directory: name it with -o, e.g. -o out/model")
    done = export(args.target, out, format=fmt, step=args.step, shard_size=args.shard_size,
                  force=args.force, dtype=args.dtype)
    say_skipped(done)
    where = f"from step {done.step} ({done.checkpoint})"
    if done.format == "hf":
        merged = ", LoRA adapters merged" if done.merged else ""
        print(f"trainwise: wrote {done.path} ({done.tensors} tensors in {done.files} "
              f"safetensors file(s), Hugging Face format{merged}) {where}")
    elif done.format == "peft":
        print(f"trainwise: wrote {done.path} (PEFT adapter: {done.targets} LoRA modules, "
              f"{done.tensors} tensors) {where}")
    else:
        print(f"trainwise: wrote {done.path} ({done.tensors} tensors, "
              f"{(done.bytes or 0) / 1e6:.1f} MB, {done.format}) {where}")
    return 0
