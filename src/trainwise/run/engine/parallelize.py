"""Layout wrapping: a few `apply_*` functions, and `parallelize()` that picks among them
from the job's ParallelDims, over the job's mesh (run/engine/mesh.py).

Everything here composes PyTorch's own pieces: DTensor's tensor parallelism
(`parallelize_module` with the model's own plan), expert parallelism (the same with the
model's ExpertParallel styles, on the experts' view of the mesh), activation
checkpointing's wrapper, torch.compile, DistributedDataParallel and FSDP2's
`fully_shard`, all on one N-D DeviceMesh (dp_replicate x dp_shard x tp, and
edp_replicate x efsdp x ep over the same ranks).
"""

from __future__ import annotations

import contextlib
from functools import partial

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import parallelize_module
from torch.nn.parallel import DistributedDataParallel

from trainwise.config.parallel_dims import ParallelDims
from trainwise.dtypes import TORCH_DTYPES
from trainwise.errors import ConfigError
from trainwise.models.checkpointing import checkpoint_blocks
from trainwise.run.engine.mesh import JobMesh, job_mesh


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, plans: list[dict[str, object]]) -> None:
    """Tensor parallelism: each of the model's plans (module name -> ParallelStyle) in
    turn, on the 1-D tp mesh; the parameters become DTensors sharded (or replicated) over
    it. Must come before AC, compile and FSDP, which wrap the modules it splits. Frozen
    parameters stay frozen (LoRA's base): some styles make new trainable Parameters
    (SequenceParallel's replicated norm weights)."""
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    for plan in plans:
        parallelize_module(model, tp_mesh, plan)
    for name, param in model.named_parameters():
        if name in frozen:
            param.requires_grad_(False)


def apply_ep(model: nn.Module, ep_mesh: DeviceMesh, plan: dict[str, object]) -> list[nn.Module]:
    """Expert parallelism: the model's plan (its routed experts modules -> ExpertParallel)
    on the 1-D ep mesh; each experts module's [E, ...] weights become DTensors sharded on
    dim 0 over it. After TP, before AC, compile and FSDP (torchtitan's order). Returns the
    modules split, which FSDP wraps on their own mesh."""
    parallelize_module(model, ep_mesh, plan)
    return [model.get_submodule(name) for name in plan]


def apply_ac(model: nn.Module, blocks: list[nn.Module], mode: str) -> list[nn.Module]:
    """Wrap blocks in activation checkpointing (models.checkpointing): `full` every block,
    `selective` every other one (layer-wise), `selective-op` every block under torchtitan's
    per-operation policy. Returns the new block list."""
    if mode == "none" or not blocks:
        return blocks
    return checkpoint_blocks(model, blocks, mode)


def apply_compile(blocks: list[nn.Module]) -> None:
    """Compile each block in place: repeated blocks share one compiled graph."""
    for block in blocks:
        block.compile()


def apply_ddp(
    model: nn.Module, device: torch.device, group: dist.ProcessGroup | None = None
) -> nn.Module:
    """DDP with the gradients as views of its all-reduce buckets (Accelerate's and
    Lightning's `gradient_as_bucket_view`): no copy of every gradient into its bucket and
    back each step, and no second copy of them held (plan.model.memory counts it so).
    Its broadcast of the buffers before every forward only where one is persistent (at
    wrapping it syncs them all)."""
    ids = [device.index] if device.type == "cuda" else None
    return DistributedDataParallel(
        model, device_ids=ids, process_group=group, gradient_as_bucket_view=True,
        forward_sync_buffers=has_persistent_buffers(model),
    )


def has_persistent_buffers(model: nn.Module) -> bool:
    """Whether `model` has a buffer its state dict saves (BatchNorm's running statistics,
    a MoE router's bias): state that training changes, which DDP keeps equal on every
    rank by broadcasting rank 0's before each forward. Buffers left out of the state dict
    (a rotary table) are computed from the configuration, alike on every rank: that
    broadcast would be a collective a step for nothing. Asked of each module, not by name:
    a wrapper (checkpointing's, compile's) renames a buffer in its state dict."""
    return any(
        buffer is not None and name not in module._non_persistent_buffers_set
        for module in model.modules() for name, buffer in module._buffers.items()
    )


def apply_fsdp(
    model: nn.Module,
    blocks: list[nn.Module],
    mesh: DeviceMesh,
    regathered: int,
    param_dtype: str,
    reduce_dtype: str,
    cpu_offload: bool,
    experts: list[nn.Module] | None = None,
    expert_mesh: DeviceMesh | None = None,
    dp_size: int = 1,
) -> nn.Module:
    """FSDP2: one `fully_shard` per block (its own all-gather / reduce-scatter unit, so
    communication overlaps the neighbouring block's compute), then one on the root for the
    rest (embeddings, final norm, head). Expert-parallel modules (`experts`) first, each
    a unit of its own over `expert_mesh` (the experts' data parallelism beside ep). The
    first `regathered` blocks, and the experts within them, free their gathered
    parameters after forward (ParallelDims.regathered_blocks); the rest keep them until
    their backward."""
    mp = MixedPrecisionPolicy(
        param_dtype=TORCH_DTYPES[param_dtype], reduce_dtype=TORCH_DTYPES[reduce_dtype]
    )
    kwargs = {"mesh": mesh, "mp_policy": mp}
    if cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    resharded = {id(m) for block in blocks[:regathered] for m in block.modules()}
    for module in experts or []:
        # Their own unit on their own mesh; their gradients are summed over it (the tokens
        # of the ep group reached them by all-to-all already) and divided by every
        # data-parallel rank, as the dense parameters' are averaged (torchtitan's way).
        fully_shard(module, reshard_after_forward=id(module) in resharded,
                    **{**kwargs, "mesh": expert_mesh},
                    shard_placement_fn=partial(_expert_placement, shards=expert_mesh.size(-1)))
        module.set_gradient_divide_factor(float(dp_size))
        if expert_mesh.device_type == "cpu" and expert_mesh.size(-1) > 1:
            # gloo has no PREMUL_SUM: a plain sum, then the division. (Not without a
            # reduce-scatter: torch 2.13 would then divide twice.)
            module.set_force_sum_reduction_for_comms(True)
    for i, block in enumerate(blocks):
        fully_shard(block, reshard_after_forward=i < regathered, **kwargs)
    # The root's parameters are needed again first in backward: keep them gathered.
    fully_shard(model, reshard_after_forward=False, **kwargs)
    return model


def parallelize(
    model: nn.Module,
    blocks: list[nn.Module],
    dims: ParallelDims,
    *,
    device: torch.device,
    precision: str = "fp32",
    reduce_dtype: str = "fp32",
    ac: str = "none",
    compile: bool = False,
    group: dist.ProcessGroup | None = None,
    tp_plan: list[dict[str, object]] | None = None,
    mesh: JobMesh | None = None,
    ep_plan: dict[str, object] | None = None,
) -> nn.Module:
    """The one place a layout is applied to a model (or one part of it), in torchtitan's
    order: tensor parallelism (the model's `tp_plan`), expert parallelism (`ep_plan`),
    AC, compile, then the data-parallel wrapper (FSDP must see the final modules), over
    `mesh`: the job's, built once (mesh.job_mesh); built here from `dims` and `group`
    when not given. `group`: data parallelism over that group's ranks instead of all (not
    for hsdp, tp or ep)."""
    mesh = mesh or job_mesh(dims, device.type, group)
    if dims.tp > 1:
        if tp_plan is None:
            raise ConfigError(f"parallel.tp = {dims.tp} needs a model with a tensor-parallel plan")
        apply_tp(model, mesh.tp_mesh(), tp_plan)
    experts = []
    if dims.ep > 1:
        if ep_plan is None:
            raise ConfigError(f"parallel.ep = {dims.ep} needs a model with routed experts")
        experts = apply_ep(model, mesh.ep_mesh(), ep_plan)
    blocks = apply_ac(model, blocks, ac)
    if compile:
        apply_compile(blocks)
    if dims.single or (not dims.fsdp and dims.dp_size == 1):
        return model
    if not dims.fsdp:
        if dims.tp > 1:
            raise ConfigError("DDP cannot replicate tensor-parallel shards: use FSDP or HSDP")
        return apply_ddp(model, device, mesh.dp_group())
    return apply_fsdp(
        model,
        blocks,
        mesh.dp_mesh(),
        regathered=dims.regathered_blocks(len(blocks)),
        param_dtype=precision,
        reduce_dtype=reduce_dtype,
        cpu_offload=dims.cpu_offload,
        experts=experts,
        expert_mesh=mesh.experts and mesh.expert_dp_mesh(),
        dp_size=dims.dp_size,
    )


def _expert_placement(param: nn.Parameter, shards: int) -> Shard:
    """FSDP's dim for an expert weight over `shards` ranks: the experts' (0), unless the
    rank's experts do not split evenly among them (then the rows, dim 1, where they do),
    as torchtitan does."""
    local = param.to_local().shape[0] if isinstance(param, DTensor) else param.shape[0]
    if local % shards and param.shape[1] % shards == 0:
        return Shard(1)
    return Shard(0)


def reshard_all(model: nn.Module) -> None:
    """Free every FSDP unit's gathered parameters: after a forward without backward (an
    evaluation), the units kept gathered after forward (the root, the last block) would
    hold them until the next training step's backward."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def set_gradient_sync(model: nn.Module, enabled: bool) -> object:
    """Context for one micro-batch: gradients are synchronised only on the last one."""
    if isinstance(model, DistributedDataParallel):
        return contextlib.nullcontext() if enabled else model.no_sync()
    if hasattr(model, "set_requires_gradient_sync"):  # an FSDP2 module
        model.set_requires_gradient_sync(enabled)
    return contextlib.nullcontext()
