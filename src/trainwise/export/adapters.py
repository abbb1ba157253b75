"""A LoRA run's adapters in PEFT's format: ``adapter_config.json`` (written by PEFT's own
``LoraConfig``) and ``adapter_model.safetensors``, which
``peft.PeftModel.from_pretrained(base, DIR)`` loads onto the Hugging Face base model.

Our adapter ``<path>.lora_A.weight`` (r x in) and ``<path>.lora_B.weight`` (out x r) are
PEFT's tensors as they are; only the names change: the model's own name of the base
Linear becomes Hugging Face's (export.hf's renaming), under PEFT's prefix
``base_model.model.`` (PEFT leaves the adapter's name out of the file). Embeddings or a
head that trained fully (lora.train_embeddings / train_head) go in as PEFT's
``modules_to_save``, stored under their plain names as PEFT stores them.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainwise.errors import ConfigError
from trainwise.models.lora import ADAPTERS

if TYPE_CHECKING:
    from trainwise.config import JobConfig

PREFIX = "base_model.model."  # PEFT's name of the base model inside a PeftModel
_FULL_MODULES = {"train_embeddings": "embed_tokens", "train_head": "lm_head"}
_EMBED_HEAD = ("embed_tokens", "lm_head")


def adapter_base(name: str) -> str | None:
    """`<path>` of an adapter entry `<path>.lora_A.weight` / `.lora_B.weight`, else None."""
    for suffix in (f".{adapter}.weight" for adapter in ADAPTERS):
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return None


def peft_names(state: dict[str, Any], rename: Callable[[str], str]) -> tuple[dict, list[str]]:
    """(the adapters under PEFT's names, the targeted modules' Hugging Face paths) from a
    checkpoint's model entries. `rename` maps a model name to Hugging Face's."""
    tensors: dict[str, Any] = {}
    targets: set[str] = set()
    for name, value in state.items():
        base = adapter_base(name)
        if base is None:
            continue
        hf_path = rename(base + ".weight").removesuffix(".weight")
        targets.add(hf_path)
        tensors[PREFIX + hf_path + name[len(base) :]] = value
    return tensors, sorted(targets)


def trained_whole(
    state: dict[str, Any], rename: Callable[[str], str], lora: Any, tied: bool
) -> tuple[dict[str, Any], list[str]]:
    """(the embeddings / head that trained fully, under PEFT's names; modules_to_save).
    Tied, one tensor trains for both: PEFT's ensure_weight_tying keeps its copies of the
    two tied, and loads both names."""
    leaves = [leaf for key, leaf in _FULL_MODULES.items() if getattr(lora, key)]
    if not leaves:
        return {}, []
    found: dict[str, tuple[str, Any]] = {}
    for name, value in state.items():
        if adapter_base(name) is None:
            hf = rename(name)
            found.update({leaf: (hf, value) for leaf in _EMBED_HEAD if hf.endswith(f"{leaf}.weight")})
    if not tied:
        return {PREFIX + found[leaf][0]: found[leaf][1] for leaf in leaves if leaf in found}, leaves
    embed, head = _EMBED_HEAD
    value = (found.get(embed) or found[head])[1]
    names = [found[leaf][0] if leaf in found else f"{leaf}.weight" for leaf in _EMBED_HEAD]
    if embed not in found:
        names[0] = "model.embed_tokens.weight"  # the Llama family's, where the head is
    return {PREFIX + names[0]: value, PREFIX + names[1]: value.clone()}, [embed]


def lora_run_config(source: Path, checkpoint: Path) -> JobConfig | None:
    """The run config of a LoRA run's checkpoint (`source` is what the user gave: the run,
    or the checkpoint itself), or None when the run trained every parameter.
    ConfigError when the checkpoint holds adapters but no run config can be found."""
    from trainwise.export.hf import adapter_entries
    from trainwise.export.trained import run_config

    for folder in (source, checkpoint.parent.parent):
        if (folder / "config.toml").is_file():
            cfg = run_config(folder)
            return cfg if cfg.lora.rank > 0 else None
    if adapter_entries(checkpoint):
        raise ConfigError(
            f"{checkpoint} holds LoRA adapters but no run config.toml is beside it: give the "
            "run directory (runs/NAME), whose [lora] section says how to apply them"
        )
    return None


def merged_state(cfg: JobConfig, checkpoint: Path) -> dict[str, Any]:
    """The LoRA run's trained model (the checkpoint over its starting weights) with the
    adapters folded into their base weights: a plain model's state dict."""
    from trainwise.export.trained import build_trained
    from trainwise.models.lora import merge_lora

    module = build_trained(cfg, checkpoint)
    return merge_lora({k: v.detach() for k, v in module.state_dict().items()}, cfg.lora)


def not_lora(where: Path) -> str:
    """The one line for --format peft on a run that trained every parameter."""
    return (
        f"--format peft: {where} trained every parameter (lora.rank = 0), so it has no "
        "adapters to export; use --format safetensors for its weights (or hf, for a "
        "Hugging Face model or a Llama-style preset)"
    )


def export_peft(cfg: JobConfig, checkpoint: Path, out: Path, force: bool = False,
                dtype: str | None = None) -> dict:
    """Write the adapters of a LoRA run's `checkpoint` (`cfg`: the run's config, from
    lora_run_config) as a PEFT adapter directory `out`, via `out.partial` renamed when
    complete; floating-point tensors as `dtype` (None: as trained)."""
    from safetensors.torch import save_file

    from trainwise.export.hf import checkpoint_model_spec, hf_target, staged_dir
    from trainwise.export.weights import (
        cast_floats,
        checkpoint_step,
        load_model_state,
        refuse_existing,
    )

    checkpoint, out = Path(checkpoint), Path(out)
    refuse_existing(out, force)
    spec = checkpoint_model_spec(checkpoint)
    state = load_model_state(checkpoint)
    try:
        hf_config, rename = hf_target(spec, {k: tuple(v.shape) for k, v in state.items()})
    except ConfigError as err:  # PEFT's names are Hugging Face's: the same models export
        raise ConfigError(err.problems[0].replace("--format hf", "--format peft")) from None
    tensors, targets = peft_names(state, rename)
    if not targets:
        raise ConfigError(f"{checkpoint} holds no LoRA adapters (no *.lora_A.weight): give "
                          "the checkpoint of a LoRA run")
    tied = bool(hf_config.get("tie_word_embeddings"))
    whole, full = trained_whole(state, rename, cfg.lora, tied)
    tensors.update(whole)
    config = lora_config(cfg.lora, targets, full, tied and bool(full), _base_dir(spec.name))
    with staged_dir(out) as partial:  # never half an adapter
        config.save_pretrained(str(partial))
        contiguous = {k: v.detach().contiguous() for k, v in cast_floats(tensors, dtype).items()}
        save_file(contiguous, str(partial / "adapter_model.safetensors"),
                  metadata={"format": "pt"})
    return {"tensors": len(tensors), "targets": len(targets), "step": checkpoint_step(checkpoint)}


def lora_config(lora: Any, targets: list[str], full: list[str], tie: bool, base: str | None):
    """PEFT's own LoraConfig for the run's [lora] (it writes adapter_config.json)."""
    try:
        import peft
    except ImportError:
        raise ConfigError("--format peft needs PEFT: pip install 'trainwise[hf]'") from None
    return peft.LoraConfig(
        r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=targets,
        modules_to_save=full or None, ensure_weight_tying=tie, bias="none",
        task_type="CAUSAL_LM", base_model_name_or_path=base,
    )


def _base_dir(model_name: str) -> str | None:
    """The base model's directory (model.name = 'hf:DIR'), recorded in adapter_config.json."""
    if not model_name.startswith("hf:"):
        return None
    from trainwise.models.hf import model_dir

    return str(model_dir(model_name[len("hf:") :]))
