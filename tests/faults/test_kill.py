"""A worker SIGKILLed mid-run: torchrun's elastic agent restarts the group, the workers
resume from the last checkpoint, and the run ends with weights bit-identical to the same
run left alone. A kill while a checkpoint is being written leaves a partial directory
that the next start removes; the previous checkpoint is used. The killed worker (ddp,
fsdp) held one gloo group, the job's: no side group beside the step."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from faulty import (
    References,
    assert_identical,
    fault_limit,
    final_weights,
    finish,
    job_args,
    kill,
    start,
    thread_names,
    wait_for_pid,
)

from helpers import run_main

# Each test's limit: its runs and the references it may wait for.
pytestmark = [pytest.mark.dist, pytest.mark.timeout(fault_limit())]


def events(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_sigkill_restart_resumes_exactly(workdir: Path, reference: References, strategy: str):
    broken = workdir / "broken"
    proc = start(job_args(broken, 2, strategy), workdir, faults="pause@step=10,rank=1")
    pid = wait_for_pid(proc, broken / "faults" / "pause-step-10.pid")
    threads = thread_names(pid)
    kill(pid)  # after step 10; the last checkpoint is step 8
    rc, out, err = finish(proc)
    assert rc == 0, err
    # A training worker holds one gloo group, the job's: each more one is an event loop
    # waking every 10 ms beside the step (docs/development.md), one thread it names so.
    assert threads.count("gloo_tcp_loop") == 1, threads

    log = events(broken)
    failure = next(e for e in log if e["kind"] == "failure")
    assert failure["pid"] == pid and failure["signal"] == "SIGKILL"
    resume = next(e for e in log if e["kind"] == "resume")
    assert resume["step"] == 8 and resume["attempt"] == 1 and resume["rng"] == "restored"
    assert "resuming from step 8" in err
    summary = json.loads((broken / "summary.json").read_text())
    cost = summary["retry_cost"]
    assert cost["failures"] == 1 and cost["downtime_s"] > 0 and cost["recomputed_s"] > 0
    assert "1 failure cost" in out

    assert_identical(reference.weights(2, strategy), final_weights(broken))
    if strategy == "ddp":  # the report prices the same events: downtime plus recomputation
        made = run_main("report", str(broken), "--format", "json", cwd=workdir)
        assert made.returncode == 0, made.stderr
        terms = {t["name"]: t for t in json.loads(made.stdout)["runs"][0]["cost"]["terms"]}
        retry_h = (cost["downtime_s"] + cost["recomputed_s"]) * 2 / 3600
        assert terms["failure retry"]["gpu_hours"] == pytest.approx(retry_h) and retry_h > 0


def test_kill_during_save_keeps_the_previous_checkpoint(workdir: Path):
    run_dir = workdir / "run"
    proc = start(job_args(run_dir, 2, "ddp"), workdir, faults="pause_in_save@step=8,rank=0")
    pid = wait_for_pid(proc, run_dir / "faults" / "pause_in_save-step-8.pid")
    partial = run_dir / "checkpoints" / "step-00000008.tmp"
    assert partial.is_dir() and not (partial / "manifest.json").exists()
    kill(pid)  # rank 0, after the shards of step 8 are written, before the commit
    rc, out, err = finish(proc)
    assert rc == 0, err

    log = events(run_dir)
    resume = next(e for e in log if e["kind"] == "resume")
    assert resume["step"] == 4  # step 8 never committed
    assert "removed an interrupted save" in err and "step-00000008.tmp" in err
    steps = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert steps == ["step-00000004", "step-00000008", "step-00000012"]  # keep_last = 3
    listing = run_main("checkpoints", str(run_dir), "--verify", "full", "--json", cwd=workdir)
    assert listing.returncode == 0, listing.stderr
    assert all(c["valid"] for c in json.loads(listing.stdout))
