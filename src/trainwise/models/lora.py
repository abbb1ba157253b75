"""LoRA (Hu et al. 2021): the targeted Linears keep their weights frozen and learn a
low-rank update, y = base(x) + lora_B(lora_A(dropout(x))) * alpha / rank.

Our own layer rather than PEFT's: PEFT wraps each Linear in a new module (the base moves
to `<path>.base_layer.weight`), so the model's tensor-parallel plan, the Hugging Face
weight names and the checkpoint keys would no longer apply, and it initialises adapters
as it builds them, which a meta-device model cannot. `LoRALinear` is a SUBCLASS of
nn.Linear (as torchtitan's `components/lora.py`): the base keeps `<path>.weight` /
`<path>.bias`, the adapters are `<path>.lora_A` (in -> r) and `<path>.lora_B` (r -> out),
initialised as PEFT does (A kaiming-uniform with a = sqrt(5), B zero: step 0 is the base
model), so that PEFT's saved names are ours under `base_model.model.`.

The converter (registered in models.converters.CONVERTERS) swaps the Linears in place on
the meta device (or on the device, for a model built whole), freezes everything but the
adapters (and the embeddings / head when asked), keeps the frozen weights in the compute
dtype, fills the adapters' values (`init_parameter`, per parameter, as run.materialize
does for the model's own), and lays the adapters out under tensor parallelism like their
base (`adapt_tp_plan`).
"""

from __future__ import annotations

import copy
import functools
import math
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from trainwise.config.schema import LORA_DEFAULT_TARGETS, lora_target_matches
from trainwise.dtypes import TORCH_DTYPES

if TYPE_CHECKING:
    from trainwise.config import JobConfig
    from trainwise.config.schema import LoraConfig

DEFAULT_TARGETS = LORA_DEFAULT_TARGETS  # the config's default (config.schema)
ADAPTERS = ("lora_A", "lora_B")


class LoRALinear(nn.Linear):
    """An nn.Linear (frozen: weight, bias) plus a trainable low-rank update."""

    lora_A: nn.Linear
    lora_B: nn.Linear
    lora_dropout: nn.Module
    scaling: float

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, rank: int, alpha: float, dropout: float
    ) -> LoRALinear:
        """Turn `linear` into a LoRALinear in place (same object, same parameters). The
        adapters are float32 (they train: FSDP's mixed precision or autocast casts them);
        on a meta-device model their values come later (the engine's `init_parameter`),
        on a built one now, from the global RNG."""
        linear.__class__ = cls
        layer: LoRALinear = linear  # type: ignore[assignment]
        with torch.device("meta"):  # no default init wasted
            layer.lora_A = nn.Linear(linear.in_features, rank, bias=False, dtype=torch.float32)
            layer.lora_B = nn.Linear(rank, linear.out_features, bias=False, dtype=torch.float32)
        if not linear.weight.is_meta:
            for adapter in ADAPTERS:
                getattr(layer, adapter).to_empty(device=linear.weight.device)
                init_adapter(f"{adapter}.weight", getattr(layer, adapter).weight, None)
        layer.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        layer.scaling = alpha / rank
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        update = self.lora_B(self.lora_A(self.lora_dropout(x).to(self.lora_A.weight.dtype)))
        return super().forward(x) + (update * self.scaling).to(x.dtype)


def is_adapter(name: str) -> bool:
    """Whether a parameter name is a LoRA adapter's (`<path>.lora_A.weight`)."""
    return any(f".{a}." in f".{name}" for a in ADAPTERS)


@torch.no_grad()
def init_adapter(name: str, tensor: torch.Tensor, generator: torch.Generator | None) -> None:
    """PEFT's default: A kaiming-uniform (a = sqrt(5), nn.Linear's own init), B zero."""
    if name.endswith("lora_B.weight"):
        nn.init.zeros_(tensor)
    else:
        nn.init.kaiming_uniform_(tensor, a=math.sqrt(5), generator=generator)


def target_names(model: nn.Module, targets: list[str] | None) -> list[str]:
    """The names of the nn.Linear modules the patterns select (default: DEFAULT_TARGETS)."""
    patterns = targets if targets is not None else DEFAULT_TARGETS
    return [
        n for n, m in model.named_modules()
        if n and isinstance(m, nn.Linear) and not isinstance(m, LoRALinear) and
        not n.endswith(ADAPTERS) and lora_target_matches(n, patterns)
    ]


def target_problems(model: nn.Module, cfg: LoraConfig) -> list[str]:
    """Why [lora] cannot apply to `model` (any device, meta too), one line each."""
    if cfg.rank == 0:
        return []
    linears = [n for n, m in model.named_modules() if n and isinstance(m, nn.Linear)]
    if not linears:
        return [
            f"lora.rank = {cfg.rank}: the model has no named nn.Linear modules for adapters; "
            "use a model built from nn.Linear layers or lora.rank = 0"
        ]
    problems = []
    patterns = cfg.targets if cfg.targets is not None else DEFAULT_TARGETS
    if cfg.targets is None and not target_names(model, None):
        problems.append(
            f"lora.targets: none of the default patterns ({', '.join(DEFAULT_TARGETS)}) "
            f"matches the model's Linears (e.g. {linears[0]!r}); set lora.targets"
        )
    for p in patterns if cfg.targets is not None else ():
        if not target_names(model, [p]):
            problems.append(
                f"lora.targets: {p!r} matches no nn.Linear of the model (e.g. "
                f"{linears[0]!r}); fix the pattern (fnmatch, on the full name or its last part)"
            )
    for name in target_names(model, patterns):
        m = model.get_submodule(name)
        smaller = min(m.in_features, m.out_features)
        if cfg.rank > smaller:
            problems.append(
                f"lora.rank = {cfg.rank} exceeds {name!r}'s smaller dimension ({smaller}); "
                f"use a rank <= {smaller} or leave that layer out of lora.targets"
            )
            break
    return problems


def lora_layers(model: nn.Module) -> dict[str, LoRALinear]:
    """name -> LoRALinear of a converted model (wrapper name parts as the model has them)."""
    return {n: m for n, m in model.named_modules() if isinstance(m, LoRALinear)}


def parameter_counts(model: nn.Module) -> tuple[int, int]:
    """(trainable, total) parameters, each counted once (global sizes under DTensor)."""
    params = list(model.parameters())  # dedups tied weights
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)


def lora_line(parts: list[nn.Module]) -> str:
    """What a LoRA run trains, for its log: adapters, trainable and total parameters."""
    layers = sum(len(lora_layers(part)) for part in parts)
    counts = [parameter_counts(part) for part in parts]
    trainable, total = sum(c[0] for c in counts), sum(c[1] for c in counts)
    return (
        f"LoRA on {layers} Linear(s): {trainable:,} trainable of {total:,} parameters "
        f"({100 * trainable / max(total, 1):.2f} %)"
    )


def merge_lora(state: dict[str, torch.Tensor], lora: LoraConfig) -> dict[str, torch.Tensor]:
    """A full state dict with the adapters folded into their bases, W + B @ A * alpha / r
    (in float32, back to W's dtype), and the adapter entries dropped."""
    scaling = lora.alpha / lora.rank
    out = {k: v for k, v in state.items() if not is_adapter(k)}
    for key in state:
        if key.endswith("lora_A.weight"):
            path = key[: -len(".lora_A.weight")]
            a, b = state[key].float(), state[f"{path}.lora_B.weight"].float()
            base = out[f"{path}.weight"]
            out[f"{path}.weight"] = (base.float() + (b @ a) * scaling).to(base.dtype)
    return out


class LoRAConverter:
    """The `lora` model converter (models.converters)."""

    name = "lora"

    def __init__(self, cfg: LoraConfig, dtype: str):
        self.cfg, self.dtype = cfg, TORCH_DTYPES[dtype]

    def convert(self, model: nn.Module) -> None:
        """Swap the targeted Linears, then freeze all but the adapters (and embeddings /
        head when asked); the frozen weights go to the compute dtype (no gradient, no
        optimizer state: nothing needs them in float32)."""
        cfg = self.cfg
        for name in target_names(model, cfg.targets):
            LoRALinear.from_linear(model.get_submodule(name), cfg.rank, cfg.alpha, cfg.dropout)
        for name, param in model.named_parameters():
            param.requires_grad_(is_adapter(name))
        for module in _kept_trainable(model, cfg.train_embeddings, cfg.train_head):
            module.weight.requires_grad_(True)
        for param in model.parameters():
            if not param.requires_grad and param.is_floating_point():
                param.data = param.data.to(self.dtype)  # keeps the object: ties hold

    def owns(self, name: str) -> bool:
        return is_adapter(name)

    def init_parameter(self, name: str, tensor: torch.Tensor, generator: torch.Generator) -> None:
        init_adapter(name, tensor, generator)

    def adapt_tp_plan(self, model: nn.Module, plans: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return adapt_tp_plan(model, plans)


def _kept_trainable(model: nn.Module, embeddings: bool, head: bool) -> list[nn.Module]:
    """The token embedding (the first nn.Embedding) and the output head (`lm_head`, or
    `head` as the mlp classifier names it; the embedding when the head is tied to it and
    has no module of its own), as asked."""
    embedding = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    heads = [m for n, m in model.named_modules() if n.rsplit(".", 1)[-1] in ("lm_head", "head")]
    kept = [embedding] if embeddings and embedding is not None else []
    if head:
        kept += heads or ([embedding] if embedding is not None else [])
    return kept


@functools.cache
def _lora_styles() -> dict[type, type]:
    """torch's Colwise / Rowwise styles -> their LoRALinear versions, made on first use:
    DTensor's imports cost a launcher, which builds LoRA models without splitting them, a
    second of CPU."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    class LoRAColwise(ColwiseParallel):
        """Colwise for a LoRALinear: base and lora_B split by output rows, lora_A replicated
        (each rank computes the whole r-dim projection, then its slice of the update)."""

        def _partition_linear_fn(self, name: str, module: nn.Module, device_mesh: Any) -> None:
            if isinstance(module, LoRALinear):
                src = self.src_data_rank
                _distribute(module, device_mesh, {"weight": Shard(0), "bias": Shard(0)}, src)
                _distribute(module.lora_A, device_mesh, {"weight": Replicate()}, src)
                _distribute(module.lora_B, device_mesh, {"weight": Shard(0)}, src)

    class LoRARowwise(RowwiseParallel):
        """Rowwise for a LoRALinear: base and lora_A split by input columns (their outputs
        are partial sums), lora_B replicated; the update's partial sum is reduced with the
        base's by the style's output redistribution."""

        def _partition_linear_fn(self, name: str, module: nn.Module, device_mesh: Any) -> None:
            if isinstance(module, LoRALinear):
                src = self.src_data_rank
                _distribute(module, device_mesh, {"weight": Shard(1), "bias": Replicate()}, src)
                _distribute(module.lora_A, device_mesh, {"weight": Shard(1)}, src)
                _distribute(module.lora_B, device_mesh, {"weight": Replicate()}, src)

    return {ColwiseParallel: LoRAColwise, RowwiseParallel: LoRARowwise}


def _distribute(
    module: nn.Module, mesh: Any, placements: dict[str, Any], src_data_rank: int | None
) -> None:
    """`module`'s parameters as DTensors placed as given (as the styles' own do: the
    source rank's values, or each rank's own with None), frozen or not as they were."""
    from torch.distributed.tensor import distribute_tensor

    for pname, placement in placements.items():
        param = getattr(module, pname, None)
        if param is None:
            continue
        tensor = distribute_tensor(param, mesh, [placement], src_data_rank=src_data_rank)
        module.register_parameter(pname, nn.Parameter(tensor, requires_grad=param.requires_grad))


def adapt_tp_plan(model: nn.Module, plans: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The model's TP plans with each LoRALinear's Colwise/Rowwise style swapped for one
    that also lays out its adapters (same input/output layouts)."""
    layers = lora_layers(model)
    out = []
    for plan in plans:
        new = {}
        for name, style in plan.items():
            if name in layers and type(style) in _lora_styles():
                style = copy.copy(style)
                style.__class__ = _lora_styles()[type(style)]
            new[name] = style
        out.append(new)
    return out


def lora_converter(config: JobConfig) -> LoRAConverter | None:
    """The factory in models.converters.CONVERTERS: None when lora.rank = 0."""
    if config.lora.rank == 0:
        return None
    return LoRAConverter(config.lora, config.precision.dtype)

