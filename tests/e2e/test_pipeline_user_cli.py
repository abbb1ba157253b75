"""`trainwise train --set parallel.pp=2` with your own module that cannot be cut: one line,
exit status 2, no worker started (no run directory). The checks behind it, case by case:
tests/unit/test_user_stages.py."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from helpers import QUIET, hang_limit, run_main

pytestmark = pytest.mark.e2e

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
def test_a_module_that_cannot_be_cut_is_one_line_exit_2_and_no_worker(
    workdir: Path, monkeypatch: pytest.MonkeyPatch, case
):
    """Through the CLI's main in this process (the refusal comes before any worker), with
    the folder of flat.py importable as `trainwise` run there would have it."""
    (workdir / "flat.py").write_text(NO_BLOCKS)
    monkeypatch.syspath_prepend(str(workdir))
    monkeypatch.delitem(sys.modules, "flat", raising=False)  # another test's folder's
    args, said = CASES[case]
    res = run_main("train", "--nproc", "2", "--strategy", "ddp", "--set", "parallel.pp=2",
                   "--set", "data.seq_len=16", *args, *QUIET, cwd=workdir)
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith("trainwise: error: parallel.pp") and said in lines[0]
    assert not (workdir / "runs").exists(), "a run directory means the job started"
