"""Tensor parallelism without real processes: the layout arithmetic, the checks that stop a
job before any worker starts, the 3-D mesh on PyTorch's fake backend, the GPT's plan, and
the per-parameter initialisation that every layout shares."""

from __future__ import annotations

import sys
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from trainwise.config import load_config
from trainwise.config.parallel_dims import ParallelDims
from trainwise.errors import ConfigError
from trainwise.hardware import GB, DeviceInfo
from trainwise.models import ModelSpec, build_model
from trainwise.run.engine.materialize import materialize, parameter_seed, plain_name
from trainwise.run.engine.mesh import build_mesh, dp_mesh
from trainwise.run.engine.parallelize import apply_ac
from trainwise.run.engine.step import DataParallelStep
from trainwise.run.job.resolve import job_plan, prepare_job, start_lines

CPU = DeviceInfo("cpu", "cpu", 1, 64 * GB, bf16=True, fp16=False, gpu=None)


def cfg(*overrides: str):
    return load_config(overrides=["data.synthetic_tokens=20000", *overrides])


def problems_of(config, world: int, local: int | None = None) -> list[str]:
    with pytest.raises(ConfigError) as info:
        prepare_job(config, world, CPU, local)
    return info.value.problems


# --- layouts -------------------------------------------------------------------------------


def test_tp_composes_with_each_data_parallel_shortcut():
    fsdp = ParallelDims.from_strategy("fsdp", 8, tp=2)
    assert (fsdp.dp_replicate, fsdp.dp_shard, fsdp.tp, fsdp.fsdp) == (1, 4, 2, True)
    assert fsdp.mesh_dims() == (("dp_shard", "tp"), (4, 2))
    hsdp = ParallelDims.from_strategy("hsdp", 8, replicate=2, tp=2)
    assert hsdp.mesh_dims() == (("dp_replicate", "dp_shard", "tp"), (2, 2, 2))
    # DDP cannot hold DTensor shards: its replication is FSDP2's with a shard group of one.
    ddp = ParallelDims.from_strategy("ddp", 4, tp=2)
    assert (ddp.dp_replicate, ddp.dp_shard, ddp.fsdp) == (2, 1, True)
    alone = ParallelDims.from_strategy("ddp", 2, tp=2)
    assert (alone.dp_size, alone.fsdp, alone.mesh_dims()) == (1, False, (("tp",), (2,)))
    assert fsdp.config_keys()["parallel.tp"] == 2


def test_the_job_resolves_tp_with_fsdp():
    job = prepare_job(cfg("parallel.strategy=fsdp", "parallel.tp=2"), 4, CPU)
    assert job.dims.describe() == "dp_replicate 1 x dp_shard 2 x tp 2"
    assert job.decision.reason.startswith(
        "fsdp 2 x tp 2 (set by parallel.strategy = 'fsdp', parallel.tp = 2): "
    )
    assert job.global_batch == job.cfg.data.micro_batch * job.grad_accum * 2


def test_accumulate_rule():
    zero3 = ParallelDims.from_strategy("fsdp", 4)
    zero2 = ParallelDims.from_strategy("fsdp", 4, shard="grad_op")
    assert zero3.accumulates_sharded("auto", 2) and not zero2.accumulates_sharded("auto", 2)
    assert zero2.accumulates_sharded("sharded", 2)
    assert not zero3.accumulates_sharded("unsharded", 2)
    assert not zero3.accumulates_sharded("sharded", 1)  # nothing to accumulate
    assert not ParallelDims(dp_replicate=4).accumulates_sharded("sharded", 2)  # DDP


def test_three_d_mesh_keeps_tp_groups_on_consecutive_ranks():
    dist.init_process_group("fake", store=FakeStore(), rank=5, world_size=8)
    try:
        dims = ParallelDims.from_strategy("hsdp", 8, replicate=2, tp=2)
        mesh = build_mesh(dims, "cpu")
        assert mesh["tp"].mesh.tolist() == [4, 5]
        assert mesh["dp_shard"].mesh.tolist() == [5, 7]
        assert dp_mesh(mesh).mesh_dim_names == ("dp_replicate", "dp_shard")
        assert dp_mesh(mesh).mesh.tolist() == [[1, 3], [5, 7]]
    finally:
        dist.destroy_process_group()


# --- bad input: one line each, before any worker starts ---------------------------------------


def test_tp_that_splits_no_head_is_refused_with_each_reason():
    problems = problems_of(cfg("parallel.strategy=fsdp", "parallel.tp=3"), 3)
    text = "\n".join(problems)
    assert "model heads (n_head) = 4" in text and "key/value heads (n_kv_head) = 4" in text
    assert "FFN width (d_ff) = 256" in text
    assert all("\n" not in p for p in problems)


def test_tp_across_machines_needs_permission():
    c = cfg("parallel.strategy=fsdp", "parallel.tp=4")
    assert any("exceeds the 2 workers of one machine" in p for p in problems_of(c, 4, local=2))
    allowed = cfg("parallel.strategy=fsdp", "parallel.tp=4", "parallel.allow_tp_across_nodes=true")
    job = prepare_job(allowed, 4, CPU, 2)
    assert job.dims.tp == 4
    assert any("parallel.tp = 4 spans machines" in line for line in start_lines(job, 2, 8))


def test_a_model_without_a_plan_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    (tmp_path / "planless.py").write_text(
        "import torch\n\ndef build():\n    return torch.nn.Sequential(torch.nn.Embedding(256, 8))\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    problems = problems_of(cfg("model.name='planless:build'", "parallel.tp=2"), 2)
    assert any("has no tensor-parallel plan" in p and "tp_plan" in p for p in problems)
    sys.modules.pop("planless", None)


# --- the GPT's plan and its initialisation ---------------------------------------------------


def test_the_plan_splits_every_projection_of_the_gpt():
    with torch.device("meta"):
        bundle = build_model(ModelSpec("small", vocab_size=256, seq_len=32))
    plan = {k: type(v).__name__ for p in bundle.tp_plan(True) for k, v in p.items()}
    for i in range(len(bundle.blocks)):
        for name in ("q_proj", "k_proj", "v_proj"):
            assert plan[f"blocks.{i}.attn.{name}"] == "ColwiseParallel"
        assert plan[f"blocks.{i}.mlp.up"] == plan[f"blocks.{i}.mlp.gate"] == "ColwiseParallel"
        assert (
            plan[f"blocks.{i}.attn.out_proj"] == plan[f"blocks.{i}.mlp.down"] == "RowwiseParallel"
        )
        assert plan[f"blocks.{i}.norm1"] == "SequenceParallel"
    assert plan["tok_emb"] == "RowwiseParallel"
    off = {k for p in bundle.tp_plan(False) for k in p}
    assert not any(k.endswith(("norm1", "norm2")) for k in off)


def built(ac: str, seed: int = 0) -> dict[str, torch.Tensor]:
    with torch.device("meta"):
        bundle = build_model(ModelSpec("small", vocab_size=256, seq_len=32))
    apply_ac(bundle.module, bundle.blocks, ac)
    materialize(bundle.module, bundle.init_parameter, seed, torch.device("cpu"))
    return {plain_name(n): p.detach().clone() for n, p in bundle.module.named_parameters()}


def test_per_parameter_init_ignores_wrappers_and_follows_the_seed():
    plain, wrapped = built("none"), built("full")
    assert plain.keys() == wrapped.keys()
    assert all(torch.equal(plain[n], wrapped[n]) for n in plain)
    other = built("none", seed=1)
    assert not torch.equal(plain["tok_emb.weight"], other["tok_emb.weight"])
    # GPT-2's statistics: normal(0.02) weights, smaller residual projections, unit norms.
    assert abs(plain["tok_emb.weight"].std().item() - 0.02) < 0.002
    assert plain["blocks.0.attn.out_proj.weight"].std() < 0.01
    assert torch.equal(plain["norm.weight"], torch.ones(256))
    assert parameter_seed(0, "a.weight") != parameter_seed(0, "b.weight")


def test_rope_tables_are_rebuilt_after_materialising():
    with torch.device("meta"):
        bundle = build_model(ModelSpec("small", vocab_size=256, seq_len=32))
    materialize(bundle.module, bundle.init_parameter, 0, torch.device("cpu"))
    reference = build_model(ModelSpec("small", vocab_size=256, seq_len=32)).module
    rotary, expected = bundle.module.blocks[0].attn.rotary, reference.blocks[0].attn.rotary
    assert torch.equal(rotary.cos, expected.cos) and torch.equal(rotary.sin, expected.sin)


class RecordingModel(torch.nn.Linear):
    """Stands in for an FSDP2 module: a gradient-sync setting that holds until changed
    (the stepper changes it only when it must), recorded at each micro-batch's forward."""

    def __init__(self):
        super().__init__(4, 2)
        self.sync = True
        self.syncs: list[bool] = []

    def set_requires_gradient_sync(self, enabled: bool) -> None:
        self.sync = enabled

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.syncs.append(self.sync)
        return super().forward(x)


@pytest.mark.parametrize(
    ("sharded", "probe", "expected"),
    [
        (True, False, [True, True, True]),
        (False, False, [False, False, True]),
        (True, True, [True, True, False, True]),  # the probe pass syncs the last one
        (False, True, [False, False, False, True]),
    ],
)
def test_the_stepper_syncs_every_micro_batch_only_when_sharded(sharded, probe, expected):
    model = RecordingModel()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
    stepper = DataParallelStep(
        torch.nn.functional.cross_entropy, opt, sched, None, nullcontext, 3, 1.0,
        torch.device("cpu"), sharded_accumulation=sharded,
    )
    batches = iter([(torch.randn(2, 4), torch.tensor([0, 1]))] * 3)
    stepper.step([model], batches, probe=probe)
    assert model.syncs == expected


def test_auto_over_four_workers_keeps_the_jobs_tp_and_lays_out_the_other_two():
    """What a 4-worker `auto` launch with parallel.tp = 2 runs (decided in the launcher,
    before any worker): tp 2, the other two workers as replicas or shards, whichever the
    performance model prices best, and the plan the report compares with is that layout.
    Its losses need no launch of their own: tests/dist/test_tensor_parallel.py trains both
    layouts it may pick, and `auto` itself on 2 workers."""
    job = prepare_job(cfg("parallel.strategy=auto", "parallel.tp=2", "data.micro_batch=4",
                          "data.grad_accum=2", "data.global_batch=16"), 4, CPU, 4)
    replicas_or_shards = ("dp_replicate 2 x dp_shard 1 x tp 2", "dp_replicate 1 x dp_shard 2 x tp 2")
    assert job.dims.tp == 2 and job.dims.describe() in replicas_or_shards
    assert (job.global_batch, job.grad_accum) == (16, 2)
    plan = job_plan(job)
    assert (plan["layout"], plan["accumulate"]) == (job.dims.describe(), job.accumulate)
    assert plan["name"].startswith("tp2 + ")
