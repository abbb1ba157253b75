"""Plan versus actual on the demo: two identical runs of the default job (2 CPU workers,
the tiny GPT), the second planned with the first's calibration (plan.calibration). Its
report has no plan figure off by more than the flag level without a stated reason."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import QUIET, hang_limit, run_cli, run_main
from trainwise.hardware import GB
from trainwise.report.analysis import PLAN_ERROR_FLAG, analyse
from trainwise.report.rundir import load_run

# Timings of two runs compared: under other tests' load they would compare the load.
# The fixture's two runs, which the first test carries.
pytestmark = [pytest.mark.e2e, pytest.mark.serial, pytest.mark.timeout(hang_limit(launches=3, steps=120))]

# The demo's job, shorter: saves and evaluations at the same rhythm in both runs.
DEMO = ["train", *QUIET, "--steps", "60", "--set", "checkpoint.interval=20",
        "--set", "train.eval_every=30"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The two runs, in one directory: `first`, then `second` calibrated on it."""
    where = tmp_path_factory.mktemp("plan-actual")
    first = run_cli(*DEMO, "--run-dir", "first", cwd=where)
    assert first.returncode == 0, first.stderr[-3000:]
    second = run_cli(*DEMO, "--run-dir", "second", "--set", "plan.calibration='first'", cwd=where)
    assert second.returncode == 0, second.stderr[-3000:]
    return where


def test_the_calibrated_plan_holds_or_says_why(runs: Path):
    report = analyse(load_run(runs / "second"))
    checks = {c.name: c for c in report.plan_vs_actual}
    assert set(checks) == {"step time", "tokens/s", "memory per worker", "checkpoint save"}
    for check in checks.values():
        assert check.error is not None, f"{check.name}: not compared"
        off = abs(check.error) > PLAN_ERROR_FLAG
        assert not off or check.reason, (
            f"{check.name}: plan {check.planned:.4g}, actual {check.actual:.4g} "
            f"({check.error:+.0%}) with no stated reason"
        )
    # The memory compared is what the job added on CPU, not the interpreter's whole set.
    assert report.curves.mem_kind == "rss_added"


def test_the_second_plan_took_the_first_runs_measurements(runs: Path):
    plan = json.loads((runs / "second" / "plan.json").read_text())
    said = " | ".join(plan["calibration"])
    for measured in ("compute efficiency", "besides its bytes", "runtime adds"):
        assert measured in said, said
    assert plan["calibration_source"] == "first"
    first = json.loads((runs / "first" / "plan.json").read_text())
    assert first["calibration"] == []
    # A save is planned as its measured fixed cost plus its bytes, not the bytes alone.
    ckpt = plan["checkpoint"]
    assert plan["checkpoint_latency_s"] > 0
    assert ckpt["save_s"] == pytest.approx(
        plan["checkpoint_latency_s"] + ckpt["size_bytes"] / (plan["checkpoint_write_gbps"] * GB)
    )


def test_an_uncalibrated_demo_compares_like_with_like(runs: Path):
    """Without calibration the memory row compares the job's own memory (not flagged out
    as incomparable) and the save plan includes a fixed latency."""
    report = analyse(load_run(runs / "first"))
    memory = next(c for c in report.plan_vs_actual if c.name == "memory per worker")
    save = next(c for c in report.plan_vs_actual if c.name == "checkpoint save")
    assert memory.actual is not None and memory.error is not None
    # Before: the whole resident set, hundreds of MB against the plan's 14.5 MB.
    assert memory.actual < 200e6
    assert save.planned is not None and save.planned >= 0.01


def test_a_calibration_that_is_not_a_run_is_one_line(tmp_path: Path):
    # Through the CLI's main in this process: refused before any worker (this serial pass
    # is wall time alone, a process start is a few seconds of it).
    res = run_main(*DEMO, "--set", "plan.calibration='nowhere'", cwd=tmp_path)
    assert res.returncode == 2
    assert "plan.calibration = 'nowhere'" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr
