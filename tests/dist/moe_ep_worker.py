"""A torchrun worker for test_moe_ep: trains each case of CASES (the tiny MoE with its
experts split over parallel.ep ranks, the balancing loss and the bias update on) a few
steps through the engine (build_trainer) inside one process group of 2 or 4, evaluates
once, and writes per case the losses and their balancing part, the gradient norms, the
held-out loss, the routers' biases this rank holds, what it holds of the experts, the
steps' all-to-alls (their spans and seconds on this rank) and tokens per expert (summed
over the ranks as the recorder sums them). `case_run` also trains the one-process
reference of a case (without a process group). Not a test."""

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
from trainwise.models.moe.layers import GroupedExperts
from trainwise.run.engine.recorder import reduce_steps
from trainwise.run.engine.step import mean_over_ranks
from trainwise.run.engine.trainer import build_trainer
from trainwise.run.job.distributed import destroy_process_group
from trainwise.run.job.resolve import prepare_job

STEPS = 3
# Visible balancing: a loss weight and a bias rate far above the published ones.
MOE = ["moe.aux_loss_coef=0.05", "moe.bias_update_rate=0.01"]
# name -> (processes, micro_batch, grad_accum, data-parallel ranks, layout overrides).
# ddp2 probes the exposed sync on every step (its last micro-batch runs twice, the second
# with its loss x 0): the all-to-alls of the probe pass are not the step's.
CASES = {
    "ddp2-ep2": (2, 2, 2, 2, ["parallel.strategy='ddp'"]),
    "fsdp4-ep2": (4, 1, 2, 4, ["parallel.strategy='fsdp'"]),
    # Every block checkpointed: its recomputed forward exchanges the rows again.
    "hsdp2x2-ep2": (4, 2, 1, 4, ["parallel.strategy='hsdp'", "parallel.replicate=2",
                                 "parallel.ac='full'"]),
    "pp2-fsdp2-ep2": (4, 2, 1, 2, ["parallel.strategy='fsdp'", "parallel.pp=2"]),
    "fsdp2-tp2-ep2": (4, 2, 1, 2, ["parallel.strategy='fsdp'", "parallel.tp=2"]),
    # ep = tp with no data-parallel wrapper: the tp pair's tokens split, its experts too.
    "tp2-ep2": (2, 2, 1, 1, ["parallel.strategy='ddp'", "parallel.tp=2"]),
    # Every token routed to rank 1's experts (starve): rank 0's get no row in any step.
    "fsdp2-ep2-starved": (2, 2, 1, 2, ["parallel.strategy='fsdp'"]),
}
STARVED = "fsdp2-ep2-starved"


def overrides(mb: int, accum: int, layout: list[str], ep: int) -> list[str]:
    return [
        "model.name='moe-tiny'", "data.seq_len=32", "data.synthetic_tokens=20000",
        f"data.micro_batch={mb}", f"data.grad_accum={accum}", "checkpoint.enabled=false",
        "optim.lr=0.003", *MOE, *layout, f"parallel.ep={ep}",
    ]


def case_run(name: str, pipeline: bool) -> dict:
    """STEPS steps of case `name` on this process group (`pipeline`: its layout, ep 2) or
    on one process (its global batch as one micro-batch a step, accumulated as the case
    does)."""
    _, mb, accum, dp, layout = CASES[name]
    keys = overrides(mb, accum, layout, 2) if pipeline else overrides(
        mb * dp, accum, ["parallel.strategy='single'"], 1)
    cfg = load_config(overrides=keys)
    world = dist.get_world_size() if pipeline else 1
    job = prepare_job(cfg, world, detect_device("cpu"), world)
    trainer = build_trainer(cfg, job, torch.device("cpu"))
    if name == STARVED:
        starve(trainer.parts)
    batches = iter(build_loader(
        job.datasets[0], micro_batch=cfg.data.micro_batch, grad_accum=job.grad_accum,
        dp_rank=trainer.dp_rank, dp_size=trainer.dp_size, seed=cfg.train.seed,
        num_steps=STEPS,
    ))
    probe = pipeline and name == "ddp2-ep2"
    results = [trainer.train_step(batches, probe=probe) for _ in range(STEPS)]
    evaluation = build_eval_loader(
        job.datasets[1], micro_batch=cfg.data.micro_batch, max_batches=2,
        dp_rank=trainer.dp_rank, dp_size=trainer.dp_size, seed=cfg.train.seed,
    )
    _, _, tokens = reduce_steps(results)  # the recorder's one collective
    return {
        "tokens": tokens,
        # The token copies this rank's routers routed each step (its own share).
        "routed": [float(r.expert_tokens.sum()) for r in results],
        # This rank's all-to-all spans a step (none on one process).
        "a2a_spans": [len(r.a2a.spans) if r.a2a is not None else 0 for r in results],
        "a2a_s": [r.spans()[0].get("a2a") for r in results],
        "losses": [mean_over_ranks(r.loss)[0] for r in results],
        "aux": [mean_over_ranks(r.aux_loss)[0] for r in results],
        "grad_norms": [float(r.grad_norm) for r in results],
        "eval": trainer.evaluate(evaluation),
        "biases": {i: r.expert_bias.tolist() for i, r in routers(trainer.parts).items()},
        "layout": job.dims.describe(),
        "experts": held_experts(trainer.parts),
    }


def starve(parts: list[torch.nn.Module]) -> None:
    """Raise the balancing bias of experts 4-7 far above the rest: every token's top-k are
    among them (the bias picks), so experts 0-3, rank 0's under ep 2, get no token, for
    more steps than a case runs (the update moves a bias by the rate a step)."""
    for router in routers(parts).values():
        with torch.no_grad():
            router.expert_bias[4:] += 100.0


def held_experts(parts: list[torch.nn.Module]) -> dict[str, list[int]]:
    """The local shape of each routed experts weight this rank holds, by name."""
    return {
        f"{name}.{key}": list(p.to_local().shape if hasattr(p, "to_local") else p.shape)
        for part in parts for name, m in part.named_modules() if isinstance(m, GroupedExperts)
        for key, p in m.named_parameters()
    }


def main(root: str) -> None:
    faulthandler.enable()  # a crash in C++ (gloo, teardown) prints where it happened
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    out = {name: case_run(name, True) for name, case in CASES.items() if case[0] == world}
    (Path(root) / f"rank{dist.get_rank()}.json").write_text(json.dumps(out))
    destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
