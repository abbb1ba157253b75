"""A full disk: the run directory on a tmpfs with room for one checkpoint and not two. The
second save fails on every rank with one clear line, the first checkpoint stays valid, and
the run stops with a non-zero status instead of training on without checkpoints."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from faulty import fault_limit, job_args, tmpfs

from helpers import run_cli, run_main
from trainwise.config import load_config
from trainwise.hardware import detect_device
from trainwise.run.job.resolve import prepare_job

# Each test's limit: its runs and the references it may wait for.
pytestmark = [pytest.mark.dist, pytest.mark.timeout(fault_limit())]

FP32 = 4
ADAM_STATES = 2  # exp_avg and exp_avg_sq, each the size of the parameters


def checkpoint_bytes() -> int:
    """What one checkpoint of the default model takes: fp32 parameters and Adam's two
    states (the trainer file, metadata and RNG states add a few KB)."""
    job = prepare_job(load_config(), 2, detect_device("cpu"))
    return job.params * FP32 * (1 + ADAM_STATES)


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A tmpfs with room for the run's small files and 1.5 checkpoints."""
    with tmpfs(tmp_path / "small", int(checkpoint_bytes() * 1.5) + 512 * 1024) as mount:
        yield mount


def test_disk_full_stops_cleanly_and_keeps_the_last_checkpoint(workdir: Path, small_disk: Path):
    run_dir = small_disk / "run"
    done = run_cli(*job_args(run_dir, 2, "ddp", steps=12), cwd=workdir)
    assert done.returncode != 0
    err = done.stderr
    assert "checkpoint of step 8 could not be written" in err, err
    assert "no space left on the device" in err and "the previous checkpoint is intact" in err
    assert "Traceback" not in err and "Traceback" not in done.stdout

    log = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    kinds = [e["kind"] for e in log]
    assert "fatal" in kinds and "finish" not in kinds and "failure" not in kinds
    assert [e["step"] for e in log if e["kind"] == "checkpoint"] == [4]

    listing = run_main("checkpoints", str(run_dir), "--verify", "full", "--json", cwd=workdir)
    assert listing.returncode == 0, listing.stderr
    found = json.loads(listing.stdout)
    assert [(c["step"], c["valid"]) for c in found] == [(4, True), (8, False)], found
    assert found[1]["status"] == "incomplete"  # the failed save, removed at the next start
