"""Preemption as Slurm and Kubernetes do it: SIGTERM (or SIGUSR1) to `trainwise train`.
The run finishes its step, saves synchronously and exits 0 with a `preempted` event; the
same command started again resumes and ends bit-identical to an uninterrupted run."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
from faulty import (
    STEPS,
    References,
    assert_identical,
    final_weights,
    finish,
    job_args,
    start,
    wait_for_pid,
)

from helpers import run_cli

pytestmark = pytest.mark.dist


def preempt(workdir: Path, run_dir: Path, sig: signal.Signals) -> dict:
    """Start the job, send `sig` to the launcher once rank 0 paused after step 6, check
    the clean stop; returns the `preempted` event."""
    args = job_args(run_dir, 2, "fsdp")
    proc = start(args, workdir, faults="pause@step=6,rank=0")
    wait_for_pid(proc, run_dir / "faults" / "pause-step-6.pid")
    proc.send_signal(sig)  # to the launcher, as the scheduler would
    rc, out, err = finish(proc)
    assert rc == 0, err
    assert "stopped by" in out and "run the same command again" in out
    log = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]
    stop = next(e for e in log if e["kind"] == "preempted")
    assert stop["signal"] == sig.name
    saved = [e["step"] for e in log if e["kind"] == "checkpoint"]
    assert saved[-1] == stop["step"] and stop["step"] < STEPS
    assert not any(e["kind"] == "failure" for e in log)
    return stop


def test_sigterm_saves_exits_zero_and_resumes_exactly(workdir: Path, reference: References):
    run_dir = workdir / "run"
    stop = preempt(workdir, run_dir, signal.SIGTERM)
    again = run_cli(*job_args(run_dir, 2, "fsdp"), cwd=workdir)
    assert again.returncode == 0, again.stderr
    assert f"resuming from step {stop['step']}" in again.stderr
    assert f"stopped by SIGTERM after step {stop['step']}; resumed from step {stop['step']}" in (
        again.stderr
    )
    assert "0 step(s) redone" in again.stderr
    assert_identical(reference.weights(2, "fsdp"), final_weights(run_dir, workdir))


def test_sigusr1_is_a_preemption_too(workdir: Path):
    """What `sbatch --signal=USR1@90` sends; the launcher must forward it, not die of it."""
    preempt(workdir, workdir / "run", signal.SIGUSR1)
