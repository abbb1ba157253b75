"""The fault injection points: parsing, which rank and attempt they fire on, once or always."""

from __future__ import annotations

from pathlib import Path

from trainwise.run.faults import NO_FAULTS, Fault, Faults, parse_faults


def faults(text: str, rank: int = 0, attempt: int = 0) -> Faults:
    return Faults.from_env(rank, Path("unused"), attempt, {"TRAINWISE_FAULTS": text})


def test_parse_several():
    parsed = parse_faults("pause@step=3,rank=1; nan@step=5,always=1;hang@step=2,seconds=1.5")
    assert parsed == [
        Fault("pause", 3, rank=1),
        Fault("nan", 5, always=True),
        Fault("hang", 2, seconds=1.5),
    ]
    assert parse_faults("") == []


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


def test_without_the_variable_the_seam_does_nothing():
    assert faults("") is NO_FAULTS
    data = [1, 2]
    assert NO_FAULTS.data(data) is data and not NO_FAULTS.poisons(3)
    NO_FAULTS.after_step(3)  # returns at once: no pid file, no wait
