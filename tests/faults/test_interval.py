"""When saves happen besides every N steps: `interval = "auto"` (Young/Daly from the measured
stall and the cluster's MTBF, decided on rank 0's clock and agreed by all ranks) and
`every_minutes`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from faulty import fault_limit, job_args

from helpers import run_cli

# Each test's limit: its runs and the references it may wait for.
pytestmark = [pytest.mark.dist, pytest.mark.timeout(fault_limit())]


def saved_steps(run_dir: Path) -> list[int]:
    lines = (run_dir / "events.jsonl").read_text().splitlines()
    return [e["step"] for e in map(json.loads, lines) if e["kind"] == "checkpoint"]


def test_auto_interval_follows_young_daly(workdir: Path):
    # An MTBF of 3.6 ms makes the optimum shorter than a step: save as often as allowed.
    run_dir = workdir / "run"
    # The ranks agree on a save when they next exchange flags: at every flush (here every
    # step; by default about once a second of training).
    extra = ("--set", "checkpoint.interval='auto'", "--set", "cluster.mtbf_hours=1e-6",
             "--set", "logging.flush_every=1")
    done = run_cli(*job_args(run_dir, 2, "ddp", *extra, steps=16), cwd=workdir)
    assert done.returncode == 0, done.stderr
    assert "checkpoint interval auto = 1 steps" in done.stderr
    steps = saved_steps(run_dir)
    assert steps[0] == 10  # the first save measures the stall
    assert steps[-1] == 16  # the final save
    assert len(steps) >= 4, steps  # auto saves between: agreed by both ranks one step late


def test_every_minutes_saves_by_the_clock(workdir: Path):
    run_dir = workdir / "run"
    extra = ("--set", "checkpoint.interval=1000", "--set", "checkpoint.every_minutes=1e-6")
    done = run_cli(*job_args(run_dir, 1, "single", *extra, steps=6), cwd=workdir)
    assert done.returncode == 0, done.stderr
    assert saved_steps(run_dir) == [1, 2, 3, 4, 5, 6]  # one process: no agreement delay
