"""The model as a list of parts, built by one pipeline in torchtitan's order:

    meta device -> converters -> split into parts -> parallelize each part on the mesh
    (TP, AC, compile, FSDP) -> materialize or load weights

One part, or this rank's pipeline stages (parallel.pp > 1: models.pipeline cuts them, as
torchtitan's `pipeline_llm`, the GPT's or your own module's, each keeping the whole
model's parameter names), each parallelized on the mesh's other dims. Everything after the build (the step, the states,
the optimizer, evaluation, clipping, the export) takes the list.
"""

from __future__ import annotations

from fnmatch import fnmatch

import torch
from torch import nn

from trainwise.config import JobConfig
from trainwise.config.schema import ParallelConfig
from trainwise.models import ModelBundle
from trainwise.models.converters import ModelConverter, adapt_tp_plan, place
from trainwise.models.gpt import GPT
from trainwise.models.gpt_parallel import gpt_tp_plan
from trainwise.models.pipeline import rank_stages, split_stage, stage_layers
from trainwise.run.engine.materialize import (
    build_unparallelized,
    convert_built,
    fill_storage,
    load_pretrained,
)
from trainwise.run.engine.mesh import JobMesh
from trainwise.run.engine.parallelize import parallelize
from trainwise.run.job.resolve import Job, sequence_parallel


def build_parts(
    cfg: JobConfig,
    job: Job,
    mesh: JobMesh,
    device: torch.device,
    dtype: str,
    converters: list[ModelConverter],
    a2a_timer: object = None,
) -> tuple[ModelBundle, list[nn.Module]]:
    """The job's model as parallelized parts on `mesh`. A model with per-parameter init
    (the GPT) is built on the meta device and materialised shard by shard after
    parallelizing; others are built whole on the device from the seeded RNG (the same
    weights on every rank), and converted there. A converter's own parameters (LoRA's
    adapters) are filled as the converter says, after any pretrained weights load.
    `a2a_timer`: where expert parallelism's all-to-alls leave their spans."""
    seed = cfg.train.seed
    bundle = build_unparallelized(job.model_spec, seed, device)
    place(converters, job.dims, device.type)
    init, added = convert_built(bundle, converters, seed)
    parts = split(bundle, cfg.parallel, mesh)
    # Under pp, FSDP keeps each stage's parameters gathered through the step, for every
    # schedule (ParallelDims' rule: the zero-bubble weight pass needs them in the graph).
    dims = job.dims
    # DDP keeps a whole replica per rank and checks it at wrapping: materialise first.
    whole = not dims.fsdp and dims.tp == 1
    if bundle.init_parameter is not None and whole:
        for part in parts:
            fill_storage(bundle, part, init, seed, device)
    sp = sequence_parallel(cfg)
    tensor_parallel = dims.tp > 1 and bundle.tp_plan is not None
    parts = [
        parallelize(
            part,
            stage_layers(part) if dims.pp > 1 else blocks_in(part, bundle.blocks),
            dims,
            device=device,
            precision=dtype,
            reduce_dtype=cfg.precision.reduce_dtype,
            ac=cfg.parallel.ac,
            compile=cfg.train.compile,
            tp_plan=(
                adapt_tp_plan(part, tp_plan(bundle, part, sp, dims.pp), converters)
                if tensor_parallel else None
            ),
            mesh=mesh,
            ep_plan=(
                bundle.ep_plan(part, a2a_timer)
                if dims.ep > 1 and bundle.ep_plan is not None else None
            ),
        )
        for part in parts
    ]
    if bundle.init_parameter is not None and not whole:
        # FSDP's CPU offload keeps the sharded parameters in host memory.
        home = torch.device("cpu") if dims.cpu_offload else device
        for part in parts:
            fill_storage(bundle, part, init, seed, home)
    if bundle.load_weights is not None:  # pretrained: each rank reads its own shards
        for part in parts:
            load_pretrained(bundle, part, init, added, seed)
    return bundle, parts


def split(bundle: ModelBundle, parallel: ParallelConfig, mesh: JobMesh) -> list[nn.Module]:
    """The model's parts on this rank: the whole model, or its pipeline stages (the job's
    checks refused a model that does not split)."""
    pp = mesh.dims.pp
    if pp == 1:
        return [bundle.module]
    schedule, virtual = parallel.pp_schedule, parallel.pp_virtual
    stages = pp * virtual
    ids = rank_stages(mesh.pp_rank, pp, virtual, schedule)
    return [split_stage(bundle.module, i, stages) for i in ids]


def tp_plan(bundle: ModelBundle, part: nn.Module, sp: bool, pp: int) -> list[dict[str, object]]:
    """The tensor-parallel plan of `part`: the model's, or a pipeline stage's own: the
    GPT's plan of the stage, or the entries of your model's plan that name a module the
    stage holds (torch would warn of each other one and skip it)."""
    if pp == 1:
        return bundle.tp_plan(sp)
    if isinstance(part, GPT):
        return gpt_tp_plan(part, sp)
    return held_plans(bundle.tp_plan(sp), part)


def held_plans(plans: list[dict[str, object]], part: nn.Module) -> list[dict[str, object]]:
    """`plans` less the entries whose module name (a pattern, as parallelize_module
    matches it) names no module of `part`."""
    names = [name for name, _ in part.named_modules()]
    return [
        {key: style for key, style in plan.items() if any(fnmatch(n, key) for n in names)}
        for plan in plans
    ]


def blocks_in(part: nn.Module, blocks: list[nn.Module]) -> list[nn.Module]:
    """The model's blocks (FSDP and AC units) that lie in `part`, in order."""
    inside = {id(m) for m in part.modules()}
    return [b for b in blocks if id(b) in inside]
