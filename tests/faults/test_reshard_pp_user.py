"""Checkpoints of your own module under pipeline stages cross layouts both ways, on three
`trainwise train` launches of tests/user_lm.py with a head tied to its embedding (the
copy on the last stage is saved under the head's name, its optimizer state under the
embedding's: the whole model's names):

1. pp 2 (1F1B, a stage per worker), 8 steps, a checkpoint every 4: the same losses as
   one process (trained here);
2. plain FSDP (dp_shard 2) resumes the pp run's step-4 checkpoint (DCP reshards it),
   saving every 2 steps;
3. pp 2 in the V (ZBVZeroBubble: the first and the last stage, both copies of the tied
   weight, on worker 0) resumes that run's step-6 checkpoint.

Each continues the pp run's losses (fp32, rel 1e-5: the layouts sum in other orders)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from faulty import job_args

from helpers import hang_limit, read_records, run_cli

STEPS = 8
TESTS = Path(__file__).parents[1]  # user_lm.py: the workers import it by model.name
MODEL = ("--set", "model.name='user_lm:build'", "--set", "model.kwargs={tie = true}",
         "--set", "data.seq_len=32")
# name -> (nproc, strategy, extra); the global batch stays 16 (job_args' contract).
LAYOUTS = {
    "pp2": (2, "ddp", ("--set", "parallel.pp=2", "--set", "data.micro_batch=16")),
    "fsdp2": (2, "fsdp", ()),
    "pp2_v": (2, "ddp", ("--set", "parallel.pp=2", "--set", "data.micro_batch=16",
                         "--set", "parallel.pp_schedule=ZBVZeroBubble",
                         "--set", "parallel.pp_virtual=2")),
}
LAUNCH = hang_limit(steps=STEPS)

pytestmark = [pytest.mark.dist, pytest.mark.timeout(hang_limit(launches=3, steps=3 * STEPS))]


def _train(root: Path, name: str, layout: str, *extra: str) -> str:
    """The run's stderr (what the launcher said)."""
    nproc, strategy, more = LAYOUTS[layout]
    args = job_args(root / name, nproc, strategy, *MODEL, *more, *extra, steps=STEPS)
    path = os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")]))
    done = run_cli(*args, cwd=root, timeout=LAUNCH, env={"PYTHONPATH": path})
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stderr


def _resume(root: Path, name: str, layout: str, written: Path, step: int, *extra: str) -> Path:
    checkpoint = written / "checkpoints" / f"step-{step:08d}"
    said = _train(root, name, layout, "--set", f"checkpoint.resume={checkpoint}", *extra)
    assert f"resuming from step {step}" in said
    return root / name


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("reshard_pp_user")
    _train(root, "pp", "pp2")
    pp = root / "pp"
    # Every 2 steps, all kept: the next leg resumes its step 6.
    fsdp = _resume(root, "fsdp", "fsdp2", pp, 4,
                   "--set", "checkpoint.interval=2", "--set", "checkpoint.keep_last=4")
    back = _resume(root, "pp-v", "pp2_v", fsdp, 6)
    return {"pp": pp, "fsdp": fsdp, "pp_v": back}


def _losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_records(run_dir) if "loss" in r}


def _one_process(run_dir: Path) -> list[float]:
    """The pp run's job on one process (its config, without stages): STEPS losses."""
    from trainwise.config import load_config
    from trainwise.data import build_loader
    from trainwise.hardware import detect_device
    from trainwise.run.engine.trainer import build_trainer
    from trainwise.run.job.resolve import prepare_job

    cfg = load_config(run_dir / "config.toml",
                      overrides=["parallel.pp=1", "parallel.strategy='single'"])
    job = prepare_job(cfg, 1, detect_device("cpu"), 1)
    trainer = build_trainer(cfg, job, torch.device("cpu"))
    batches = iter(build_loader(job.datasets[0], micro_batch=cfg.data.micro_batch,
                                grad_accum=job.grad_accum, dp_rank=0, dp_size=1,
                                seed=cfg.train.seed, num_steps=STEPS))
    return [float(trainer.train_step(batches).loss) for _ in range(STEPS)]


def test_pp_2_trains_one_processs_losses(runs):
    got = _losses(runs["pp"])
    assert sorted(got) == list(range(1, STEPS + 1))
    want = _one_process(runs["pp"])
    for step, loss in got.items():
        assert loss == pytest.approx(want[step - 1], rel=1e-5), step


def test_resumes_across_layouts_continue_the_pp_runs_losses(runs):
    """pp 2 -> fsdp 2 -> pp 2 in the V: each resumed run continues the pp run."""
    pp = _losses(runs["pp"])
    for name, start_at in (("fsdp", 4), ("pp_v", 6)):
        got = _losses(runs[name])
        assert sorted(got) == list(range(start_at + 1, STEPS + 1)), name
        for step, loss in got.items():
            assert loss == pytest.approx(pp[step], rel=1e-5), (name, step)
