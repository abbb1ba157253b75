"""Shared test helpers: run the CLI as a user types it, in a separate process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

# Quiet, fast, loopback-only runs: every test job sets these.
QUIET = ["--set", "logging.progress=none", "--set", "logging.tensorboard=false",
         "--set", "logging.report=false"]  # fmt: skip


def cli_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", PYTHONUNBUFFERED="1")
    outer = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_STEP_ID")
    for var in outer:
        env.pop(var, None)  # a test must not think it is a worker of an outer job
    return env


def run_cli(
    *args: str, cwd: Path, timeout: float = 240, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """`trainwise ARGS` in `cwd`; `env` adds variables (a test's fault, say)."""
    return subprocess.run(
        [sys.executable, "-m", "trainwise", *args],
        cwd=cwd,
        env={**cli_env(), **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def read_records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
