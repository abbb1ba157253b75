"""The tests' one seam: parsing, which rank and attempt a fault fires on, once or always;
every hook a no-op without the variable."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from trainwise.faults import ENV, NO_FAULTS, Fault, Faults, parse_faults


def faults(text: str, rank: int = 0, attempt: int = 0) -> Faults:
    return Faults.from_env(rank, Path("unused"), attempt, {ENV: text})


def test_parse_several():
    parsed = parse_faults("pause@step=3,rank=1; nan@step=5,always=1;hang@step=2,seconds=1.5")
    assert parsed == [
        Fault("pause", 3, rank=1),
        Fault("nan", 5, always=True),
        Fault("hang", 2, seconds=1.5),
    ]
    assert parse_faults("") == []
    assert parse_faults("pause_in_prepare@commit=2") == [Fault("pause_in_prepare", 2)]
    assert parse_faults("versions@rank=1,torch=9.9.9") == [
        Fault("versions", 0, rank=1, values=(("torch", "9.9.9"),))
    ]


def test_an_unknown_fault_is_refused():
    with pytest.raises(ValueError, match="unknown fault 'nann'"):
        parse_faults("nann@step=3")


def test_fires_once_on_the_first_attempt_only():
    f = faults("nan@step=6")
    assert [f.poisons(s) for s in (5, 6)] == [False, True]
    assert not f.poisons(6)  # a transient fault: the step run again (after a rollback) is clean
    assert not faults("nan@step=6", attempt=1).poisons(6)


def test_always_repeats_on_every_attempt():
    f = faults("nan@step=6,always=1", attempt=2)
    assert f.poisons(6) and f.poisons(6)


def test_rank_filter():
    assert faults("hang@step=2,rank=1", rank=1).fires("hang", 2)
    assert faults("hang@step=2,rank=1", rank=0).fires("hang", 2) is None
    assert faults("hang@step=2", rank=3).fires("hang", 2)  # no rank: every rank


def test_without_the_variable_the_seam_does_nothing(tmp_path: Path, monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    assert faults("") is NO_FAULTS
    assert Faults.from_env() is NO_FAULTS and Faults.from_env(3, tmp_path, 1) is NO_FAULTS
    data, versions, tracker = [1, 2], {"torch": "2.9"}, _Tracker()
    assert NO_FAULTS.data(data) is data and not NO_FAULTS.poisons(3)
    assert NO_FAULTS.versions(versions) == versions and NO_FAULTS.tracker(tracker) is tracker
    NO_FAULTS.network(object(), lambda n: 1.0)
    seam = Faults([], 0, tmp_path)  # every pause hook returns at once: no pid file, no wait
    seam.before_step(3)
    seam.after_step(3)
    seam.in_save(3)
    seam.in_prepare(tmp_path / "out.partial", 1)
    assert list(tmp_path.iterdir()) == []


class _Tracker:
    name = "jsonl"


def test_versions_replace_what_one_rank_reports():
    mine = {"torch": "2.9", "cuda": "-"}
    assert faults("versions@rank=1,torch=9.9.9", rank=1).versions(mine) == {
        "torch": "9.9.9", "cuda": "-"
    }
    assert faults("versions@rank=1,torch=9.9.9", rank=0).versions(mine) == mine
    # not a one-off: a rank asked twice, or on a later attempt, reports the same
    assert faults("versions@torch=9.9.9", attempt=1).versions(mine)["torch"] == "9.9.9"


def test_the_prepare_pause_announces_its_pid_beside_the_output(tmp_path: Path):
    partial = tmp_path / "out.partial"
    (tmp_path / "out.partial.go").touch()  # the test lets it go at once
    seam = faults("pause_in_prepare@commit=2")
    seam.in_prepare(partial, 1)
    assert not (tmp_path / "out.partial.pid").exists()  # the first commit: not yet
    seam.in_prepare(partial, 2)
    assert (tmp_path / "out.partial.pid").read_text() == str(os.getpid())
