"""Strategy wrapping that needs no real process group: activation checkpointing and the
block replacement it does; the hsdp mesh's layout, on PyTorch's in-process fake backend."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from trainwise.config.parallel_dims import ParallelDims
from trainwise.models import ModelSpec, build_model
from trainwise.run.engine.mesh import build_mesh
from trainwise.run.engine.parallelize import apply_ac, parallelize


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


def kept_after_forward(model: torch.nn.Module) -> dict[str, bool]:
    """Each FSDP unit of `model` by name ("" the root): whether torch keeps its parameters
    gathered after forward."""
    from torch.distributed.fsdp import FSDPModule

    return {
        name: not m._get_fsdp_state()._fsdp_param_group._reshard_after_forward
        for name, m in model.named_modules() if isinstance(m, FSDPModule)
    }


@pytest.mark.parametrize(("model", "ac", "ep"), [
    ("small", "none", 1), ("small", "full", 1), ("moe-tiny", "none", 2),
])
def test_fsdp_full_keeps_the_last_block_and_the_root_gathered(model, ac, ep):
    # torchtitan's default policy: backward starts with the last block, which FSDP would
    # gather again at once; the planner counts the same (ParallelDims.regathered_blocks).
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        for shard, gathered in (("full", True), ("grad_op", None)):
            dims = ParallelDims.from_strategy("fsdp", 2, shard=shard, ep=ep)
            torch.manual_seed(0)
            bundle = build_model(ModelSpec(model, vocab_size=64, seq_len=16))
            plan = bundle.ep_plan(bundle.module, None) if ep > 1 else None
            parallelize(bundle.module, list(bundle.blocks), dims, device=torch.device("cpu"),
                        ac=ac, ep_plan=plan)
            kept = kept_after_forward(bundle.module)
            last = len(bundle.blocks) - 1
            units = {name.replace("._checkpoint_wrapped_module", "") for name in kept}
            assert {f"blocks.{i}" for i in range(last + 1)} <= units
            if gathered is None:  # grad_op: every unit stays gathered
                assert all(kept.values())
                continue
            in_last = {n for n, k in kept.items() if n.startswith(f"blocks.{last}")}
            assert {n for n, k in kept.items() if k} == in_last | {""}
            assert dims.regathered_blocks(last + 1) == last
            if ep > 1:  # the last block's experts too, as a unit of their own
                assert len(in_last) == 2
    finally:
        dist.destroy_process_group()


def test_a_forward_without_backward_is_resharded_after_it():
    # Evaluation runs forward only: the units kept gathered after forward (the root, the
    # last block) would hold stale copies while the optimizer updates their shards.
    from torch.distributed.fsdp import FSDPModule

    from trainwise.run.engine.parallelize import reshard_all

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        bundle = build_model(ModelSpec("small", vocab_size=64, seq_len=16))
        model = parallelize(bundle.module, list(bundle.blocks),
                            ParallelDims.from_strategy("fsdp", 2), device=torch.device("cpu"))

        def gathered() -> set[str]:
            return {name for name, m in model.named_modules() if isinstance(m, FSDPModule)
                    and m._get_fsdp_state()._fsdp_param_group.is_unsharded}

        with torch.no_grad():
            model(torch.randint(0, 64, (2, 16)))
        assert gathered() == {"", f"blocks.{len(bundle.blocks) - 1}"}
        reshard_all(model)
        assert gathered() == set()
    finally:
        dist.destroy_process_group()


@pytest.fixture
def one_rank_gloo(tmp_path):
    """A real gloo group of one rank, in this process."""
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize(("model", "ac", "broadcasts"), [
    ("small", "none", False), ("moe-tiny", "none", True), ("moe-tiny", "full", True),
])
def test_ddp_broadcasts_only_persistent_buffers_and_keeps_gradients_in_its_buckets(
    one_rank_gloo, model, ac, broadcasts
):
    # small: rotary tables, left out of the state dict; moe-tiny: the routers' bias, saved,
    # also where checkpointing's wrapper renames it in the state dict.
    from trainwise.run.engine.parallelize import apply_ddp, has_persistent_buffers

    bundle = build_model(ModelSpec(model, vocab_size=64, seq_len=16))
    apply_ac(bundle.module, list(bundle.blocks), ac)
    assert list(bundle.module.buffers())
    assert has_persistent_buffers(bundle.module) is broadcasts
    ddp = apply_ddp(bundle.module, torch.device("cpu"))
    assert ddp.forward_sync_buffers is broadcasts
    x = torch.randint(0, 64, (2, 16))
    bundle.loss_fn(ddp(x), x).backward()
    grads = [p.grad for p in ddp.parameters() if p.grad is not None]
    # views of a few flat buckets, not a tensor each
    assert len({g.untyped_storage().data_ptr() for g in grads}) < len(grads) / 4
