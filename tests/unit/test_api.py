"""trainwise as a library, without launching: every public name documented and typed, the
import and a preset's plan free of torch, `trainwise.plan()` the very record `plan --json`
prints, the precedence of a job's keywords, typed errors instead of exits, and the records
read back from their JSON without losing a key."""

from __future__ import annotations

import dataclasses
import inspect
import json
import subprocess
import sys
import typing
from pathlib import Path

import pytest

import own_models
import trainwise
import user_job
from helpers import cli_env, hang_limit
from trainwise.api import JOB_KEYWORDS, PLAN_KEYWORDS, JobSpec, job_spec
from trainwise.cli.main import main
from trainwise.errors import ConfigError, ModelError
from trainwise.records import Plan, RunSummary, StepRecord


def test_every_public_name_has_a_docstring_and_type_hints():
    """Each of trainwise.__all__: functions with every parameter and the return typed,
    record classes with a docstring and every field typed (hints that resolve)."""
    from trainwise.config import JobConfig
    from trainwise.config.load import Layer

    # The names api/ imports only for type checking (they cost imports at run time).
    names = {"JobConfig": JobConfig, "Layer": Layer, "DoctorRecord": trainwise.DoctorRecord,
             "RunReport": trainwise.RunReport}
    missing = []
    for name in trainwise.__all__:
        obj = getattr(trainwise, name)
        if name == "__version__":
            assert isinstance(obj, str)
            continue
        if not inspect.getdoc(obj):
            missing.append(f"{name}: no docstring")
        if inspect.isfunction(obj):
            sig = inspect.signature(obj)
            typing.get_type_hints(obj, localns=names)  # they resolve
            untyped = [
                p for p, v in sig.parameters.items() if v.annotation is inspect.Parameter.empty
            ]
            if untyped or sig.return_annotation is inspect.Signature.empty:
                missing.append(f"{name}: untyped {untyped or 'return'}")
        elif dataclasses.is_dataclass(obj):
            hints = typing.get_type_hints(obj, localns=names)
            missing += [f"{name}.{f.name}: untyped" for f in dataclasses.fields(obj)
                        if f.name not in hints]
        elif isinstance(obj, type):  # a pydantic record (the doctor's)
            missing += [f"{name}.{f}: untyped" for f, info in obj.model_fields.items()
                        if info.annotation is None]
        else:
            missing.append(f"{name}: neither a function nor a record")
    assert missing == []
    assert {"plan", "train", "report", "doctor"} <= set(trainwise.__all__)


def test_the_verbs_stay_functions_beside_their_subpackages():
    from trainwise.plan.planner import make_plan  # binds the subpackage `plan`...
    from trainwise.report.analysis import analyse

    assert inspect.isfunction(trainwise.plan)  # ...which the package does not let shadow it
    assert inspect.isfunction(trainwise.report) and inspect.isfunction(trainwise.doctor)
    assert callable(make_plan) and callable(analyse)
    assert sys.modules["trainwise.plan"].__name__ == "trainwise.plan"


def test_import_and_a_presets_plan_import_no_torch():
    code = (
        "import sys, trainwise\n"
        "assert 'torch' not in sys.modules, 'import trainwise'\n"
        "plan = trainwise.plan(model='llama-7b', gpus=16)\n"
        "assert 'torch' not in sys.modules, 'trainwise.plan()'\n"
        "print(plan.recommendation.strategy)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], env=cli_env(), capture_output=True, text=True, timeout=hang_limit()
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip()


@pytest.mark.parametrize(
    "flags, keywords",
    [
        (["--model", "llama-13b", "--gpus", "32", "--gpu", "A100-80GB", "--sweep", "8..64"],
         {"model": "llama-13b", "gpus": 32, "gpu": "A100-80GB", "sweep": "8..64"}),
        (["--gpus", "16", "--set", "lora.rank=8", "--set", "plan.max_pp=2"],
         {"gpus": 16, "lora": {"rank": 8}, "overrides": {"plan.max_pp": 2}}),
        # Your own module: a GPT of the tests' own (priced as its shape), given as the
        # function; a classifier priced by its blocks and a sample of its own dataset.
        (["--model", "own_models:llama_small", "--seq", "256", "--gpus", "2"],
         {"model": own_models.llama_small, "seq": 256, "gpus": 2}),
        (["--model", "user_job:build", "--gpus", "2", "--set", "data.dataset=user_job:map_data"],
         {"model": user_job.build, "data": user_job.map_data, "gpus": 2}),
    ],
    ids=["preset", "sections", "own-gpt", "own-classifier"],
)
def test_plan_json_is_the_record_the_api_returns(capsys, flags, keywords):
    assert main(["plan", "--json", *flags]) == 0
    printed = capsys.readouterr().out
    plan = trainwise.plan(**keywords)
    assert isinstance(plan, Plan) and plan.planned is not None
    assert json.dumps(plan.to_dict(), indent=2) + "\n" == printed
    # And the typed record loses nothing of the planner's JSON.
    from trainwise.plan.record import plan_record

    assert Plan.from_dict(plan_record(plan.planned)).to_dict() == plan_record(plan.planned)
    assert Plan.from_dict(json.loads(printed)).to_dict() == json.loads(printed)


def test_a_job_file_given_as_a_path_a_dict_or_a_jobconfig_plans_alike(tmp_path: Path):
    from trainwise.config import load_config

    job = tmp_path / "job.toml"
    job.write_text('[model]\nname = "gpt2-124m"\n[train]\nsteps = 10\n[data]\nseq_len = 512\n')
    by_path = trainwise.plan(job, gpus=8).to_dict()
    as_dict = {"model": {"name": "gpt2-124m"}, "train": {"steps": 10}, "data": {"seq_len": 512}}
    assert trainwise.plan(as_dict, gpus=8).to_dict() == by_path
    assert trainwise.plan(load_config(job), gpus=8).to_dict() == by_path


def _steps(spec: JobSpec) -> tuple[int, str]:
    cfg, given = spec.load()
    return cfg.train.steps, given["train.steps"]


def test_keywords_win_over_sections_which_win_over_the_config(tmp_path: Path):
    """defaults < config < section dicts < shortcuts < overrides; each key names where it
    came from."""
    job = tmp_path / "job.toml"
    job.write_text("[train]\nsteps = 5\n")

    def spec(steps=None, sections=None, overrides=None) -> JobSpec:
        return job_spec(job, {"steps": steps}, JOB_KEYWORDS, sections or {}, overrides)

    assert _steps(spec()) == (5, str(job))
    assert _steps(spec(sections={"train": {"steps": 6}})) == (6, "train=")
    assert _steps(spec(7, {"train": {"steps": 6}})) == (7, "steps=")
    assert _steps(spec(7, {"train": {"steps": 6}}, {"train.steps": 8})) == (8, "overrides")
    with pytest.raises(ConfigError) as err:
        spec(-1).load()
    assert err.value.problems[0].startswith("train.steps = -1 (from steps=)")


def test_model_and_data_take_a_section_dict_or_a_value():
    spec = job_spec(None, {"model": {"name": "small", "dropout": 0.1}, "data": "synthetic"},
                    JOB_KEYWORDS, {}, None)
    cfg, _ = spec.load()
    assert (cfg.model.name, cfg.model.dropout, cfg.data.dataset) == ("small", 0.1, "synthetic")


@pytest.mark.parametrize(
    "call, error, words",
    [
        (lambda: trainwise.plan(gpus=0), ConfigError, ["plan.gpus = 0 (from gpus=)"]),
        (lambda: trainwise.plan(optimz={"lr": 1}), ConfigError, ["unknown keyword optimz="]),
        (lambda: trainwise.plan(optim=3), ConfigError, ["optim=3: a section is a dict"]),
        (lambda: trainwise.plan(sweep="1..x"), ConfigError, ["sweep '1..x'", "1..1024"]),
        (lambda: trainwise.plan(deadline_hours=1, budget_usd=1), ConfigError,
         ["deadline_hours= and budget_usd= were both given"]),
        (lambda: trainwise.train(overrides={"train.nope": 1}), ConfigError,
         ["unknown key 'train.nope' (from overrides)"]),
        (lambda: trainwise.train(model=3), ConfigError, ["model=3: give a preset"]),
    ],
)
def test_bad_input_raises_a_typed_error_naming_the_keyword(call, error, words):
    with pytest.raises(error) as err:
        call()
    text = str(err.value)
    assert len(err.value.problems) == 1 and "\n" not in text
    for word in words:
        assert word in text


def test_a_module_instance_is_refused_for_its_class():
    torch = pytest.importorskip("torch")
    with pytest.raises(ModelError, match=r"model=Linear\(\.\.\.\): an nn.Module instance"):
        trainwise.train(model=torch.nn.Linear(2, 2))


def test_the_shortcuts_set_the_keys_of_the_flags_of_the_same_name():
    """One mapping in two places (the API's keywords, the CLI's flags): they agree."""
    from trainwise.cli.plan import FLAGS
    from trainwise.cli.train import JOB_FLAGS

    flags = {flag.removeprefix("--").replace("-", "_"): key for flag, key, _, _ in FLAGS}
    assert {k: PLAN_KEYWORDS[k] for k in flags.keys() & PLAN_KEYWORDS} == {
        k: flags[k] for k in flags.keys() & PLAN_KEYWORDS
    }
    assert len(flags.keys() & PLAN_KEYWORDS) >= 10
    job = {flag.removeprefix("--").replace("-", "_"): key for key, flag in JOB_FLAGS.items()}
    shared = job.keys() & JOB_KEYWORDS
    assert shared >= {"model", "steps", "nproc", "strategy", "precision", "run_dir"}
    assert {k: JOB_KEYWORDS[k] for k in shared} == {k: job[k] for k in shared}


def test_step_and_summary_records_read_back_older_and_newer_files():
    rec = StepRecord(step=3, loss=2.0, eval_loss=None, lr=1e-3, grad_norm=1.0, step_s=0.1,
                     data_s=0.0, compute_s=0.1, sync_s=None, optim_s=0.0, ckpt_s=0.0,
                     tokens=30, tokens_per_s=300.0, samples_per_s=3.0, mfu=None, mem_bytes=1,
                     mem_kind="rss_added", elapsed_s=0.3, time=1.0, attempt=0)
    assert StepRecord.from_dict(dataclasses.asdict(rec)) == rec
    old = {k: v for k, v in dataclasses.asdict(rec).items() if k not in ("tp_s", "bubble_s")}
    assert StepRecord.from_dict({**old, "a_later_key": 1}) == rec  # unknown keys passed over
    summary = RunSummary.from_dict({"steps": 4, "retry_cost": {"failures": 1, "total_s": 2.0}})
    assert summary.retry_cost is not None and summary.retry_cost.failures == 1
    assert summary.final_loss is None and summary.stage_share == {}
