"""The trained model of a run, whole in this one process, with the job's tokenizer: what
`trainwise generate` runs and what the LoRA exports read.

The model is built as the run built it: the checkpoint's model spec, the job's
converters (a LoRA run gets its adapters), then the starting weights the run had (the
pretrained Hugging Face weights, or the seeded per-parameter init), then the checkpoint's
weights over them. A checkpoint that leaves out the frozen base (LoRA) thus still gives
the whole model; one that lacks a trainable parameter is refused.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainwise.errors import ConfigError

if TYPE_CHECKING:
    import torch
    from torch import nn

    from trainwise.config import JobConfig
    from trainwise.data.tokenizer import Tokenizer
    from trainwise.models import ModelSpec


@dataclass
class Trained:
    """A model to run: logits of ids[1, T], its tokenizer and how many positions it takes."""

    logits: Callable[[torch.Tensor], torch.Tensor]
    tokenizer: Tokenizer
    max_len: int | None
    source: str  # for the user: which checkpoint or directory
    module: nn.Module  # the model itself (LoRA's frozen base: requires_grad False)


def run_config(run_dir: Path) -> JobConfig:
    """The resolved config the run wrote (RUN/config.toml)."""
    from trainwise.config import load_config

    path = Path(run_dir) / "config.toml"
    if not path.is_file():
        raise ConfigError(
            f"{run_dir}: no config.toml, so not a run directory; give runs/NAME as "
            "`trainwise train` wrote it"
        )
    return load_config(path)


def chosen_checkpoint(run_dir: Path, step: int | None = None) -> Path:
    """The run's newest valid checkpoint (or that of `step`); ConfigError when none."""
    from trainwise.export.weights import resolve_checkpoint
    from trainwise.run.checkpoint.store import CheckpointError

    try:
        return resolve_checkpoint(Path(run_dir), step)
    except CheckpointError as err:
        raise ConfigError(str(err)) from None


def build_trained(cfg: JobConfig, checkpoint: Path) -> nn.Module:
    """The run's model in eval mode on the CPU, with the checkpoint's weights."""
    from trainwise.export.hf import checkpoint_model_spec
    from trainwise.export.weights import load_model_state

    spec = checkpoint_model_spec(checkpoint)
    check_base(checkpoint, spec, cfg.train.seed)
    module = starting_model(cfg, spec)
    load_over(module, load_model_state(checkpoint), checkpoint)
    return module.eval()


def check_base(checkpoint: Path, spec: ModelSpec, seed: int) -> None:
    """A LoRA checkpoint holds no frozen base: the base rebuilt now must be the one it
    trained on (the lineage's lora.base_weights, as a resume checks it)."""
    from trainwise.models import base_weights_id

    try:
        lineage = json.loads((Path(checkpoint) / "trainer.json").read_text())["lineage"]
        recorded = lineage.get("lora.base_weights")
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return  # no lineage: a checkpoint that holds its whole model
    if recorded is not None and recorded != (now := base_weights_id(spec, seed)):
        raise ConfigError(
            f"{checkpoint}: its LoRA adapters were trained on base weights {recorded}, but "
            f"{spec.name} now holds {now}; restore the base model the run trained on"
        )


def starting_model(cfg: JobConfig, spec: ModelSpec) -> nn.Module:
    """The model as the run started it, in run/engine/parts.py's order on one process:
    built on the meta device (or whole, seeded), converted, then given the pretrained
    weights or the seeded init, and the converters' parameters their own init."""
    import torch

    from trainwise.models.converters import build_converters
    from trainwise.run.engine.materialize import (
        build_unparallelized,
        convert_built,
        fill_storage,
        load_pretrained,
    )

    seed, cpu = cfg.train.seed, torch.device("cpu")
    bundle = build_unparallelized(spec, seed, cpu)
    init, added = convert_built(bundle, build_converters(cfg), seed)
    if bundle.init_parameter is not None:
        fill_storage(bundle, bundle.module, init, seed, cpu)
    if bundle.load_weights is not None:
        load_pretrained(bundle, bundle.module, init, added, seed)
    return bundle.module


def load_over(module: nn.Module, state: dict[str, Any], checkpoint: Path) -> None:
    """The checkpoint's entries into `module`: every one must be the model's, and only
    frozen parameters (a LoRA run's base, which the checkpoint leaves out) may be missing."""
    result = module.load_state_dict(state, strict=False)
    trainable = {n for n, p in module.named_parameters() if p.requires_grad}
    missing = [k for k in result.missing_keys if k in trainable]
    if result.unexpected_keys or missing:
        what = (
            f"holds {result.unexpected_keys[0]!r}, which the model does not have"
            if result.unexpected_keys
            else f"lacks the trained parameter {missing[0]!r}"
        )
        raise ConfigError(
            f"{checkpoint} {what}: the run's config.toml does not describe the model of "
            "this checkpoint; give the run directory that wrote it"
        )


def job_tokenizer(cfg: JobConfig, where: str) -> Tokenizer:
    """The tokenizer the job's prepared data was tokenized with (its index.json names it);
    ConfigError when the data has none (synthetic, digits, a bare token file)."""
    from trainwise.data import is_prepared_dir, read_index
    from trainwise.data.tokenizer import BYTES, load_tokenizer

    data = cfg.data
    if data.dataset == "tokens" and data.path and not Path(data.path).exists():
        raise ConfigError(
            f"data.path = {data.path!r} of {where} is not found from here, and its index.json "
            "names the tokenizer: run generate from the folder the run was trained from"
        )
    if data.dataset != "tokens" or not data.path or not is_prepared_dir(data.path):
        what = f"data.dataset = {data.dataset!r}" if data.dataset != "tokens" else (
            f"data.path = {data.path!r}, a token file without index.json"
        )
        raise ConfigError(
            f"{where} trained on {what}, which has no tokenizer to turn text into ids: "
            "generate needs a run on data prepared by `trainwise data prepare` (or an "
            "exported model directory holding tokenizer.json)"
        )
    recorded = read_index(data.path).get("tokenizer") or {}
    spec = recorded.get("spec")
    if not spec:
        raise ConfigError(f"data.path = {data.path!r}: its index.json names no tokenizer; "
                          "prepare the data again with this trainwise version")
    try:
        tokenizer = load_tokenizer(spec)
    except ConfigError as err:
        raise ConfigError(
            f"data.path = {data.path!r} was tokenized with {spec!r}, which cannot be loaded "
            f"now ({err.problems[0]})"
        ) from None
    if spec != BYTES and recorded.get("sha256") not in (None, tokenizer.sha256):
        raise ConfigError(
            f"the tokenizer {spec!r} changed since data.path = {data.path!r} was prepared "
            "(its sha256 differs from the index's): restore it, or generate from an export "
            "that holds its tokenizer"
        )
    return tokenizer


def from_run(run_dir: Path, step: int | None = None) -> Trained:
    """A run's trained model (its newest valid checkpoint, or `step`'s) and tokenizer."""

    cfg = run_config(run_dir)
    tokenizer = job_tokenizer(cfg, f"run {run_dir}")
    checkpoint = chosen_checkpoint(run_dir, step)
    module = build_trained(cfg, checkpoint)
    shape = getattr(module, "shape", None)
    max_len = getattr(shape, "max_seq_len", None) or cfg.data.seq_len
    return Trained(module, tokenizer, max_len, str(checkpoint), module)  # its output: logits


def from_export(folder: Path) -> Trained:
    """A Hugging Face model directory (`export --format hf`), run by transformers, with
    the tokenizer.json it holds."""

    from trainwise.data.tokenizer import load_tokenizer

    folder = Path(folder)
    if not (folder / "tokenizer.json").is_file():
        raise ConfigError(
            f"{folder} holds no tokenizer.json, so text cannot become ids: copy the model's "
            "tokenizer.json (and tokenizer_config.json) there"
        )
    tokenizer = load_tokenizer(str(folder / "tokenizer.json"))
    try:
        import transformers
    except ImportError:
        raise ConfigError(
            f"{folder}: a Hugging Face directory needs transformers: pip install 'trainwise[hf]'"
        ) from None
    transformers.utils.logging.disable_progress_bar()  # one line of ours says what loads
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()

    def logits(ids: torch.Tensor) -> torch.Tensor:
        return model(input_ids=ids, use_cache=False).logits

    max_len = getattr(model.config, "max_position_embeddings", None)
    return Trained(logits, tokenizer, max_len, str(folder), model)


def load_trained(target: Path, step: int | None = None) -> Trained:
    """A run directory's trained model, or an exported Hugging Face directory's."""
    target = Path(target)
    if not target.is_dir():
        raise ConfigError(
            f"{target}: no such directory; give a run directory (runs/NAME) or a model "
            "directory written by `trainwise export --format hf`"
        )
    if (target / "config.json").is_file() and not (target / "config.toml").is_file():
        if step is not None:
            raise ConfigError(f"--step {step}: {target} is an exported model, not a run; "
                              "drop --step")
        return from_export(target)
    return from_run(target, step)
