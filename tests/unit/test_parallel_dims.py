"""The layout value: degrees, their checks, and the names the rest of the code asks it."""

from __future__ import annotations

import pytest

from trainwise.config.parallel_dims import (
    PLAN_NAMES,
    PLAN_ROWS,
    LayoutRequest,
    ParallelDims,
    row_layout,
)
from trainwise.errors import ConfigError


@pytest.mark.parametrize(
    ("strategy", "replicate", "expected"),
    [
        ("single", None, (1, 1, False, "single")),
        ("ddp", None, (8, 1, False, "ddp")),
        ("fsdp", None, (1, 8, True, "fsdp-full")),
        ("hsdp", 2, (2, 4, True, "hsdp")),
    ],
)
def test_shortcuts_resolve_to_degrees(strategy: str, replicate: int | None, expected: tuple):
    world = 1 if strategy == "single" else 8
    dims = ParallelDims.from_strategy(strategy, world, replicate=replicate)
    assert (dims.dp_replicate, dims.dp_shard, dims.fsdp, dims.plan_name) == expected
    assert dims.world == world and dims.strategy == strategy


def test_every_plan_name_round_trips():
    for name in PLAN_NAMES:
        world = 1 if name == "single" else 16
        assert ParallelDims.from_plan_name(name, world, gpus_per_node=8).plan_name == name


def test_data_parallel_rank_and_mesh_with_tensor_parallelism():
    dims = ParallelDims(dp_replicate=2, dp_shard=2, tp=2, fsdp=True)
    assert dims.world == 8 and dims.dp_size == 4
    assert dims.mesh_dims() == (("dp_replicate", "dp_shard", "tp"), (2, 2, 2))
    assert dims.describe() == "dp_replicate 2 x dp_shard 2 x tp 2"


def test_pipeline_stages_are_the_outermost_dim():
    dims = ParallelDims.from_strategy("fsdp", 16, tp=2, pp=4)
    assert (dims.pp, dims.dp_shard, dims.tp, dims.world, dims.dp_size) == (4, 2, 2, 16, 2)
    assert dims.mesh_dims() == (("pp", "dp_shard", "tp"), (4, 2, 2))
    assert dims.describe() == "pp 4 x dp_replicate 1 x dp_shard 2 x tp 2"
    assert dims.config_keys()["parallel.pp"] == 4
    # Replicas of pipeline stages are FSDP2's replication (DDP's reducer does not follow
    # the schedule's micro-batches: tests/dist/test_pipeline.py trains them).
    replicas = ParallelDims.from_strategy("ddp", 4, pp=2)
    assert replicas.fsdp and replicas.mesh_dims() == (
        ("pp", "dp_replicate", "dp_shard"), (2, 2, 1)
    )
    with pytest.raises(ConfigError, match="tp x parallel.pp = 2 x 3 does not divide the 8"):
        ParallelDims.from_strategy("fsdp", 8, tp=2, pp=3)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"pp": 0}, "parallel.pp = 0: a degree is a whole number"),
        ({"cp": 2}, "parallel.cp = 2: not supported yet"),
        ({"tp": 0}, "parallel.tp = 0: a degree is a whole number"),
        ({"cpu_offload": True}, "cpu_offload = true needs FSDP"),
        ({"dp_shard": 2}, "dp_shard = 2 needs FSDP"),
    ],
)
def test_bad_degrees_are_one_line_each(kwargs: dict, message: str):
    with pytest.raises(ConfigError, match=message):
        ParallelDims(**kwargs)


def test_config_keys_run_the_layout():
    dims = ParallelDims.from_strategy("fsdp", 4, shard="grad_op", cpu_offload=True)
    assert dims.config_keys() == {
        "parallel.strategy": "fsdp", "parallel.shard": "grad_op", "parallel.cpu_offload": True,
    }
    assert ParallelDims.from_strategy("hsdp", 8, replicate=2).config_keys()["parallel.replicate"] == 2


def test_fsdp_keeps_pipeline_stages_gathered_whatever_parallel_shard_says():
    # torchtitan's default with pp (reshard_after_forward False "to avoid per-microbatch
    # all-gathers"): full under stages is grad_op, and its names say so.
    full = ParallelDims.from_strategy("fsdp", 8, shard="full", pp=2)
    grad_op = ParallelDims.from_strategy("fsdp", 8, shard="grad_op", pp=2)
    assert full == grad_op
    assert (full.reshard_after_forward, full.shard, full.plan_name) == (
        False, "grad_op", "fsdp-grad-op",
    )
    assert ParallelDims(1, 4, pp=2, fsdp=True) == grad_op  # built directly, the same rule
    assert full.shard_note("full").endswith("run as grad_op")
    assert full.shard_note("grad_op") == ""
    # Without stages full is ZeRO-3, as asked; replicas of stages hold no shard to keep.
    flat = ParallelDims.from_strategy("fsdp", 8, shard="full")
    assert flat.reshard_after_forward and flat.shard_note("full") == ""
    replicas = ParallelDims.from_strategy("ddp", 8, pp=2)
    assert replicas.fsdp and replicas.shard_note("full") == ""


# --- LayoutRequest: parallel.* before the world size is known ------------------------------


def test_a_request_answers_the_job_set_ups_questions():
    from trainwise.config import load_config

    def request(*overrides: str) -> LayoutRequest:
        return LayoutRequest.of(load_config(overrides=list(overrides)).parallel)

    assert request("parallel.strategy=single").single
    assert request().auto and request().may_shard and not request().sharded
    ddp = request("parallel.strategy=ddp")
    assert not (ddp.single or ddp.auto or ddp.may_shard)
    # A row name is fsdp with its options.
    grad_op = request("parallel.strategy=fsdp-grad-op")
    assert grad_op.sharded and grad_op.layout(8, 1).plan_name == "fsdp-grad-op"


@pytest.mark.parametrize(
    ("request_", "world", "nodes", "groups", "kind"),
    [
        (LayoutRequest("hsdp"), 16, 2, 2, "hsdp"),  # one replica group per machine
        (LayoutRequest("fsdp"), 16, 2, 1, "fsdp"),  # one shard group over the world
        (LayoutRequest("fsdp", dp_shard=4), 16, 2, 4, "hsdp"),  # smaller groups: hsdp
        (LayoutRequest("fsdp", dp_shard=2, tp=2), 16, 2, 4, "hsdp"),
        (LayoutRequest("hsdp", replicate=8), 16, 2, 8, "hsdp"),
        (LayoutRequest("ddp", dp_shard=4), 16, 2, 1, "ddp"),  # refused by the job set-up
    ],
)
def test_replica_groups_and_the_shortcut_that_runs(request_, world, nodes, groups, kind):
    assert request_.replica_groups(world, nodes) == groups
    assert request_.kind(groups) == kind


def test_a_request_resolves_to_the_layout_and_auto_has_none_before_the_planner():
    dims = LayoutRequest("fsdp", dp_shard=2, tp=2).layout(8, 2)
    assert (dims.dp_replicate, dims.dp_shard, dims.tp, dims.hybrid) == (2, 2, 2, True)
    # ddp with tp: FSDP2's replication on the same mesh (runnable)
    assert LayoutRequest("ddp", tp=2).layout(4, 1) == ParallelDims(2, 1, 2, fsdp=True)
    with pytest.raises(ConfigError, match="resolve auto first"):
        LayoutRequest("auto").layout(4, 1)


def test_the_rows_are_written_once_simplest_first():
    assert tuple(PLAN_ROWS) == PLAN_NAMES
    assert [row_layout(n).plan_name for n in PLAN_NAMES] == list(PLAN_NAMES)


@pytest.mark.parametrize(("dims", "name"), [
    (ParallelDims(), "single"),
    (ParallelDims.from_strategy("ddp", 8), "ddp"),
    (ParallelDims.from_strategy("fsdp", 8), "fsdp"),
    (ParallelDims.from_strategy("hsdp", 8, replicate=2), "hsdp"),
    (ParallelDims.from_strategy("ddp", 2, pp=2), "pp 2"),  # strategy: single
    (ParallelDims.from_strategy("fsdp", 4, pp=2), "pp 2 x fsdp 2"),
    (ParallelDims.from_strategy("ddp", 4, pp=2), "pp 2 x ddp 2"),  # strategy: hsdp
    (ParallelDims.from_strategy("fsdp", 4, tp=2), "fsdp 2 x tp 2"),
    (ParallelDims.from_strategy("fsdp", 2, tp=2), "tp 2"),
    (ParallelDims.from_strategy("hsdp", 16, replicate=2, tp=2, pp=2), "pp 2 x hsdp 4 x tp 2"),
])
def test_the_layout_name_says_its_stages_and_tensor_parallelism(dims: ParallelDims, name: str):
    """What people read: the shortcut alone for a plain layout; pp and tp say so (the
    strategy names only the data-parallel part: pp 2 on 2 workers is `single`)."""
    assert dims.name == name


@pytest.mark.parametrize(
    ("dims", "expert_dims"),
    [
        # FSDP over 8 with ep 2: each half of the experts sharded over 4 ranks (efsdp).
        (ParallelDims.from_strategy("fsdp", 8, ep=2), (1, 4)),
        # HSDP 2 x 4 with ep 4: sharded over 1, replicated over the 2 replica groups.
        (ParallelDims.from_strategy("hsdp", 8, replicate=2, ep=4), (2, 1)),
        # DDP (FSDP2's replication once runnable) with ep 2: replicated over 4 / 2.
        (ParallelDims.from_strategy("ddp", 4, ep=2), (2, 1)),
        # ep across shard groups (HSDP 4 x 2 with ep 4): every slice replicated.
        (ParallelDims.from_strategy("hsdp", 8, replicate=4, ep=4), (2, 1)),
        # Under tp each tp rank routes its own tokens: ep borrows from dp x tp (a stage's
        # 4 ranks): ep 2 is the tp pair, each half sharded over the 2 shard groups.
        (ParallelDims.from_strategy("fsdp", 8, tp=2, pp=2, ep=2), (1, 2)),
        (ParallelDims.from_strategy("fsdp", 4, tp=2, ep=4), (1, 1)),
        (ParallelDims.from_strategy("single", 2, tp=2, ep=2), (1, 1)),
    ],
)
def test_the_experts_data_parallelism_beside_ep(dims: ParallelDims, expert_dims: tuple):
    replicas, shards = dims.expert_dims()
    assert (replicas, shards) == expert_dims
    assert replicas * shards * dims.ep == dims.dp_size * dims.tp


def test_ep_replicated_over_tp_without_a_wrapper_is_refused():
    # tp 4 with ep 2 and no data parallelism: nothing would sum the replicas' gradients.
    with pytest.raises(ConfigError, match="parallel.ep = 2 leaves the experts replicated"):
        ParallelDims.from_strategy("single", 4, tp=4, ep=2)
    with pytest.raises(ConfigError, match="ep = 4 does not divide the 2 data- and tensor"):
        ParallelDims.from_strategy("single", 2, tp=2, ep=4)


def test_expert_parallel_replicas_run_as_fsdp2_replication():
    # DDP cannot hold the experts' DTensor shards: ddp with ep is FSDP2's replication.
    dims = ParallelDims.from_strategy("ddp", 4, ep=2)
    assert (dims.fsdp, dims.dp_replicate, dims.dp_shard) == (True, 4, 1)
    assert dims.name == "ddp 4 x ep 2"
    with pytest.raises(ConfigError, match=r"parallel.ep = 3 does not divide the 8 data- and"):
        ParallelDims.from_strategy("fsdp", 8, tp=2, ep=3)
