"""Layout wrapping: a few `apply_*` functions, and `parallelize()` that picks among them
from the job's ParallelDims.

Everything here composes PyTorch's own pieces: DTensor's tensor parallelism
(`parallelize_module` with the model's own plan), activation checkpointing's wrapper,
torch.compile, DistributedDataParallel and FSDP2's `fully_shard`, all on one N-D
DeviceMesh (dp_replicate x dp_shard x tp).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor.parallel import parallelize_module
from torch.nn.parallel import DistributedDataParallel

from trainwise.config.parallel_dims import ParallelDims
from trainwise.errors import ConfigError
from trainwise.run.engine.precision import TORCH_DTYPES


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, plans: list[dict[str, object]]) -> None:
    """Tensor parallelism: each of the model's plans (module name -> ParallelStyle) in
    turn, on the 1-D tp mesh; the parameters become DTensors sharded (or replicated) over
    it. Must come before AC, compile and FSDP, which wrap the modules it splits."""
    for plan in plans:
        parallelize_module(model, tp_mesh, plan)


def apply_ac(model: nn.Module, blocks: list[nn.Module], mode: str) -> list[nn.Module]:
    """Wrap blocks in activation checkpointing: `full` every block, `selective` every other
    one (layer-wise selective AC). Returns the new block list."""
    if mode == "none" or not blocks:
        return blocks
    wrapped = []
    for i, block in enumerate(blocks):
        if mode == "full" or i % 2 == 0:
            # Recomputation must draw the same dropout masks as the forward did.
            new = checkpoint_wrapper(block, preserve_rng_state=True)
            _replace_child(model, block, new)
            wrapped.append(new)
        else:
            wrapped.append(block)
    return wrapped


def apply_compile(blocks: list[nn.Module]) -> None:
    """Compile each block in place: repeated blocks share one compiled graph."""
    for block in blocks:
        block.compile()


def apply_ddp(
    model: nn.Module, device: torch.device, group: dist.ProcessGroup | None = None
) -> nn.Module:
    ids = [device.index] if device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=ids, process_group=group)


def apply_fsdp(
    model: nn.Module,
    blocks: list[nn.Module],
    mesh: DeviceMesh,
    reshard_after_forward: bool,
    param_dtype: str,
    reduce_dtype: str,
    cpu_offload: bool,
) -> nn.Module:
    """FSDP2: one `fully_shard` per block (its own all-gather / reduce-scatter unit, so
    communication overlaps the neighbouring block's compute), then one on the root for the
    rest (embeddings, final norm, head)."""
    mp = MixedPrecisionPolicy(
        param_dtype=TORCH_DTYPES[param_dtype], reduce_dtype=TORCH_DTYPES[reduce_dtype]
    )
    kwargs = {"mesh": mesh, "mp_policy": mp}
    if cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    for block in blocks:
        fully_shard(block, reshard_after_forward=reshard_after_forward, **kwargs)
    # The root's parameters are needed again first in backward: keep them gathered.
    fully_shard(model, reshard_after_forward=False, **kwargs)
    return model


def build_mesh(
    dims: ParallelDims, device_type: str, group: dist.ProcessGroup | None = None
) -> DeviceMesh | None:
    """The layout's device mesh (ParallelDims.mesh_dims: named dims over all ranks), or a
    1-D shard mesh over `group`'s ranks (the doctor times smaller worlds inside one
    launch). None when nothing is sharded."""
    if not dims.fsdp and dims.tp == 1:
        return None
    if group is not None:
        if dims.tp > 1:
            raise ValueError("a mesh over a process group is data-parallel only (tp = 1)")
        return DeviceMesh.from_group(group, device_type, mesh_dim_names=("dp_shard",))
    # Rows of arange(world) reshaped (dp_replicate, dp_shard, tp): a tp group is a run of
    # consecutive ranks (inside a machine), a shard group the next level out. torchrun
    # numbers ranks machine by machine, so with one replica per machine each shard group
    # is one machine and only dp_replicate crosses machines.
    names, sizes = dims.mesh_dims()
    mesh = init_device_mesh(device_type, sizes, mesh_dim_names=names)
    if "dp_shard" in names and "tp" in names:
        # A gradient norm is partial over both: with the flattened dim registered DTensor
        # completes it in one all-reduce instead of one per dim.
        mesh["dp_shard", "tp"]._flatten("dp_shard_tp")
    return mesh


def dp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The data-parallel dims of the N-D mesh, which FSDP shards (and replicates) over."""
    names = tuple(n for n in mesh.mesh_dim_names if n != "tp")
    return mesh if len(names) == mesh.ndim else mesh[names]


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
) -> nn.Module:
    """The one place a layout is applied, in torchtitan's order: tensor parallelism (the
    model's `tp_plan`), AC, compile, then the data-parallel wrapper (FSDP must see the
    final modules). `group`: data parallelism over that group's ranks instead of all (not
    for hsdp or tp)."""
    mesh = build_mesh(dims, device.type, group)
    if dims.tp > 1:
        if tp_plan is None:
            raise ConfigError(f"parallel.tp = {dims.tp} needs a model with a tensor-parallel plan")
        apply_tp(model, mesh["tp"], tp_plan)
    blocks = apply_ac(model, blocks, ac)
    if compile:
        apply_compile(blocks)
    if dims.single or (not dims.fsdp and dims.dp_size == 1):
        return model
    if not dims.fsdp:
        if dims.tp > 1:
            raise ConfigError("DDP cannot replicate tensor-parallel shards: use FSDP or HSDP")
        return apply_ddp(model, device, group)
    return apply_fsdp(
        model,
        blocks,
        dp_mesh(mesh),
        reshard_after_forward=dims.reshard_after_forward,
        param_dtype=precision,
        reduce_dtype=reduce_dtype,
        cpu_offload=dims.cpu_offload,
    )


def set_gradient_sync(model: nn.Module, enabled: bool) -> object:
    """Context for one micro-batch: gradients are synchronised only on the last one."""
    if isinstance(model, DistributedDataParallel):
        return contextlib.nullcontext() if enabled else model.no_sync()
    if hasattr(model, "set_requires_gradient_sync"):  # an FSDP2 module
        model.set_requires_gradient_sync(enabled)
    return contextlib.nullcontext()


def _replace_child(root: nn.Module, old: nn.Module, new: nn.Module) -> None:
    for parent in root.modules():
        for name, child in parent.named_children():
            if child is old:
                setattr(parent, name, new)  # ModuleList children are named "0", "1", ...
                return
    raise ValueError("block to wrap is not part of the model")
