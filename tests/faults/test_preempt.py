"""Preemption as Slurm and Kubernetes do it: SIGTERM (or SIGUSR1) to `trainwise train`.
The run finishes its step, saves synchronously and exits 128 + the signal (never 0: it did
not finish) with a `preempted` event; the same command started again resumes and ends
bit-identical to an uninterrupted run, and exits 0 when it finishes."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
from faulty import (
    STEPS,
    References,
    assert_identical,
    fault_limit,
    final_weights,
    finish,
    job_args,
    start,
    wait_for_pid,
)

# Each test's limit: its runs and the references it may wait for.
pytestmark = [pytest.mark.dist, pytest.mark.timeout(fault_limit())]


def preempt(workdir: Path, run_dir: Path, sig: signal.Signals) -> dict:
    """Start the job, send `sig` to the launcher once rank 0 paused after step 6, check
    the clean stop; returns the `preempted` event."""
    args = job_args(run_dir, 2, "fsdp")
    proc = start(args, workdir, faults="pause@step=6,rank=0")
    wait_for_pid(proc, run_dir / "faults" / "pause-step-6.pid")
    proc.send_signal(sig)  # to the launcher, as the scheduler would
    rc, out, err = finish(proc)
    assert rc == 128 + sig, err  # 143 SIGTERM, 138 SIGUSR1: `train && export` stops here
    assert "stopped by" in out and "run the same command again" in out
    log = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]
    stop = next(e for e in log if e["kind"] == "preempted")
    assert stop["signal"] == sig.name
    saved = [e["step"] for e in log if e["kind"] == "checkpoint"]
    assert saved[-1] == stop["step"] and stop["step"] < STEPS
    assert not any(e["kind"] == "failure" for e in log)
    return stop


def test_sigterm_saves_exits_143_and_resumes_exactly(workdir: Path, reference: References):
    """The resumed run is Ctrl-C'd after its last step (paused there, in teardown): that
    run has finished, so it ends with its summary and exit 0, not as a stop."""
    run_dir = workdir / "run"
    stop = preempt(workdir, run_dir, signal.SIGTERM)
    proc = start(job_args(run_dir, 2, "fsdp"), workdir, faults=f"pause@step={STEPS},rank=0")
    wait_for_pid(proc, run_dir / "faults" / f"pause-step-{STEPS}.pid")
    proc.send_signal(signal.SIGINT)
    rc, out, err = finish(proc)
    assert rc == 0, err
    assert "before a save" not in out + err and "finished" in out
    assert f"resuming from step {stop['step']}" in err
    assert f"stopped by SIGTERM after step {stop['step']}; resumed from step {stop['step']}" in err
    assert "0 step(s) redone" in err
    assert_identical(reference.weights(2, "fsdp"), final_weights(run_dir))


def test_sigusr1_is_a_preemption_too(workdir: Path):
    """What `sbatch --signal=USR1@90` sends; the launcher must forward it, not die of it."""
    preempt(workdir, workdir / "run", signal.SIGUSR1)
