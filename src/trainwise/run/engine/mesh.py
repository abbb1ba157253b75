"""The job's device mesh, built once from its ParallelDims and kept (on the Trainer): the
wrappers shard and replicate over it, and the rest asks it which share of the data this
rank reads (`dp_rank`, `dp_size`) instead of redoing arithmetic that must match the
order of its dims.

With expert parallelism a second view of the same ranks holds the routed experts
(torchtitan's sparse mesh): this stage's data- and tensor-parallel ranks (each routes its
own tokens: models.moe.parallel), replicas outermost, tp innermost, unflattened into
(edp_replicate, efsdp, ep), ep innermost so that an ep group is consecutive ranks (a tp
group's and its neighbours', inside a machine, where the all-to-all is cheapest).
Both views derive from one root mesh, which FSDP2 needs to combine the experts' ep
sharding with its own over efsdp."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from trainwise.config.parallel_dims import ParallelDims

DP_DIMS = ("dp_replicate", "dp_shard")  # the dims over which ranks read different samples
# The experts' view of the data-parallel ranks: ParallelDims.expert_dims' replicas and
# shards, and the ep group.
EXPERT_DIMS = ("edp_replicate", "efsdp", "ep")


def build_mesh(
    dims: ParallelDims, device_type: str, group: dist.ProcessGroup | None = None
) -> DeviceMesh | None:
    """The layout's device mesh (ParallelDims.mesh_dims: named dims over all ranks), or a
    1-D data-parallel mesh over `group`'s ranks (the doctor times smaller worlds inside one
    launch). None when there is nothing to shard or replicate over (one rank, no FSDP)."""
    names, sizes = dims.mesh_dims()
    if not names:
        return None
    if group is not None:
        if len(names) > 1:
            raise ValueError("a mesh over a process group is 1-D data-parallel (not hsdp or tp)")
        return DeviceMesh.from_group(group, device_type, mesh_dim_names=names)
    # Rows of arange(world) reshaped (dp_replicate, dp_shard, tp): a tp group is a run of
    # consecutive ranks (inside a machine), a shard group the next level out. torchrun
    # numbers ranks machine by machine, so with one replica per machine each shard group
    # is one machine and only dp_replicate crosses machines. A 1-D mesh over every rank
    # reuses the default group (no new group is created).
    mesh = init_device_mesh(device_type, sizes, mesh_dim_names=names)
    if "dp_shard" in names and "tp" in names:
        # A gradient norm is partial over both: with the flattened dim registered DTensor
        # completes it in one all-reduce instead of one per dim.
        mesh["dp_shard", "tp"]._flatten("dp_shard_tp")
    return mesh


def build_expert_mesh(dims: ParallelDims, mesh: DeviceMesh | None) -> DeviceMesh | None:
    """The experts' view of `mesh`'s data- and tensor-parallel ranks (EXPERT_DIMS, sized
    by ParallelDims.expert_dims; tp innermost), from the same root; None without expert
    parallelism."""
    if dims.ep == 1:
        return None
    names = tuple(n for n in mesh.mesh_dim_names if n in (*DP_DIMS, "tp"))
    # Named after its dims: dp_shard x tp is the one build_mesh flattened already.
    flat = mesh[names[0]] if len(names) == 1 else mesh[names]._flatten("_".join(names))
    replicas, shards = dims.expert_dims()
    experts = flat._unflatten(0, (replicas, shards, dims.ep), EXPERT_DIMS)
    # The experts' gradient norm is partial over efsdp and ep: flattened, DTensor
    # completes it in one all-reduce instead of one per dim.
    experts["efsdp", "ep"]._flatten("efsdp_ep")
    return experts


def dp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The data-parallel dims of the N-D mesh, which FSDP shards (and replicates) over."""
    names = tuple(n for n in mesh.mesh_dim_names if n in DP_DIMS)
    return mesh if len(names) == mesh.ndim else mesh[names]


@dataclass(frozen=True)
class JobMesh:
    """The layout and its device mesh (None: one rank, no wrapper); with expert
    parallelism the experts' view of the same ranks (build_expert_mesh)."""

    dims: ParallelDims
    device_mesh: DeviceMesh | None
    experts: DeviceMesh | None = None

    def _dp_axes(self) -> list[int]:
        """Indices of the mesh's data-parallel dims, outermost first."""
        m = self.device_mesh
        return [] if m is None else [i for i, n in enumerate(m.mesh_dim_names) if n in DP_DIMS]

    @property
    def dp_size(self) -> int:
        """Ranks that read different samples (a tensor-parallel group reads the same)."""
        return math.prod(self.device_mesh.size(i) for i in self._dp_axes())

    @property
    def dp_rank(self) -> int:
        """Which share of the data this rank reads: its coordinate over the data-parallel
        dims of the mesh, replicas outermost."""
        if self.device_mesh is None:
            return 0
        coordinate = self.device_mesh.get_coordinate()
        if coordinate is None:
            raise ValueError("this rank is not part of the job's mesh")
        rank = 0
        for i in self._dp_axes():
            rank = rank * self.device_mesh.size(i) + coordinate[i]
        return rank

    @property
    def pp_rank(self) -> int:
        """This rank's place in the pipeline (0: the stage that embeds)."""
        if self.dims.pp == 1:
            return 0
        return self.device_mesh.get_local_rank("pp")

    def pp_group(self) -> dist.ProcessGroup:
        """The ranks of this rank's pipeline (one per stage position, the same data- and
        tensor-parallel coordinates): where activations go point to point."""
        return self.device_mesh.get_group("pp")

    def tp_mesh(self) -> DeviceMesh:
        return self.device_mesh["tp"]

    def dp_mesh(self) -> DeviceMesh:
        return dp_mesh(self.device_mesh)

    def ep_mesh(self) -> DeviceMesh:
        """The ranks that split the experts among them and exchange tokens."""
        return self.experts["ep"]

    def expert_dp_mesh(self) -> DeviceMesh:
        """Where FSDP shards (efsdp) and replicates (edp_replicate) each slice of the
        experts: 1-D without replicas, else 2-D as HSDP's."""
        replicas, _ = self.dims.expert_dims()
        return self.experts["efsdp"] if replicas == 1 else self.experts["edp_replicate", "efsdp"]

    def dp_group(self) -> dist.ProcessGroup | None:
        """DDP's group: the replicate dim's (None: the default group)."""
        return None if self.device_mesh is None else self.dp_mesh().get_group()


def job_mesh(
    dims: ParallelDims, device_type: str, group: dist.ProcessGroup | None = None
) -> JobMesh:
    """Build the job's mesh once (see build_mesh), and the experts' view of it."""
    if group is not None and dims.ep > 1:
        raise ValueError("a mesh over a process group is 1-D data-parallel (not ep)")
    mesh = build_mesh(dims, device_type, group)
    return JobMesh(dims, mesh, build_expert_mesh(dims, mesh))
