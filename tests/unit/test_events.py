"""Unit tests of trainwise.run.observe.events: the events.jsonl log (append, read, concurrent appends)
and retry_cost on synthetic event lists whose answers are worked out by hand in comments."""

from __future__ import annotations

import json
import multiprocessing as mp
import random
import sys
from types import SimpleNamespace

import pytest

from helpers import hang_limit, wait_until
from trainwise.jsonl import JsonlError, cut_torn_files, cut_torn_tail
from trainwise.run.observe.events import (
    EVENTS_FILE,
    KINDS,
    RetryCost,
    append_event,
    read_events,
    retry_cost,
)


def ev(t: float, kind: str, **fields) -> dict:
    return {"time": t, "kind": kind, **fields}


def ckpt(t: float, step: int, step_time: float) -> dict:
    return ev(t, "checkpoint", step=step, step_time=step_time, stall_s=0.1, save_s=0.5)


def fail(t: float, rank: int = 0) -> dict:
    return ev(t, "failure", rank=rank, exit_code=1, signal=None, pid=1000 + rank)


# ---- the log file -------------------------------------------------------------------------


def test_round_trip(tmp_path, monkeypatch):
    from trainwise.run.observe import events

    monkeypatch.setattr(events, "time", SimpleNamespace(time=lambda: 4567.25))  # the clock
    a = append_event(tmp_path, "start", world_size=2)
    b = append_event(tmp_path, "checkpoint", time=123.5, step=10, step_time=120.0, path="x")
    monkeypatch.undo()
    assert a["time"] == 4567.25
    assert a == {"time": a["time"], "kind": "start", "world_size": 2}
    assert b == {"time": 123.5, "kind": "checkpoint", "step": 10, "step_time": 120.0, "path": "x"}
    assert read_events(tmp_path) == [a, b]
    lines = (tmp_path / EVENTS_FILE).read_text().splitlines()
    assert len(lines) == 2 and json.loads(lines[1]) == b


def test_missing_file_reads_empty(tmp_path):
    assert read_events(tmp_path) == []
    assert read_events(tmp_path / "no" / "such" / "run") == []


def test_creates_run_dir(tmp_path):
    run = tmp_path / "runs" / "r1"
    append_event(run, "ready", attempt=0, step=0)
    assert [e["kind"] for e in read_events(run)] == ["ready"]


def test_a_torn_last_line_is_skipped_with_a_warning(tmp_path, caplog):
    append_event(tmp_path, "start", time=1.0)
    append_event(tmp_path, "ready", time=2.0, attempt=0, step=0)
    with open(tmp_path / EVENTS_FILE, "ab") as f:
        f.write(b'{"time": 3.0, "kind": "fail')  # a crash mid-write: no closing brace, no newline
    assert read_events(tmp_path) == [
        {"time": 1.0, "kind": "start"},
        {"time": 2.0, "kind": "ready", "attempt": 0, "step": 0},
    ]
    assert "cut off mid-record" in caplog.text and EVENTS_FILE in caplog.text


@pytest.mark.parametrize("garbage", [b"not json\n", b"[1, 2]\n"])
def test_a_damaged_line_in_the_middle_is_one_error_naming_it(tmp_path, garbage):
    append_event(tmp_path, "start", time=1.0)
    with open(tmp_path / EVENTS_FILE, "ab") as f:
        f.write(garbage)
    append_event(tmp_path, "ready", time=2.0, attempt=0, step=0)
    with pytest.raises(JsonlError, match=r"events.jsonl line 2: not JSON"):
        read_events(tmp_path)


def test_unknown_kind_raises(tmp_path):
    with pytest.raises(ValueError, match="unknown event kind 'oops'"):
        append_event(tmp_path, "oops")
    assert not (tmp_path / EVENTS_FILE).exists()


def test_kinds():
    assert "failure" in KINDS and "ready" in KINDS and len(set(KINDS)) == len(KINDS)


N_PROCS, N_LINES = 4, 200


def _writer(run_dir, proc: int) -> None:
    pad = "x" * (100 + 97 * proc)  # lines of different lengths, a few hundred bytes each
    for i in range(N_LINES):
        append_event(run_dir, "checkpoint", proc=proc, i=i, pad=pad)


def test_concurrent_appends_do_not_interleave(tmp_path):
    method = "fork" if sys.platform.startswith("linux") else "spawn"
    ctx = mp.get_context(method)
    procs = [ctx.Process(target=_writer, args=(tmp_path, p)) for p in range(N_PROCS)]
    for p in procs:
        p.start()
    for p in procs:
        wait_until(lambda p=p: p.exitcode is not None, limit=hang_limit(procs=0),
                   what=f"the end of writer process {p.pid}")
        assert p.exitcode == 0
    lines = (tmp_path / EVENTS_FILE).read_text().splitlines()
    assert len(lines) == N_PROCS * N_LINES
    parsed = [json.loads(line) for line in lines]  # every line is whole
    assert sorted((e["proc"], e["i"]) for e in parsed) == [
        (p, i) for p in range(N_PROCS) for i in range(N_LINES)
    ]
    assert len(read_events(tmp_path)) == N_PROCS * N_LINES


# ---- retry_cost ---------------------------------------------------------------------------


def test_no_failures_cost_nothing():
    events = [
        ev(0.0, "start"),
        ev(100.0, "ready", attempt=0, step=0),
        ckpt(150.0, 10, 140.0),
        ev(200.0, "finish"),
    ]
    assert retry_cost(events, gpus=8) == RetryCost(0, 0.0, 0.0, 0.0, 0.0)
    assert retry_cost([], gpus=1) == RetryCost(0, 0.0, 0.0, 0.0, 0.0)


def test_one_failure_after_a_checkpoint():
    events = [
        ev(100.0, "ready", attempt=0, step=0),
        ckpt(130.0, 10, 125.0),
        ckpt(160.0, 20, 155.0),  # the newest before the failure
        fail(170.0),
        ckpt(175.0, 22, 165.0),  # committed after the failure: does not count
        ev(182.0, "ready", attempt=1, step=20),
        ev(300.0, "finish"),
    ]
    # recomputed = 170 - 155 = 15; downtime = 182 - 170 = 12; 27 s * 4 GPUs / 3600 = 0.03 GPU-h
    c = retry_cost(events, gpus=4)
    assert c.failures == 1
    assert c.recomputed_s == pytest.approx(15.0)
    assert c.downtime_s == pytest.approx(12.0)
    assert c.total_s == pytest.approx(27.0)
    assert c.gpu_hours == pytest.approx(0.03)
    assert c.summary_line() == (
        "1 failure cost 27.0 s (12.0 s restarting, 15.0 s recomputing) = 0.0300 GPU-h"
    )


def test_failure_before_any_checkpoint_of_the_attempt_uses_ready_time():
    events = [
        ev(0.0, "ready", attempt=0, step=0),
        ckpt(50.0, 10, 45.0),
        fail(60.0),
        ev(70.0, "ready", attempt=1, step=10),
        fail(100.0),  # the checkpoint at step_time 45 is older than this attempt's ready (70)
        ev(130.0, "ready", attempt=2, step=10),
    ]
    # incident 1: recomputed 60 - 45 = 15, downtime 70 - 60 = 10
    # incident 2: recomputed 100 - 70 = 30, downtime 130 - 100 = 30
    c = retry_cost(events, gpus=2)
    assert c.failures == 2
    assert c.recomputed_s == pytest.approx(45.0)
    assert c.downtime_s == pytest.approx(40.0)
    assert c.total_s == pytest.approx(85.0)
    assert c.gpu_hours == pytest.approx(85.0 * 2 / 3600)


def test_several_ranks_failing_are_one_incident():
    events = [
        ev(0.0, "ready", attempt=0, step=0),
        fail(50.5, rank=0),
        fail(50.0, rank=1),  # the earliest: F = 50
        fail(51.0, rank=2),
        ev(60.0, "ready", attempt=1, step=0),
    ]
    c = retry_cost(events, gpus=3)
    assert c.failures == 1
    assert c.recomputed_s == pytest.approx(50.0)
    assert c.downtime_s == pytest.approx(10.0)


def test_preemption_costs_nothing():
    events = [
        ev(0.0, "ready", attempt=0, step=0),
        ckpt(100.0, 99, 99.0),
        ev(101.0, "preempted", step=99, signal="SIGTERM"),
        fail(101.5, rank=1),  # a rank killed while the planned stop finishes: part of it
        ev(500.0, "ready", attempt=1, step=99),
        ev(600.0, "finish"),
    ]
    assert retry_cost(events, gpus=8) == RetryCost(0, 0.0, 0.0, 0.0, 0.0)


def test_run_that_died_for_good_has_no_downtime():
    events = [ev(0.0, "ready", attempt=0, step=0), ckpt(20.0, 5, 18.0), fail(50.0)]
    c = retry_cost(events, gpus=1)
    assert (c.failures, c.downtime_s, c.recomputed_s) == (1, 0.0, pytest.approx(32.0))


def test_unlogged_failure_between_attempts_is_an_incident():
    # No failure event, but attempt 1 followed attempt 0: F = the last event (40)
    events = [
        ev(0.0, "ready", attempt=0, step=0),
        ckpt(40.0, 10, 30.0),
        ev(100.0, "ready", attempt=1, step=10),
    ]
    c = retry_cost(events, gpus=1)
    assert c.failures == 1
    assert c.recomputed_s == pytest.approx(10.0)  # 40 - 30: an underestimate
    assert c.downtime_s == pytest.approx(60.0)  # 100 - 40
    assert c.total_s == pytest.approx(70.0)  # ready to ready, less the saved work: exact


def test_failure_while_building_costs_downtime_only():
    events = [ev(0.0, "start"), fail(5.0), ev(20.0, "ready", attempt=1, step=0)]
    c = retry_cost(events, gpus=1)
    assert (c.failures, c.recomputed_s, c.downtime_s) == (1, 0.0, pytest.approx(15.0))


def test_event_order_does_not_matter():
    events = [
        ev(0.0, "ready", attempt=0, step=0),
        ckpt(50.0, 10, 45.0),
        fail(60.0),
        ev(70.0, "ready", attempt=1, step=10),
        fail(100.0),
        ev(130.0, "ready", attempt=2, step=10),
    ]
    shuffled = events[:]
    random.Random(0).shuffle(shuffled)
    assert retry_cost(shuffled, gpus=2) == retry_cost(events, gpus=2)


def test_summary_line_plural():
    c = RetryCost(failures=2, downtime_s=12.0, recomputed_s=29.2, total_s=41.2, gpu_hours=0.0229)
    assert c.summary_line() == (
        "2 failures cost 41.2 s (12.0 s restarting, 29.2 s recomputing) = 0.0229 GPU-h"
    )


@pytest.mark.parametrize("gpus", [0, -1, 1.5])
def test_bad_gpus_raise(gpus):
    with pytest.raises(ValueError, match="gpus"):
        retry_cost([], gpus=gpus)


@pytest.mark.parametrize(
    "text, kept",
    [
        ('{"a": 1}\n{"a": 2', '{"a": 1}\n'),  # torn: cut off
        ('{"a": 1}\n{"a": 2}', '{"a": 1}\n{"a": 2}\n'),  # whole but for its newline
        ('{"a": 1}\n', '{"a": 1}\n'),  # nothing torn
        ('{"a": ', ""),  # no whole record at all
    ],
)
def test_cut_torn_tail_leaves_whole_records(tmp_path, text, kept):
    path = tmp_path / "x.jsonl"
    path.write_text(text)
    cut_torn_tail(path)
    assert path.read_text() == kept


def test_cut_torn_tail_finds_the_newline_far_from_the_end(tmp_path, monkeypatch):
    import trainwise.jsonl as jsonl

    monkeypatch.setattr(jsonl, "TAIL_BLOCK", 4)  # the search crosses several blocks
    path = tmp_path / "x.jsonl"
    path.write_text('{"a": 1}\n{"b": "' + "y" * 50)
    assert cut_torn_tail(path) == 57
    assert path.read_text() == '{"a": 1}\n'


def test_cut_torn_files_names_each_file_it_cut(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{"st')
    (tmp_path / "events.jsonl").write_text('{"kind": "start"}\n')
    (tmp_path / "other.jsonl").write_text('{"x": 1}\n{')
    said = cut_torn_files(tmp_path)
    assert len(said) == 2 and "metrics.jsonl" in said[0] and "other.jsonl" in said[1]
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1}\n'


def test_a_new_lineage_after_a_stop_is_not_a_resume():
    """A rerun with checkpoint.resume = 'never' after Ctrl-C redoes nothing: it starts over."""
    from trainwise.run.observe.events import resumptions

    log = [
        {"kind": "preempted", "time": 10.0, "step": 112, "signal": "SIGINT"},
        {"kind": "start", "time": 15.0},
        {"kind": "lineage", "time": 16.0, "lineage": "abcd", "moved_to": "x"},
        {"kind": "ready", "time": 17.0, "step": 0, "attempt": 0},
    ]
    (found,) = resumptions(log)
    assert found.new_lineage and found.redone_steps is None
    assert "redone" not in found.line() and "resumed from" not in found.line()
    assert "new lineage" in found.line() and "checkpoint.resume = 'never'" in found.line()
    resumed = resumptions([e for e in log if e["kind"] != "lineage"])[0]
    assert resumed.line().endswith("resumed from step 0 5 s later, 112 step(s) redone")
