"""A torchrun worker for test_pipeline_user: trains each case of CASES (your own module,
tests/user_lm.py, cut into pipeline stages by its convention, on a layout of 4 ranks) a
few steps through the engine (build_trainer: stages, mesh, the pipeline step) inside one
process group, evaluates once, and writes the losses, gradient norms and held-out loss per
case. `case_losses` is also how the test trains a case's one-process reference (without a
process group). Not a test."""

from __future__ import annotations

import faulthandler
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from trainwise.config import load_config
from trainwise.data import build_eval_loader, build_loader
from trainwise.hardware import detect_device
from trainwise.run.engine.step import mean_over_ranks
from trainwise.run.engine.trainer import build_trainer
from trainwise.run.job.distributed import destroy_process_group
from trainwise.run.job.resolve import prepare_job

STEPS = 3
WORLD = 4
# name -> (factory, model.kwargs, strategy around the 2 stages, schedule, pp_virtual,
# micro_batch, grad_accum). Every layout is pp 2 x 2 data-parallel ranks.
CASES = {
    # Blocks in a ModuleDict (torchtitan's), FSDP inside each stage.
    "fsdp2-1f1b": ("user_lm:build", "{}", "fsdp", "1F1B", 1, 4, 1),
    # A head tied to the embedding across the ranks, the factory's own loss, replicas.
    "ddp2-gpipe-tied": ("user_lm:build_with_loss", "{tie = true, blocks = 'list'}", "ddp",
                        "GPipe", 1, 4, 1),
    # Two stages a rank (4 of one block), Sequential blocks, tied, with accumulation.
    "fsdp2-interleaved-tied": ("user_lm:build", "{tie = true, blocks = 'sequential'}", "fsdp",
                               "Interleaved1F1B", 2, 2, 2),
    # The V: the first and the last stage (both copies of the tied weight) on rank 0.
    "ddp2-zbv-tied": ("user_lm:build", "{tie = true}", "ddp", "ZBVZeroBubble", 2, 4, 1),
}


def overrides(case: tuple, pipeline: bool) -> list[str]:
    factory, kwargs, strategy, schedule, virtual, mb, accum = case
    keys = [
        f"model.name='{factory}'", f"model.kwargs={kwargs}", "data.seq_len=32",
        "data.synthetic_tokens=20000", f"data.grad_accum={accum}", "checkpoint.enabled=false",
        "optim.lr=0.003",
    ]
    if not pipeline:  # the pipeline's two data-parallel ranks' samples, in one process
        return [*keys, "parallel.strategy='single'", f"data.micro_batch={2 * mb}"]
    return [
        *keys, f"parallel.strategy='{strategy}'", f"data.micro_batch={mb}", "parallel.pp=2",
        f"parallel.pp_schedule='{schedule}'", f"parallel.pp_virtual={virtual}",
    ]


def case_losses(case: tuple, pipeline: bool) -> dict:
    """STEPS training losses and gradient norms, then the held-out loss, of `case` on this
    process group's ranks (`pipeline`) or on one process."""
    cfg = load_config(overrides=overrides(case, pipeline))
    world = dist.get_world_size() if pipeline else 1
    job = prepare_job(cfg, world, detect_device("cpu"), world)
    trainer = build_trainer(cfg, job, torch.device("cpu"))
    batches = iter(build_loader(
        job.datasets[0], micro_batch=cfg.data.micro_batch, grad_accum=job.grad_accum,
        dp_rank=trainer.dp_rank, dp_size=trainer.dp_size, seed=cfg.train.seed,
        num_steps=STEPS,
    ))
    results = [trainer.train_step(batches) for _ in range(STEPS)]
    evaluation = build_eval_loader(
        job.datasets[1], micro_batch=cfg.data.micro_batch, max_batches=2,
        dp_rank=trainer.dp_rank, dp_size=trainer.dp_size, seed=cfg.train.seed,
    )
    return {
        "losses": [mean_over_ranks(r.loss)[0] for r in results],
        "grad_norms": [float(r.grad_norm) for r in results],
        "eval": trainer.evaluate(evaluation),
        "layout": job.dims.describe(), "dp_rank": trainer.dp_rank, "parts": len(trainer.parts),
        "params": sorted(n for part in trainer.parts for n, _ in part.named_parameters()),
    }


def main(root: str) -> None:
    faulthandler.enable()  # a crash in C++ (gloo, teardown) prints where it happened
    dist.init_process_group("gloo")
    out = {name: case_losses(case, True) for name, case in CASES.items()}
    (Path(root) / f"rank{dist.get_rank()}.json").write_text(json.dumps(out))
    destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
