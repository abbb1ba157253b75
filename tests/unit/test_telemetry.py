"""Unit tests of trainwise.run.observe.telemetry: the record schema, metrics.jsonl (and TensorBoard)
writing and reading, the stage clock on CPU and the plain-line progress output."""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import types

import pytest
import torch

from trainwise.run.observe import telemetry
from trainwise.run.observe.telemetry import (
    RECORD_FIELDS,
    STAGES,
    MetricsWriter,
    Progress,
    StageClock,
    StepRecord,
    read_metrics,
)
from trainwise.run.observe.trackers import build_trackers


def record(step: int, **kw) -> StepRecord:
    values = dict(
        step=step,
        loss=1.5,
        eval_loss=None,
        lr=1e-3,
        grad_norm=0.25,
        step_s=0.5,
        data_s=0.125,
        compute_s=0.25,
        sync_s=None,
        optim_s=0.0625,
        ckpt_s=0.0,
        tokens=1024 * step,
        tokens_per_s=1000.0,
        samples_per_s=15.625,
        mfu=None,
        mem_bytes=123456,
        mem_kind="rss_peak",
        elapsed_s=2.0 * step,
        time=1.7e9 + step,
        attempt=0,
    )
    values.update(kw)
    return StepRecord(**values)


# --- schema ----------------------------------------------------------------------------------


def test_record_fields_are_the_dataclass_fields():
    assert tuple(f.name for f in dataclasses.fields(StepRecord)) == RECORD_FIELDS
    assert RECORD_FIELDS[0] == "step"
    assert len(set(RECORD_FIELDS)) == len(RECORD_FIELDS)


def test_record_fields_include_the_stages():
    assert STAGES == ("data_s", "compute_s", "bubble_s", "sync_s", "optim_s", "ckpt_s")
    for stage in STAGES:
        assert stage in RECORD_FIELDS


# --- MetricsWriter / read_metrics ------------------------------------------------------------


def test_metrics_round_trip(tmp_path):
    records = [
        record(1),
        record(2, eval_loss=1.25, sync_s=0.03125, mfu=0.5, mem_kind="cuda_peak"),
        record(3),
    ]
    writer = MetricsWriter(tmp_path)
    for rec in records:
        writer.write(rec)
    writer.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == len(records)  # one JSON line per record
    assert set(json.loads(lines[0])) == set(RECORD_FIELDS)
    back = read_metrics(tmp_path)
    assert back == [dataclasses.asdict(rec) for rec in records]
    assert back[0]["eval_loss"] is None and back[1]["eval_loss"] == 1.25
    assert not (tmp_path / "tensorboard").exists()


def test_metrics_are_flushed_after_each_record(tmp_path):
    writer = MetricsWriter(tmp_path)
    writer.write(record(1))
    writer.sync()
    # Readable before close: a crash must not lose written steps.
    assert [r["step"] for r in read_metrics(tmp_path)] == [1]
    writer.write(record(2), record(3))
    writer.sync()
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3]
    writer.close()


def test_a_new_writer_starts_a_new_file(tmp_path):
    first = MetricsWriter(tmp_path)
    first.write(record(1))
    first.write(record(2))
    first.close()
    second = MetricsWriter(tmp_path)
    second.write(record(7))
    second.close()
    assert [r["step"] for r in read_metrics(tmp_path)] == [7]


def test_read_metrics_skips_blank_lines(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n\n{"step": 2}\n')
    assert read_metrics(tmp_path) == [{"step": 1}, {"step": 2}]


def test_read_metrics_skips_a_line_cut_by_a_crash(tmp_path):
    assert read_metrics(tmp_path) == []  # no file yet
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2, "lo')
    assert read_metrics(tmp_path) == [{"step": 1}]


def test_a_resumed_writer_appends_after_the_last_whole_record(tmp_path):
    # A writer killed mid-line, then the resumed run's writer: the torn line is cut off.
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2, "lo')
    writer = MetricsWriter(tmp_path, append=True)
    writer.write(record(2))
    writer.close()
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]


def test_a_failed_write_leaves_no_part_of_it(tmp_path, monkeypatch):
    writer = MetricsWriter(tmp_path)
    writer.write(record(1))
    writer.sync()
    real = os.write

    def half_then_full(fd, data):  # as a full disk does: part of the write, then ENOSPC
        if len(data) > 8:
            return real(fd, data[: len(data) // 2])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(telemetry.os, "write", half_then_full)
    writer.write(record(2))
    with pytest.raises(RuntimeError, match="No space left"):
        writer.sync()
    monkeypatch.setattr(telemetry.os, "write", real)
    assert [json.loads(line)["step"] for line in
            (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1]
    with pytest.raises(RuntimeError):
        writer.close()


def test_tensorboard_events_are_written(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    trackers = build_trackers(["tensorboard"], tmp_path, {}, mlflow_uri=None, tensorboard_every=2)
    writer = MetricsWriter(tmp_path, trackers)
    writer.write(record(1), record(2, loss=1.25), record(3, eval_loss=2.5))
    writer.write(record(4, loss=1.0, grad_norm=0.5))
    writer.close()
    trackers.finish([], finished=True)
    events = list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert len(events) == 1
    assert len(read_metrics(tmp_path)) == 4
    # What TensorBoard itself reads back: the training scalars every 2 steps, each step's
    # in one event, and the evaluation at its step.
    board = EventAccumulator(str(events[0])).Reload()
    tags = board.Tags()["scalars"]
    assert {"train/loss", "train/grad_norm", "train/tokens", "eval/loss"} <= set(tags)
    assert "train/time" not in tags and "train/sync_s" not in tags  # the clock; None
    points = {tag: [(e.step, e.value) for e in board.Scalars(tag)] for tag in tags}
    assert points["train/loss"] == [(2, 1.25), (4, 1.0)]
    assert points["train/grad_norm"] == [(2, 0.25), (4, 0.5)]
    assert points["eval/loss"] == [(3, 2.5)]


# --- StageClock ------------------------------------------------------------------------------


def test_stage_clock_sums_spans_per_name(monkeypatch):
    # A fake clock: each mark reads the next of these instants.
    ticks = iter([10.0, 10.5, 12.0, 12.25, 13.0, 13.125])
    monkeypatch.setattr(telemetry, "time", types.SimpleNamespace(perf_counter=lambda: next(ticks)))
    clock = StageClock(torch.device("cpu"))
    for name in ("start", "data_s", "compute_s", "sync_s", "compute_s", "optim_s"):
        clock.mark(name)
    spans = clock.spans()
    # Each span is keyed by its later mark: data 10.5-10.0; compute (12.0-10.5) + (13.0-12.25)
    # = 1.5 + 0.75; sync 12.25-12.0; optim 13.125-13.0.
    assert spans == {"data_s": 0.5, "compute_s": 2.25, "sync_s": 0.25, "optim_s": 0.125}


def test_stage_clock_with_the_real_clock():
    clock = StageClock(torch.device("cpu"))
    assert clock.cuda is False
    for name in ("start", "data_s", "compute_s", "optim_s", "compute_s"):
        clock.mark(name)
    spans = clock.spans()
    # Two 'compute_s' spans land in one key; the first mark names no span.
    assert set(spans) == {"data_s", "compute_s", "optim_s"}
    assert all(v >= 0.0 for v in spans.values())
    # spans() consumes the marks: the next step starts empty.
    assert clock.spans() == {}


def test_stage_clock_with_one_mark_has_no_spans():
    clock = StageClock(torch.device("cpu"))
    clock.mark("start")
    assert clock.spans() == {}


# --- Progress --------------------------------------------------------------------------------


def test_progress_lines_every_n_steps_and_at_the_end(capsys):
    progress = Progress(total=7, mode="lines", every=3)
    for step in range(1, 8):
        progress.update(record(step, eval_loss=1.25 if step == 6 else None))
    progress.close()
    lines = capsys.readouterr().out.splitlines()
    # Steps 3 and 6 (every 3) and 7 (the last). elapsed_s = 2 x step, so
    # eta = (7 - step) x elapsed / step = 2 x (7 - step): 8, 2, 0.
    assert lines == [
        "step 3/7  loss 1.5000  1,000 tok/s  eta 8s",
        "step 6/7  loss 1.5000  1,000 tok/s  eval 1.2500  eta 2s",
        "step 7/7  loss 1.5000  1,000 tok/s  eta 0s",
    ]


def test_progress_auto_without_a_terminal_prints_lines(capsys):
    progress = Progress(total=2, mode="auto", every=1)
    assert progress.mode == "lines"  # captured stdout is not a tty
    progress.update(record(1))
    progress.update(record(2))
    progress.close()
    out = capsys.readouterr().out.splitlines()
    assert [line.split()[1] for line in out] == ["1/2", "2/2"]


def test_progress_none_prints_nothing(capsys):
    progress = Progress(total=3, mode="none", every=1)
    for step in range(1, 4):
        progress.update(record(step))
    progress.close()
    assert capsys.readouterr().out == ""


def test_cpu_memory_is_what_the_process_added_over_its_baseline():
    cpu = torch.device("cpu")
    telemetry.mark_memory_baseline()
    before, kind = telemetry.peak_memory(cpu)
    assert kind == "rss_added"
    block = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched
    after, _ = telemetry.peak_memory(cpu)
    assert after - before >= 60 * 2**20
    # The whole process holds far more than what it added since the baseline.
    telemetry._rss_baseline.clear()
    whole, kind = telemetry.peak_memory(cpu)
    assert kind == "rss_peak" and whole > after
    del block
