"""Damaged checkpoints and a diverging loss, on one in-process worker (fast; the restart
machinery is covered by test_kill): flipped and truncated shard files are found, named and
skipped; each non-finite policy does what it says."""

from __future__ import annotations

import json
import shutil
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

from helpers import read_records

# Each test's limit: its runs and the references it may wait for.
pytestmark = [pytest.mark.dist, pytest.mark.timeout(fault_limit())]

# One in-process worker. The reference run has checkpoints at 4, 8 and 12 (keep_last = 3).


def events(run_dir: Path, kind: str) -> list[dict]:
    lines = (run_dir / "events.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["kind"] == kind]


def shard(run_dir: Path, step: int) -> Path:
    files = sorted((run_dir / "checkpoints" / f"step-{step:08d}").glob("*.distcp"))
    assert files, f"no shard file in step {step}"
    return files[0]


def flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 8] = bytes(b ^ 0xFF for b in data[middle : middle + 8])
    path.write_bytes(bytes(data))


def truncate(path: Path) -> None:
    with path.open("r+b") as f:
        f.truncate(path.stat().st_size // 2)


def run(run_dir: Path, cwd: Path, *extra: str, faults: str = "") -> tuple[int, str, str]:
    args = job_args(run_dir, 1, "single", *extra)
    return finish(start(args, cwd, faults=faults))


def killed_after_last_save(run_dir: Path) -> None:
    """Make a finished run look like one killed after its last save: no finish event (a
    finished run is not run again)."""
    log = run_dir / "events.jsonl"
    kept = [line for line in log.read_text().splitlines() if json.loads(line)["kind"] != "finish"]
    log.write_text("".join(line + "\n" for line in kept))


def test_corrupted_and_truncated_checkpoints_are_skipped(workdir: Path, reference: References):
    run_dir = workdir / "run"
    shutil.copytree(reference.run(1, "single"), run_dir)
    killed_after_last_save(run_dir)

    flipped, cut = shard(run_dir, 12), shard(run_dir, 8)
    flip(flipped)
    truncate(cut)
    rc, _, err = run(run_dir, workdir)
    assert rc == 0, err
    warnings = [line for line in err.splitlines() if "is invalid and skipped" in line]
    assert len(warnings) == 2, err
    assert str(flipped) in warnings[0] and "xxh3 mismatch" in warnings[0]
    assert str(cut) in warnings[1] and "truncated" in warnings[1]
    assert "resuming from step 4" in err
    skipped = events(run_dir, "checkpoint_skipped")
    assert [Path(e["path"]).name for e in skipped] == ["step-00000012", "step-00000008"]
    # Steps 5..12 were trained again from step 4's exact state.
    assert_identical(reference.weights(1, "single"), final_weights(run_dir))

    for step in (4, 8, 12):
        flip(shard(run_dir, step))
    killed_after_last_save(run_dir)
    rc, out, err = run(run_dir, workdir)
    assert rc == 1
    assert "no valid checkpoint" in err and "checkpoint.resume = 'never'" in err
    assert "Traceback" not in err and "Traceback" not in out


def test_two_ranks_share_the_hashing_and_a_mismatch_found_by_rank_1_is_reported(
    workdir: Path, reference: References
):
    """verify = "full" on 2 ranks: rank r hashes every 2nd file from the r-th; a flipped
    file of rank 1's share is still named by rank 0's warning, and the run resumes from the
    step before, to the reference's weights."""
    run_dir = workdir / "run"
    shutil.copytree(reference.run(2, "ddp"), run_dir)
    killed_after_last_save(run_dir)
    newest = run_dir / "checkpoints" / "step-00000012"
    files = [e["path"] for e in json.loads((newest / "manifest.json").read_text())["files"]]
    odd = [f for f in files[1::2] if f.endswith(".distcp")]
    assert odd, files  # the layout this test relies on: a shard in rank 1's share
    flip(newest / odd[0])
    rc, _, err = finish(start(job_args(run_dir, 2, "ddp"), workdir))
    assert rc == 0, err
    warnings = [line for line in err.splitlines() if "is invalid and skipped" in line]
    assert len(warnings) == 1 and f"{odd[0]}: xxh3 mismatch" in warnings[0], err
    assert "resuming from step 8" in err
    assert_identical(reference.weights(2, "ddp"), final_weights(run_dir))


# fused: the update skips itself on the device and the host reads the verdict a step later;
# foreach: the host reads the norm and skips the update at its step (run/engine/guard.py).
@pytest.mark.parametrize("implementation", ["fused", "foreach"])
def test_nonfinite_skip_skips_one_update(workdir: Path, implementation: str):
    rc, _, err = run(workdir / "run", workdir, "--set", "train.nonfinite=skip",
                     "--set", f"optim.implementation={implementation}", faults="nan@step=6")
    assert rc == 0, err
    assert "step 6: non-finite loss or gradient norm (skip)" in err
    assert [e["step"] for e in events(workdir / "run", "nonfinite")] == [6]
    records = read_records(workdir / "run")
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    losses = {r["step"]: r["loss"] for r in records}
    assert losses[6] != losses[6]  # NaN recorded as it was
    assert all(losses[s] == losses[s] for s in losses if s != 6)


def test_nonfinite_rollback_reloads_the_last_checkpoint(workdir: Path, reference: References):
    run_dir = workdir / "run"
    rc, _, err = run(run_dir, workdir, "--set", "train.nonfinite=rollback", faults="nan@step=6")
    assert rc == 0, err
    assert "step 6: rolled back to step 4" in err
    assert [e["to_step"] for e in events(run_dir, "rollback")] == [4]
    # A transient fault: after the rollback the run is the one that never saw it.
    assert_identical(reference.weights(1, "single"), final_weights(run_dir))


def test_a_stop_that_meets_a_rollback_ends_at_the_checkpoint(
    workdir: Path, reference: References
):
    """SIGTERM while step 6's NaN is unjudged: the next step rolls back to step 4 and
    stops there, saving nothing; the same command again finishes as the run that never saw
    the fault."""
    run_dir = workdir / "run"
    args = job_args(run_dir, 1, "single", "--set", "train.nonfinite=rollback")
    proc = start(args, workdir, faults="nan@step=6;pause@step=6")
    wait_for_pid(proc, run_dir / "faults" / "pause-step-6.pid")
    proc.send_signal(signal.SIGTERM)
    rc, _, err = finish(proc)
    assert rc == 128 + signal.SIGTERM, err
    assert "step 6: rolled back to step 4" in err
    assert "after step 4; rolled back to its checkpoint, nothing saved" in err
    assert [e["step"] for e in events(run_dir, "preempted")] == [4]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-00000004"]
    rc, _, err = finish(start(job_args(run_dir, 1, "single"), workdir))
    assert rc == 0, err
    assert_identical(reference.weights(1, "single"), final_weights(run_dir))


def test_nonfinite_rollback_gives_up_when_the_fault_repeats(workdir: Path):
    run_dir = workdir / "run"
    extra = ("--set", "train.nonfinite=rollback")
    rc, _, err = run(run_dir, workdir, *extra, faults="nan@step=6,always=1")
    assert rc == 1
    assert "still non-finite after 3 rollbacks" in err and "Traceback" not in err
    assert len(events(run_dir, "rollback")) == 3


def test_nonfinite_stop_keeps_the_last_checkpoint(workdir: Path):
    run_dir = workdir / "run"
    rc, _, err = run(run_dir, workdir, "--set", "train.nonfinite=stop", faults="nan@step=6")
    assert rc == 1
    assert "step 6: non-finite loss or gradient norm (train.nonfinite = 'stop')" in err
    assert "Traceback" not in err
    saved = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert saved == ["step-00000004"]


@pytest.mark.parametrize(("step", "kept"), [(8, [4]), (STEPS, [4, 8])])
def test_a_nonfinite_step_is_judged_before_its_save_and_at_the_end(
    workdir: Path, step: int, kept: list[int]
):
    """The verdict that comes a step late is read at once where the step saves (no
    checkpoint after an unjudged step) and at the last step (no run ends unjudged)."""
    run_dir = workdir / "run"
    rc, _, err = run(run_dir, workdir, "--set", "train.nonfinite=stop", faults=f"nan@step={step}")
    assert rc == 1, err
    assert f"step {step}: non-finite loss or gradient norm (train.nonfinite = 'stop')" in err
    saved = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert saved == [f"step-{s:08d}" for s in kept]
