"""The run directory's lock: one job per directory, the launchers of one multi-machine job
together. flock holds per open file, so two holds in this process exclude each other as two
processes' would."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainwise.run.job.run_lock import LOCK_FILE, RunDirBusy, hold_run_dir


def take(run_dir: Path, job_id: str | None = None) -> None:
    with hold_run_dir(run_dir, job_id):
        pass


def test_a_second_job_on_one_machine_is_refused_and_the_lock_is_free_after(tmp_path: Path):
    with hold_run_dir(tmp_path), pytest.raises(RunDirBusy, match="in use by another"):
        take(tmp_path)
    take(tmp_path)  # released: taken again without a word
    assert (tmp_path / LOCK_FILE).read_text() == ""


def test_the_launchers_of_one_multi_machine_job_share_it_and_no_one_else_does(tmp_path: Path):
    with hold_run_dir(tmp_path, "job@host:29400"):
        with hold_run_dir(tmp_path, "job@host:29400"):
            with pytest.raises(RunDirBusy, match="job job@host:29400"):
                take(tmp_path, "other@host:29400")
            with pytest.raises(RunDirBusy):
                take(tmp_path)
        # The first launcher out leaves the identity for those still in.
        held = json.loads((tmp_path / LOCK_FILE).read_text())
        assert held["job"] == "job@host:29400"
    assert (tmp_path / LOCK_FILE).read_text() == ""


def test_a_multi_machine_job_does_not_join_a_one_machine_job(tmp_path: Path):
    with hold_run_dir(tmp_path), pytest.raises(RunDirBusy):
        take(tmp_path, "job@host:29400")


def test_a_lock_left_by_a_dead_launcher_is_taken_over_with_a_line(tmp_path: Path, capsys):
    stale = {"host": "gone", "pid": 4242, "since": 0}
    (tmp_path / LOCK_FILE).write_text(json.dumps(stale))
    with hold_run_dir(tmp_path):
        pass
    said = capsys.readouterr().err
    assert "taking over the lock" in said and "pid 4242 on host gone" in said


def test_a_launcher_arriving_as_the_last_holder_leaves_takes_the_lock(tmp_path: Path, monkeypatch):
    """The race a loaded machine showed: this launcher's exclusive try fails while the last
    holder empties the file on its way out; by its shared try the holder is gone and the
    file names nobody. It holds the directory as the job's first launcher, not "busy"."""
    from trainwise.run.job import run_lock

    real, tries = run_lock._try_lock, []

    def leaving_holder(fd: int, kind: int) -> bool:
        tries.append(kind)
        return False if len(tries) == 1 else real(fd, kind)  # the first try meets the holder

    monkeypatch.setattr(run_lock, "_try_lock", leaving_holder)
    (tmp_path / LOCK_FILE).write_text("")
    with hold_run_dir(tmp_path, "job@host:29400"):
        held = json.loads((tmp_path / LOCK_FILE).read_text())
        assert held["job"] == "job@host:29400"
