"""`trainwise plan --calibrate`: measured figures from a run directory replace the assumed
ones. Run directories are written here with known figures; the arithmetic is by hand."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainwise.config import load_config
from trainwise.errors import ConfigError
from trainwise.plan.calibrate import apply_calibration, read_calibration
from trainwise.plan.inputs import PLAN_DEFAULTS, resolve_inputs
from trainwise.plan.planner import make_plan

JOB = {
    "world": 2,
    "device": "NVIDIA H100 80GB HBM3",
    "flops_per_token": 1e6,
    "tokens_per_step": 4096,
    "recompute_factor": 1.0,
    "peak_flops_per_device": 1e12,
}


def write_run(path: Path, job: dict = JOB, compute: float = 0.008, optim: float = 0.002) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "job.json").write_text(json.dumps(job))
    lines = []
    for step in range(1, 7):
        slow = step <= 2  # warm-up steps, ten times slower: must be left out
        lines.append(
            json.dumps({"step": step, "compute_s": compute * (10 if slow else 1), "optim_s": optim})
        )
    (path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return path


def test_efficiency_from_a_train_run_by_hand(tmp_path: Path):
    # Per device: 4096 / 2 tokens x 1e6 FLOPs = 2.048e9 FLOPs in 0.008 + 0.002 s:
    # 2.048e11 FLOP/s of a 1e12 peak = 0.2048.
    cal = read_calibration(write_run(tmp_path / "run"))
    assert cal.efficiency == pytest.approx(0.2048)
    # Recomputation counts as work the device did: x 4/3.
    job = dict(JOB, recompute_factor=4 / 3)
    cal = read_calibration(write_run(tmp_path / "ac", job))
    assert cal.efficiency == pytest.approx(0.2048 * 4 / 3)


def test_bandwidth_from_a_doctor_run(tmp_path: Path):
    run = tmp_path / "doctor"
    run.mkdir()
    (run / "doctor.json").write_text(
        json.dumps({"bandwidth": {"intra_node_busbw_bytes_per_s": 2e11}})
    )
    cal = read_calibration(run)
    assert (cal.intra_bps, cal.inter_bps, cal.efficiency) == (2e11, None, None)


def test_calibration_replaces_the_assumptions_and_changes_the_plan(tmp_path: Path):
    inputs = resolve_inputs(load_config(None, base=PLAN_DEFAULTS))
    run = write_run(tmp_path / "run")
    (run / "doctor.json").write_text(
        json.dumps({"bandwidth": {"intra_node_busbw_bytes_per_s": 1e9}})
    )
    calibrated, notes = apply_calibration(inputs, read_calibration(run))
    assert calibrated.efficiency == pytest.approx(0.2048)
    assert calibrated.hardware.intra_bps == 1e9
    assert any("20.5% of peak" in n and "assumed 40%" in n for n in notes)
    assert any("1 GB/s measured" in n for n in notes)
    before = make_plan(inputs).strategy("fsdp-full")
    after = make_plan(calibrated, calibration=notes).strategy("fsdp-full")
    # Half the efficiency: about twice the compute time.
    assert after.step.compute == pytest.approx(before.step.compute * 0.4 / 0.2048)


def test_a_different_device_is_said(tmp_path: Path):
    inputs = resolve_inputs(load_config(None, base=PLAN_DEFAULTS))
    run = write_run(tmp_path / "run", dict(JOB, device="cpu"))
    _, notes = apply_calibration(inputs, read_calibration(run))
    assert any("measured on cpu, planned for H100-SXM" in n for n in notes)


def test_missing_or_unusable_run_directories(tmp_path: Path):
    with pytest.raises(ConfigError, match="not a directory"):
        read_calibration(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="neither job.json"):
        read_calibration(tmp_path / "empty")
    short = write_run(tmp_path / "short")
    (short / "metrics.jsonl").write_text(json.dumps({"step": 1, "compute_s": 1, "optim_s": 1}))
    with pytest.raises(ConfigError, match="no step after the first 2"):
        read_calibration(short)
    (short / "metrics.jsonl").write_text("{not json\n")
    with pytest.raises(ConfigError, match="line 1 is not JSON"):
        read_calibration(short)
