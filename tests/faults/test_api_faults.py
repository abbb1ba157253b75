"""`trainwise.train()` from a Python process, not the CLI (api_script.py: a user's script
whose model lives in its __main__, so it reaches the workers by value): the returned
record is the run directory's, a worker killed mid-run is restarted by the elastic agent
and finds the model again, a rerun of the script resumes (the reference to the model is the
same in a new process), and Ctrl-C (SIGINT to the script) saves a checkpoint and returns a
"stopped" result, as `trainwise train` exits 130 (test_preempt.py's stop, from Python).
Two launches in all, shared by the checks."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from faulty import kill, wait_for_pid

from helpers import cli_env, hang_limit, read_records
from trainwise.records import RunSummary

pytestmark = [pytest.mark.dist, pytest.mark.timeout(hang_limit(launches=3, steps=20))]
SCRIPT = Path(__file__).with_name("api_script.py")
FIRST, MORE = 6, 14  # steps of the first launch, and of the rerun that continues it


def start(run_dir: Path, steps: int, faults: str) -> subprocess.Popen:
    env = {**cli_env(), "TRAINWISE_FAULTS": faults}
    return subprocess.Popen(
        [sys.executable, str(SCRIPT), str(run_dir), str(steps)], cwd=run_dir.parent, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def result_of(proc: subprocess.Popen, steps: int) -> tuple[int, dict, str]:
    out, err = proc.communicate(timeout=hang_limit(launches=2, steps=steps))
    lines = [line for line in out.splitlines() if line.startswith("{")]
    assert lines, f"no result printed (exit {proc.returncode}):\n{err[-3000:]}"
    return proc.returncode, json.loads(lines[-1]), err


@pytest.fixture(scope="module")
def first(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict, str]:
    """Six steps; rank 1 is killed after step 3 and the agent restarts the workers, which
    resume from the checkpoint of step 2."""
    run_dir = tmp_path_factory.mktemp("api") / "run"
    proc = start(run_dir, FIRST, "pause@step=3,rank=1")
    kill(wait_for_pid(proc, run_dir / "faults" / "pause-step-3.pid", hang_limit()))
    rc, result, err = result_of(proc, FIRST)
    assert rc == 0, err[-3000:]
    return run_dir, result, err


def test_the_returned_record_is_the_run_directorys(first):
    run_dir, result, err = first
    assert result["status"] == "finished" and result["exit_status"] == 0
    assert Path(result["run_dir"]).resolve() == run_dir.resolve()
    written = json.loads((run_dir / "summary.json").read_text())
    assert result["summary"] == RunSummary.from_dict(written).to_dict()
    assert written.keys() <= result["summary"].keys(), "a key of summary.json is not typed"
    assert result["steps"] == [r["step"] for r in read_records(run_dir)]
    assert result["summary"]["last_step"] == FIRST
    assert f"{FIRST}/{FIRST}" in err  # the bar that followed the metrics


def test_a_model_from_main_travels_by_value_and_survives_a_restart(first):
    run_dir, result, _ = first
    assert result["summary"]["model"].startswith("pickled:")
    events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]
    assert any(e["kind"] == "failure" for e in events)
    ready = [e for e in events if e["kind"] == "ready"]
    assert [e["attempt"] for e in ready] == [0, 1] and ready[1]["step"] == 2
    assert result["steps"][-1] == FIRST and result["summary"]["retry_cost"]["failures"] == 1


def test_a_rerun_resumes_and_sigint_stops_it_after_a_save(first):
    """The script again, with more steps: its model's reference is the one in the
    checkpoints' lineage, so it resumes; Ctrl-C once rank 0 is past step 8 saves within
    the next steps (every rank agrees on the step) and train() returns the stop."""
    run_dir, before, _ = first
    proc = start(run_dir, MORE, "pause@step=8,rank=0")
    wait_for_pid(proc, run_dir / "faults" / "pause-step-8.pid", hang_limit())
    proc.send_signal(signal.SIGINT)
    rc, result, err = result_of(proc, MORE)
    assert rc == 0, err[-3000:]  # the script ran to its end: train() returned
    assert result["status"] == "stopped" and result["exit_status"] == 128 + signal.SIGINT
    stop = result["stop"]
    assert stop["signal"] == "SIGINT" and 8 <= stop["step"] < MORE
    assert "run the same command again to resume" in result["message"]
    assert result["summary"]["model"] == before["summary"]["model"]
    assert f"resuming from step {FIRST}" in err
    saved = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]
    assert [e["step"] for e in saved if e["kind"] == "checkpoint"][-1] == stop["step"]
    assert Path(result["stop"]["checkpoint"]).is_dir()
