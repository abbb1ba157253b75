"""Nothing lost: the ways a user loses work, each reproduced with real processes, really
signalled and killed. Every run is the fault tests' short job (12 steps, a checkpoint every
4); "nothing lost" means every step's loss equals the uninterrupted run's."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from faulty import STEPS, References, fault_limit, finish, start, wait_for_pid
from faulty import job_args as fault_job_args

from helpers import (
    cli_env,
    communicate,
    hang_limit,
    params_marking_slow,
    read_records,
    run_cli,
    run_main,
    wait_until,
)

# Each test's limit: its runs and the references it may wait for.
pytestmark = [pytest.mark.dist, pytest.mark.timeout(fault_limit())]


def job_args(run_dir: Path, nproc: int, strategy: str, *extra: str, steps: int = STEPS):
    """The fault tests' job, every record flushed at once: a killed run keeps the records
    of the steps it finished (by default they are written every logging.flush_every)."""
    return fault_job_args(
        run_dir, nproc, strategy, "--set", "logging.flush_every=1", *extra, steps=steps
    )


def losses(run_dir: Path) -> dict[int, float]:
    """Each step's loss as the run finally computed it (a recomputed step's last record)."""
    return {r["step"]: r["loss"] for r in read_records(run_dir)}


def events(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]


def reference_losses(reference: References, strategy: str = "ddp") -> dict[int, float]:
    found = losses(reference.run(2, strategy))
    assert sorted(found) == list(range(1, STEPS + 1))
    return found


def descendants(pid: int) -> set[int]:
    """Every live process below `pid`, from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def wait_gone(pids: set[int], what: str) -> None:
    """Returns once every process of `pids` has ended; fails (Hung) after a launch's limit."""
    wait_until(lambda: not any(map(alive, pids)), limit=hang_limit(), what=what)


def start_in_session(args: list[str], cwd: Path, faults: str = "") -> subprocess.Popen:
    """`trainwise ARGS` as a terminal runs it: its own process group, so a signal to the
    group is what Ctrl-C or a closed terminal sends."""
    env = cli_env()
    env["TRAINWISE_FAULTS"] = faults
    return subprocess.Popen(
        [sys.executable, "-m", "trainwise", *args], cwd=cwd, env=env, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
    )


def complaint_lines(stderr: str) -> list[str]:
    """What the user reads on stderr beyond the normal start-up lines of a run."""
    return [
        line
        for line in stderr.splitlines()
        if line.strip() and not line.startswith("INFO trainwise:")
    ]


# 1. Retention and a new lineage ----------------------------------------------------------


def test_a_new_lineage_keeps_its_checkpoints_and_resumes_within_itself(
    workdir: Path, reference: References
):
    """resume = 'never' in a directory holding a finished run's higher steps: the old
    checkpoints move aside, the new ones survive retention, and a worker killed after step
    10 resumes from the new lineage's step 8, not the old run's step 12."""
    run_dir = workdir / "run"
    first = run_cli(*job_args(run_dir, 2, "ddp", "--set", "optim.lr=1e-3"), cwd=workdir)
    assert first.returncode == 0, first.stderr
    args = job_args(run_dir, 2, "ddp", "--set", "checkpoint.resume=never")
    proc = start(args, workdir, faults="pause@step=10,rank=1")
    os.kill(wait_for_pid(proc, run_dir / "faults" / "pause-step-10.pid"), signal.SIGKILL)
    rc, out, err = finish(proc)
    assert rc == 0, err

    log = events(run_dir)
    resume = [e for e in log if e["kind"] == "resume"]
    assert [(e["step"], e["attempt"]) for e in resume] == [(8, 1)], resume
    moved = next(e for e in log if e["kind"] == "lineage")["moved_to"]
    assert sorted(p.name for p in Path(moved).iterdir()) == [
        "step-00000004", "step-00000008", "step-00000012",
    ]
    current = sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.name != "previous")
    assert current == ["step-00000004", "step-00000008", "step-00000012"]
    assert losses(run_dir) == reference_losses(reference)


# 2. Lineage ------------------------------------------------------------------------------


def finished_reference(workdir: Path, reference: References) -> Path:
    """A copy of the session's finished 2 x ddp reference (12 steps, checkpoints 4, 8, 12),
    to continue or refuse: the fault tests' uninterrupted run, not a launch of its own."""
    run_dir = workdir / "run"
    shutil.copytree(reference.run(2, "ddp"), run_dir)
    return run_dir


def test_resume_refuses_another_runs_checkpoint_and_takes_its_weights_when_asked(
    workdir: Path, reference: References
):
    run_dir = finished_reference(workdir, reference)
    before = (run_dir / "events.jsonl").read_text()

    other = fault_job_args(run_dir, 2, "ddp", "--set", "optim.lr=1e-3", steps=16)
    refused = run_main(*other, cwd=workdir)  # refused before any worker: main, no process
    assert refused.returncode == 2, refused.stderr
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 1, refused.stderr
    assert "step-00000012" in lines[0] and "optim.lr = 0.003 there, 0.001 here" in lines[0]
    assert "checkpoint.resume_from_other" in lines[0]
    assert (run_dir / "events.jsonl").read_text() == before  # no worker started

    taken = run_cli(*other, "--set", "checkpoint.resume_from_other=weights", cwd=workdir)
    assert taken.returncode == 0, taken.stderr
    assert "resuming from step 12" in taken.stderr and "another lineage" in taken.stderr
    lrs = [r["lr"] for r in read_records(run_dir) if r["step"] > 12]
    assert len(lrs) == 4 and max(lrs) <= 1e-3  # this run's peak rate, from step 13 on


# 3. One live job per run directory ------------------------------------------------------


def test_a_second_launch_is_refused_and_workers_never_reread_the_config(
    workdir: Path, reference: References
):
    """Run A pauses after step 6; run B into the same directory is refused with the
    holder's pid. A's config.toml is then overwritten and a worker killed: the restarted
    workers train with the config A was launched with."""
    run_dir = workdir / "run"
    proc = start(job_args(run_dir, 2, "ddp"), workdir, faults="pause@step=6,rank=1")
    paused = wait_for_pid(proc, run_dir / "faults" / "pause-step-6.pid")

    # Through the CLI's main in this process: refused before any worker.
    second = run_main(*job_args(run_dir, 2, "ddp", "--set", "optim.lr=1e-3"), cwd=workdir)
    assert second.returncode == 2, second.stderr
    assert f"pid {proc.pid} on host" in second.stderr and "in use by another" in second.stderr
    assert len(second.stderr.strip().splitlines()) == 1

    config = run_dir / "config.toml"
    config.write_text(config.read_text().replace("lr = 0.003", "lr = 0.1"))
    os.kill(paused, signal.SIGKILL)
    rc, out, err = finish(proc)
    assert rc == 0, err
    assert losses(run_dir) == reference_losses(reference)


# 4 and 5. Stops: the launcher killed, Ctrl-C, a closed terminal -------------------------


def test_workers_die_with_a_killed_launcher_after_saving(workdir: Path, reference: References):
    run_dir = workdir / "run"
    proc = start(job_args(run_dir, 2, "ddp"), workdir, faults="pause@step=5,rank=0")
    wait_for_pid(proc, run_dir / "faults" / "pause-step-5.pid")
    workers = descendants(proc.pid)
    assert len(workers) >= 2
    proc.kill()  # SIGKILL: no handler, no forwarding
    communicate(proc, limit=hang_limit(), what="the killed launcher's end")
    wait_gone(workers, "the end of the workers of a killed launcher")

    stop = next(e for e in events(run_dir) if e["kind"] == "preempted")
    # The stop is agreed one exchange later, on every rank at once: after step 7.
    assert stop["signal"] == "launcher exit" and stop["step"] == 7
    again = run_cli(*job_args(run_dir, 2, "ddp"), cwd=workdir)
    assert again.returncode == 0, again.stderr
    assert "resuming from step 7" in again.stderr
    assert losses(run_dir) == reference_losses(reference)


# A slow check (bench/slow_checks.sh), out of make test: SIGHUP. The launcher forwards it
# (torchrun.HANDLED_SIGNALS) and the workers handle it (control.PREEMPT_SIGNALS) as they do
# SIGINT, delivered the same way here; its exit status (129) has a unit test
# (test_control_signals).
@pytest.mark.parametrize("sig", params_marking_slow([signal.SIGINT, signal.SIGHUP],
                                                     {signal.SIGHUP}))
def test_ctrl_c_and_a_closed_terminal_save_and_say_where_to_resume(
    workdir: Path, reference: References, sig: signal.Signals
):
    run_dir = workdir / "run"
    proc = start_in_session(job_args(run_dir, 2, "ddp"), workdir, faults="pause@step=5,rank=0")
    wait_for_pid(proc, run_dir / "faults" / "pause-step-5.pid")
    workers = descendants(proc.pid)
    os.killpg(proc.pid, sig)  # what the terminal sends to its foreground group
    rc, out, err = finish(proc)
    assert rc == 128 + sig, err  # saved, not finished: 130 SIGINT, 129 SIGHUP
    assert f"stopped by {sig.name} after step 7" in out and "run the same command again" in out
    assert "step-00000007" in out
    assert "Traceback" not in err and len(complaint_lines(err)) <= 3, err
    wait_gone(workers, f"the end of the workers after {sig.name}")
    if sig != signal.SIGINT:  # the save is the signal's; resuming from it, the same
        return

    again = run_cli(*job_args(run_dir, 2, "ddp"), cwd=workdir)
    assert again.returncode == 0, again.stderr
    assert losses(run_dir) == reference_losses(reference)


def test_a_second_ctrl_c_stops_at_once_without_a_save(workdir: Path):
    """The first Ctrl-C starts the save of step 7, which a fault holds open; the second
    ends the run there: no step 7 committed, no traceback, no process left."""
    run_dir = workdir / "run"
    faults = "pause@step=5,rank=0;pause_in_save@step=7,rank=0"
    proc = start_in_session(job_args(run_dir, 2, "ddp"), workdir, faults=faults)
    wait_for_pid(proc, run_dir / "faults" / "pause-step-5.pid")
    workers = descendants(proc.pid)
    os.killpg(proc.pid, signal.SIGINT)
    wait_for_pid(proc, run_dir / "faults" / "pause_in_save-step-7.pid")
    os.killpg(proc.pid, signal.SIGINT)
    rc, out, err = finish(proc, limit=hang_limit())
    assert rc == 130, (out, err)
    assert "Traceback" not in err and len(complaint_lines(err)) <= 3, err
    assert "step-00000004" in err  # where the run can resume from
    wait_gone(workers, "the end of the workers after a second SIGINT")
    assert not (run_dir / "checkpoints" / "step-00000007").exists()


# 6. Fatal means fatal --------------------------------------------------------------------


def test_a_full_run_directory_ends_the_job_at_once(workdir: Path, tmp_path: Path):
    """The run directory's disk fills up mid-run (checkpoints live elsewhere): one line,
    no restart, the checkpoints intact."""
    mount = tmp_path / "small"
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)],
                          capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {made.stderr.strip()}")
    try:
        run_dir, ckpts = mount / "run", tmp_path / "ckpts"
        args = job_args(run_dir, 2, "ddp", "--set", f"checkpoint.dir={ckpts}",
                        "--set", "logging.flush_every=1")
        proc = start(args, workdir, faults="pause@step=6,rank=0")
        marker = run_dir / "faults" / "pause-step-6.pid"
        wait_for_pid(proc, marker)
        with open(mount / "filler", "wb") as filler:  # the disk fills while the run pauses
            try:
                while True:
                    filler.write(b"\0" * 65536)
                    filler.flush()
            except OSError:
                pass
        marker.with_suffix(".go").touch()  # then it goes on, onto a full disk
        rc, out, err = finish(proc)
        assert rc == 1, err
        assert "Traceback" not in err and "restart" not in err.lower(), err
        assert "no space left on device" in complaint_lines(err)[-1].lower(), err
        assert len(complaint_lines(err)) <= 3, err
        assert (ckpts / "step-00000004" / "manifest.json").is_file()
    finally:
        subprocess.run(["umount", "--lazy", str(mount)], check=False)


def test_when_restarts_run_out_the_last_line_names_the_checkpoint(workdir: Path):
    run_dir = workdir / "run"
    args = job_args(
        run_dir, 2, "ddp", "--set", "checkpoint.max_restarts=0", "--set", "logging.report=true"
    )
    proc = start(args, workdir, faults="pause@step=6,rank=1")
    os.kill(wait_for_pid(proc, run_dir / "faults" / "pause-step-6.pid"), signal.SIGKILL)
    rc, out, err = finish(proc)
    assert rc == 1
    last = err.strip().splitlines()[-1]
    assert "no restarts allowed (checkpoint.max_restarts = 0)" in last, last
    assert str(run_dir / "checkpoints" / "step-00000004") in last, last
    # The report of what the run recorded up to the failure, named above that line.
    assert f"report of what the run recorded: {run_dir / 'report.html'}" in err
    assert (run_dir / "report.html").read_text().rstrip().endswith("</html>")


# 7. Reruns -------------------------------------------------------------------------------


def test_rerunning_a_finished_run_touches_nothing_and_more_steps_continue_it(
    workdir: Path, reference: References
):
    run_dir = finished_reference(workdir, reference)
    args = fault_job_args(run_dir, 2, "ddp")  # the reference's own command
    kept = {name: (run_dir / name).read_bytes()
            for name in ("summary.json", "metrics.jsonl", "events.jsonl")}

    again = run_cli(*args, "--set", "logging.report=true", cwd=workdir)
    assert again.returncode == 0, again.stderr
    assert again.stderr.strip().splitlines() == [
        f"trainwise: {run_dir} finished at step 12 (train.steps = 12); its summary, metrics and "
        "report are kept: raise --steps to continue it, or choose another --run-dir"
    ]
    assert {name: (run_dir / name).read_bytes() for name in kept} == kept
    assert not (run_dir / "report.html").exists()  # not even the report asked for

    more = run_cli(*fault_job_args(run_dir, 2, "ddp", steps=16), cwd=workdir)
    assert more.returncode == 0, more.stderr
    assert "resuming from step 12" in more.stderr
    assert sorted(losses(run_dir)) == list(range(1, 17))
