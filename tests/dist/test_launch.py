"""Launching: through our elastic agent, under torchrun, under srun's variables; a failed
worker's traceback reaches the user's terminal. Real processes on gloo."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import (
    QUIET,
    cli_env,
    communicate,
    hang_limit,
    read_records,
    run_cli,
    run_limited,
    worker_failure,
)
from trainwise.run.job.distributed import free_port

pytestmark = pytest.mark.dist

FAILING_MODEL = """
import os
import torch
from torch import nn


class Fails(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(64, 10)

    def forward(self, x):
        if os.environ.get("RANK") == "1":
            raise RuntimeError("boom on rank 1")
        return self.lin(x)


def build():
    return Fails()
"""


def test_a_failed_worker_reaches_the_terminal(workdir: Path):
    (workdir / "failing_model.py").write_text(FAILING_MODEL)
    res = run_cli(
        "train",
        "--model",
        "failing_model:build",
        "--set",
        "data.dataset='digits'",
        "--nproc",
        "2",
        "--strategy",
        "ddp",
        "--steps",
        "3",
        *QUIET,
        "--set",
        "checkpoint.max_restarts=0",
        cwd=workdir,  # restarts are test_kill's
    )
    assert res.returncode == 1
    assert "Traceback" in res.stderr and "boom on rank 1" in res.stderr
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("trainwise: worker rank 1 failed with exit code 1")
    assert "boom on rank 1" in last


def test_under_torchrun_each_process_is_one_worker(workdir: Path):
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "trainwise",
        "train",
        "--steps",
        "4",
        "--run-dir",
        "run",
        *QUIET,
    ]
    res = run_limited(cmd, cwd=workdir, what="trainwise under torchrun", limit=hang_limit(steps=4))
    assert res.returncode == 0, worker_failure(res.stderr)
    assert res.stdout.count("training finished") == 1  # rank 0 alone reports
    job = json.loads((workdir / "run" / "job.json").read_text())
    assert job["world"] == 2 and job["strategy"] == "ddp"
    assert [r["step"] for r in read_records(workdir / "run")] == [1, 2, 3, 4]
    assert not (workdir / "runs").exists()  # nothing else was started


def test_srun_variables_make_workers(workdir: Path):
    """srun starts every task itself and sets SLURM_*; trainwise must not spawn again."""
    port = str(free_port())
    procs = []
    for rank in (0, 1):
        env = cli_env()
        env.update(
            SLURM_STEP_ID="0",
            SLURM_PROCID=str(rank),
            SLURM_NTASKS="2",
            SLURM_LOCALID=str(rank),
            SLURM_NTASKS_PER_NODE="2",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port,
        )
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "trainwise",
                    "train",
                    "--steps",
                    "3",
                    "--strategy",
                    "fsdp",
                    "--run-dir",
                    "run",
                    *QUIET,
                ],
                cwd=workdir,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    outs = [communicate(p, limit=hang_limit(steps=3), what=f"srun task {rank}")
            for rank, p in enumerate(procs)]
    assert [p.returncode for p in procs] == [0, 0], outs[0][1][-2000:] + outs[1][1][-2000:]
    assert "training finished" in outs[0][0] and "training finished" not in outs[1][0]
    job = json.loads((workdir / "run" / "job.json").read_text())
    assert job["world"] == 2 and job["strategy"] == "fsdp"
    assert len(read_records(workdir / "run")) == 3


def test_one_process_auto_is_single(workdir: Path):
    res = run_cli("train", "--nproc", "1", "--steps", "3", "--run-dir", "run", *QUIET, cwd=workdir)
    assert res.returncode == 0, res.stderr[-3000:]
    job = json.loads((workdir / "run" / "job.json").read_text())
    assert job["strategy"] == "single" and job["world"] == 1
    assert "single: one replica needs" in res.stdout


# A worker module that only writes, as JSON, the variables of the launch it sees.
ENV_WORKER = """
import json, os, sys
from pathlib import Path
names = ("OMP_NUM_THREADS", "TRAINWISE_LAUNCH", "TRAINWISE_TEST_GIVEN")
seen = {name: os.environ.get(name) for name in names}
Path(sys.argv[1], "env-" + os.environ["RANK"] + ".json").write_text(json.dumps(seen))
"""


def test_two_jobs_from_one_process_each_start_from_its_environment(tmp_path: Path, monkeypatch):
    """A notebook's two trainwise.train calls: the second launch's workers get their own
    share of the cores, not the first launch's left behind as if the user had set it, and
    after each launch the process's environment is what it was (start_job)."""
    from trainwise.config.load import load_config
    from trainwise.run.launch.start import start_job

    (tmp_path / "env_worker.py").write_text(ENV_WORKER)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))  # where the workers find env_worker
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # no share set by the user
    monkeypatch.setattr("os.cpu_count", lambda: 8)
    before = dict(os.environ)
    seen = {}
    for nproc in (2, 4):
        cfg = load_config(overrides=[
            f"cluster.nproc={nproc}", "cluster.oversubscribe=true", "train.steps=1",
            f"logging.run_dir='{tmp_path / f'run{nproc}'}'"])
        run_dir = start_job(cfg, lambda *_: None, "env_worker",
                            environment={"TRAINWISE_TEST_GIVEN": str(nproc)})
        seen[nproc] = [json.loads((run_dir / f"env-{r}.json").read_text()) for r in range(nproc)]
        assert dict(os.environ) == before
    for nproc, workers in seen.items():
        assert {w["OMP_NUM_THREADS"] for w in workers} == {str(8 // nproc)}
        assert {w["TRAINWISE_TEST_GIVEN"] for w in workers} == {str(nproc)}
        assert all(w["TRAINWISE_LAUNCH"] for w in workers)
