"""Export a checkpoint as a Hugging Face model directory: config.json, safetensors shards of
at most ``shard_bytes`` and model.safetensors.index.json (one model.safetensors when it
fits), which ``transformers.AutoModelForCausalLM.from_pretrained`` loads.

Any layout exports: DCP reads the checkpoint's tensors whole in this one process (no process
group, no model built), one output shard at a time, so the process never holds more than
one shard. The names are the model's own: an ``hf:`` transformers model's are already
Hugging Face's, trainwise's Llama-style GPT's are renamed (models.llama).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from trainwise.errors import ConfigError
from trainwise.export.weights import (
    cast_floats,
    checkpoint_step,
    publish,
    refuse_existing,
    unwritable,
    written_dtype,
)
from trainwise.models import ModelSpec, model_kind, resolve_shape
from trainwise.models.hf import model_dir, read_hf_config
from trainwise.models.llama import gpt_to_hf, llama_config
from trainwise.run.checkpoint.store import CheckpointError

_MODEL = "model."  # the checkpoint's prefix of the model's entries
# A checkpoint entry -> its (Hugging Face name, tensor) pairs: one, several (a MoE model's
# experts, one tensor each in the files) or none (state the files do not hold).
Split = Callable[[str, Any], Iterable[tuple[str, Any]]]
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def checkpoint_model_spec(checkpoint: Path) -> ModelSpec:
    """The model spec the run recorded in the checkpoint's trainer.json."""
    try:
        spec = json.loads((checkpoint / "trainer.json").read_text())["model_spec"]
    except (OSError, ValueError, KeyError, TypeError):
        raise CheckpointError(
            f"{checkpoint}: trainer.json does not say which model was trained; export "
            "--format hf needs a checkpoint written by this trainwise version"
        ) from None
    known = set(ModelSpec.__dataclass_fields__)
    return ModelSpec(**{k: v for k, v in spec.items() if k in known})


def hf_target(spec: ModelSpec, sizes: dict[str, tuple[int, ...]]) -> tuple[dict, Callable]:
    """(config.json, checkpoint name -> Hugging Face name) for the trained model."""
    kind = model_kind(spec.name)
    if kind == "hf" and spec.impl != "trainwise":
        config = read_hf_config(spec.name[len("hf:") :])
        emb = next((s for k, s in sizes.items() if k.endswith("embed_tokens.weight")), None)
        if emb is not None:  # the data may have set the vocabulary
            config["vocab_size"] = emb[0]
        return config, lambda name: name.removeprefix("model.")
    if kind == "custom":
        raise ConfigError(
            f"export --format hf: model.name = {spec.name!r} is a module of your own, which "
            "transformers cannot build from a config.json: use --format safetensors (one "
            "file of its state dict, which your module's load_state_dict takes)"
        )
    shape = resolve_shape(spec) if kind in ("preset", "hf") else None
    if shape is None:
        raise ConfigError(
            f"export --format hf: model {spec.name!r} is not a Hugging Face model or a "
            "Llama-style GPT preset; use --format safetensors"
        )
    emb = sizes.get("tok_emb.weight")
    if emb is not None and emb[0] != shape.vocab_size:
        shape = type(shape)(**{**shape.__dict__, "vocab_size": emb[0]})
    return llama_config(shape), gpt_to_hf


def moe_target(spec: ModelSpec, sizes: dict[str, tuple[int, ...]]) -> tuple[dict, Split] | None:
    """(config.json, checkpoint entry -> its Hugging Face tensors) for a trained MoE model
    (models.moe.hf: an experts' entry is E tensors of the files); None for another."""
    from dataclasses import replace

    from trainwise.models import resolve_moe_shape

    kind = model_kind(spec.name)
    if kind not in ("moe", "hf") or (kind == "hf" and spec.impl != "trainwise"):
        return None
    shape = resolve_moe_shape(spec)
    if shape is None:
        return None
    emb = sizes.get("tok_emb.weight")
    if emb is not None and emb[0] != shape.vocab_size:  # the data may have set it
        shape = replace(shape, vocab_size=emb[0])
    source = read_hf_config(spec.name[len("hf:") :]) if kind == "hf" else None
    from trainwise.models.moe.hf import export_target

    return export_target(shape, source, spec.aux_loss_coef)


def _renamed(rename: Callable[[str], str]) -> Split:
    return lambda name, tensor: [(rename(name), tensor)]


def _tensor_sizes(checkpoint: Path) -> dict[str, tuple[tuple[int, ...], Any]]:
    """{model entry: (shape, dtype)} from the checkpoint's metadata (no tensor read)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = FileSystemReader(str(checkpoint)).read_metadata()
    return {
        key[len(_MODEL) :]: (tuple(md.size), md.properties.dtype)
        for key, md in metadata.state_dict_metadata.items()
        if key.startswith(_MODEL) and isinstance(md, TensorStorageMetadata)
    }


def adapter_entries(checkpoint: Path) -> list[str]:
    """The checkpoint's LoRA adapter entries (metadata only: no tensor read)."""
    from trainwise.models.lora import is_adapter

    return [k for k in _tensor_sizes(checkpoint) if is_adapter(k)]


def plan_shards(sizes: dict[str, tuple[tuple[int, ...], Any]], shard_bytes: int) -> list[list[str]]:
    """Entries in order, cut into groups of at most shard_bytes (a larger tensor alone)."""
    import math

    groups: list[list[str]] = [[]]
    used = 0
    for name, (shape, dtype) in sizes.items():
        nbytes = math.prod(shape) * dtype.itemsize
        if groups[-1] and used + nbytes > shard_bytes:
            groups.append([])
            used = 0
        groups[-1].append(name)
        used += nbytes
    return groups


def _read(checkpoint: Path, names: list[str], sizes: dict) -> dict[str, Any]:
    """The named model entries of the checkpoint, whole, read by DCP in this process."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp

    state = {n: torch.empty(sizes[n][0], dtype=sizes[n][1]) for n in names}
    with warnings.catch_warnings():  # DCP warns that one process loads alone: intended
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.load(
            {"model": state}, storage_reader=dcp.FileSystemReader(str(checkpoint)), no_dist=True
        )
    return state


def export_hf(
    checkpoint: Path,
    out: Path,
    shard_bytes: int = 5 * 10**9,
    force: bool = False,
    state: dict[str, Any] | None = None,
    dtype: str | None = None,
) -> dict[str, Any]:
    """Write ``checkpoint``'s model as a Hugging Face directory ``out`` via ``out.partial``
    renamed at the end. An existing ``out`` is refused unless `force`; then it is replaced
    only once the new directory is complete. `state`: the model's entries to write instead
    of the checkpoint's (a LoRA run's merged weights); `dtype`: the floating-point tensors'
    (fp32, bf16, fp16; None: as trained), config.json's torch_dtype with them. Returns what
    was written."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    checkpoint, out = Path(checkpoint), Path(out)
    refuse_existing(out, force)
    if shard_bytes < 1:
        raise ConfigError(f"--shard-size {shard_bytes}: must be a positive number of bytes")
    spec = checkpoint_model_spec(checkpoint)
    if state is None:
        sizes = _tensor_sizes(checkpoint)
    else:
        sizes = {k: (tuple(v.shape), v.dtype) for k, v in state.items()}

    def read(names: list[str]) -> dict[str, Any]:
        """Those model entries: from `state`, or read from the checkpoint by DCP."""
        got = _read(checkpoint, names, sizes) if state is None else {n: state[n] for n in names}
        return cast_floats(got, dtype)

    shapes = {k: s for k, (s, _) in sizes.items()}
    moe = moe_target(spec, shapes)
    if moe is not None:
        config, split = moe
    else:
        config, rename = hf_target(spec, shapes)
        if config.get("tie_word_embeddings"):
            sizes = {k: v for k, v in sizes.items() if rename(k) != "lm_head.weight"}
        split = _renamed(rename)
    written = {k: (shape, written_dtype(d, dtype)) for k, (shape, d) in sizes.items()}
    groups = plan_shards(written, shard_bytes)
    try:
        with staged_dir(out) as partial:
            weight_map = _write_shards(read, partial, groups, split, save_file)
            dtypes = {str(d).removeprefix("torch.") for _, d in written.values() if d.is_floating_point}
            config["torch_dtype"] = config["dtype"] = (
                next(iter(dtypes)) if len(dtypes) == 1 else "float32"
            )
            text = json.dumps(config, indent=2, sort_keys=True) + "\n"
            (partial / "config.json").write_text(text)
            _copy_tokenizer(spec, partial)
    except (OSError, SafetensorError) as err:  # the checkpoint was read by DCP
        raise unwritable(out, err) from None
    return {"tensors": len(weight_map), "files": len(groups), "step": checkpoint_step(checkpoint)}


@contextlib.contextmanager
def staged_dir(out: Path) -> Iterator[Path]:
    """A fresh ``out.partial`` to fill, put at ``out`` (replace_dir) when the block ends, and
    removed when it fails: never half a directory at ``out``."""
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    try:
        partial.mkdir(parents=True)
        yield partial
        replace_dir(partial, out)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise


def replace_dir(partial: Path, out: Path) -> None:
    """Put the finished ``partial`` at ``out``; an existing ``out`` (--force) is renamed
    away first and deleted only after, so a crash between leaves one of them whole."""
    if not out.exists():
        os.replace(partial, out)
        return
    old = out.with_name(out.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    os.replace(out, old)
    os.replace(partial, out)
    shutil.rmtree(old, ignore_errors=True)


def _write_shards(read, folder, groups, split: Split, save_file) -> dict[str, str]:
    """Each group read and written in turn, each entry as its Hugging Face tensors; the
    index when there is more than one file."""
    import math

    weight_map: dict[str, str] = {}
    total = 0
    for i, names in enumerate(groups, 1):
        file = (
            "model.safetensors"
            if len(groups) == 1
            else f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        )
        state = read(names)
        tensors = {hf: t.contiguous() for n, t in state.items() for hf, t in split(n, t)}
        part = folder / (file + ".part")
        save_file(tensors, str(part), metadata={"format": "pt"})
        publish(part, folder / file)  # the mode of the folder's other files
        weight_map.update(dict.fromkeys(tensors, file))
        total += sum(math.prod(t.shape) * t.element_size() for t in tensors.values())
        del state, tensors
    if len(groups) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return weight_map


def _copy_tokenizer(spec: ModelSpec, folder: Path) -> None:
    """The source model directory's tokenizer files, when there are any, so the export is
    a complete model directory."""
    if model_kind(spec.name) != "hf":
        return
    source = model_dir(spec.name[len("hf:") :])
    for name in _TOKENIZER_FILES:
        with contextlib.suppress(OSError):
            if (source / name).is_file():
                shutil.copyfile(source / name, folder / name)


def parse_size(text: str) -> int:
    """'5GB', '500MB', '2GiB' or a number of bytes -> bytes."""
    units = {
        "KB": 10**3,
        "MB": 10**6,
        "GB": 10**9,
        "KIB": 2**10,
        "MIB": 2**20,
        "GIB": 2**30,
        "B": 1,
    }
    t = text.strip().upper()
    for unit, factor in units.items():
        if t.endswith(unit) and t[: -len(unit)].strip().replace(".", "", 1).isdigit():
            return int(float(t[: -len(unit)]) * factor)
    if t.isdigit():
        return int(t)
    raise ConfigError(f"--shard-size {text!r}: give bytes or a size such as 500MB or 5GB")
