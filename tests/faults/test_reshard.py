"""Resharding: a checkpoint written by one strategy and world size resumes under another
(`checkpoint.resume = PATH`). The resumed run continues with the losses of the run that
wrote the checkpoint and went on uninterrupted: the model and optimizer state carried
over (a lost Adam state would change the very next update), and the data position is
re-split over the new ranks (the sampler's stream depends only on seed, global batch and
step, so the same samples follow step 4 whatever the number of ranks)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from faulty import STEPS, References, fault_limit, job_args
from safetensors.torch import load_file

from helpers import params_marking_slow, read_records, run_cli
from trainwise.config import load_config
from trainwise.data import build_eval_loader
from trainwise.hardware import detect_device
from trainwise.models import build_model
from trainwise.run.engine.precision import autocast_context
from trainwise.run.engine.step import evaluate
from trainwise.run.job.resolve import prepare_job

# Each test's limit: its runs and the references it may wait for.
pytestmark = [pytest.mark.dist, pytest.mark.timeout(fault_limit())]

RESUME_AT = 4
LAYOUTS = {"fsdp2": (2, "fsdp"), "ddp2": (2, "ddp"), "single": (1, "single")}


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_records(run_dir)}


# A slow check (bench/slow_checks.sh), out of make test: ddp 2 -> fsdp 2. An unsharded
# checkpoint into FSDP is single -> fsdp 2, and a resume at the same world size (the data
# position and RNG kept) is fsdp 2 -> ddp 2.
@pytest.mark.parametrize(("source", "target"), params_marking_slow(
    [("fsdp2", "ddp2"), ("fsdp2", "single"), ("single", "fsdp2"), ("ddp2", "fsdp2")],
    {("ddp2", "fsdp2")}))
def test_resume_under_another_layout(
    workdir: Path, reference: References, source: str, target: str
):
    written = reference.run(*LAYOUTS[source])
    checkpoint = written / "checkpoints" / f"step-{RESUME_AT:08d}"
    nproc, strategy = LAYOUTS[target]
    run_dir = workdir / "resumed"
    resume = ("--set", f"checkpoint.resume={checkpoint}")
    done = run_cli(*job_args(run_dir, nproc, strategy, *resume), cwd=workdir)
    assert done.returncode == 0, done.stderr
    assert f"resuming from step {RESUME_AT}" in done.stderr

    event = next(
        json.loads(line)
        for line in (run_dir / "events.jsonl").read_text().splitlines()
        if json.loads(line)["kind"] == "resume"
    )
    assert (event["from_world"], event["from_strategy"]) == LAYOUTS[source]
    same_world = LAYOUTS[source][0] == nproc
    assert event["rng"] == ("restored" if same_world else "kept (written by another world size)")

    before, after = losses(written), losses(run_dir)
    assert sorted(after) == list(range(RESUME_AT + 1, STEPS + 1))
    for step, loss in after.items():
        assert loss == pytest.approx(before[step], rel=1e-5, abs=1e-6), f"step {step}"


def test_export_matches_the_sharded_model(workdir: Path, reference: References):
    """The consolidated file of an FSDP x2 run, loaded into the plain model, gives the
    held-out loss the sharded model measured at its last step (the checkpoint's state)."""
    run_dir = reference.run(2, "fsdp")
    measured = read_records(run_dir)[-1]["eval_loss"]
    out = workdir / "model.safetensors"
    done = run_cli("export", str(run_dir), "-o", str(out), cwd=workdir)
    assert done.returncode == 0, done.stderr

    cfg = load_config(run_dir / "config.toml")
    job = prepare_job(cfg, 2, detect_device("cpu"))  # the run's datasets and model spec
    bundle = build_model(job.model_spec)
    bundle.module.load_state_dict(load_file(out), strict=True)
    cpu = torch.device("cpu")

    def autocast():
        return autocast_context(False, cfg.precision.dtype, cpu)

    per_rank = [
        evaluate(
            bundle.module,
            bundle.loss_fn,
            build_eval_loader(
                job.datasets[1],
                micro_batch=cfg.data.micro_batch,
                max_batches=cfg.train.eval_batches,
                dp_rank=rank,
                dp_size=2,
                seed=cfg.train.seed,
            ),
            autocast,
            cpu,
        )
        for rank in range(2)
    ]
    assert sum(per_rank) / 2 == pytest.approx(measured, rel=1e-5)
