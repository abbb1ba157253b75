"""Pipeline parallelism through the CLI: `trainwise train` with parallel.pp = 2 on 2 gloo
workers (with activation checkpointing and torch.compile per stage, an evaluation through
the schedule)
records the step's bubble, the summary and `trainwise report` show it; bad pipeline
input stops before any worker with one line and exit status 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import QUIET, hang_limit, read_records, run_cli, run_main

# The fixture's run compiles (about a launch's work), which the first test carries.
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(hang_limit(launches=3, steps=6))]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    root = tmp_path_factory.mktemp("pipeline_cli")
    res = run_cli(
        "train", "--nproc", "2", "--strategy", "ddp", "--steps", "6", "--run-dir", "run",
        *QUIET, "--set", "parallel.pp=2", "--set", "parallel.ac='full'",
        "--set", "train.compile=true",
        "--set", "data.seq_len=32", "--set", "train.eval_every=3",
        "--set", "checkpoint.enabled=false", cwd=root,
        timeout=hang_limit(launches=2, steps=6),  # compiling is about a launch's work
    )
    assert res.returncode == 0, res.stderr[-3000:]
    return root / "run", res.stdout + res.stderr


def test_the_job_runs_two_stages(run):
    folder, output = run
    job = json.loads((folder / "job.json").read_text())
    assert job["layout"] == "pp 2 x dp_replicate 1 x dp_shard 1 x tp 1"
    # Its name says the stages (the data-parallel shortcut alone would be "single").
    assert (job["layout_name"], job["strategy"]) == ("pp 2", "single")
    startup = ("tiny on 2 x cpu (pp 2 x dp_replicate 1 x dp_shard 1 x tp 1), pp 2 (set by "
               "parallel.strategy = 'ddp', parallel.pp = 2): ")
    assert startup in output
    assert "  layout     pp 2 x dp_replicate 1 x dp_shard 1 x tp 1" in output  # the summary
    records = read_records(folder)
    assert [r["step"] for r in records] == list(range(1, 7))
    assert records[-1]["loss"] < records[0]["loss"]
    assert [r["eval_loss"] is not None for r in records] == [False, False, True] * 2


def test_every_step_records_its_bubble(run):
    folder, output = run
    records = read_records(folder)
    assert all(r["bubble_s"] is not None and r["bubble_s"] >= 0 for r in records)
    assert all(r["sync_s"] is not None for r in records)  # measured each step, not probed
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["stage_share"]["bubble"] > 0
    assert "pipeline bubble" in output  # the summary's step time


def test_the_report_shows_the_bubble(run):
    folder, _ = run
    res = run_main("report", str(folder), cwd=folder.parent)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "  strategy   pp 2 on 2 x cpu" in res.stdout
    row = next(line for line in res.stdout.splitlines() if "pipeline bubble" in line)
    assert float(row.split()[2]) > 0  # its seconds


@pytest.mark.parametrize(("sets", "line"), [
    # tiny has 2 layers: 2 ranks x 2 stages each cannot split them.
    (["parallel.pp=2", "parallel.pp_virtual=2", "parallel.pp_schedule='Interleaved1F1B'"],
     "parallel.pp x parallel.pp_virtual = 2 x 2 = 4 stages divide neither the model's 2 layers nor 2 + 2"),
    (["parallel.pp=2", "data.micro_batch=1"],
     "parallel.pp_microbatches = 1 is fewer than the 2 stages 1F1B keeps in flight"),
])
def test_bad_pipeline_input_stops_before_any_worker(tmp_path: Path, sets, line):
    args = [a for kv in sets for a in ("--set", kv)]
    # Through the CLI's main in this process: the refusal comes before any worker.
    res = run_main("train", "--nproc", "2", "--strategy", "ddp", *QUIET, *args, cwd=tmp_path)
    assert res.returncode == 2, res.stderr
    assert line in res.stderr
    assert "Traceback" not in res.stderr and not (tmp_path / "runs").exists()
