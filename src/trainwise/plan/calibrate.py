"""Measured figures that replace the planner's assumptions (`trainwise plan --calibrate`).

From a `trainwise train` run directory: the achieved compute rate as a share of the
device's peak, from job.json (FLOPs per token, recomputation, peak) and the steady steps of
metrics.jsonl (compute and optimizer seconds). From a `trainwise doctor` run: the measured
bus bandwidth within and between nodes, and the loader's rate, from doctor.json:

    {"bandwidth": {"intra_node_busbw_bytes_per_s": float | null,
                   "inter_node_busbw_bytes_per_s": float | null},
     "data_samples_per_s_per_worker": float | null}

Pure file reading: no torch.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field, replace
from pathlib import Path

from trainwise.errors import ConfigError
from trainwise.hardware.catalog import GB, find_gpu
from trainwise.plan.inputs import PlanInputs

WARMUP_STEPS = 2  # the first steps pay for allocation and autotuning; not steady state


@dataclass(frozen=True)
class Calibration:
    source: str
    device: str | None = None  # what the run measured on
    efficiency: float | None = None
    intra_bps: float | None = None
    inter_bps: float | None = None
    data_samples_per_s: float | None = None  # one worker's loader
    notes: list[str] = field(default_factory=list)


def read_calibration(run_dir: str | Path) -> Calibration:
    path = Path(run_dir)
    where = f"--calibrate {run_dir}"
    if not path.is_dir():
        raise ConfigError(f"{where}: not a directory; give a trainwise train or doctor run")
    cal = Calibration(source=str(run_dir))
    found = False
    if (path / "job.json").is_file() and (path / "metrics.jsonl").is_file():
        cal = _from_train(path, where, cal)
        found = True
    if (path / "doctor.json").is_file():
        cal = _from_doctor(path, where, cal)
        found = True
    if not found:
        raise ConfigError(
            f"{where}: holds neither job.json + metrics.jsonl (trainwise train) nor "
            "doctor.json (trainwise doctor); give a finished run directory"
        )
    return cal


def _json(path: Path, where: str) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ConfigError(f"{where}: {path.name} cannot be read as JSON ({err})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: {path.name} is not a JSON object")
    return data


def _from_train(path: Path, where: str, cal: Calibration) -> Calibration:
    job = _json(path / "job.json", where)
    flops = job.get("flops_per_token")
    peak = job.get("peak_flops_per_device")
    world = job.get("world")
    tokens = job.get("tokens_per_step")
    if not (flops and peak and world and tokens):
        return replace(
            cal,
            device=job.get("device"),
            notes=cal.notes
            + ["the run's model FLOPs or its device's peak are unknown: efficiency not measured"],
        )
    records = []
    for n, line in enumerate((path / "metrics.jsonl").read_text().splitlines(), 1):
        try:
            records.append(json.loads(line))
        except ValueError:
            raise ConfigError(f"{where}: metrics.jsonl line {n} is not JSON") from None
    steady = [r for r in records if r.get("step", 0) > WARMUP_STEPS]
    if not steady:
        raise ConfigError(
            f"{where}: metrics.jsonl has no step after the first {WARMUP_STEPS}; "
            "calibrate from a longer run"
        )
    # Achieved FLOP/s of one device while it computes: its tokens x hardware FLOPs per token
    # over forward + backward + optimizer seconds.
    work = tokens / world * flops * job.get("recompute_factor", 1.0)
    try:
        rates = [work / (r["compute_s"] + r["optim_s"]) for r in steady]
    except (KeyError, TypeError, ZeroDivisionError):
        raise ConfigError(
            f"{where}: metrics.jsonl records lack compute_s and optim_s seconds; give a "
            "run written by trainwise train"
        ) from None
    efficiency = statistics.median(rates) / peak
    return replace(cal, device=job.get("device"), efficiency=min(efficiency, 1.0))


def _from_doctor(path: Path, where: str, cal: Calibration) -> Calibration:
    record = _json(path / "doctor.json", where)
    bandwidth = record.get("bandwidth") or {}
    intra = bandwidth.get("intra_node_busbw_bytes_per_s")
    inter = bandwidth.get("inter_node_busbw_bytes_per_s")
    data = record.get("data_samples_per_s_per_worker")
    return replace(
        cal,
        intra_bps=intra or cal.intra_bps,
        inter_bps=inter or cal.inter_bps,
        data_samples_per_s=data or cal.data_samples_per_s,
    )


def apply_calibration(inputs: PlanInputs, cal: Calibration) -> tuple[PlanInputs, list[str]]:
    """The inputs with the measured figures in place of the assumed ones, and one sentence
    per replaced figure."""
    hw = inputs.hardware
    said = list(cal.notes)
    if cal.efficiency is not None:
        said.append(
            f"compute efficiency {cal.efficiency:.1%} of peak measured in {cal.source} "
            f"(assumed {inputs.efficiency:.0%})"
        )
        measured_on = find_gpu(cal.device) if cal.device else None
        if cal.device and (measured_on is None or measured_on.name != hw.gpu.split(" ")[0]):
            said.append(
                f"measured on {cal.device}, planned for {hw.gpu}: the efficiency may not transfer"
            )
        inputs = replace(inputs, efficiency=cal.efficiency)
    if cal.intra_bps:
        said.append(
            f"within a node {cal.intra_bps / GB:.3g} GB/s measured (catalog "
            f"{hw.intra_bps / GB:.3g} GB/s)"
        )
        hw = replace(hw, intra_bps=cal.intra_bps)
    if cal.inter_bps:
        said.append(
            f"between nodes {cal.inter_bps / GB:.3g} GB/s measured (assumed "
            f"{hw.inter_bps / GB:.3g} GB/s)"
        )
        hw = replace(hw, inter_bps=cal.inter_bps)
    if cal.data_samples_per_s:
        said.append(
            f"the loader delivers {cal.data_samples_per_s:,.0f} samples/s per worker, measured "
            "by the doctor on this job's data"
        )
        inputs = replace(inputs, data_samples_per_s=cal.data_samples_per_s)
    return replace(inputs, hardware=hw), said
