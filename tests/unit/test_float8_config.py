"""precision.float8: the job keys validate (fp16 refused, rowwise without float8
all-gather), enter the lineage only when on, and a float8 job the runtime trains passes the
job's checks (what it does not train: tests/unit/test_float8_convert.py)."""

from __future__ import annotations

import pytest

from trainwise.config import load_config
from trainwise.config.lineage import lineage_keys
from trainwise.errors import ConfigError
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


def test_prepare_job_accepts_float8_on_a_cpu():
    """Emulated there (torchao's emulate mode): every path of float8 runs on a CPU."""
    for recipe in ("tensorwise", "rowwise"):
        cfg = load_config(overrides=[f"precision.float8='{recipe}'"])
        job = prepare_job(cfg, 1, CPU)
        assert job.world == 1
