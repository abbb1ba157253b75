"""Strategy wrapping that needs no real process group: activation checkpointing and the
block replacement it does; the hsdp mesh's layout, on PyTorch's in-process fake backend."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from trainwise.config.parallel_dims import ParallelDims
from trainwise.models import ModelSpec, build_model
from trainwise.run.engine.mesh import build_mesh
from trainwise.run.engine.parallelize import apply_ac


def grads_after_one_step(ac: str, dropout: float) -> list[torch.Tensor]:
    torch.manual_seed(0)
    bundle = build_model(ModelSpec("tiny", vocab_size=64, seq_len=16, dropout=dropout))
    apply_ac(bundle.module, bundle.blocks, ac)
    x = torch.randint(0, 64, (4, 16))
    torch.manual_seed(1)  # the same dropout masks in both runs
    bundle.loss_fn(bundle.module(x), x).backward()
    return [p.grad.clone() for p in bundle.module.parameters()]


def test_checkpointed_blocks_recompute_the_same_dropout_masks():
    eager = grads_after_one_step("none", dropout=0.3)
    for ac in ("full", "selective", "selective-op"):
        rerun = grads_after_one_step(ac, dropout=0.3)
        assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(eager, rerun, strict=True))


def test_ac_wraps_every_block_or_every_other_one():
    torch.manual_seed(0)
    bundle = build_model(ModelSpec("small", vocab_size=64, seq_len=16))
    n = len(bundle.blocks)
    full = apply_ac(bundle.module, list(bundle.blocks), "full")
    assert [type(b).__name__ for b in full] == ["CheckpointWrapper"] * n
    assert list(bundle.module.blocks) == full  # replaced in the model, not just the list
    torch.manual_seed(0)
    bundle = build_model(ModelSpec("small", vocab_size=64, seq_len=16))
    sel = apply_ac(bundle.module, list(bundle.blocks), "selective")
    wrapped = [type(b).__name__ == "CheckpointWrapper" for b in sel]
    assert wrapped == [i % 2 == 0 for i in range(n)]


def test_hsdp_mesh_shards_within_a_machine_and_replicates_across():
    # 2 machines x 8 ranks; torchrun numbers ranks machine by machine, so rank 9 is the
    # second machine's second worker: it shards with ranks 8-15, replicates with rank 1.
    dist.init_process_group("fake", store=FakeStore(), rank=9, world_size=16)
    try:
        mesh = build_mesh(ParallelDims.from_strategy("hsdp", 16, replicate=2), "cpu")
        assert mesh.mesh.tolist() == [list(range(8)), list(range(8, 16))]
        assert mesh["dp_shard"].mesh.tolist() == list(range(8, 16))
        assert mesh["dp_replicate"].mesh.tolist() == [1, 9]
    finally:
        dist.destroy_process_group()
