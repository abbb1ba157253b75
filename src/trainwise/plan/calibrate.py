"""Measured figures that replace the planner's assumptions (`trainwise plan --calibrate`,
and `plan.calibration` for `trainwise train`), and the machine's calibration file that
`trainwise doctor` writes and later plans on that machine kind use by default.

From a `trainwise train` run directory: the achieved compute rate as a share of the
device's peak, from job.json (FLOPs per token, recomputation, peak) and the steady steps of
metrics.jsonl (compute and optimizer seconds); and, against the run's own plan.json, the
link rate its exposed gradient sync achieved, the memory its runtime added beyond the
planned tensors (CPU), and the fixed latency of its checkpoint saves (events.jsonl); from a
Mixture-of-Experts run with its experts split (parallel.ep > 1), the load imbalance its
routing measured (summary.json `ep_imbalance`, models.moe.load), for `moe.imbalance`. From a
`trainwise doctor` run: what doctor.json holds (doctor.result.DoctorRecord): the bus
bandwidth per link class, the loader's rate, the checkpoint latency and write speed, the
efficiency of the job's timed steps, the runtime's memory, the launch latency.

A calibration file (JSON, `Calibration.to_dict`) names its machine kind (the catalog's
device name, `kind`, and the device as detected); it lives at
`calibration_dir()/calibration-<kind>.json` unless given by path.

Pure file reading: no torch.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import tomllib

from trainwise.errors import ConfigError
from trainwise.hardware.catalog import GB, find_gpu
from trainwise.jsonl import read_objects
from trainwise.plan.inputs import PlanInputs
from trainwise.plan.model.gemm import GemmTable
from trainwise.plan.model.network import Fabric, nic_bps_from_rail_busbw
from trainwise.records import JobRecord, RunPlanFigures
from trainwise.whole_file import write_whole

WARMUP_STEPS = 2  # the first steps pay for allocation and autotuning; not steady state


CALIBRATION_DIR_ENV = "TRAINWISE_CALIBRATION_DIR"  # where machine calibrations live
FILE_VERSION = 1


@dataclass(frozen=True)
class Calibration:
    source: str
    device: str | None = None  # what the run measured on
    efficiency: float | None = None
    intra_bps: float | None = None
    inter_bps: float | None = None
    data_samples_per_s: float | None = None  # one worker's loader
    checkpoint_latency_s: float | None = None  # a save's fixed seconds
    checkpoint_bps: float | None = None  # a node's checkpoint write speed
    # Per-worker memory the runtime added beyond the planned tensors, measured on CPU (the
    # resident set over the worker's baseline; a GPU's allocator peak holds tensors only).
    cpu_runtime_bytes: float | None = None
    link_note: str = ""  # how the links were measured (a doctor, or a run's own sync)
    step_s: float | None = None  # a train run's median steady step, checkpoints aside
    save_s: float | None = None  # and its median checkpoint save
    launch_s: float | None = None  # the launcher's start to every worker joined
    # A Mixture-of-Experts run's busiest expert-parallel rank's routed tokens over the
    # mean (summary.json ep_imbalance), for moe.imbalance, and its ep degree.
    moe_imbalance: float | None = None
    moe_ep: int | None = None
    # Achieved efficiency per GEMM shape, measured on CUDA (trainwise.doctor.gemm's
    # measure_gemm_table); None until a doctor on CUDA measured it.
    gemm: GemmTable | None = None
    kind: str | None = None  # the catalog's name of the device: the machine kind
    measured: str | None = None  # when (ISO 8601 date and time, UTC)
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """The calibration file's JSON object."""
        out = {"version": FILE_VERSION, **asdict(self)}
        out["gemm"] = self.gemm.to_dict() if self.gemm else None
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str) -> Calibration:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known - {"version"})
        if data.get("version") != FILE_VERSION or unknown or "source" not in data:
            what = f"unknown keys {', '.join(unknown)}" if unknown else "no version 1 record"
            raise ConfigError(
                f"{where}: not a trainwise calibration file ({what}); run trainwise doctor "
                "to write one"
            )
        values = {k: v for k, v in data.items() if k in known}
        values["gemm"] = _gemm(values.get("gemm"))
        return cls(**values)


def calibration_dir() -> Path:
    """Where `trainwise doctor` writes machine calibrations: $TRAINWISE_CALIBRATION_DIR,
    else $XDG_CACHE_HOME/trainwise, else ~/.cache/trainwise."""
    given = os.environ.get(CALIBRATION_DIR_ENV)
    if given:
        return Path(given)
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "trainwise"


def calibration_path(kind: str) -> Path:
    """The default calibration file of machine kind `kind` (a catalog device name)."""
    slug = "".join(ch if ch.isalnum() or ch in "-_." else "-" for ch in kind)
    return calibration_dir() / f"calibration-{slug}.json"


def write_calibration(cal: Calibration, path: Path) -> None:
    """The file whole or not at all (a reader never sees half of it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_whole(path, json.dumps(cal.to_dict(), indent=1) + "\n")


def read_calibration(run_dir: str | Path, where: str = "") -> Calibration:
    """The measurements of a calibration file or a run directory; `where` names the input
    in a message (default: the --calibrate option)."""
    path = Path(run_dir)
    where = where or f"--calibrate {run_dir}"
    if path.is_file():
        return Calibration.from_dict(_json(path, where), where)
    if not path.is_dir():
        raise ConfigError(
            f"{where}: no such file or directory; give a calibration file or a trainwise "
            "train or doctor run"
        )
    cal = Calibration(source=str(run_dir))
    found = False
    if (path / "job.json").is_file() and (path / "metrics.jsonl").is_file():
        cal = _moe_load(path, where, _from_train(path, where, cal))
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
    job = JobRecord.from_dict(_json(path / "job.json", where))
    flops, peak, world = job.flops_per_token, job.peak_flops_per_device, job.world
    tokens = job.tokens_per_step
    if not (flops and peak and world and tokens):
        return replace(
            cal,
            device=job.device,
            notes=cal.notes
            + ["the run's model FLOPs or its device's peak are unknown: efficiency not measured"],
        )
    # The project's one reader: a torn last line is skipped, a damaged middle one refused.
    records = read_objects(path / "metrics.jsonl")
    steady = [r for r in records if r.get("step", 0) > WARMUP_STEPS]
    if not steady:
        raise ConfigError(
            f"{where}: metrics.jsonl has no step after the first {WARMUP_STEPS}; "
            "calibrate from a longer run"
        )
    # Achieved FLOP/s of one device while it computes: its tokens x hardware FLOPs per token
    # over forward + backward + optimizer seconds.
    work = tokens / world * flops * job.recompute_factor
    try:
        rates = [work / (r["compute_s"] + r["optim_s"]) for r in steady]
    except (KeyError, TypeError, ZeroDivisionError):
        raise ConfigError(
            f"{where}: metrics.jsonl records lack compute_s and optim_s seconds; give a "
            "run written by trainwise train"
        ) from None
    efficiency = statistics.median(rates) / peak
    cal = replace(cal, device=job.device, efficiency=min(efficiency, 1.0))
    if not (path / "plan.json").is_file():
        return cal
    return _against_plan(path, RunPlanFigures.from_dict(_json(path / "plan.json", where)),
                         steady, cal)


def _against_plan(
    path: Path, plan: RunPlanFigures, steady: list[dict], cal: Calibration
) -> Calibration:
    """What the run measured where its own plan (plan.json) assumed: the link rate of its
    exposed sync, the memory its runtime added, the fixed latency of its saves."""
    notes = list(cal.notes)
    calm = [r for r in steady if not r.get("ckpt_s")] or steady
    # The step's time beyond compute and the optimizer is its exposed sync: taken as what
    # the median step has left (medians of the probed split do not add up to the step's).
    busy = statistics.median(r["compute_s"] + (r.get("sync_s") or 0.0) + r["optim_s"] for r in calm)
    sync = busy - statistics.median(r["compute_s"] + r["optim_s"] for r in calm)
    comm, exposed = plan.step.comm, plan.step.exposed_comm
    intra = None
    if sync > 0 and comm and plan.intra_node_gbps and plan.gpus > 1:
        if abs(exposed - comm) > 0.01 * comm:
            notes.append("the run's plan overlaps communication: its link rate not measured")
        elif _nodes(path) > 1:
            notes.append("the run spans nodes: its sync does not single out one link")
        else:  # the plan's sync time is wire bytes / link rate: scale the rate by the miss
            intra = plan.intra_node_gbps * GB * comm / sync
    mem = [r for r in steady if r.get("mem_kind") == "rss_added" and r.get("mem_bytes")]
    runtime = None
    if mem and plan.memory_total is not None:
        tensors = plan.memory_total - plan.memory_overhead
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


def _save_latency(path: Path, plan: RunPlanFigures, nodes: int) -> float | None:
    """The median save's seconds less its bytes at the plan's write speed: what a save
    costs whatever its size."""
    gbps = plan.checkpoint_write_gbps
    saves = _saves(path)
    if not saves or not gbps:
        return None
    return statistics.median(
        max(0.0, e["save_s"] - e["bytes"] / (gbps * GB * nodes)) for e in saves
    )


def _moe_load(path: Path, where: str, cal: Calibration) -> Calibration:
    """A Mixture-of-Experts run's measured load imbalance (summary.json's ep_imbalance: the
    steady steps' median) and the ep it was measured over (config.toml's parallel.ep);
    unchanged for a dense run or one without its experts split (no ep_imbalance)."""
    summary = path / "summary.json"
    imbalance = _json(summary, where).get("ep_imbalance") if summary.is_file() else None
    if imbalance is None:
        return cal
    ep = None  # unread: the note then names no degree
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        ep = tomllib.loads((path / "config.toml").read_text())["parallel"]["ep"]
    return replace(cal, moe_imbalance=float(imbalance), moe_ep=ep)


def _from_doctor(path: Path, where: str, cal: Calibration) -> Calibration:
    record = _json(path / "doctor.json", where)
    bandwidth = record.get("bandwidth") or {}
    intra = bandwidth.get("intra_node_busbw_bytes_per_s")
    inter = bandwidth.get("inter_node_busbw_bytes_per_s")
    data = record.get("data_samples_per_s_per_worker")
    machine = record.get("machine") or {}
    # A save of the job's own state (smoke) over the disk check's probe of a few bytes.
    latency = _first(machine.get("save_latency_s"), record.get("checkpoint_latency_s"))
    return replace(
        cal,
        device=cal.device or record.get("device"),
        intra_bps=intra or cal.intra_bps,
        inter_bps=inter or cal.inter_bps,
        link_note="the doctor" if intra or inter else cal.link_note,
        data_samples_per_s=data or cal.data_samples_per_s,
        checkpoint_latency_s=latency if latency is not None else cal.checkpoint_latency_s,
        checkpoint_bps=machine.get("checkpoint_write_bytes_per_s") or cal.checkpoint_bps,
        efficiency=machine.get("efficiency") or cal.efficiency,
        cpu_runtime_bytes=_first(machine.get("cpu_runtime_bytes"), cal.cpu_runtime_bytes),
        launch_s=machine.get("launch_s") or cal.launch_s,
        gemm=_gemm(machine.get("gemm") or record.get("gemm")) or cal.gemm,
    )


def _gemm(data: dict[str, Any] | GemmTable | None) -> GemmTable | None:
    """A GEMM table as the files hold it (GemmTable.to_dict), or already read."""
    if data is None or isinstance(data, GemmTable):
        return data
    return GemmTable.from_dict(data)


def _first(*values: float | None) -> float | None:
    return next((v for v in values if v is not None), None)


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
        # The doctor's rails share the node's NICs: the busbw it saw is one rail's share.
        nic = nic_bps_from_rail_busbw(
            cal.inter_bps, Fabric(inputs.gpus_per_node, hw.intra_bps, hw.inter_bps, hw.nics_per_node)
        )
        said.append(
            f"between nodes {nic / GB:.3g} GB/s a NIC, from {cal.inter_bps / GB:.3g} GB/s "
            f"measured on the rails (assumed {hw.inter_bps / GB:.3g} GB/s)"
        )
        hw = replace(hw, inter_bps=nic)
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
    if cal.checkpoint_bps:
        said.append(
            f"checkpoints write at {cal.checkpoint_bps / GB:.3g} GB/s per node, measured in "
            f"{cal.source} (assumed {inputs.checkpoint_bps / GB:.3g} GB/s)"
        )
        inputs = replace(inputs, checkpoint_bps=cal.checkpoint_bps)
    if cal.launch_s is not None:
        said.append(f"starting the workers took {cal.launch_s:.3g} s, measured in {cal.source}")
    inputs, said = _runtime_memory(inputs, cal, said)
    inputs, said = _expert_load(inputs, cal, said)
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


def _expert_load(
    inputs: PlanInputs, cal: Calibration, said: list[str]
) -> tuple[PlanInputs, list[str]]:
    """A run's measured expert load imbalance in place of moe.imbalance, for a plan of a
    Mixture-of-Experts model (its routing, not the machine's: a dense plan ignores it)."""
    w = inputs.workload
    if cal.moe_imbalance is None:
        return inputs, said
    if w.moe is None:
        return inputs, said + [
            f"the expert load imbalance measured in {cal.source} is not applied: this plan's "
            "model has no experts"
        ]
    over = f" over {cal.moe_ep} expert-parallel ranks" if cal.moe_ep else ""
    said = said + [
        f"expert load imbalance {cal.moe_imbalance:.3g} (the busiest rank's routed tokens over "
        f"the mean) measured{over} in {cal.source} (assumed moe.imbalance {w.imbalance:.3g})"
    ]
    return replace(inputs, workload=replace(w, imbalance=cal.moe_imbalance)), said


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


NO_CALIBRATION = "none"  # plan.calibration / --calibrate: plan on the defaults


def machine_calibration(
    given: str | None, gpu: str, where: str
) -> tuple[Calibration | None, list[str]]:
    """The calibration a plan for device `gpu` (the catalog's name) uses, and warnings:
    `given` (a file or a run directory; "none": no calibration) or, when not given, this
    machine kind's default file (calibration_path) when there is one. A calibration file
    of another machine kind is refused when given (one line) and skipped with a warning
    when found at the default place."""
    kind = gpu.split(" ")[0]
    if given == NO_CALIBRATION:
        return None, []
    if given:
        cal = read_calibration(given, where=where)
        if cal.kind and cal.kind != kind:
            raise ConfigError(
                f"{where}: measured on a {cal.kind} machine ({cal.device}), but this plan is "
                f"for {kind}: give the calibration file of a {kind} machine (trainwise doctor "
                f"on one writes it) or '{NO_CALIBRATION}'"
            )
        return cal, []
    path = calibration_path(kind)
    if not path.is_file():
        return None, []
    try:
        cal = read_calibration(path, where=str(path))
    except ConfigError as err:
        return None, [f"{err.problems[0]}: planning on the defaults"]
    if cal.kind != kind:
        return None, [
            f"{path} was measured on a {cal.kind} machine ({cal.device}), not {kind}: not "
            "used; run trainwise doctor on this machine to replace it"
        ]
    return replace(cal, source=str(path)), []
