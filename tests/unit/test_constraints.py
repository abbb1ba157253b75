"""What the user sets constrains the planner's search (plan.constraints), the strategy
words plan and train share, and the job --emit writes (plan.emit): the issue's commands."""

from __future__ import annotations

import math

import pytest

from trainwise.config import load_config
from trainwise.config.load import load_job
from trainwise.errors import ConfigError
from trainwise.hardware.catalog import GB
from trainwise.plan.constraints import check_allowed, user_allowed
from trainwise.plan.emit import job_config, job_toml
from trainwise.plan.inputs import PLAN_DEFAULTS, resolve_inputs
from trainwise.plan.planner import make_plan
from trainwise.plan.search import recommend
from trainwise.plan.space import shortcut


def planned(flags: dict | None = None, sets: tuple[str, ...] = ()):
    """What `trainwise plan` does with these flags and --set: (plan, config, given keys)."""
    cfg, given = load_job(None, flags or {}, list(sets), base=PLAN_DEFAULTS)
    inputs = resolve_inputs(cfg)
    allowed = user_allowed(cfg, given)
    check_allowed(inputs, allowed)
    return make_plan(inputs, allowed=allowed), cfg, given


def test_the_settings_given_stay_in_the_recommendation():
    # plan --model llama-7b --gpus 64 --gpus-per-node 8 --ac full --micro-batch 4
    #      --set parallel.tp=4: it recommended tp 1, ac none, micro-batch 2
    flags = {"model.name": "llama-7b", "plan.gpus": 64, "cluster.nproc": 8,
             "parallel.ac": "full", "data.micro_batch": 4}
    plan, _, _ = planned(flags, ("parallel.tp=4",))
    choice = plan.recommendation.choice
    assert choice.fits
    assert (choice.ac, choice.micro_batch, choice.dims.tp) == ("full", 4, 4)
    # What is unset is still searched: free, the search picks other values.
    free, _, _ = planned({"model.name": "llama-7b", "plan.gpus": 64, "cluster.nproc": 8})
    assert (free.best.setup.ac, free.best.setup.micro_batch, free.best.setup.dims.tp) != (
        "full", 4, 4,
    )


def test_sharded_accumulation_is_priced_when_set():
    # plan --params 7.5e9 --gpus 64 --strategy fsdp-full --set parallel.accumulate=sharded
    flags = {"plan.params": 7.5e9, "plan.gpus": 64, "cluster.nproc": 8,
             "plan.strategy": "fsdp-full"}
    plan, _, _ = planned(flags, ("parallel.accumulate=sharded",))
    zero3 = 7.5e9 * 16 / 64  # ZeRO-3: 16 bytes of model state per parameter, over 64
    assert plan.strategy("fsdp-full").setup.accumulate == "sharded"  # 1 x 16 micro-batches
    for s in (plan.best, plan.strategy("fsdp-full")):
        states = s.memory.params + s.memory.grads + s.memory.optimizer
        assert states == pytest.approx(zero3, rel=1e-3)
        assert states / GB == pytest.approx(1.88, abs=0.005)


@pytest.mark.parametrize(
    "word, plan_name, kind",
    [("fsdp", "fsdp-full", "fsdp"), ("hsdp", "hsdp", "hsdp"), ("ddp", "ddp", "ddp"),
     ("fsdp-grad-op", "fsdp-grad-op", "fsdp")],
)
def test_plan_takes_trains_strategy_words(word, plan_name, kind):
    plan, _, _ = planned({"model.name": "llama-7b", "plan.gpus": 16, "plan.strategy": word})
    assert plan.strategies[0].name == plan_name  # the named row
    assert plan.best.fits and shortcut(plan.best.setup.dims) == kind  # the search, kept to it


def test_plan_fsdp_keeps_parallel_shard():
    plan, _, _ = planned(
        {"model.name": "llama-7b", "plan.gpus": 8, "plan.strategy": "fsdp"},
        ("parallel.shard=grad_op",),
    )
    assert plan.best.setup.dims.plan_name == "fsdp-grad-op"


def test_train_takes_the_planners_row_names():
    cfg = load_config(overrides=["parallel.strategy=fsdp-grad-op"])
    assert (cfg.parallel.strategy, cfg.parallel.shard) == ("fsdp", "grad_op")
    cfg = load_config(overrides=["parallel.strategy=fsdp-offload"])
    assert (cfg.parallel.strategy, cfg.parallel.cpu_offload) == ("fsdp", True)
    with pytest.raises(ConfigError, match="parallel.shard = 'full'"):
        load_config(overrides=["parallel.strategy=fsdp-grad-op", "parallel.shard=full"])


def test_nothing_fits_under_the_settings_says_which_one_to_relax():
    # plan --strategy ddp where one replica does not fit: no recommendation that does not fit
    plan, _, _ = planned(
        {"model.name": "llama-7b", "plan.gpus": 8, "plan.strategy": "ddp"}, ("parallel.tp=1",)
    )
    assert not plan.recommendation.choice.fits
    nearest = [r for r in plan.recommendation.reasons if "nearest configuration" in r]
    assert len(nearest) == 1 and 'plan.strategy = "ddp"' in nearest[0]


@pytest.mark.parametrize(
    "sets, words",
    [(("parallel.tp=3",), "parallel.tp = 3 does not divide"),
     (("plan.strategy=single",), "strategy 'single' runs one GPU")],
)
def test_a_setting_nothing_meets_is_one_line(sets, words):
    with pytest.raises(ConfigError, match=words) as err:
        planned({"model.name": "llama-7b", "plan.gpus": 64}, sets)
    assert len(err.value.problems) == 1


def test_plan_and_auto_choose_alike_for_a_job_that_sets_its_knobs():
    """The same constraints function: a job that sets what the runtime keeps (knobs, tp,
    shard) gets one answer from `plan` and from `train --strategy auto`."""
    sets = ["parallel.ac=selective", "data.micro_batch=2", "data.grad_accum=4",
            "parallel.tp=2", "parallel.shard=full"]
    cfg, given = load_job(None, {"model.name": "llama-7b", "plan.gpus": 32}, sets,
                          base={**PLAN_DEFAULTS, "data.global_batch": None})
    inputs = resolve_inputs(cfg)
    as_plan = recommend(inputs, user_allowed(cfg, given))
    as_auto = recommend(inputs, user_allowed(cfg))
    assert as_plan.setup == as_auto.setup


def _emitted(flags: dict):
    plan, cfg, given = planned(flags)
    choice = plan.recommendation.choice
    return plan, choice, job_config(cfg, choice, plan.inputs, given), job_toml(
        cfg, choice, plan.inputs, given
    )


def test_the_12_gpu_job_runs_its_global_batch_on_12_workers():
    # llama-7b on 12 GPUs emitted 16 workers and 86 x 12 = 1,032 for 1,024
    plan, choice, job, text = _emitted({"model.name": "llama-7b", "plan.gpus": 12})
    dp = 12 // (job.parallel.tp * job.parallel.pp)  # the data-parallel ranks
    assert job.cluster.nproc * job.cluster.nodes == 12
    assert job.cluster.nproc <= 8  # the machines' GPUs
    assert job.data.micro_batch * job.data.grad_accum * dp == job.data.global_batch
    assert job.data.global_batch == 1020  # the nearest multiple of 12 workers, said so
    assert "global batch 1,020 instead of 1,024" in text
    seq = job.data.seq_len
    assert seq == 4096 and job.model.name == "llama-7b" and job.model.vocab_size == 32000
    assert job.train.steps == math.ceil(plan.inputs.tokens / (1020 * seq))
    interval = choice.plan.checkpoint.interval_min * 60 / choice.plan.step.total
    assert job.checkpoint.interval == round(interval)
    assert len(text.splitlines()) < 40  # the planned keys, not the commented schema


def test_the_3_worker_cpu_job_rounds_its_batch_and_says_so():
    plan, choice, job, text = _emitted(
        {"model.name": "tiny", "cluster.gpu": "cpu", "plan.gpus": 3, "data.global_batch": 32}
    )
    assert (job.cluster.nproc, job.cluster.nodes, job.cluster.device) == (3, 1, "cpu")
    assert job.data.micro_batch * job.data.grad_accum * 3 == job.data.global_batch == 33
    assert "33 instead of 32" in text and "33 instead of 32" in " ".join(plan.warnings)
