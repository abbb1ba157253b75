"""A torchrun worker for test_moe_dist: trains each case of CASES (a layout of the tiny
Mixture-of-Experts model, with its load-balancing loss and the auxiliary-loss-free bias
update on) a few steps through the engine (build_trainer) inside one process group of 4,
evaluates once, and writes per case the losses and their balancing part, the gradient
norms, the held-out loss and the routers' biases this rank holds. `case_run` also trains
the one-process reference of a case (without a process group). Not a test."""

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
from trainwise.models.moe.balance import routers
from trainwise.run.engine.step import mean_over_ranks
from trainwise.run.engine.trainer import build_trainer
from trainwise.run.job.distributed import destroy_process_group
from trainwise.run.job.resolve import prepare_job

STEPS = 3
# Visible balancing: a loss weight and a bias rate far above the published ones.
MOE = ["moe.aux_loss_coef=0.05", "moe.bias_update_rate=0.01"]
# name -> (micro_batch, grad_accum, data-parallel ranks, layout overrides); 4 processes.
# ddp4 probes the exposed sync on every step (its micro-batch runs twice, the second with
# its loss x 0): the routers must not count those tokens again.
CASES = {
    "ddp4": (2, 1, 4, ["parallel.strategy='ddp'"]),
    "fsdp4-accum": (1, 2, 4, ["parallel.strategy='fsdp'"]),
    "pp2-fsdp2": (2, 1, 2, ["parallel.strategy='fsdp'", "parallel.pp=2"]),
    "fsdp2-tp2": (2, 1, 2, ["parallel.strategy='fsdp'", "parallel.tp=2"]),
    # A Hugging Face Qwen3-MoE directory (q/k norms over this rank's heads under TP, heads
    # of 16 on a width of 32), its pretrained weights loaded into the sharded model.
    "qwen3-fsdp2-tp2": (2, 1, 2, ["parallel.strategy='fsdp'", "parallel.tp=2"]),
}
QWEN3 = ["model.name='hf:{root}/qwen3moe'", "model.impl='trainwise'", "data.vocab_size=98"]


def overrides(name: str, root: Path, mb: int, accum: int, layout: list[str]) -> list[str]:
    model = [k.format(root=root) for k in QWEN3] if name.startswith("qwen3") else [
        "model.name='moe-tiny'"]
    return [
        *model, "data.seq_len=32", "data.synthetic_tokens=20000",
        f"data.micro_batch={mb}", f"data.grad_accum={accum}", "checkpoint.enabled=false",
        "optim.lr=0.003", *MOE, *layout,
    ]


def case_run(name: str, root: Path, pipeline: bool) -> dict:
    """STEPS steps of case `name` on this process group (`pipeline`: its layout) or on one
    process (its global batch as one micro-batch a step, accumulated as the case does)."""
    mb, accum, dp, layout = CASES[name]
    keys = overrides(name, root, mb, accum, layout) if pipeline else overrides(
        name, root, mb * dp, accum, ["parallel.strategy='single'"])
    cfg = load_config(overrides=keys)
    world = dist.get_world_size() if pipeline else 1
    job = prepare_job(cfg, world, detect_device("cpu"), world)
    trainer = build_trainer(cfg, job, torch.device("cpu"))
    read = reread(trainer.parts[0], root) if name.startswith("qwen3") else None
    batches = iter(build_loader(
        job.datasets[0], micro_batch=cfg.data.micro_batch, grad_accum=job.grad_accum,
        dp_rank=trainer.dp_rank, dp_size=trainer.dp_size, seed=cfg.train.seed,
        num_steps=STEPS,
    ))
    probe = pipeline and name == "ddp4"
    results = [trainer.train_step(batches, probe=probe) for _ in range(STEPS)]
    evaluation = build_eval_loader(
        job.datasets[1], micro_batch=cfg.data.micro_batch, max_batches=2,
        dp_rank=trainer.dp_rank, dp_size=trainer.dp_size, seed=cfg.train.seed,
    )
    return {
        "losses": [mean_over_ranks(r.loss)[0] for r in results],
        "aux": [mean_over_ranks(r.aux_loss)[0] for r in results],
        "grad_norms": [float(r.grad_norm) for r in results],
        "eval": trainer.evaluate(evaluation),
        "biases": {i: r.expert_bias.tolist() for i, r in routers(trainer.parts).items()},
        "layout": job.dims.describe(),
        "read": read,
    }


def reread(part: torch.nn.Module, root: Path) -> dict:
    """The pretrained weights read into the built model once more (the same values): the
    bytes this rank read, of all the files' and of their experts'."""
    from trainwise.models.moe.hf import load_moe_weights

    return load_moe_weights(part, root / "qwen3moe", "qwen3_moe", 4, "test")


def main(root: str) -> None:
    faulthandler.enable()  # a crash in C++ (gloo, teardown) prints where it happened
    dist.init_process_group("gloo")
    out = {name: case_run(name, Path(root), True) for name in CASES}
    (Path(root) / f"rank{dist.get_rank()}.json").write_text(json.dumps(out))
    destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
