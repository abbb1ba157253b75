"""The model registry: turns a `ModelSpec` (what the config says) into a `ModelBundle` (what
the runtime trains)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from trainwise.errors import ModelError
from trainwise.models.blocks import find_blocks
from trainwise.models.custom import build_custom
from trainwise.models.gpt import GPT
from trainwise.models.hf import build_from_dir, hf_shape, hf_takes_example_ids
from trainwise.models.mlp import MLPClassifier
from trainwise.models.moe.shapes import MOE_PRESETS, MoEShape, moe_job_shape, moe_tp_problems
from trainwise.models.shapes import PRESETS, GPTShape, job_shape, norm_impl_problem, tp_problems
from trainwise.objects import load_callable


@dataclass
class ModelSpec:
    """What the config says about the model."""

    name: str  # a preset name | "mlp" | "pkg.mod:factory" | "hf:<config.json or folder>"
    vocab_size: int | None = None  # LMs: overrides the preset's vocab (the data decides it)
    seq_len: int | None = None  # GPT presets: overrides max_seq_len
    in_features: int | None = None  # mlp
    num_classes: int | None = None  # mlp
    hidden: tuple[int, ...] = (128, 128)  # mlp
    dropout: float = 0.0
    kwargs: dict[str, Any] = field(default_factory=dict)  # passed to a custom factory
    init: str = "auto"  # hf: "auto" | "pretrained" | "random" (model.init)
    impl: str = "transformers"  # hf: "transformers" | "trainwise" (model.impl)
    loss: str | None = None  # model.loss: "pkg.mod:fn", in place of the model's own loss
    norm_impl: str = "fused"  # model.norm_impl: trainwise's GPT's RMSNorm kernels
    # Mixture-of-Experts models ([moe]): the balancing loss's weight, token dropping.
    aux_loss_coef: float = 0.001
    capacity_factor: float | None = None


@dataclass
class ModelBundle:
    """What the runtime gets."""

    module: nn.Module
    loss_fn: Callable[[Tensor, Tensor], Tensor]  # (output, target) -> mean loss
    blocks: list[nn.Module]  # units for FSDP / activation checkpointing; may be empty
    shape: GPTShape | None  # set for GPT presets (FLOPs and memory formulas)
    # Fills the model once wrapped or sharded (every rank calls it); None: keep the init.
    load_weights: Callable[[nn.Module], dict[str, int]] | None = None
    # Tensor parallelism: tp_plan(sequence_parallel) -> plans for parallelize_module, applied
    # in order; None: the model cannot be split (parallel.tp must be 1).
    tp_plan: Callable[[bool], list[dict[str, Any]]] | None = None
    # Fills one parameter at full size from a generator: the model can be built on the meta
    # device and initialised shard by shard (None: built whole on the device, as seeded).
    init_parameter: Callable[[str, Tensor, torch.Generator], None] | None = None
    moe: MoEShape | None = None  # set for Mixture-of-Experts models (models.moe)
    # Expert parallelism: ep_plan(part, timer) -> plan for parallelize_module on the ep mesh
    # (`timer`: where the all-to-alls' spans go); None: no experts to split (ep must be 1).
    ep_plan: Callable[[nn.Module, Any], dict[str, Any]] | None = None


def _gpt_tp_plan(gpt: GPT, sequence_parallel: bool) -> list[dict[str, Any]]:
    """models.gpt_parallel's plan of `gpt`, imported when a worker parallelises it: the
    launcher resolves the job without DTensor's imports (a second of CPU a launch)."""
    from trainwise.models.gpt_parallel import gpt_tp_plan

    return gpt_tp_plan(gpt, sequence_parallel)


def cross_entropy_loss(output: Tensor, target: Tensor) -> Tensor:
    """Mean cross entropy over the last dim of `output`; leading dims are flattened, so it
    fits LM logits [B, T, V] with targets [B, T] and classifier logits [B, C] with [B]."""
    if output.shape[:-1] != target.shape:
        raise ModelError(
            f"loss: output shape {list(output.shape)} does not match target "
            f"shape {list(target.shape)}; cross entropy wants logits [..., C] and "
            "targets [...]; give a custom model its own loss_fn"
        )
    return F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))


def preset_names() -> list[str]:
    return [*PRESETS, *MOE_PRESETS]


def model_kind(name: str) -> Literal["preset", "moe", "mlp", "custom", "hf"]:
    if name in PRESETS:
        return "preset"
    if name in MOE_PRESETS:
        return "moe"
    if name == "mlp":
        return "mlp"
    if name.startswith("hf:"):
        return "hf"
    if ":" in name:
        return "custom"
    raise ModelError(
        f"model.name = {name!r}: not a preset ({', '.join(preset_names())}), 'mlp', "
        "'package.module:factory' or 'hf:path/to/config.json'"
    )


def resolve_shape(spec: ModelSpec) -> GPTShape | None:
    """The preset's shape with vocab_size / seq_len overrides applied, or the GPT shape of
    an hf: Llama directory built by trainwise; None for other kinds."""
    kind = model_kind(spec.name)
    if kind == "hf" and spec.impl == "trainwise":
        from trainwise.models.moe.hf import is_moe_dir

        path = spec.name[len("hf:") :]
        if is_moe_dir(path):  # a MoE directory: resolve_moe_shape's
            return None
        return hf_shape(path, spec.vocab_size, spec.seq_len, spec.init)
    if kind != "preset":
        return None
    return job_shape(spec.name, spec.vocab_size, spec.seq_len)


def resolve_moe_shape(spec: ModelSpec) -> MoEShape | None:
    """The Mixture-of-Experts shape of the model (a MoE preset with the job's vocabulary,
    or an hf: MoE directory built by trainwise); None for a model without experts."""
    kind = model_kind(spec.name)
    if kind == "moe":
        return moe_job_shape(spec.name, spec.vocab_size, spec.seq_len)
    if kind == "hf" and spec.impl == "trainwise":
        from trainwise.models.moe.hf import hf_moe_shape

        return hf_moe_shape(spec.name[len("hf:") :], spec.vocab_size, spec.seq_len, spec.init)
    return None


def load_loss(path: str) -> Callable[[Tensor, Tensor], Tensor]:
    """model.loss = "pkg.mod:fn": fn(output, target) -> a scalar tensor."""
    return load_callable(
        path, "model.loss", ModelError, "a function (output, target) -> scalar loss tensor"
    )


def _gpt_family(spec: ModelSpec) -> bool:
    """Whether the model is trainwise's dense GPT (a preset, or an hf: directory built by
    trainwise), whose norms model.norm_impl chooses."""
    kind = model_kind(spec.name)
    gpt = kind == "preset" or (kind == "hf" and spec.impl == "trainwise")
    return gpt and resolve_moe_shape(spec) is None


def _own_norms(spec: ModelSpec) -> str:
    return (f"model.norm_impl = {spec.norm_impl!r} applies to trainwise's GPT (a preset, or "
            f"hf: with model.impl = 'trainwise'); model {spec.name!r} runs its own norms: "
            "use model.norm_impl = 'fused'")


def norm_impl_problems(spec: ModelSpec) -> list[str]:
    """Why model.norm_impl cannot apply to the model, one line each, from its name and
    shape (nothing built): the launcher's check of what building it would refuse."""
    if spec.norm_impl == "fused":
        return []
    if not _gpt_family(spec):
        return [_own_norms(spec)]
    shape = resolve_shape(spec)
    problem = norm_impl_problem(shape, spec.norm_impl) if shape is not None else None
    return [problem] if problem else []


def build_model(spec: ModelSpec) -> ModelBundle:
    """Build on the current default device; the caller seeds the RNG. The loss is
    model.loss where set, else the factory's, else cross entropy."""
    bundle = _build_model(spec)
    if spec.loss is not None:
        bundle.loss_fn = load_loss(spec.loss)
    return bundle


def _build_model(spec: ModelSpec) -> ModelBundle:
    kind = model_kind(spec.name)
    if not 0.0 <= spec.dropout < 1.0:
        raise ModelError(f"model.dropout = {spec.dropout!r}: must be in [0, 1)")
    if spec.norm_impl != "fused" and not _gpt_family(spec):
        raise ModelError(_own_norms(spec))
    if kind == "preset":
        shape = resolve_shape(spec)
        gpt = GPT(shape, dropout=spec.dropout, norm_impl=spec.norm_impl)
        return ModelBundle(
            gpt, cross_entropy_loss, list(gpt.blocks), shape,
            tp_plan=partial(_gpt_tp_plan, gpt), init_parameter=gpt.init_parameter,
        )
    if kind == "moe":
        from trainwise.models.moe.build import moe_bundle

        return moe_bundle(resolve_moe_shape(spec), spec)
    if kind == "mlp":
        missing = [
            f"model.{k} is required for model.name = 'mlp'; set it (the data usually decides it)"
            for k in ("in_features", "num_classes")
            if getattr(spec, k) is None
        ]
        if missing:
            raise ModelError(missing)
        mlp = MLPClassifier(spec.in_features, spec.num_classes, spec.hidden, spec.dropout)
        return ModelBundle(mlp, cross_entropy_loss, list(mlp.blocks), None)
    if kind == "hf" and (moe := resolve_moe_shape(spec)) is not None:
        from trainwise.models.moe.hf import build_moe_dir

        return build_moe_dir(spec, moe)
    if kind == "hf":
        hf = build_from_dir(
            spec.name[len("hf:") :], spec.vocab_size, spec.seq_len, spec.dropout, spec.init,
            spec.impl, spec.norm_impl,
        )
        bundle = ModelBundle(hf.module, cross_entropy_loss, hf.blocks, hf.shape, hf.load_weights)
        if isinstance(hf.module, GPT):  # model.impl = 'trainwise': the GPT's own hooks
            bundle.tp_plan = partial(_gpt_tp_plan, hf.module)
            bundle.init_parameter = hf.module.init_parameter
        return bundle
    module, loss_fn = build_custom(spec.name, spec.kwargs)
    return ModelBundle(
        module, loss_fn or cross_entropy_loss, list(find_blocks(module).modules), None,
        tp_plan=getattr(module, "tp_plan", None),
        init_parameter=getattr(module, "init_parameter", None),
    )


def takes_example_ids(spec: ModelSpec) -> bool:
    """Whether the model's forward takes `doc` (the example of each token, from packed SFT
    data) and keeps examples apart: the built-in GPT's does, and a transformers model's
    when its attention takes a custom 4-D mask."""
    kind = model_kind(spec.name)
    if kind != "hf":
        return kind in ("preset", "moe")
    return spec.impl == "trainwise" or hf_takes_example_ids(spec.name[len("hf:") :])


def count_parameters(spec: ModelSpec) -> int:
    """Parameter count without allocating: presets analytically, others built on meta."""
    shape = resolve_shape(spec)
    if shape is not None and model_kind(spec.name) == "preset":
        return shape.num_params()
    if model_kind(spec.name) == "moe":
        return resolve_moe_shape(spec).num_params()
    with torch.device("meta"):
        module = build_model(spec).module
    return sum(p.numel() for p in module.parameters())  # parameters() dedups tied weights


def tp_model_problems(spec: ModelSpec, tp: int, seq_len: int, sequence_parallel: bool) -> list[str]:
    """Why the model cannot run with tensor-parallel degree `tp`, one line each (built on
    meta: nothing is allocated)."""
    if tp == 1:
        return []
    kind = model_kind(spec.name)
    if kind == "preset":  # the shape says it all; a model built on meta imports dynamo
        return tp_problems(resolve_shape(spec), tp, seq_len, sequence_parallel)
    if kind == "moe":
        return moe_tp_problems(resolve_moe_shape(spec), tp, seq_len, sequence_parallel)
    with torch.device("meta"):
        bundle = build_model(spec)
    if bundle.tp_plan is None:
        return [
            f"parallel.tp = {tp} but model.name = {spec.name!r} has no tensor-parallel plan: "
            "give the model a `tp_plan(sequence_parallel)` method (docs/parallelism.md) or "
            "use parallel.tp = 1"
        ]
    if bundle.moe is not None:
        return moe_tp_problems(bundle.moe, tp, seq_len, sequence_parallel)
    shape = bundle.shape
    return tp_problems(shape, tp, seq_len, sequence_parallel) if shape is not None else []


def lora_model_problems(spec: ModelSpec, lora: Any) -> list[str]:
    """Why [lora] (a LoraConfig) cannot apply to the model, one line each (built on meta:
    nothing is allocated)."""
    if lora.rank == 0:
        return []
    from trainwise.models.lora import target_problems

    with torch.device("meta"):
        module = build_model(spec).module
    return target_problems(module, lora)


def base_weights_id(spec: ModelSpec, seed: int) -> str:
    """What the model's weights come from before training: the id of a pretrained
    directory's safetensors (hf_weights.weights_digest: free in the hub cache, else one
    read of every file), else the seed that draws them (a LoRA run's frozen base is
    rebuilt from it on resume, not saved)."""
    from trainwise.models.hf import model_dir, wants_pretrained
    from trainwise.models.hf_weights import weights_digest

    if model_kind(spec.name) == "hf":
        path = spec.name[len("hf:") :]
        if wants_pretrained(path, spec.init):
            return weights_digest(model_dir(path))
    return f"random, train.seed = {seed}"
