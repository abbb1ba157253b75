"""A full run directory (checkpoints elsewhere): the disk fills mid-run, the run stops with
one line before a checkpoint could resume past steps whose records were lost, and once
space is freed the rerun continues metrics.jsonl on whole lines: every step recorded, every
line JSON, and the report works."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from faulty import fault_limit, fill_disk, finish, job_args, start, tmpfs, wait_for_pid

from helpers import QUIET, run_cli, run_main

# Each test's limit: its runs and the references it may wait for.
pytestmark = [pytest.mark.dist, pytest.mark.timeout(fault_limit())]

STEPS = 16
# Records are written only before each save (every 8 steps) and at the end: the 8 records
# written after the disk fills take more than a tmpfs page (4 KiB, each record ~570
# bytes), so the write cannot fit in the slack of metrics.jsonl's last page and tears.
ARGS = ["--set", "checkpoint.interval=8", "--set", "logging.flush_every=100"]


def test_full_run_dir_tears_no_record_and_the_rerun_continues(tmp_path: Path):
    with tmpfs(tmp_path / "small", 1 << 20) as disk:
        run_dir = disk / "run"
        args = [*job_args(run_dir, 1, "ddp", *ARGS, steps=STEPS),
                "--set", f"checkpoint.dir={tmp_path / 'checkpoints'}"]
        proc = start(args, tmp_path, faults="pause@step=10")
        marker = run_dir / "faults" / "pause-step-10.pid"
        wait_for_pid(proc, marker)
        filler = fill_disk(disk)
        marker.with_suffix(".go").touch()  # an empty file: made on the full disk
        rc, out, err = finish(proc)
        assert rc != 0, err
        assert "Traceback" not in err + out, err
        assert "disk is full" in err and "metrics.jsonl" in err, err
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
        assert all(json.loads(line) for line in lines)  # no half-written record
        filler.unlink()

        again = run_cli(*args, cwd=tmp_path)
        assert again.returncode == 0, again.stderr
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        assert sorted({r["step"] for r in records}) == list(range(1, STEPS + 1))
        report = run_main("report", str(run_dir), "-o", str(tmp_path / "r.html"), cwd=tmp_path)
        assert report.returncode == 0, report.stderr


def test_a_full_disk_at_launch_is_one_line(tmp_path: Path):
    with tmpfs(tmp_path / "small", 256 << 10) as disk:
        earlier = disk / "earlier"
        earlier.mkdir()
        (earlier / ".lock").touch()  # a run directory an earlier launch left
        (earlier / "events.jsonl").write_text('{"time": 1.0, "kind": "start"}\n')
        fill_disk(disk)
        for run_dir in (disk / "new", earlier):
            # Through the CLI's main in this process: refused before any worker.
            done = run_main("train", "--steps", "2", "--run-dir", str(run_dir), *QUIET,
                            cwd=tmp_path)
            assert done.returncode == 2, done.stderr
            lines = done.stderr.strip().splitlines()
            assert len(lines) == 1, done.stderr
            assert f"'{run_dir}' cannot be used (No space left on device): free space" in lines[0]
