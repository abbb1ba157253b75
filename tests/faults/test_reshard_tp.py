"""Resharding across tensor-parallel layouts: a checkpoint written by 2-way FSDP x 2-way TP
(DTensors on a 2-D mesh) resumes on one process and under 4-way FSDP, one written by one
process resumes under 2-way TP, one written by 4-way FSDP under 2 x 2, and each continues
with the losses of the uninterrupted run; `trainwise export` writes the whole model from
the TP checkpoint; a worker killed under TP resumes bit-exact. Like test_reshard, on the
shared job_args (12 steps, a checkpoint every 4, global batch 16). Three of these are slow
checks (below): their proofs are made elsewhere."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from faulty import (
    References,
    assert_identical,
    exported_weights,
    fault_limit,
    final_weights,
    finish,
    job_args,
    kill,
    start,
    wait_for_pid,
)

from helpers import read_records, run_cli

# Each test's limit: its runs and the references it may wait for, and for the first, the module fixture's runs.
pytestmark = [pytest.mark.dist, pytest.mark.timeout(fault_limit(launches=1))]

RESUME_AT = 4
# name -> (nproc, strategy, extra): micro-batches keep the global batch at 16.
TP_LAYOUTS = {
    "fsdp2_tp2": (4, "fsdp", ("--set", "parallel.tp=2", "--set", "data.micro_batch=8")),
    "tp2": (2, "auto", ("--set", "parallel.tp=2", "--set", "data.micro_batch=16")),
}


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_records(run_dir)}


@pytest.fixture(scope="module")
def tp_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted 2 x 2 run whose checkpoints the tests resume."""
    root = tmp_path_factory.mktemp("reshard_tp")
    nproc, strategy, extra = TP_LAYOUTS["fsdp2_tp2"]
    run_dir = root / "fsdp2_tp2"
    done = run_cli(*job_args(run_dir, nproc, strategy, *extra), cwd=root)
    assert done.returncode == 0, done.stderr
    return run_dir


def resume(workdir: Path, written: Path, nproc: int, strategy: str, *extra: str) -> Path:
    checkpoint = written / "checkpoints" / f"step-{RESUME_AT:08d}"
    run_dir = workdir / f"resumed-{written.name}-{nproc}-{strategy}"
    args = job_args(run_dir, nproc, strategy, *extra, "--set", f"checkpoint.resume={checkpoint}")
    done = run_cli(*args, cwd=workdir)
    assert done.returncode == 0, done.stderr
    assert f"resuming from step {RESUME_AT}" in done.stderr
    return run_dir


def assert_continues(written: Path, resumed: Path) -> None:
    before, after = losses(written), losses(resumed)
    assert sorted(after) == list(range(RESUME_AT + 1, max(before) + 1))
    for step, loss in after.items():
        assert loss == pytest.approx(before[step], rel=1e-5, abs=1e-6), f"step {step}"


def test_tp_checkpoint_resumes_on_one_process(workdir: Path, tp_run: Path):
    assert_continues(tp_run, resume(workdir, tp_run, 1, "single"))


def test_single_checkpoint_resumes_under_tp(workdir: Path, reference: References):
    written = reference.run(1, "single")
    nproc, strategy, extra = TP_LAYOUTS["tp2"]
    assert_continues(written, resume(workdir, written, nproc, strategy, *extra))


# Slow checks (bench/slow_checks.sh), out of make test, each a proof another test makes on
# the same load path (CheckpointManager.load: dcp.load into the model's own state dict, the
# layout not a branch of it): an unsharded-by-tp checkpoint into dp_shard 2 x tp 2 is
# test_reshard_pp's third leg (fsdp 2 -> dp_shard 2 x tp 2) and, from one process, the test
# above; a tp checkpoint into another layout is test_tp_checkpoint_resumes_on_one_process
# (and test_reshard_pp's tp -> pp leg); the agent's restart after a SIGKILL does not depend
# on the layout (test_kill), and a dp_shard 2 x tp 2 run resumed from its own checkpoint
# bit for bit is test_float8's.
@pytest.mark.slow_check
def test_fsdp_checkpoint_resumes_under_fsdp_and_tp(workdir: Path, reference: References):
    written = reference.run(4, "fsdp")  # dp 4: every parameter sharded 4 ways, no TP
    nproc, strategy, extra = TP_LAYOUTS["fsdp2_tp2"]
    assert_continues(written, resume(workdir, written, nproc, strategy, *extra))


@pytest.mark.slow_check
def test_tp_checkpoint_resumes_under_fsdp_alone(workdir: Path, tp_run: Path):
    assert_continues(tp_run, resume(workdir, tp_run, 4, "fsdp"))


def test_export_of_a_tp_checkpoint_is_the_whole_model(
    workdir: Path, tp_run: Path, reference: References
):
    """The exported 2 x 2 model equals the single-process model trained alike (to float
    rounding): every shard was gathered under its plain name."""
    tp, single = exported_weights(tp_run, workdir), reference.weights(1, "single")
    assert tp.keys() == single.keys()
    for name in tp:
        torch.testing.assert_close(tp[name], single[name], rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.slow_check
def test_sigkill_under_tp_resumes_exactly(workdir: Path, tp_run: Path):
    nproc, strategy, extra = TP_LAYOUTS["fsdp2_tp2"]
    broken = workdir / "broken"
    proc = start(job_args(broken, nproc, strategy, *extra), workdir, faults="pause@step=10,rank=1")
    kill(wait_for_pid(proc, broken / "faults" / "pause-step-10.pid"))  # last checkpoint: 8
    rc, _, err = finish(proc)
    assert rc == 0, err
    assert "resuming from step 8" in err
    assert_identical(final_weights(tp_run), final_weights(broken))
