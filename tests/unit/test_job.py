"""Unit tests of trainwise.run.job.resolve: the machine-dependent checks (collected into one
ConfigError), the strategy decision and resolve_nproc, on fake devices (no CUDA needed)."""

from __future__ import annotations

import pytest

from trainwise.config import load_config
from trainwise.errors import ConfigError
from trainwise.hardware import GB, DeviceInfo
from trainwise.models.moe.cost import param_split
from trainwise.models.registry import build_model
from trainwise.models.shapes import PRESETS
from trainwise.plan import runtime_allowed
from trainwise.plan.constraints import user_allowed
from trainwise.plan.estimate import evaluate, price
from trainwise.plan.inputs import resolve_inputs
from trainwise.plan.moe.comm import ALL_TO_ALL
from trainwise.plan.planner import make_plan
from trainwise.run.job.resolve import job_plan, prepare_job, resolve_nproc, start_lines
from trainwise.run.job.run_files import default_run_dir

CPU = DeviceInfo("cpu", "cpu", 1, 64 * GB, bf16=True, fp16=False, gpu=None)
# A GPU without bf16 (e.g. a V100-class card), one visible.
GPU1 = DeviceInfo("cuda", "FakeGPU", 1, 16 * GB, bf16=False, fp16=True, gpu=None)
GPU4 = DeviceInfo("cuda", "FakeGPU", 4, 16 * GB, bf16=True, fp16=True, gpu=None)
NO_GPU = DeviceInfo("cuda", "none", 0, 0.0, bf16=False, fp16=False, gpu=None)

SMALL = ["data.synthetic_tokens=20000"]


def cfg(*overrides: str):
    return load_config(overrides=[*SMALL, *overrides])


def problems_of(config, world: int, device: DeviceInfo = CPU) -> list[str]:
    with pytest.raises(ConfigError) as info:
        prepare_job(config, world, device)
    return info.value.problems


# --- defaults on CPU ----------------------------------------------------------------------


def test_default_config_world_2_on_cpu_is_ddp():
    job = prepare_job(cfg(), 2, CPU)
    assert job.strategy == "ddp"
    assert job.cpu_offload is False
    assert job.backend == "gloo"
    assert job.replicate == 1
    assert job.dp_size == 2
    # micro_batch 16 x grad_accum 1 x 2 workers.
    assert job.global_batch == 32
    assert job.params == job.shape.num_params()
    assert job.decision.reason.startswith("ddp")


def test_default_config_world_1_on_cpu_is_single():
    job = prepare_job(cfg(), 1, CPU)
    assert job.strategy == "single"
    assert job.dp_size == 1
    assert job.global_batch == 16  # 16 x 1 x 1


def test_global_batch_is_micro_batch_times_accum_times_world():
    job = prepare_job(cfg("data.micro_batch=4", "data.grad_accum=3"), 2, CPU)
    assert job.global_batch == 24  # 4 x 3 x 2
    assert job.summary_dict()["tokens_per_step"] == 24 * 64  # default seq_len 64


def test_matching_global_batch_is_accepted():
    job = prepare_job(cfg("data.global_batch=32"), 2, CPU)  # 16 x 1 x 2
    assert job.global_batch == 32


# --- machine checks ----------------------------------------------------------------------


def test_fp16_on_cpu_is_an_error():
    problems = problems_of(cfg("precision.dtype=fp16"), 1, CPU)
    assert len(problems) == 1
    assert "precision.dtype" in problems[0]
    assert "fp16" in problems[0]


def test_bf16_on_a_gpu_without_bf16_is_an_error():
    problems = problems_of(cfg("precision.dtype=bf16"), 1, GPU1)
    assert len(problems) == 1
    assert "precision.dtype = 'bf16'" in problems[0]
    assert "FakeGPU" in problems[0]


def test_fake_gpu_with_supported_settings_is_accepted():
    job = prepare_job(cfg("precision.dtype=fp16"), 1, GPU1)
    assert job.backend == "nccl"
    assert job.strategy == "single"


def test_more_workers_than_gpus_is_an_error():
    problems = problems_of(cfg(), 2, GPU1)
    assert len(problems) == 1
    assert "cluster.nproc = 2" in problems[0]
    assert "1 visible GPUs" in problems[0]


def test_cuda_without_a_visible_gpu_is_an_error():
    problems = problems_of(cfg(), 1, NO_GPU)
    assert any("no CUDA device is visible" in p for p in problems)


def test_nccl_on_cpu_is_an_error():
    problems = problems_of(cfg("cluster.backend=nccl"), 1, CPU)
    assert len(problems) == 1
    assert "cluster.backend = 'nccl'" in problems[0]


def test_strategy_single_with_world_2_is_an_error():
    problems = problems_of(cfg("parallel.strategy=single"), 2, CPU)
    assert len(problems) == 1
    assert "parallel.strategy = 'single'" in problems[0]
    assert "cluster.nproc = 2" in problems[0]


def test_hsdp_replicate_must_divide_the_world():
    problems = problems_of(cfg("parallel.strategy=hsdp", "parallel.replicate=3"), 2, CPU)
    assert len(problems) == 1
    assert "parallel.replicate = 3" in problems[0]
    assert "world size 2" in problems[0]


def test_hsdp_that_divides_the_world_is_accepted():
    job = prepare_job(cfg("parallel.strategy=hsdp", "parallel.replicate=2"), 4, CPU)
    assert (job.strategy, job.replicate) == ("hsdp", 2)
    assert job.global_batch == 64  # 16 x 1 x 4


def test_cpu_offload_on_cpu_is_an_error():
    problems = problems_of(cfg("parallel.strategy=fsdp", "parallel.cpu_offload=true"), 2, CPU)
    assert len(problems) == 1
    assert "parallel.cpu_offload" in problems[0]


def test_global_batch_mismatch_shows_the_arithmetic():
    problems = problems_of(cfg("data.global_batch=64"), 2, CPU)
    assert len(problems) == 1
    assert "data.global_batch = 64" in problems[0]
    assert "micro_batch(16) x grad_accum(1) x data-parallel size(2) = 32" in problems[0]


def test_global_batch_larger_than_the_training_samples():
    # 20000 tokens, 5% held out: 19000 training tokens, (19000 - 1) // 64 = 296 windows,
    # fewer than a global batch of 400 x 1 x 1.
    problems = problems_of(cfg("data.micro_batch=400"), 1, CPU)
    assert len(problems) == 1
    assert "global batch 400" in problems[0]
    assert "296 training samples" in problems[0]


def test_model_vocab_smaller_than_the_data_vocab():
    problems = problems_of(cfg("model.vocab_size=10"), 1, CPU)
    assert len(problems) == 1
    assert "model.vocab_size = 10" in problems[0]
    assert "256" in problems[0]  # the synthetic corpus' default vocabulary


def test_unknown_model_name():
    problems = problems_of(cfg("model.name=no-such-model"), 1, CPU)
    assert len(problems) == 1
    assert "'no-such-model'" in problems[0]
    assert "tiny" in problems[0]  # the presets are listed


def test_several_machine_problems_are_reported_together():
    config = cfg("precision.dtype=fp16", "parallel.strategy=single", "cluster.backend=nccl")
    problems = problems_of(config, 2, CPU)
    assert len(problems) == 3
    assert any("precision.dtype" in p for p in problems)
    assert any("parallel.strategy = 'single'" in p for p in problems)
    assert any("cluster.backend" in p for p in problems)
    assert all("\n" not in p for p in problems)


def test_machine_problems_are_kept_when_the_model_is_unknown():
    problems = problems_of(cfg("precision.dtype=fp16", "model.name=no-such-model"), 1, CPU)
    assert len(problems) == 2


# --- the strategy decision -----------------------------------------------------------------


def test_auto_picks_fsdp_when_device_memory_is_tiny():
    job = prepare_job(cfg("cluster.device_memory_gb=0.01"), 2, CPU)
    assert job.strategy == "fsdp"
    assert job.cpu_offload is False  # nothing to offload from on CPU
    # 0.01 GB with 5% headroom: 9.5 MB, less than one replica.
    assert job.decision.budget_bytes == pytest.approx(0.01 * GB * 0.95)
    assert job.decision.replica.total > job.decision.budget_bytes


def test_auto_picks_ddp_when_device_memory_is_large():
    job = prepare_job(cfg("cluster.device_memory_gb=100"), 2, CPU)
    assert job.strategy == "ddp"
    assert job.decision.budget_bytes == pytest.approx(100 * GB * 0.95)


def test_cpu_memory_is_shared_by_the_workers():
    job = prepare_job(cfg(), 2, CPU)
    # 64 GB of RAM over 2 workers, 5% kept free: 30.4 GB each.
    assert job.decision.budget_bytes == pytest.approx(64 * GB / 2 * 0.95)


def test_forced_ddp_that_cannot_fit_is_an_error():
    problems = problems_of(cfg("parallel.strategy=ddp", "cluster.device_memory_gb=0.001"), 2)
    assert len(problems) == 1
    assert "parallel.strategy = 'ddp'" in problems[0]


def test_forced_fsdp_is_kept_with_its_reason():
    job = prepare_job(cfg("parallel.strategy=fsdp"), 2, CPU)
    assert job.strategy == "fsdp"
    assert "set by parallel.strategy" in job.decision.reason


# --- several machines: hsdp ----------------------------------------------------------------

# 16 ranks need 2-token batches and no held-out evaluation on the small synthetic data.
MANY = ("data.micro_batch=2", "train.eval_every=0")
# 3 MB devices: the default model's replica (3.5 MB) does not fit 2.7 MB usable; fsdp over
# 16 (2.0 MB) and hsdp over 8 (2.1 MB) do. Between machines one NIC of 0.01 GB/s, within
# the catalog's cpu loopback at 2 GB/s: the planner predicts fsdp 0.138 s a step, hsdp
# over 8 0.0516 s (its 8 rails share the one NIC).
SLOW_LINK = ("cluster.inter_node_gbps=0.01", "cluster.nics_per_node=1")
TINY_SLOW = (*MANY, "cluster.device_memory_gb=0.003", *SLOW_LINK)


def _same_as_the_plan(job) -> None:
    """`auto` ran the planner's chooser: `trainwise plan` on the same inputs, restricted to
    what the runtime runs, recommends the same configuration, and the job runs its layout."""
    c = job.cfg.parallel
    plan = make_plan(job.plan_inputs, allowed=runtime_allowed(c.shard, c.dp_shard))
    assert plan.recommendation.choice.setup == job.decision.choice.setup
    chosen = job.decision.choice.dims
    assert (job.dims.dp_replicate, job.dims.dp_shard, job.dims.fsdp) == (
        chosen.dp_replicate, chosen.dp_shard, chosen.fsdp,
    )


def test_auto_on_two_machines_with_a_slow_link_is_hsdp_across_them():
    job = prepare_job(cfg(*TINY_SLOW), 16, CPU, local_world=8)
    assert (job.strategy, job.replicate, job.cpu_offload) == ("hsdp", 2, False)
    assert job.dp_size == 16
    assert job.decision.reason.startswith("hsdp: ")
    assert "dp_replicate 2 x dp_shard 8 x tp 1" in job.decision.reason
    # Whole-world FSDP sends every gather over the slow link; hsdp only the gradient
    # shards' all-reduce (its step is priced by the same model the plan uses).
    hsdp, fsdp = job.decision.choice.plan, evaluate(job.plan_inputs, "fsdp-full")
    assert hsdp.step.exposed_comm < fsdp.step.exposed_comm
    assert hsdp.step.total < fsdp.step.total
    assert job.summary_dict()["replicate"] == 2
    _same_as_the_plan(job)


def test_auto_on_one_machine_takes_the_planners_shard_group():
    # One machine: no group crosses the slow link, so the shard group is the planner's
    # choice by its step alone (the per-operation model prices the optimizer step divided
    # over the shard group, so it may take all 16), not the cross-machine hsdp of two.
    job = prepare_job(cfg(*TINY_SLOW), 16, CPU, local_world=16)
    assert job.dims.dp_shard * job.replicate == 16 and job.replicate != 2
    _same_as_the_plan(job)


def test_auto_on_two_machines_with_a_slow_link_keeps_ddp_when_a_replica_fits():
    # The replica fits. NCCL's tree all-reduce reduces inside each machine before crossing,
    # so ddp puts the bytes hsdp's all-reduce across machines would on the one NIC: the
    # simplest, ddp, is within 1 % of the best.
    job = prepare_job(cfg(*MANY, *SLOW_LINK), 16, CPU, local_world=8)
    assert job.strategy == "ddp"
    assert evaluate(job.plan_inputs, "ddp").step.total <= 1.01 * evaluate(
        job.plan_inputs, "hsdp"
    ).step.total
    _same_as_the_plan(job)


def test_auto_on_one_machine_that_fits_a_replica_is_ddp():
    job = prepare_job(cfg(), 2, CPU)
    assert (job.strategy, job.replicate) == ("ddp", 1)
    _same_as_the_plan(job)


def test_hsdp_replicates_across_the_machines_by_default():
    job = prepare_job(cfg("parallel.strategy=hsdp"), 4, CPU, local_world=2)
    assert (job.strategy, job.replicate) == ("hsdp", 2)
    # On one machine the default stays 1; a given replicate is kept.
    assert prepare_job(cfg("parallel.strategy=hsdp"), 4, CPU).replicate == 1
    given = cfg("parallel.strategy=hsdp", "parallel.replicate=4")
    assert prepare_job(given, 4, CPU, local_world=2).replicate == 4


# --- resolve_nproc -------------------------------------------------------------------------


def test_resolve_nproc_explicit():
    assert resolve_nproc(load_config(overrides=["cluster.nproc=3"]), GPU4) == 3


def test_resolve_nproc_single_is_one():
    assert resolve_nproc(load_config(overrides=["parallel.strategy=single"]), GPU4) == 1


def test_resolve_nproc_cpu_is_two():
    assert resolve_nproc(load_config(), CPU) == 2


def test_resolve_nproc_cuda_is_one_per_gpu():
    assert resolve_nproc(load_config(), GPU4) == 4
    assert resolve_nproc(load_config(), NO_GPU) == 1  # max(0, 1)


def test_auto_on_one_cpu_worker_never_picks_cpu_offload():
    job = prepare_job(cfg("cluster.device_memory_gb=0.0001"), 1, CPU)
    assert job.cpu_offload is False


def test_gpu_count_is_checked_per_machine_not_per_job():
    # 2 machines x 4 GPUs: a world of 8 with 4 workers here is fine...
    job = prepare_job(cfg(), 8, GPU4, local_world=4)
    assert job.world == 8 and job.dp_size == 8
    # ...5 workers on a machine with 4 GPUs is not.
    with pytest.raises(ConfigError) as info:
        prepare_job(cfg(), 10, GPU4, local_world=5)
    assert any("cluster.nproc = 5 exceeds the 4 visible GPUs" in p for p in info.value.problems)


def test_a_held_out_split_smaller_than_the_ranks_is_an_error():
    # 1400 tokens, 5 % held out = 70 tokens -> one 64-token window for 2 ranks.
    problems = problems_of(cfg("data.synthetic_tokens=1400", "data.micro_batch=2"), 2, CPU)
    assert len(problems) == 1
    assert "holds out 1 samples" in problems[0] and "train.eval_every = 0" in problems[0]
    # Without evaluation the same data is fine.
    job = prepare_job(
        cfg("data.synthetic_tokens=1400", "data.micro_batch=2", "train.eval_every=0"), 2, CPU
    )
    assert job.strategy == "ddp"


# --- a Mixture-of-Experts job: priced by its shape, its ep kept ---------------------------

MOE = ("model.name='moe-tiny'", "data.seq_len=64")


def test_auto_prices_a_moe_job_by_its_shape_and_keeps_its_ep():
    """`auto` prices a MoE job with the planner's MoE model (plan/moe: experts over ep, the
    all-to-all, moe.imbalance), not as a module's profile; the job's parallel.ep
    constrains the search (plan.constraints: the runtime keeps it), so the layout chosen
    is the one that runs: the same `trainwise plan` recommends under those constraints."""
    job = prepare_job(cfg(*MOE, "parallel.ep=2", "moe.imbalance=1.1"), 2, CPU)
    w = job.plan_inputs.workload
    assert (w.moe, w.profile, w.imbalance) == (job.moe, None, 1.1)
    assert job.decision.choice.dims.ep == job.dims.ep == 2
    assert not job.plan_notes  # nothing put on the layout after the choice
    plan = make_plan(job.plan_inputs, allowed=user_allowed(job.cfg))
    assert plan.recommendation.choice.setup == job.decision.choice.setup
    # Each rank holds the dense parameters and half of the experts (fp32 master weights).
    dense, experts = param_split(job.moe).dense, job.moe.expert_total()
    assert job.decision.estimate.params == pytest.approx(4 * (dense + experts / 2))
    # Without parallel.ep the job's ep is 1: kept, every expert on every rank.
    dense_job = prepare_job(cfg(*MOE), 2, CPU)
    assert dense_job.dims.ep == 1
    assert dense_job.decision.estimate.params == pytest.approx(4 * (dense + experts))


def test_a_moe_jobs_plan_carries_the_all_to_all_and_the_imbalance():
    """plan.json of a MoE job with its experts split: the imbalance priced and the seconds
    of a step its all-to-alls take (the report sets the run's measured ones beside them)."""
    job = prepare_job(cfg(*MOE, "parallel.ep=2", "parallel.strategy=fsdp"), 2, CPU)
    plan = job_plan(job)
    assert plan["name"] == "ep2 + fsdp-full" and plan["moe_imbalance"] == 1.25
    setup = job.decision.setup
    (a2a,) = [c for c in price(job.plan_inputs, setup).collectives if c.name == ALL_TO_ALL]
    assert plan["all_to_all_s"] == pytest.approx(a2a.seconds) and a2a.seconds > 0
    assert job_plan(prepare_job(cfg(*MOE), 2, CPU))["all_to_all_s"] is None


def test_a_moe_job_in_pipeline_stages_is_priced_with_them():
    """The runtime runs a MoE model in pipeline stages; the planner's MoE model prices
    them (plan.moe.parallel): the job's plan is its stages', with nothing left out."""
    job = prepare_job(cfg(*MOE, "parallel.ep=2", "parallel.strategy=fsdp", "parallel.pp=2",
                          "data.grad_accum=2"), 4, CPU)
    assert job.dims.name == "pp 2 x fsdp 2 x ep 2"
    assert job.plan_notes == []
    plan = job_plan(job)
    assert plan["name"].startswith("pp2 + ep2 + ") and plan["all_to_all_s"] > 0
    # auto chooses the layout inside the stages, as for the GPT (the planner cuts it now)
    auto = prepare_job(cfg(*MOE, "parallel.pp=2", "data.grad_accum=2"), 4, CPU)
    assert auto.dims.pp == 2 and auto.decision.setup.dims.pp == 2


# --- the planner counts what training builds ----------------------------------------------

# Presets small enough to build on a CPU in a test.
BUILDABLE = [name for name, shape in PRESETS.items() if shape.num_params() < 20_000_000]


def test_the_small_presets_are_compared():
    assert {"tiny", "small"} <= set(BUILDABLE)


@pytest.mark.parametrize("name", BUILDABLE)
@pytest.mark.parametrize(
    "extra",
    [[], ["data.seq_len=32"], ["data.seq_len=200", "model.vocab_size=300"]],
    ids=["defaults", "shorter-context", "longer-context-bigger-vocab"],
)
def test_the_plan_counts_the_parameters_training_builds(name: str, extra: list[str]):
    config = cfg(f"model.name={name}", "cluster.device=cpu", *extra)
    job = prepare_job(config, 2, CPU)
    built = build_model(job.model_spec).module
    trained = sum(p.numel() for p in built.parameters())  # tied weights once
    assert resolve_inputs(config).workload.params == trained
    assert job.params == trained


# --- what the launcher says at start-up ---------------------------------------------------


def test_start_lines_say_how_the_batch_follows_from_nproc_and_warn_past_the_cores():
    two, eight = (prepare_job(cfg(), n, CPU) for n in (2, 8))
    assert start_lines(two, 2, cores=2) == [
        "trainwise: plan figures: uncalibrated defaults (the catalog's figures and plan.* "
        "assumptions; `trainwise doctor` measures this machine)",
        "trainwise: global batch 32 samples per step = data.micro_batch 16 x data.grad_accum "
        "1 x data-parallel size 2 (--nproc 2); another --nproc changes it",
    ]
    _, batch, warning = start_lines(eight, 8, cores=2)
    assert "global batch 128 " in batch and "data-parallel size 8 (--nproc 8)" in batch
    assert warning.startswith("trainwise: warning: 8 CPU workers (--nproc 8) on 2 cores")
    assert "--nproc 2 or fewer" in warning
    # A GPU the catalog lacks: no plan (so no figures line), and no warning.
    assert len(start_lines(prepare_job(cfg(), 4, GPU4), 4, cores=2)) == 1


def test_the_launcher_prints_the_start_lines(tmp_path, monkeypatch, capsys):
    from trainwise.hardware import detect
    from trainwise.run.launch import torchrun as launch
    from trainwise.run.launch.start import start_job

    monkeypatch.setattr(detect, "detect_device", lambda kind="auto": CPU)
    monkeypatch.setattr(detect, "usable_cores", lambda: 2)
    started = []
    monkeypatch.setattr(launch, "launch_workers", lambda *a, **kw: started.append(a[1]))
    # Asked for (cluster.oversubscribe): started, with the warning.
    config = cfg("cluster.nproc=8", "cluster.oversubscribe=true",
                 f"logging.run_dir='{tmp_path / 'run'}'")
    start_job(config, lambda *_: None, "trainwise.run.engine.worker")
    err = capsys.readouterr().err.splitlines()
    assert started == [8]
    assert any("global batch 128 " in line for line in err)
    assert any("warning: 8 CPU workers (--nproc 8) on 2 cores" in line for line in err)


def test_the_job_holds_its_layout_as_one_value():
    job = prepare_job(cfg("parallel.strategy=hsdp", "parallel.replicate=2"), 4, CPU)
    assert job.dims.describe() == "dp_replicate 2 x dp_shard 2 x tp 1"
    assert (job.dims.hybrid, job.dims.plan_name, job.dp_size) == (True, "hsdp", 4)
    assert job.summary_dict()["layout"] == "dp_replicate 2 x dp_shard 2 x tp 1"
    assert prepare_job(cfg("parallel.strategy=ddp"), 2, CPU).dims.fsdp is False


def test_a_shard_group_smaller_than_the_world_is_hybrid():
    job = prepare_job(cfg("parallel.strategy=fsdp", "parallel.dp_shard=2"), 4, CPU)
    assert (job.dims.dp_replicate, job.dims.dp_shard, job.strategy) == (2, 2, "hsdp")


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (("parallel.tp=3",), "parallel.tp = 3 does not divide the 4 workers"),
        (("parallel.tp=2", "parallel.strategy=fsdp", "parallel.dp_shard=4"),
         "parallel.dp_shard = 4 does not divide the 4 workers / parallel.tp 2"),
        (("parallel.strategy=ddp", "parallel.dp_shard=2"), "parallel.dp_shard = 2 shards with FSDP"),
        (("parallel.strategy=fsdp", "parallel.dp_shard=3"), "parallel.dp_shard = 3 does not divide"),
    ],
)
def test_degrees_the_runtime_cannot_run_are_one_line_each(overrides: tuple, expected: str):
    problems = problems_of(cfg(*overrides), 4)
    assert any(expected in p for p in problems), problems


# --- an explicit layout is priced as plan.json prices it -----------------------------------


@pytest.mark.parametrize(
    "overrides",
    [
        ("parallel.strategy=ddp", "parallel.tp=2"),
        ("parallel.strategy=ddp", "parallel.tp=2", "parallel.sequence_parallel=false"),
        # parallel.accumulate = auto: the mode the planner chooses, the one that runs
        ("parallel.strategy=fsdp", "data.grad_accum=4"),
        ("parallel.strategy=fsdp", "parallel.shard=grad_op", "parallel.tp=2", "data.grad_accum=2"),
    ],
)
def test_an_explicit_layout_is_priced_as_plan_json_prices_it(overrides):
    job = prepare_job(cfg(*overrides), 4, CPU)
    planned = job_plan(job)["memory_per_gpu"]
    # job.json's estimate (the doctor's memory check reads the same decision) is plan.json's
    assert job.summary_dict()["memory_estimate"]["total"] == pytest.approx(planned["total"], abs=1)
    assert job.decision.setup.dims == job.dims
    assert job.decision.setup.accumulate == job.accumulate


def test_ddp_with_tensor_parallelism_is_priced_with_it_not_as_a_replica():
    job = prepare_job(cfg("parallel.strategy=ddp", "parallel.tp=2"), 4, CPU)
    tp_share, replica = job.decision.estimate.total, job.decision.replica.total
    assert tp_share < replica  # each rank holds half of the model
    # A device between the two runs it; below its share is refused, naming the share.
    between = (tp_share + replica) / 2 / GB
    fits = prepare_job(cfg("parallel.strategy=ddp", "parallel.tp=2",
                           f"cluster.device_memory_gb={between}"), 4, CPU)
    assert fits.dims.tp == 2
    too_small = cfg("parallel.strategy=ddp", "parallel.tp=2",
                    f"cluster.device_memory_gb={tp_share * 0.9 / GB}")
    (problem,) = problems_of(too_small, 4)
    assert problem.startswith("parallel.strategy = 'ddp' needs ")
    # Sequence parallelism splits the norms' activations: without it a rank holds more.
    without_sp = prepare_job(
        cfg("parallel.strategy=ddp", "parallel.tp=2", "parallel.sequence_parallel=false"), 4, CPU
    )
    assert without_sp.decision.estimate.activations > job.decision.estimate.activations


def test_the_default_run_directory_ends_with_the_layouts_name():
    assert default_run_dir(cfg(), "pp 2 x fsdp 2").name.endswith("-tiny-pp2-fsdp2")
    assert default_run_dir(cfg(), "ddp").name.endswith("-tiny-ddp")
