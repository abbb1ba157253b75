"""Pipeline stages without a launch: which stages each rank holds (loop and V placement,
as torch's generate_stage_to_rank_mapping), which blocks each stage holds, the stages cut
from the meta model (the whole model's names; chained, the whole model's logits), the
micro-batch default, and each bad input refused in one line before any worker."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping
from torch.distributed.pipelining.schedules import get_schedule_class

from trainwise.config import load_config
from trainwise.config.schema import PIPELINE_SCHEDULES
from trainwise.errors import ConfigError
from trainwise.hardware import GB, DeviceInfo
from trainwise.models import ModelSpec, build_model
from trainwise.models.pipeline import (
    default_microbatches,
    placement,
    rank_stages,
    schedule_problems,
    split_gpt,
    stage_range,
)
from trainwise.run.engine.materialize import materialize
from trainwise.run.job.resolve import prepare_job

CPU = DeviceInfo("cpu", "cpu", 1, 64 * GB, bf16=True, fp16=False, gpu=None)


def test_every_schedule_offered_is_torchs():
    for name in PIPELINE_SCHEDULES:
        assert get_schedule_class(name).__name__.endswith(name)


@pytest.mark.parametrize(("schedule", "pp", "virtual"), [
    ("1F1B", 4, 1), ("Interleaved1F1B", 2, 3), ("InterleavedZeroBubble", 4, 2),
    ("ZBVZeroBubble", 2, 2), ("ZBVZeroBubble", 4, 2),
])
def test_each_rank_holds_the_stages_torch_maps_to_it(schedule, pp, virtual):
    torch_map = generate_stage_to_rank_mapping(pp, pp * virtual, style=placement(schedule))
    for rank in range(pp):
        assert rank_stages(rank, pp, virtual, schedule) == sorted(
            s for s, r in torch_map.items() if r == rank
        )


def test_v_placement_puts_the_first_and_last_stage_on_rank_0():
    assert rank_stages(0, 2, 2, "ZBVZeroBubble") == [0, 3]
    assert rank_stages(1, 2, 2, "ZBVZeroBubble") == [1, 2]
    assert rank_stages(1, 2, 2, "Interleaved1F1B") == [1, 3]


def test_stages_hold_runs_of_consecutive_blocks():
    # 12 + 2 does not divide into 4: equal runs.
    assert [list(stage_range(12, 4, s)) for s in range(4)] == [
        [0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]
    ]
    # 10 + 2 does: the embeddings and the head weigh a block each (torchtitan's split).
    assert [list(stage_range(10, 4, s)) for s in range(4)] == [
        [0, 1], [2, 3, 4], [5, 6, 7], [8, 9]
    ]


def test_the_runtime_runs_the_split_the_planner_prices():
    """Llama 3 405B's 126 layers on 16 stages: the planner recommends it, so the job's
    checks must accept it and the stages must hold 7 + 14 x 8 + 7 blocks."""
    assert schedule_problems("1F1B", 16, 1, 126, 16, 16) == []
    assert [len(stage_range(126, 16, s)) for s in range(16)] == [7] + [8] * 14 + [7]
    assert schedule_problems("1F1B", 4, 1, 5, 4, 4)[0].startswith(
        "parallel.pp x parallel.pp_virtual = 4 x 1 = 4 stages divide neither the model's 5 "
        "layers nor 5 + 2"
    )


def meta(name: str):
    with torch.device("meta"):
        return build_model(ModelSpec(name, vocab_size=256, seq_len=32))


@pytest.mark.parametrize("name", ["tiny", "small"])  # tiny: learned positions, a tied head
def test_stages_keep_the_whole_models_names_and_chain_to_its_logits(name):
    bundle = meta(name)
    whole = bundle.module
    n = len(whole.blocks)
    stages = [split_gpt(whole, s, n) for s in range(n)]
    names = [dict(stage.named_parameters()) for stage in stages]
    assert set().union(*names) == set(dict(whole.named_parameters()))
    assert "tok_emb.weight" in names[0] and "norm.weight" in names[-1]
    assert all(f"blocks.{s}.norm1.weight" in names[s] for s in range(n))
    assert all(stage.norm is None for stage in stages[:-1])
    # A tied head: the last stage holds its own copy of the embedding, under its name.
    assert ("tok_emb.weight" in names[-1]) == whole.shape.tie_embeddings
    assert stages[-1].tok_emb is not whole.tok_emb
    cpu = torch.device("cpu")
    for module in (whole, *stages):
        materialize(module, bundle.init_parameter, 0, cpu)
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    h = x
    for stage in stages:
        h = stage(h)
    assert torch.equal(h, whole(x))


def test_microbatches_default_to_one_sample_each():
    assert default_microbatches(4, 2) == 8
    assert schedule_problems("1F1B", 2, 1, 4, default_microbatches(1, 2), 2) == []


@pytest.mark.parametrize(("args", "line"), [
    (("1F1B", 4, 1, 5, 4, 4), "4 x 1 = 4 stages divide neither the model's 5 layers nor 5 + 2"),
    (("GPipe", 2, 2, 8, 4, 4), "'GPipe' runs one stage per rank but parallel.pp_virtual = 2"),
    (("ZBVZeroBubble", 2, 3, 6, 4, 4), "'ZBVZeroBubble' runs exactly two stages per rank"),
    (("Interleaved1F1B", 2, 1, 4, 4, 4), "interleaves several stages per rank"),
    (("1F1B", 4, 1, 8, 2, 2), "parallel.pp_microbatches = 2 is fewer than the 4 stages"),
    (("GPipe", 2, 1, 4, 3, 4), "parallel.pp_microbatches = 3 does not cut the 4 samples"),
    (("Interleaved1F1B", 2, 2, 8, 7, 14), "7 is not a multiple of its 3 rounds"),
    (("GPipe", 2, 1, 4, 2, 8, 4), "= 2 is not a multiple of data.grad_accum = 4"),
])
def test_each_bad_schedule_input_is_one_line(args, line):
    problems = schedule_problems(*args)
    assert len(problems) == 1 and line in problems[0], problems


def test_schedules_torch_accepts_pass():
    assert schedule_problems("Interleaved1F1B", 4, 2, 8, 8, 8) == []
    assert schedule_problems("InterleavedZeroBubble", 4, 2, 8, 3, 3) == []  # one round
    assert schedule_problems("ZBVZeroBubble", 2, 2, 4, 1, 4) == []  # torch pads the V
    assert schedule_problems("GPipe", 4, 1, 4, 1, 1) == []


def problems_of(world: int, *overrides: str) -> list[str]:
    config = load_config(overrides=["data.synthetic_tokens=20000", "data.seq_len=32", *overrides])
    with pytest.raises(ConfigError) as info:
        prepare_job(config, world, CPU, world)
    return info.value.problems


def test_a_model_that_does_not_split_is_refused():
    problems = problems_of(2, "model.name='mlp'", "data.dataset='digits'", "parallel.pp=2",
                           "parallel.strategy='ddp'")
    assert any("model.name = 'mlp' cannot be cut into pipeline stages" in p for p in problems)


def test_degrees_that_do_not_multiply_to_the_world_are_refused():
    problems = problems_of(4, "model.name='small'", "parallel.pp=3", "parallel.strategy='ddp'")
    assert problems == [
        "parallel.pp x parallel.tp = 3 x 1 does not divide the 4 workers (pp x data-parallel x "
        "tp must be the world size): choose degrees whose product divides cluster.nproc x "
        "cluster.nodes"
    ]


def test_auto_keeps_the_jobs_stages_and_chooses_around_them():
    """auto with parallel.pp set: the planner's chooser searches the layouts of pp stages
    (as it does for tp) and the job runs the one it picks."""
    config = load_config(overrides=[
        "data.synthetic_tokens=20000", "data.seq_len=32", "model.name='small'", "parallel.pp=2",
    ])
    job = prepare_job(config, 4, CPU, 4)
    assert job.dims.pp == 2 and job.dims.world == 4
    assert "pp 2 x" in job.decision.reason
    assert job.decision.reason.startswith(f"{job.dims.name}: ") and "pp 2" in job.dims.name


def test_a_pipeline_job_resolves_its_layout():
    config = load_config(overrides=[
        "data.synthetic_tokens=20000", "data.seq_len=32", "model.name='small'", "parallel.pp=2",
        "parallel.tp=2", "parallel.strategy='fsdp'", "parallel.pp_schedule='Interleaved1F1B'",
        "parallel.pp_virtual=3",
    ])
    job = prepare_job(config, 8, CPU, 8)
    assert job.dims.describe() == "pp 2 x dp_replicate 1 x dp_shard 2 x tp 2"
    assert job.dp_size == 2  # stages of one pipeline read the same samples
    # What people read names the stages and tp; the shortcut keeps the data-parallel part.
    assert job.decision.reason.startswith(
        "pp 2 x fsdp 2 x tp 2 (set by parallel.strategy = 'fsdp', parallel.pp = 2, "
        "parallel.tp = 2): "
    )
    assert (job.record().layout_name, job.strategy) == ("pp 2 x fsdp 2 x tp 2", "fsdp")
    assert job.global_batch == config.data.micro_batch * config.data.grad_accum * 2
    # parallel.shard = 'full' (the default) under stages: the stages' parameters stay
    # gathered through the step (torchtitan's default), and the run's reason says so.
    assert not job.dims.reshard_after_forward
    assert job.decision.reason.endswith("priced and run as grad_op.")


def test_compile_with_a_zero_bubble_schedule_is_refused():
    problems = problems_of(2, "model.name='small'", "parallel.pp=2", "parallel.strategy='ddp'",
                           "parallel.pp_schedule='ZBVZeroBubble'", "parallel.pp_virtual=3",
                           "train.compile=true")
    assert len(problems) == 2  # and the V's two stages a rank
    assert "train.compile = true with parallel.pp_schedule = 'ZBVZeroBubble'" in problems[1]
