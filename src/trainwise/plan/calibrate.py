"""Measured figures that replace the planner's assumptions (`trainwise plan --calibrate`,
and `plan.calibration` for `trainwise train`).

From a `trainwise train` run directory: the achieved compute rate as a share of the
device's peak, from job.json (FLOPs per token, recomputation, peak) and the steady steps of
metrics.jsonl (compute and optimizer seconds); and, against the run's own plan.json, the
link rate its exposed gradient sync achieved, the memory its runtime added beyond the
planned tensors (CPU), and the fixed latency of its checkpoint saves (events.jsonl). From a
`trainwise doctor` run: the measured bus bandwidth within and between nodes, the loader's
rate and the checkpoint latency, from doctor.json:

    {"bandwidth": {"intra_node_busbw_bytes_per_s": float | null,
                   "inter_node_busbw_bytes_per_s": float | null},
     "data_samples_per_s_per_worker": float | null,
     "checkpoint_latency_s": float | null,
     "gemm": GemmTable.to_dict() | null}   (optional: doctor.gemm.measure_gemm_table)

Pure file reading: no torch.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field, replace
from pathlib import Path

from trainwise.errors import ConfigError
from trainwise.hardware.catalog import GB, find_gpu
from trainwise.jsonl import read_objects
from trainwise.plan.gemm import GemmTable
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
    checkpoint_latency_s: float | None = None  # a save's fixed seconds
    # Per-worker memory the runtime added beyond the planned tensors, measured on CPU (the
    # resident set over the worker's baseline; a GPU's allocator peak holds tensors only).
    cpu_runtime_bytes: float | None = None
    link_note: str = ""  # how the links were measured (a doctor, or a run's own sync)
    step_s: float | None = None  # a train run's median steady step, checkpoints aside
    save_s: float | None = None  # and its median checkpoint save
    gemm: GemmTable | None = None  # a GEMM sweep (doctor.gemm), replacing the modelled rates
    notes: list[str] = field(default_factory=list)


def read_calibration(run_dir: str | Path, where: str = "") -> Calibration:
    """The measurements of a run directory; `where` names the input in a message (default:
    the --calibrate option)."""
    path = Path(run_dir)
    where = where or f"--calibrate {run_dir}"
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
    cal = replace(cal, device=job.get("device"), efficiency=min(efficiency, 1.0))
    plan = _json(path / "plan.json", where) if (path / "plan.json").is_file() else None
    return _against_plan(path, plan, steady, cal) if plan else cal


def _against_plan(path: Path, plan: dict, steady: list[dict], cal: Calibration) -> Calibration:
    """What the run measured where its own plan (plan.json) assumed: the link rate of its
    exposed sync, the memory its runtime added, the fixed latency of its saves."""
    step, memory = plan.get("step") or {}, plan.get("memory_per_gpu") or {}
    notes = list(cal.notes)
    calm = [r for r in steady if not r.get("ckpt_s")] or steady
    # The step's time beyond compute and the optimizer is its exposed sync: taken as what
    # the median step has left (medians of the probed split do not add up to the step's).
    busy = statistics.median(r["compute_s"] + (r.get("sync_s") or 0.0) + r["optim_s"] for r in calm)
    sync = busy - statistics.median(r["compute_s"] + r["optim_s"] for r in calm)
    comm, exposed = step.get("comm") or 0.0, step.get("exposed_comm") or 0.0
    intra = None
    if sync > 0 and comm and plan.get("intra_node_gbps") and plan.get("gpus", 0) > 1:
        if abs(exposed - comm) > 0.01 * comm:
            notes.append("the run's plan overlaps communication: its link rate not measured")
        elif _nodes(path) > 1:
            notes.append("the run spans nodes: its sync does not single out one link")
        else:  # the plan's sync time is wire bytes / link rate: scale the rate by the miss
            intra = plan["intra_node_gbps"] * GB * comm / sync
    mem = [r for r in steady if r.get("mem_kind") == "rss_added" and r.get("mem_bytes")]
    runtime = None
    if mem and memory.get("total") is not None:
        tensors = memory["total"] - (memory.get("overhead") or 0.0)
        runtime = max(0.0, max(r["mem_bytes"] for r in mem) - tensors)
    return replace(
        cal,
        intra_bps=intra,
        link_note=f"the exposed gradient sync of {cal.source}" if intra else "",
        cpu_runtime_bytes=runtime,
        checkpoint_latency_s=_save_latency(path, plan, _nodes(path)),
        save_s=_median_save(path),
        step_s=statistics.median(r["step_s"] for r in calm),
        notes=notes,
    )


def _nodes(path: Path) -> int:
    ready = [e for e in read_objects(path / "events.jsonl") if e.get("kind") == "ready"]
    return int(ready[-1].get("nodes") or 1) if ready else 1


def _saves(path: Path) -> list[dict]:
    return [
        e for e in read_objects(path / "events.jsonl")
        if e.get("kind") == "checkpoint" and e.get("save_s") is not None and e.get("bytes")
    ]


def _median_save(path: Path) -> float | None:
    saves = _saves(path)
    return statistics.median(e["save_s"] for e in saves) if saves else None


def _save_latency(path: Path, plan: dict, nodes: int) -> float | None:
    """The median save's seconds less its bytes at the plan's write speed: what a save
    costs whatever its size."""
    gbps = plan.get("checkpoint_write_gbps")
    saves = _saves(path)
    if not saves or not gbps:
        return None
    return statistics.median(
        max(0.0, e["save_s"] - e["bytes"] / (gbps * GB * nodes)) for e in saves
    )


def _from_doctor(path: Path, where: str, cal: Calibration) -> Calibration:
    record = _json(path / "doctor.json", where)
    bandwidth = record.get("bandwidth") or {}
    intra = bandwidth.get("intra_node_busbw_bytes_per_s")
    inter = bandwidth.get("inter_node_busbw_bytes_per_s")
    data = record.get("data_samples_per_s_per_worker")
    latency = record.get("checkpoint_latency_s")
    gemm = GemmTable.from_dict(record["gemm"]) if record.get("gemm") else cal.gemm
    return replace(
        cal,
        gemm=gemm,
        intra_bps=intra or cal.intra_bps,
        inter_bps=inter or cal.inter_bps,
        link_note="the doctor" if intra or inter else cal.link_note,
        data_samples_per_s=data or cal.data_samples_per_s,
        checkpoint_latency_s=latency if latency is not None else cal.checkpoint_latency_s,
    )


def apply_calibration(inputs: PlanInputs, cal: Calibration) -> tuple[PlanInputs, list[str]]:
    """The inputs with the measured figures in place of the assumed ones, and one sentence
    per replaced figure."""
    hw = inputs.hardware
    said = list(cal.notes)
    if cal.efficiency is not None:
        said.append(
            f"compute efficiency {cal.efficiency:.1%} of peak measured in {cal.source} "
            f"(assumed {_assumed(inputs.efficiency)})"
        )
        if cal.device and not _same_device(cal, hw.gpu):
            said.append(
                f"measured on {cal.device}, planned for {hw.gpu}: the efficiency may not transfer"
            )
        inputs = replace(inputs, efficiency=cal.efficiency)
    from_run = cal.link_note.startswith("the exposed")  # this job's messages, this device
    if cal.intra_bps and from_run and not _same_device(cal, hw.gpu):
        said.append(
            f"the link rate measured in {cal.source} on {cal.device} is not applied to a "
            f"plan for {hw.gpu}"
        )
    elif cal.intra_bps:
        said.append(
            f"within a node {cal.intra_bps / GB:.3g} GB/s measured by {cal.link_note} "
            f"(catalog {hw.intra_bps / GB:.3g} GB/s)"
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
    if cal.checkpoint_latency_s is not None:
        said.append(
            f"a checkpoint save costs {cal.checkpoint_latency_s:.3g} s besides its bytes, "
            f"measured in {cal.source} (assumed {inputs.checkpoint_latency_s:.3g} s)"
        )
        inputs = replace(inputs, checkpoint_latency_s=cal.checkpoint_latency_s)
    inputs, said = _runtime_memory(inputs, cal, said)
    if cal.gemm is not None:
        said.append(
            f"GEMM rates of {len(cal.gemm.shapes)} shapes measured on {cal.gemm.device} in "
            f"{cal.source} replace the modelled ones"
        )
        inputs = replace(inputs, gemm_table=cal.gemm)
    return replace(inputs, hardware=hw), said


def _assumed(efficiency: float | None) -> str:
    return "per-operation model" if efficiency is None else f"{efficiency:.0%}"


def _same_device(cal: Calibration, gpu: str) -> bool:
    measured_on = find_gpu(cal.device) if cal.device else None
    return measured_on is not None and measured_on.name == gpu.split(" ")[0]


def _runtime_memory(
    inputs: PlanInputs, cal: Calibration, said: list[str]
) -> tuple[PlanInputs, list[str]]:
    """The CPU runtime's own memory (a worker's resident set beyond its tensors), for a
    plan on CPU only: a GPU's memory holds other things."""
    if cal.cpu_runtime_bytes is None:
        return inputs, said
    if inputs.hardware.device != "cpu":
        return inputs, said + [
            f"the runtime's memory measured in {cal.source} is a CPU resident set: "
            "not applied to a GPU plan"
        ]
    said = said + [
        f"a worker's runtime adds {cal.cpu_runtime_bytes / 2**20:,.1f} MiB beyond its tensors "
        f"(allocator cache, thread arenas, library code), measured in {cal.source}"
    ]
    return replace(inputs, memory_overhead_bytes=cal.cpu_runtime_bytes), said
