"""The float8 model converter: torchao's `convert_to_float8_training` on the Linears that
models.float8.rule selects, with torchao's recipe (tensorwise: one scale per tensor,
cuBLAS's kernel; rowwise: one per row, scales rounded down to powers of two), as
torchtitan's Float8LinearConverter applies it.

Float8Linear is a subclass of nn.Linear with the same `weight` and `bias`: the weights
stay in high precision (fp32 masters, FSDP's bf16 copies), so checkpoints, exports and
the model's tensor-parallel plan are unchanged; only the three GEMMs of each converted
Linear (output, input gradient, weight gradient) cast their operands to float8 with
dynamic scales. On a CPU torchao emulates them (the casts and scales as on a GPU, the
matmul in fp32: `Float8LinearConfig(emulate=True)`), so every path runs in the tests;
on CUDA the real kernels (torch._scaled_mm: compute capability 8.9 or newer).

Under FSDP with the tensorwise recipe the weights are all-gathered in float8
(`enable_fsdp_float8_all_gather`): each shard is cast with the weight's global scale,
which `precompute_float8_dynamic_scale_for_fsdp` computes for all of them in one
all-reduce after each optimizer step (this converter's post-optimizer hook).
"""

from __future__ import annotations

import dataclasses
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from trainwise.models.float8.rule import FLOAT8_MULTIPLE, HEAD_NAMES, eligible

if TYPE_CHECKING:
    from trainwise.config import JobConfig
    from trainwise.config.parallel_dims import ParallelDims
    from trainwise.models.registry import ModelSpec


def torchao_float8() -> ModuleType:
    """torchao.float8, imported on first use (only a float8 job pays for it); what torchao
    says at import that a user cannot act on is filtered by trainwise.third_party."""
    import torchao.float8
    import torchao.float8.float8_linear  # noqa: F401 (Float8Linear)
    import torchao.float8.float8_tensor_parallel  # noqa: F401 (the TP styles)

    return torchao.float8


def torchao_config(recipe: str, all_gather: bool, emulate: bool) -> Any:
    """torchao's Float8LinearConfig of the recipe, emulated or not, with FSDP's float8
    all-gather (tensorwise only)."""
    config = torchao_float8().Float8LinearConfig.from_recipe_name(recipe)
    return dataclasses.replace(
        config, emulate=emulate, enable_fsdp_float8_all_gather=all_gather
    )


def converted_names(model: nn.Module) -> list[str]:
    """The Linears of `model` the converter turns to float8 (any device, meta too)."""
    return [
        name for name, m in model.named_modules()
        if name and isinstance(m, nn.Linear) and eligible(name, m.in_features, m.out_features)
    ]


class Float8Converter:
    """The `float8` model converter (models.converters): swaps the eligible Linears for
    torchao's Float8Linear. `place` (before `convert`) says the layout and the device:
    FSDP's float8 all-gather needs FSDP over more than one rank, and a CPU emulates."""

    name = "float8"

    def __init__(self, recipe: str, all_gather: bool):
        self.recipe, self.all_gather = recipe, all_gather
        self.sharded = False  # FSDP over more than one rank (place)
        self.emulate = not torch.cuda.is_available()

    def place(self, dims: ParallelDims, device_type: str) -> None:
        self.sharded = dims.fsdp and dims.dp_shard > 1
        self.emulate = device_type != "cuda"

    @property
    def gathers_float8(self) -> bool:
        """Whether FSDP all-gathers the converted weights in float8."""
        return self.recipe == "tensorwise" and self.all_gather and self.sharded

    def convert(self, model: nn.Module) -> None:
        float8 = torchao_float8()
        config = torchao_config(self.recipe, self.gathers_float8, self.emulate)
        float8.convert_to_float8_training(
            model, config=config,
            module_filter_fn=lambda m, fqn: eligible(fqn, m.in_features, m.out_features),
        )
        if self.emulate:  # a CPU, whose gloo has no float8 type
            from trainwise.models.float8.parallel import gather_float8_as_bytes

            gather_float8_as_bytes()

    def post_optimizer_hook(self, parts: list[nn.Module]) -> None:
        """The float8 scales of the updated weights, for the next step's all-gathers: one
        all-reduce of every weight's amax a part (torchtitan's precompute)."""
        if not self.gathers_float8:
            return
        precompute = torchao_float8().precompute_float8_dynamic_scale_for_fsdp
        for part in parts:
            precompute(part)

    def weights_set(self, parts: list[nn.Module]) -> None:
        """The scales of weights just built or loaded. Without them the first all-gather
        would reduce each weight's amax over its FSDP group only: under tensor parallelism
        too, a scale per tensor-parallel shard, not the weight's (one process's)."""
        self.post_optimizer_hook(parts)

    def adapt_tp_plan(self, model: nn.Module, plans: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Tensorwise: torchao's float8 styles for the converted Linears (and their
        inputs gathered in float8); rowwise keeps torch's styles, gathering in high
        precision, as torchtitan does."""
        if self.recipe != "tensorwise":
            return plans
        from trainwise.models.float8.parallel import float8_tp_plans

        return float8_tp_plans(model, plans)


def float8_converter(config: JobConfig) -> Float8Converter | None:
    """The factory in models.converters.CONVERTERS: None when precision.float8 = 'none'."""
    p = config.precision
    if p.float8 == "none":
        return None
    return Float8Converter(p.float8, p.float8_all_gather)


def float8_model_problems(cfg: JobConfig, spec: ModelSpec) -> list[str]:
    """Why precision.float8 cannot apply to the job's model, one line each (built on the
    meta device: nothing is allocated). The device is judged with the machine
    (run.job.resolve); the config alone by the schema (fp16, rowwise's all-gather)."""
    recipe = cfg.precision.float8
    if recipe == "none":
        return []
    what = f"precision.float8 = '{recipe}'"
    problems = []
    if cfg.lora.rank > 0:
        problems.append(
            f"{what} with lora.rank = {cfg.lora.rank}: float8 is not composed with LoRA's "
            "adapters (torchao's swap would replace each adapted Linear, adapters and all); "
            "set precision.float8 = 'none' or lora.rank = 0"
        )
    from trainwise.models.registry import build_model

    with torch.device("meta"):
        bundle = build_model(spec)
    if bundle.moe is not None:
        return [*problems, (
            f"{what} with a Mixture-of-Experts model ({spec.name}): its experts' grouped "
            "GEMMs have no float8 path here yet; set precision.float8 = 'none'"
        )]
    if not converted_names(bundle.module):
        problems.append(
            f"{what}: no Linear of model {spec.name!r} can run in float8 (both dimensions "
            f"must be multiples of {FLOAT8_MULTIPLE}; the output head, {'/'.join(HEAD_NAMES)}, "
            "stays in high precision); set precision.float8 = 'none'"
        )
    return problems
