"""Expert parallelism that cannot run stops before any worker with one line and exit status
2: an ep that does not divide the data- and tensor-parallel ranks it is borrowed from (the
world, or what pipeline stages leave of it), under an explicit strategy and under auto. (An ep
that does not divide the experts, and ep with a dense model: test_moe_cli.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers import QUIET, run_main

pytestmark = pytest.mark.e2e


def _refused(root: Path, nproc: int, *sets: str) -> str:
    args = [a for kv in ("model.name='moe-tiny'", *sets) for a in ("--set", kv)]
    # Through the CLI's main in this process: the refusal comes before any worker.
    res = run_main("train", "--nproc", str(nproc), "--steps", "1", "--run-dir", "run", *QUIET,
                   *args, cwd=root)
    assert res.returncode == 2, res.stderr[-2000:]
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert not (root / "run").exists()  # nothing started, nothing written
    return lines[0]


@pytest.mark.parametrize("strategy", ["fsdp", "auto"])
def test_ep_that_does_not_divide_the_world_is_one_line(tmp_path: Path, strategy: str):
    line = _refused(tmp_path, 3, "parallel.ep=2", f"parallel.strategy='{strategy}'")
    assert "parallel.ep = 2 does not divide the 3 data- and tensor-parallel ranks" in line


def test_ep_that_does_not_divide_what_pp_leaves_is_one_line(tmp_path: Path):
    # ep is borrowed from a stage's data- and tensor-parallel ranks: 4 / pp 2 = 2.
    line = _refused(tmp_path, 4, "parallel.ep=4", "parallel.pp=2", "parallel.strategy='fsdp'")
    assert "parallel.ep = 4 does not divide the 2 data- and tensor-parallel ranks" in line
