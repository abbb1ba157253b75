"""`trainwise plan --calibrate`: measured figures from a run directory replace the assumed
ones. Run directories are written here with known figures; the arithmetic is by hand."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from trainwise.config import load_config
from trainwise.config.parallel_dims import ParallelDims
from trainwise.errors import ConfigError
from trainwise.plan.calibrate import apply_calibration, read_calibration
from trainwise.plan.estimate import Setup, price
from trainwise.plan.inputs import PLAN_DEFAULTS, resolve_inputs
from trainwise.plan.moe.comm import ALL_TO_ALL
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
    assert any("20.5% of peak" in n and "assumed per-operation model" in n for n in notes)
    assert any("1 GB/s measured" in n for n in notes)
    before = make_plan(replace(inputs, efficiency=0.4)).strategy("fsdp-full")
    after = make_plan(calibrated, calibration=notes).strategy("fsdp-full")
    # Half the efficiency of a 0.4 override: about twice the compute time.
    assert after.step.compute == pytest.approx(before.step.compute * 0.4 / 0.2048)


def test_a_different_device_is_said(tmp_path: Path):
    inputs = resolve_inputs(load_config(None, base=PLAN_DEFAULTS))
    run = write_run(tmp_path / "run", dict(JOB, device="cpu"))
    _, notes = apply_calibration(inputs, read_calibration(run))
    assert any("measured on cpu, planned for H100-SXM" in n for n in notes)


def test_missing_or_unusable_run_directories(tmp_path: Path):
    with pytest.raises(ConfigError, match="no such file or directory"):
        read_calibration(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="neither job.json"):
        read_calibration(tmp_path / "empty")
    short = write_run(tmp_path / "short")
    (short / "metrics.jsonl").write_text(json.dumps({"step": 1, "compute_s": 1, "optim_s": 1}))
    with pytest.raises(ConfigError, match="no step after the first 2"):
        read_calibration(short)
    (short / "metrics.jsonl").write_text("{not json\n" + json.dumps({"step": 3}) + "\n")
    with pytest.raises(ConfigError, match="line 1: not JSON"):
        read_calibration(short)


def write_planned_run(path: Path) -> Path:
    """A 2-worker CPU run with its own plan.json: per steady step 0.008 s compute, 0.002 s
    optimizer and 0.005 s of exposed sync; 30 MB added to the resident set; two saves of
    1e8 bytes in 0.15 and 0.25 s."""
    write_run(path, dict(JOB, device="cpu"))
    records = [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]
    for r in records:
        r.update(sync_s=0.005, step_s=0.0155, mem_bytes=30_000_000, mem_kind="rss_added")
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    plan = {
        "gpus": 2, "intra_node_gbps": 2.0, "inter_node_gbps": 50.0, "checkpoint_write_gbps": 1.0,
        "step": {"comm": 0.001, "exposed_comm": 0.001},
        "memory_per_gpu": {"total": 10_000_000, "overhead": 0},
    }
    (path / "plan.json").write_text(json.dumps(plan))
    events = [{"kind": "ready", "nodes": 1}] + [
        {"kind": "checkpoint", "save_s": s, "bytes": 100_000_000} for s in (0.15, 0.25)
    ]
    (path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    return path


def test_a_train_run_measures_what_its_own_plan_assumed(tmp_path: Path):
    cal = read_calibration(write_planned_run(tmp_path / "run"))
    # The plan's 0.001 s of sync at 2 GB/s took 0.005 s: the link ran at 0.4 GB/s.
    assert cal.intra_bps == pytest.approx(0.4e9)
    # 30 MB added against 10 MB of planned tensors: 20 MB of runtime.
    assert cal.cpu_runtime_bytes == pytest.approx(20e6)
    # 1e8 bytes at 1 GB/s is 0.1 s of each save; the median rest is 0.1 s.
    assert cal.checkpoint_latency_s == pytest.approx(0.1)
    assert (cal.step_s, cal.save_s) == (pytest.approx(0.0155), pytest.approx(0.2))


def test_run_measurements_apply_to_a_cpu_plan_and_memory_not_to_a_gpu_one(tmp_path: Path):
    cal = read_calibration(write_planned_run(tmp_path / "run"))
    gpu = resolve_inputs(load_config(None, base=PLAN_DEFAULTS))
    on_gpu, notes = apply_calibration(gpu, cal)
    assert on_gpu.memory_overhead_bytes == 0
    assert any("not applied to a GPU plan" in n for n in notes)
    assert on_gpu.checkpoint_latency_s == pytest.approx(0.1)
    cpu = resolve_inputs(load_config(None, base={**PLAN_DEFAULTS, "cluster.gpu": "cpu"}))
    on_cpu, _ = apply_calibration(cpu, cal)
    assert on_cpu.memory_overhead_bytes == pytest.approx(20e6)
    before = make_plan(cpu).strategy("ddp")
    after = make_plan(on_cpu).strategy("ddp")
    assert after.memory.total == pytest.approx(before.memory.total + 20e6)
    assert after.checkpoint.save_s == pytest.approx(
        before.checkpoint.save_s - cpu.checkpoint_latency_s + 0.1
    )


def test_a_cpu_runs_link_rate_is_not_applied_to_a_gpu_plan(tmp_path: Path):
    cal = read_calibration(write_planned_run(tmp_path / "run"))
    gpu = resolve_inputs(load_config(None, base=PLAN_DEFAULTS))
    on_gpu, notes = apply_calibration(gpu, cal)
    assert on_gpu.hardware.intra_bps == gpu.hardware.intra_bps
    assert any("not applied to a plan for H100-SXM" in n for n in notes)
    cpu = resolve_inputs(load_config(None, base={**PLAN_DEFAULTS, "cluster.gpu": "cpu"}))
    on_cpu, _ = apply_calibration(cpu, cal)
    assert on_cpu.hardware.intra_bps == pytest.approx(0.4e9)


def test_a_job_that_sets_its_layout_carries_the_measured_runtime_memory(tmp_path: Path):
    """The job's decision (job.json, the doctor's memory check) prices its layout as
    plan.json does: with the calibration's 20 MB of runtime per CPU worker."""
    from trainwise.hardware import GB, DeviceInfo
    from trainwise.run.job.resolve import job_plan, prepare_job

    run = write_planned_run(tmp_path / "run")
    cpu = DeviceInfo("cpu", "cpu", 1, 64 * GB, bf16=True, fp16=False, gpu=None)
    overrides = ["data.synthetic_tokens=20000", "parallel.strategy=ddp"]
    plain = prepare_job(load_config(overrides=overrides), 2, cpu)
    calibrated = prepare_job(load_config(overrides=[*overrides, f"plan.calibration='{run}'"]), 2, cpu)
    added = calibrated.decision.estimate.overhead - plain.decision.estimate.overhead
    assert added == pytest.approx(20e6)
    planned = job_plan(calibrated)["memory_per_gpu"]["total"]
    assert calibrated.summary_dict()["memory_estimate"]["total"] == pytest.approx(planned, abs=1)


def test_a_moe_runs_measured_imbalance_replaces_moe_imbalance(tmp_path: Path):
    """A Mixture-of-Experts run with its experts split: summary.json's ep_imbalance (the
    steady steps' median) becomes the plan's moe.imbalance, which the busiest rank's
    all-to-all and expert GEMMs scale with; a dense plan leaves it, and says so."""
    run = write_run(tmp_path / "moe")
    (run / "summary.json").write_text(json.dumps({"ep_imbalance": 1.08}))
    (run / "config.toml").write_text("[parallel]\nep = 2\n")
    cal = read_calibration(run)
    assert (cal.moe_imbalance, cal.moe_ep) == (1.08, 2)
    cfg = load_config(None, {"model.name": "qwen3-30b-a3b", "parallel.ep": 8}, base=PLAN_DEFAULTS)
    inputs = resolve_inputs(cfg)
    assert inputs.workload.imbalance == 1.25  # the default the run replaces
    calibrated, notes = apply_calibration(inputs, cal)
    assert calibrated.workload.imbalance == 1.08
    assert any("expert load imbalance 1.08" in n and "over 2 expert-parallel ranks" in n
               and "assumed moe.imbalance 1.25" in n for n in notes)
    setup = Setup(ParallelDims(1, 8, ep=8, fsdp=True), "full", 1, 1)
    (before,) = [c for c in price(inputs, setup).collectives if c.name == ALL_TO_ALL]
    (after,) = [c for c in price(calibrated, setup).collectives if c.name == ALL_TO_ALL]
    assert after.wire_bytes == pytest.approx(before.wire_bytes * 1.08 / 1.25)
    dense, said = apply_calibration(resolve_inputs(load_config(None, base=PLAN_DEFAULTS)), cal)
    assert dense.workload.imbalance == 1.0
    assert any("not applied: this plan's model has no experts" in n for n in said)


def test_a_run_without_its_experts_split_calibrates_no_imbalance(tmp_path: Path):
    run = write_run(tmp_path / "ep1")
    (run / "summary.json").write_text(json.dumps({"ep_imbalance": None, "expert_imbalance": 1.4}))
    assert read_calibration(run).moe_imbalance is None
