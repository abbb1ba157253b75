"""The planner against the GPUs of this machine: plan versus measured, as ratios.

For each job of JOBS (preset, layout, micro-batch, activation checkpointing), it runs a
few real steps through trainwise's own runtime (`trainwise train` with one worker per
visible GPU, bf16, NCCL) and compares the run's measurements with the plan the run
wrote at its start (plan.json):

- memory: the steps' peak `torch.cuda.max_memory_allocated` against the plan's tensors
  (its total less its overhead: the CUDA context and the allocator's fragmentation, which
  max_memory_allocated does not count), and the peak `max_memory_reserved` against the
  tensors plus the plan's fragmentation allowance;
- step time: the median steady step (after the warm-up steps, no checkpoint) against the
  plan's step (which assumes plan.efficiency of the peak: a ratio of 0.5 means the GPU
  ran at twice that rate), and the measured MFU.

A job trainwise refuses because it does not fit the GPUs (exit 2 before any worker
starts) is listed as such; one that fails while running (out of memory) too: both are
findings. Then the NCCL all-reduce bus bandwidth: `trainwise doctor --only bandwidth`
against the catalog's figure (skipped on one GPU: it has no peer).

    python bench/gpu_validate.py                  # every job, 20 steps each
    python bench/gpu_validate.py --steps 10 --only gpt2-124m
    python bench/gpu_validate.py --set checkpoint.enabled=false   # one more override

About 4-6 minutes on one H100/H200 (most of it process start-up). Without CUDA it prints
one line and exits 0: there is nothing to validate, which is not a failure (a CPU
machine running every bench stays green). Not part of `make test`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

WARMUP_STEPS = 2  # as trainwise.plan.calibrate: allocation and autotuning
FRAGMENTATION = 0.05  # trainwise.plan.model.memory's allowance, for the reserved ratio
JOB_TIMEOUT_S = 240
BUDGET_S = 450  # no new job starts after this: the whole script stays under ~8 minutes


@dataclass(frozen=True)
class Job:
    preset: str
    layout: str  # "replicate" (ddp; single on one GPU) or "shard" (fsdp over every GPU)
    micro_batch: int
    ac: str  # none, selective, full
    seq_len: int = 1024

    @property
    def name(self) -> str:
        return f"{self.preset} {self.layout} mb{self.micro_batch} ac={self.ac}"

    def settings(self, gpus: int) -> dict[str, Any]:
        """The job's config keys on `gpus` GPUs (what `trainwise train --set` gets)."""
        strategy = "fsdp" if self.layout == "shard" else ("ddp" if gpus > 1 else "single")
        return {
            "model.name": self.preset,
            "parallel.strategy": strategy,
            "parallel.ac": self.ac,
            "data.micro_batch": self.micro_batch,
            "data.seq_len": self.seq_len,
            "precision.dtype": "bf16",
            "cluster.device": "cuda",
            "cluster.backend": "nccl",
            "checkpoint.interval": 100_000,  # no save inside the timed steps
            "train.eval_every": 0,
            "logging.progress": "none",
            "logging.tensorboard": False,
            "logging.report": False,
        }


# Small to large; each layout and checkpointing mode at least once.
JOBS = [
    Job("gpt2-124m", "replicate", 8, "none"),
    Job("gpt2-124m", "shard", 8, "none"),
    Job("gpt2-124m", "shard", 16, "selective"),
    Job("gpt2-350m", "shard", 8, "full"),
    Job("llama-1b", "shard", 4, "full"),
    Job("llama-1b", "replicate", 8, "none"),
]


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)  # a TOML basic string
    return str(value)


def overrides(job: Job, gpus: int) -> list[str]:
    return [f"{key}={toml_value(value)}" for key, value in job.settings(gpus).items()]


def run_job(
    job: Job, gpus: int, steps: int, root: Path, extra: tuple[str, ...] = ()
) -> dict[str, Any]:
    run_dir = root / job.name.replace(" ", "_").replace("=", "-")
    cmd = [sys.executable, "-m", "trainwise", "train", "--nproc", str(gpus), "--steps",
           str(steps), "--run-dir", str(run_dir)]
    for item in [*overrides(job, gpus), *extra]:
        cmd += ["--set", item]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=JOB_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return {"job": job.name, "status": f"timed out after {JOB_TIMEOUT_S} s"}
    if res.returncode == 2:
        return {"job": job.name, "status": "refused: " + last_line(res.stderr)}
    if res.returncode != 0:
        return {"job": job.name, "status": "failed: " + last_line(res.stderr)}
    return {"job": job.name, "status": "ok", **compare(run_dir)}


def last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:160] if lines else "(no message)"


def compare(run_dir: Path) -> dict[str, Any]:
    plan = json.loads((run_dir / "plan.json").read_text())
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steady = [r for r in rows if r["step"] > WARMUP_STEPS and not r.get("ckpt_s")] or rows
    memory = plan["memory_per_gpu"]
    tensors = memory["total"] - (memory.get("overhead") or 0)
    allocated = max(r["mem_bytes"] for r in rows)
    reserved = max((r.get("mem_reserved_bytes") or 0) for r in rows) or None
    step_s = statistics.median(r["step_s"] for r in steady)
    mfus = [r["mfu"] for r in steady if r.get("mfu") is not None]
    return {
        "plan_tensors_gb": tensors / 1e9,
        "allocated_gb": allocated / 1e9,
        "alloc_ratio": allocated / tensors,
        "reserved_gb": reserved / 1e9 if reserved else None,
        "reserved_ratio": reserved / (tensors * (1 + FRAGMENTATION)) if reserved else None,
        "plan_step_s": plan["step"]["total"],
        "step_s": step_s,
        "step_ratio": step_s / plan["step"]["total"],
        "mfu": statistics.median(mfus) if mfus else None,
        "plan_mfu": plan.get("mfu"),
        "intra_node_gbps": plan.get("intra_node_gbps"),
    }


def bandwidth(gpus: int, root: Path, catalog_gbps: float | None) -> str:
    if gpus < 2:
        return "NCCL all-reduce: skipped (one GPU has no peer to measure a link with)"
    run_dir = root / "doctor-bandwidth"
    cmd = [sys.executable, "-m", "trainwise", "doctor", "--only", "bandwidth", "--nproc",
           str(gpus), "--run-dir", str(run_dir), "--set", 'cluster.device="cuda"']
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=JOB_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return f"NCCL all-reduce: timed out after {JOB_TIMEOUT_S} s"
    record = run_dir / "doctor.json"
    if not record.is_file():
        return "NCCL all-reduce: the doctor failed: " + last_line(res.stderr)
    busbw = json.loads(record.read_text())["bandwidth"].get("intra_node_busbw_bytes_per_s")
    if not busbw:
        return "NCCL all-reduce: not measured (see the doctor's output)"
    vs = (
        f", {busbw / 1e9 / catalog_gbps:.2f} x the catalog's {catalog_gbps:g}"
        if catalog_gbps
        else ""
    )
    return f"NCCL all-reduce bus bandwidth {busbw / 1e9:.1f} GB/s on {gpus} GPUs{vs}"


def fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_table(results: list[dict[str, Any]]) -> None:
    head = ("job", "alloc GB", "plan GB", "alloc/plan", "reserved/plan", "step s", "plan s",
            "step/plan", "MFU")
    rows = []
    for r in results:
        if r["status"] != "ok":
            rows.append((r["job"], r["status"]))
            continue
        rows.append((
            r["job"], fmt(r["allocated_gb"], ".2f"), fmt(r["plan_tensors_gb"], ".2f"),
            fmt(r["alloc_ratio"], ".2f"), fmt(r["reserved_ratio"], ".2f"),
            fmt(r["step_s"], ".4f"), fmt(r["plan_step_s"], ".4f"), fmt(r["step_ratio"], ".2f"),
            fmt(r["mfu"], ".0%"),
        ))
    width = max(len(r[0]) for r in [head, *rows])
    print(f"{head[0]:<{width}}  " + "  ".join(f"{h:>13}" for h in head[1:]))
    for row in rows:
        if len(row) == 2:
            print(f"{row[0]:<{width}}  {row[1]}")
        else:
            print(f"{row[0]:<{width}}  " + "  ".join(f"{v:>13}" for v in row[1:]))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20, help="steps per job (default 20)")
    p.add_argument("--only", help="run only the jobs whose name contains this")
    p.add_argument("--json", action="store_true", help="print the results as JSON too")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="one more config override for every job (repeatable)")
    args = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("gpu_validate: skipped: no CUDA device is visible (torch.cuda.is_available() is "
              "False); run it on a machine with GPUs")
        return 0
    gpus = torch.cuda.device_count()
    print(f"gpu_validate: {gpus} x {torch.cuda.get_device_name(0)}, {args.steps} steps a job")
    start, results = time.perf_counter(), []
    with tempfile.TemporaryDirectory(prefix="gpu-validate-") as tmp:
        for job in (j for j in JOBS if not args.only or args.only in j.name):
            if time.perf_counter() - start > BUDGET_S:
                results.append({"job": job.name, "status": "not run (time budget spent)"})
                continue
            results.append(run_job(job, gpus, args.steps, Path(tmp), tuple(args.set)))
            print(f"  {job.name}: {results[-1]['status']}", flush=True)
        catalog = next((r["intra_node_gbps"] for r in results if r.get("intra_node_gbps")), None)
        link = bandwidth(gpus, Path(tmp), catalog)
    print_table(results)
    print(link)
    print(f"({time.perf_counter() - start:.0f} s; ratios are measured / plan)")
    if args.json:
        print(json.dumps({"gpus": gpus, "jobs": results, "bandwidth": link}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
