"""The performance model seam (plan.performance) and the machine calibration file:
the analytic and the calibrated model price the same setup differently, by the measured
figures and only by them; the file round-trips; another machine kind's file is refused
when given and skipped with a warning when found at the default place; `plan` picks up
the default file and names it in its header."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from helpers import run_main
from trainwise.config import load_config
from trainwise.config.parallel_dims import ParallelDims
from trainwise.errors import ConfigError
from trainwise.hardware.catalog import GB
from trainwise.plan.calibrate import (
    Calibration,
    calibration_path,
    machine_calibration,
    read_calibration,
    write_calibration,
)
from trainwise.plan.estimate import Setup, price
from trainwise.plan.inputs import resolve_inputs
from trainwise.plan.model.gemm import GemmTable
from trainwise.plan.model.performance import ANALYTIC, CalibratedModel, model_of

MEASURED = Calibration(
    source="a doctor run",
    device="cpu",
    efficiency=0.05,
    intra_bps=0.5 * GB,
    checkpoint_latency_s=0.2,
    checkpoint_bps=0.25 * GB,
    cpu_runtime_bytes=60e6,
    kind="cpu",
    measured="2026-01-02 03:04 UTC",
)


def cpu_inputs():
    cfg = load_config(None, base={"model.name": "tiny", "cluster.gpu": "cpu",
                                  "cluster.nproc": 2, "data.micro_batch": 16})
    return resolve_inputs(cfg)


def ddp_setup() -> Setup:
    return Setup(ParallelDims.from_plan_name("ddp", 2, 2), "none", 16, 1)


def test_the_calibrated_model_prices_with_the_measured_figures():
    inputs = cpu_inputs()
    assert model_of(inputs) is ANALYTIC
    measured, notes = CalibratedModel(calibration=MEASURED).adopt(inputs)
    assert model_of(measured).calibration is MEASURED
    before, after = price(inputs, ddp_setup()), price(measured, ddp_setup())
    # The measured efficiency overrides the per-operation model: FLOPs over peak x 0.05.
    flat = price(replace(inputs, efficiency=0.4), ddp_setup())
    assert after.step.compute == pytest.approx(flat.step.compute * 0.4 / 0.05)
    assert after.step.compute != pytest.approx(before.step.compute)
    # CPU collectives are all exposed, at wire bytes over the link (2 GB/s -> 0.5 GB/s)
    # plus their per-step latency, which the link's bandwidth does not change.
    def wire(p):
        return sum(c.seconds - c.latency_s for c in p.collectives)

    assert wire(after) == pytest.approx(wire(before) * inputs.hardware.intra_bps / (0.5 * GB))
    assert after.step.comm - wire(after) == pytest.approx(before.step.comm - wire(before))
    # A save: the measured latency plus the bytes at the measured write speed.
    size = after.checkpoint.size_bytes
    assert after.checkpoint.save_s == pytest.approx(0.2 + size / (0.25 * GB))
    # The runtime's memory beyond the tensors, per worker (CPU plan).
    assert after.memory.total == pytest.approx(before.memory.total + 60e6)
    assert len(notes) >= 5  # one sentence per replaced figure


def test_a_model_passed_to_price_overrides_the_adopted_one():
    measured, _ = CalibratedModel(calibration=MEASURED).adopt(cpu_inputs())
    # The analytic model asked for the calibrated inputs: their figures (efficiency, links)
    # are the measured ones, the model's own memory term is the same formula.
    analytic = price(measured, ddp_setup(), model=ANALYTIC)
    assert analytic.step.total == pytest.approx(price(measured, ddp_setup()).step.total)
    assert price(cpu_inputs(), ddp_setup(), model=ANALYTIC).step.total < analytic.step.total


def test_the_headers_say_what_the_figures_rest_on():
    assert "uncalibrated defaults" in ANALYTIC.header()
    header = CalibratedModel(calibration=replace(MEASURED, source="F.json")).header()
    assert header == "calibrated from F.json, measured 2026-01-02 03:04 UTC"


def test_a_calibration_file_round_trips(tmp_path: Path):
    gemm = GemmTable("cpu", "fp32", ((4096, 4096, 4096),), (7e10,), peak_flops=1e11)
    cal = replace(MEASURED, gemm=gemm, notes=["a note"])
    path = tmp_path / "sub" / "calibration-cpu.json"
    write_calibration(cal, path)
    assert read_calibration(path) == cal
    assert json.loads(path.read_text())["version"] == 1
    assert not list(path.parent.glob("*.tmp-*"))  # written whole, through a rename


def test_a_file_that_is_not_a_calibration_is_one_line(tmp_path: Path):
    path = tmp_path / "x.json"
    path.write_text(json.dumps({"version": 1, "source": "s", "speed": 3}))
    with pytest.raises(ConfigError, match="not a trainwise calibration file.*speed") as err:
        read_calibration(path, where="--calibrate x.json")
    assert len(err.value.problems) == 1


def test_another_machine_kinds_file(tmp_path: Path, calibration_dir: Path):
    h100 = tmp_path / "h100.json"
    write_calibration(replace(MEASURED, kind="H100-SXM", device="NVIDIA H100 80GB HBM3"), h100)
    # Given explicitly for a CPU plan: refused, one line naming both kinds.
    with pytest.raises(ConfigError, match="measured on a H100-SXM machine.*for cpu"):
        machine_calibration(str(h100), "cpu", "--calibrate h100.json")
    # Found at the default place of the cpu kind: skipped, with a warning.
    default = calibration_path("cpu")
    assert default.parent == calibration_dir
    default.write_text(h100.read_text())
    cal, warnings = machine_calibration(None, "cpu", "plan.calibration = None")
    assert cal is None and "not used" in warnings[0]
    # The cpu kind's own file there is used, named by its path; 'none' opts out.
    write_calibration(MEASURED, default)
    cal, warnings = machine_calibration(None, "cpu", "plan.calibration = None")
    assert cal is not None and cal.source == str(default) and not warnings
    assert machine_calibration("none", "cpu", "--calibrate none") == (None, [])


PLAN = ["plan", "--model", "tiny", "--gpu", "cpu", "--gpus", "2", "--micro-batch", "16"]


def test_plan_picks_up_the_machine_kinds_default_file(tmp_path: Path, calibration_dir: Path):
    env = {"TRAINWISE_CALIBRATION_DIR": str(calibration_dir), "COLUMNS": "200"}
    plain = run_main(*PLAN, cwd=tmp_path, env=env)
    assert plain.returncode == 0, plain.stderr
    assert "figures: uncalibrated defaults" in plain.stdout
    write_calibration(MEASURED, calibration_path("cpu"))
    res = run_main(*PLAN, cwd=tmp_path, env=env)
    assert res.returncode == 0, res.stderr
    assert f"calibrated from {calibration_path('cpu')}, measured 2026-01-02" in res.stdout
    assert "5.0% of peak" in res.stdout  # the measured efficiency, said
    record = json.loads(run_main(*PLAN, "--json", cwd=tmp_path, env=env).stdout)
    assert record["inputs"]["efficiency"] == pytest.approx(0.05)
    # Another kind's file given by hand: exit 2, one line.
    h100 = tmp_path / "h100.json"
    write_calibration(replace(MEASURED, kind="H100-SXM"), h100)
    bad = run_main(*PLAN, "--calibrate", str(h100), cwd=tmp_path, env=env)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1, bad.stderr
    assert "H100-SXM" in bad.stderr
