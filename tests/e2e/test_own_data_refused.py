"""Your own dataset gone wrong, as a user meets it at the command line: one line naming
the object and the fix, exit status 2, and no worker started (no run directory)."""

from __future__ import annotations

from pathlib import Path

import pytest

import user_job
from helpers import QUIET, hang_limit, run_cli

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize(
    ("keys", "words"),
    [
        (["data.dataset=user_job:strings"],
         "data.dataset = 'user_job:strings' yields str samples; the step needs tensors"),
        (["data.dataset=user_job:map_data", "data.collate=user_job:no_tensors"],
         "data.collate = 'user_job:no_tensors' makes dict batches with keys ['labels', 'x'] "
         "whose 'labels' is a list"),
        (["data.dataset=user_job:too_short", "data.val_fraction=0.2"],
         "data.dataset = 'user_job:too_short' has 8 samples, fewer than one global batch of "
         "16 (data.micro_batch 8 x data.grad_accum 1 x data-parallel size 2): lower"),
        (["data.dataset=user_job:raises"],
         "data.dataset = 'user_job:raises': calling it raised RuntimeError: the bucket is "
         "not mounted; fix the function"),
    ],
    ids=["wrong-type", "collate-without-tensors", "shorter-than-a-global-batch", "raises"],
)
@pytest.mark.timeout(hang_limit())
def test_bad_data_stops_before_any_worker_in_one_line(tmp_path: Path, keys, words):
    sets = [a for k in ("model.name=user_job:build", "data.micro_batch=8", *keys)
            for a in ("--set", k)]
    proc = run_cli(
        "train", "--nproc", "2", "--strategy", "ddp", "--steps", "2", "--run-dir", "run",
        *QUIET, *sets, cwd=tmp_path, env=user_job.user_env(tmp_path), timeout=hang_limit(),
    )
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("trainwise: error: "), proc.stderr
    assert words in lines[0]
    assert not (tmp_path / "run").exists()  # no run files, no event: nothing started
