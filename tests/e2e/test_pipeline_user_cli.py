"""`trainwise train --set parallel.pp=2` with your own module that cannot be cut: one line,
exit status 2, no worker started (no run directory). The checks behind it, case by case:
tests/unit/test_user_stages.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from helpers import QUIET, hang_limit, run_cli

pytestmark = pytest.mark.e2e

TESTS = Path(__file__).parents[1]  # user_lm.py, user_job.py
NO_BLOCKS = """
from torch import nn


def build():
    return nn.Sequential(nn.Embedding(256, 8), nn.Linear(8, 256))
"""
CASES = {
    "no blocks to cut": (["--model", "flat:build"],
                         "model.name = 'flat:build' has no blocks to cut into stages"),
    "stages do not divide the blocks": (
        ["--model", "user_lm:build", "--set", "model.kwargs={n_blocks = 3}"],
        "divide neither the model's 3 layers nor 3 + 2"),
    "more inputs than one": (
        ["--model", "user_job:build", "--set", "data.dataset=user_job:map_counted",
         "--set", "data.micro_batch=8"],
        "the batches of data.dataset = 'user_job:map_counted' give the model 1 more input(s)"),
}


@pytest.mark.timeout(hang_limit())
@pytest.mark.parametrize("case", list(CASES))
def test_a_module_that_cannot_be_cut_is_one_line_exit_2_and_no_worker(workdir: Path, case):
    (workdir / "flat.py").write_text(NO_BLOCKS)
    args, said = CASES[case]
    path = os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")]))
    res = run_cli("train", "--nproc", "2", "--strategy", "ddp", "--set", "parallel.pp=2",
                  "--set", "data.seq_len=16",
                  *args, *QUIET, cwd=workdir, timeout=hang_limit(), env={"PYTHONPATH": path})
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith("trainwise: error: parallel.pp") and said in lines[0]
    assert not (workdir / "runs").exists(), "a run directory means the job started"
