"""The benchmarks still run against today's code (no figure is asserted: they print ratios
for people; a test only checks that they work and measure what they say)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from helpers import hang_limit, run_limited

REPO = Path(__file__).resolve().parents[2]


def test_the_checkpoint_bench_saves_and_loads_a_whole_state(tmp_path: Path):
    out = run_limited(
        [sys.executable, str(REPO / "bench" / "checkpoint.py"), "--mb", "8", "--rounds", "1",
         "--dir", str(tmp_path), "--json"],
        what="bench/checkpoint.py --mb 8", limit=hang_limit(procs=0),
    )
    assert out.returncode == 0, out.stderr
    payload = json.loads(out.stdout[out.stdout.index("\n{") :])
    measured = {row["what"] for row in payload["rows"]}
    assert {"raw write", "sync save", "checksum (in sync save)", "Checkpointer.load"} <= measured
    state = payload["bytes"]["state (tensors)"]
    # The checkpoint holds the whole state, plus a little metadata (DCP's flat optimizer
    # format keys every setting by parameter: about 0.4 MB for this stack, whatever --mb).
    assert state <= payload["bytes"]["checkpoint dir"] < 1.1 * state
    assert not list(tmp_path.iterdir())  # its temporary folder is gone


def _gpu_validate():
    """bench/gpu_validate.py as a module (bench/ is not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "gpu_validate", REPO / "bench" / "gpu_validate.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_validate"] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_gpu_validate_without_cuda_says_so_in_one_line():
    import torch

    if torch.cuda.is_available():
        pytest.skip("with CUDA the script runs its jobs: minutes, not a test")
    out = run_limited([sys.executable, str(REPO / "bench" / "gpu_validate.py")],
                      what="bench/gpu_validate.py without CUDA", limit=hang_limit(procs=0))
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 1 and "no CUDA device is visible" in lines[0], out.stdout


def test_gpu_validate_jobs_are_valid_jobs_on_any_gpu_count():
    from trainwise.config import load_config
    from trainwise.models.shapes import PRESETS

    bench = _gpu_validate()
    assert bench.JOBS
    for job in bench.JOBS:
        assert job.preset in PRESETS
        for gpus in (1, 2, 8):
            cfg = load_config(None, overrides=bench.overrides(job, gpus))
            assert (cfg.model.name, cfg.data.micro_batch, cfg.parallel.ac) == (
                job.preset, job.micro_batch, job.ac,
            )
            assert cfg.precision.dtype == "bf16" and cfg.cluster.backend == "nccl"
            single = gpus == 1 and job.layout == "replicate"
            assert cfg.parallel.strategy == ("single" if single else
                                             "ddp" if job.layout == "replicate" else "fsdp")


def test_gpu_validate_compares_a_run_with_its_plan(tmp_path: Path):
    """The ratios from a run directory written here: allocated / the plan's tensors (its
    total less its overhead), reserved / tensors x 1.05, the median steady step / plan."""
    bench = _gpu_validate()
    plan = {"memory_per_gpu": {"total": 3e9, "overhead": 1e9}, "step": {"total": 0.1},
            "mfu": 0.4, "intra_node_gbps": 450}
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    rows = [{"step": s, "step_s": 1.0 if s <= 2 else 0.1 + 0.01 * s, "ckpt_s": 0.0,
             "mem_bytes": 2.5e9, "mem_reserved_bytes": 3.15e9, "mfu": 0.3} for s in range(1, 8)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    got = bench.compare(tmp_path)
    assert got["alloc_ratio"] == pytest.approx(1.25)
    assert got["reserved_ratio"] == pytest.approx(1.5)
    assert got["step_ratio"] == pytest.approx(0.15 / 0.1)  # steps 3..7: median 0.15
    assert got["mfu"] == pytest.approx(0.3)

