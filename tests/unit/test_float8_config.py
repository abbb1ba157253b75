"""precision.float8: the job keys validate (fp16 refused, rowwise without float8
all-gather), enter the lineage only when on, and `trainwise train` / trainwise.train()
refuse a float8 job with one line before any worker starts (the planner prices float8; this
version does not train it)."""

from __future__ import annotations

import pytest

import trainwise
from trainwise.cli.main import main
from trainwise.config import load_config
from trainwise.config.lineage import lineage_keys
from trainwise.errors import ConfigError, NotTrainedError
from trainwise.hardware import DeviceInfo
from trainwise.run.job.resolve import prepare_job

CPU = DeviceInfo("cpu", "cpu", 1, 64e9, bf16=True, fp16=False, gpu=None)


def test_float8_defaults_off_and_rowwise_implies_no_float8_all_gather():
    p = load_config().precision
    assert (p.float8, p.float8_all_gather) == ("none", True)
    p = load_config(overrides=["precision.float8='rowwise'"]).precision
    assert (p.float8, p.float8_all_gather) == ("rowwise", False)


@pytest.mark.parametrize(("overrides", "words"), [
    (["precision.float8='tensorwise'", "precision.dtype='fp16'"], "precision.dtype = 'bf16'"),
    (["precision.float8='rowwise'", "precision.float8_all_gather=true"], "tensorwise"),
    (["precision.float8='int8'"], "precision.float8"),
])
def test_float8_settings_that_cannot_run_are_refused_in_one_line(overrides, words):
    with pytest.raises(ConfigError) as info:
        load_config(overrides=overrides)
    assert words in str(info.value)


def test_float8_enters_the_lineage_only_when_on():
    assert not any("float8" in k for k in lineage_keys(load_config(), 16))
    keys = lineage_keys(load_config(overrides=["precision.float8='tensorwise'"]), 16)
    assert keys["precision.float8"] == "tensorwise"


def test_prepare_job_refuses_float8_with_one_typed_line():
    cfg = load_config(overrides=["precision.float8='tensorwise'"])
    with pytest.raises(NotTrainedError) as info:
        prepare_job(cfg, 1, CPU)
    (line,) = info.value.problems
    assert line.startswith("precision.float8 = 'tensorwise'")
    assert "trainwise plan" in line and "precision.float8 = 'none'" in line


def test_train_cli_refuses_float8_before_any_worker(tmp_path, capsys):
    run_dir = tmp_path / "run"
    rc = main(["train", "--set", "cluster.device='cpu'", "--set", "precision.float8='rowwise'",
               "--run-dir", str(run_dir)])
    assert rc == 2 and not run_dir.exists()
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("trainwise: error: precision.float8 = 'rowwise'")


def test_train_api_raises_the_typed_error(tmp_path):
    with pytest.raises(NotTrainedError):
        trainwise.train(overrides={"precision.float8": "tensorwise", "cluster.device": "cpu"},
                        run_dir=str(tmp_path / "run"))
    assert not (tmp_path / "run").exists()
