"""The host syncs of expert parallelism in the planner: work that ends in a host sync
takes the longer of its own device and host time, and such stretches add
(plan.model.compute.work_seconds); a MoE layer's forward syncs with ep > 1, its backward
does not, a layer recomputed whole syncs again (plan.moe.compute._passes)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from trainwise.config import load_config
from trainwise.config.parallel_dims import ParallelDims
from trainwise.models.moe import MOE_PRESETS
from trainwise.plan.inputs import PLAN_DEFAULTS, resolve_inputs
from trainwise.plan.model.compute import Work, synced_chain, work_seconds
from trainwise.plan.model.memory import Workload
from trainwise.plan.moe.compute import fsdp_layer_ops, moe_micro_batch, moe_per_step

TINY = MOE_PRESETS["moe-tiny"]  # two MoE layers
OP_S = 0.01


def tiny(ac: str = "none") -> Workload:
    return Workload(TINY.num_params(), None, 128, 8, precision="bf16", ac=ac, moe=TINY)


def hardware():
    keys = {**PLAN_DEFAULTS, "model.name": "moe-tiny", "cluster.gpu": "H100-SXM"}
    return resolve_inputs(load_config(None, keys)).hardware


def test_a_host_bound_synced_forward_and_a_device_bound_backward_add():
    """Three forwards of 1 s on the device and 2 s of dispatch, each ending in a sync,
    then a backward of 12 s on the device and 3 s of dispatch: the two syncs between
    the forwards drain the queue (2 x 2 s), the last forward and the backward share one
    stretch (max(1 + 12, 2 + 3) = 13 s): 17 s, where the host banking time across the
    step would take max(15, 9) = 15 s."""
    forward, backward = Work(1.0, 200), Work(12.0, 300)
    synced = synced_chain(forward, 3) + backward
    assert work_seconds(synced, OP_S, 1.0, chains=1) == pytest.approx(2 * 2.0 + 13.0)
    banked = forward.times(3) + backward
    assert work_seconds(banked, OP_S, 1.0) == pytest.approx(15.0)
    assert (synced.device_s, synced.host_ops) == (banked.device_s, banked.host_ops)


def test_stretches_on_one_side_price_as_the_longer_of_the_sums():
    """All host-bound (or all device-bound), the syncs cost nothing more: the rule only
    bites where the stretches disagree."""
    host_bound = synced_chain(Work(1.0, 200), 3) + Work(2.0, 300)
    assert work_seconds(host_bound, OP_S, 1.0, chains=1) == pytest.approx(9.0)
    device_bound = synced_chain(Work(3.0, 100), 3).times(4) + Work(2.0, 100)
    assert work_seconds(device_bound, OP_S, 1.0, chains=4) == pytest.approx(4 * 9.0 + 2.0)


def test_a_slower_pace_stretches_each_synced_device_time():
    stretch = synced_chain(Work(1.0, 50), 2)
    assert work_seconds(stretch, OP_S, 0.5, chains=1) == pytest.approx(2 * 2.0)


def test_expert_parallel_forwards_sync_and_ep_1_does_not():
    """ep 1: no all-to-all, no sync, the micro-batch as one stretch; ep 2: the two MoE
    layers' forwards are a run of two syncs; the backward adds none."""
    hw = hardware()
    alone = moe_micro_batch(tiny(), 1, 1, hw, False, None)
    assert alone.synced == ()
    parallel = moe_micro_batch(tiny(), 2, 1, hw, False, None)
    (forward,) = parallel.synced
    assert forward.count == 2
    assert 0 < forward.device_s < parallel.device_s / 2


def test_a_layer_recomputed_whole_syncs_again_in_the_backward():
    """Full AC: the backward's recomputed forwards sync too, so it is a chain as well,
    each stretch a layer's recomputed forward and its backward (without the head: a
    layer's forward and backward are half the micro-batch)."""
    hw = hardware()
    none, full = (moe_micro_batch(replace(tiny(ac), head=False), 2, 1, hw, False, None)
                  for ac in ("none", "full"))
    (forward,) = none.synced
    assert full.synced[0] == forward
    backward = full.synced[1]
    assert backward.count == 2
    assert backward.device_s == pytest.approx(none.device_s / 2)
    assert backward.host_ops == pytest.approx(none.host_ops / 2)


def test_fsdp_hooks_run_inside_the_layers_not_beside_the_step():
    """fsdp_layer_ops: 15 tensors x 20 operations a layer a micro-batch where FSDP
    gathers and reduces every micro-batch; they land in the layers' passes, half in each,
    and the step keeps only the root's three tensors'. Once a step (pipeline stages) they
    stay beside the step, all the layers' tensors."""
    flat = ParallelDims(1, 8, ep=2, fsdp=True)
    staged = ParallelDims(1, 4, pp=2, ep=2, fsdp=True, reshard_after_forward=False)
    assert fsdp_layer_ops(flat) == 15 * 20
    assert fsdp_layer_ops(staged) == 0
    assert fsdp_layer_ops(ParallelDims(8, 1, ep=2)) == 0
    hw = hardware()
    bare = moe_micro_batch(tiny(), 2, 1, hw, False, None)
    hooked = moe_micro_batch(tiny(), 2, 1, hw, False, None, 300.0)
    assert hooked.host_ops - bare.host_ops == pytest.approx(TINY.n_layer * 300.0)
    assert hooked.synced[0].host_ops - bare.synced[0].host_ops == pytest.approx(150.0)
    step_ops = moe_per_step(hw, tiny(), flat, 1).host_ops - 20 * 3
    assert moe_per_step(hw, tiny(), flat, 4).host_ops == step_ops + 4 * 20 * 3
    assert moe_per_step(hw, tiny(), staged, 4).host_ops == step_ops + 20 * (15 * 2 + 3)


def test_each_pipeline_chunk_of_a_rank_is_a_chain_of_its_own():
    """A rank's blocks in v pipeline chunks: each chunk's forward runs apart (another
    chunk's backward between), so its last sync's stretch joins that work: two syncs in
    two chains leave no stretch closed, and the host banks time as without syncs.
    rank_chunks says how many chunks a rank holds: v interleaved, two on a V, one for
    1F1B."""
    from trainwise.plan.model.pipeline import rank_chunks

    work = synced_chain(Work(1.0, 200), 2) + Work(12.0, 300)
    assert work_seconds(work, OP_S, 1.0, chains=1) == pytest.approx(2.0 + 13.0)
    assert work_seconds(work, OP_S, 1.0, chains=2) == pytest.approx(14.0)
    assert rank_chunks(8, 4, "Interleaved1F1B") == 4
    assert rank_chunks(8, 2, "ZBVZeroBubble") == 2
    assert rank_chunks(8, 1, "1F1B") == 1
