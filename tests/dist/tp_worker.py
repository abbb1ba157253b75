"""A torchrun worker for test_meta_init: builds the `small` GPT the way a 2 x 2 job
(dp_shard 2 x tp 2) does it (meta device, tensor parallelism, FSDP2, then materialised
shard by shard), saves the gathered parameters and this rank's storage figures, then runs
one micro-batch under each accumulation mode and records the gradient bytes it holds.
Then trains the job a few steps through the engine (build_trainer: converters, parts, the
mesh, the step strategy) with and without a toy model converter, and records the losses
and the data-parallel rank the mesh gives. Not a test."""

from __future__ import annotations

import faulthandler
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from trainwise.config import load_config
from trainwise.config.parallel_dims import ParallelDims
from trainwise.data import build_loader
from trainwise.hardware import detect_device
from trainwise.models import ModelSpec, build_model
from trainwise.models.converters import CONVERTERS
from trainwise.run.engine.materialize import materialize, plain_name
from trainwise.run.engine.parallelize import parallelize, set_gradient_sync
from trainwise.run.engine.step import mean_over_ranks
from trainwise.run.engine.trainer import build_trainer
from trainwise.run.job.distributed import destroy_process_group
from trainwise.run.job.resolve import prepare_job

SPEC = ModelSpec("small", vocab_size=256, seq_len=32)
CPU = torch.device("cpu")


def local_bytes(t: torch.Tensor) -> int:
    t = t.to_local() if isinstance(t, DTensor) else t
    return t.numel() * t.element_size()


def built(dims: ParallelDims):
    with torch.device("meta"):
        bundle = build_model(SPEC)
    model = parallelize(
        bundle.module, bundle.blocks, dims, device=CPU, tp_plan=bundle.tp_plan(True)
    )
    materialize(model, bundle.init_parameter, 0, CPU)
    return bundle, model


def grad_bytes_after_one_micro_batch(dims: ParallelDims, sharded: bool) -> int:
    bundle, model = built(dims)
    set_gradient_sync(model, sharded)  # what the Stepper does on a micro-batch but the last
    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    with loss_parallel():
        loss = bundle.loss_fn(model(x), x)
        loss.backward()
    return sum(local_bytes(p.grad) for p in model.parameters() if p.grad is not None)


class CountingLinear(torch.nn.Linear):
    """A Linear that counts its calls and computes what it did: the toy converter swaps
    each Linear's class for it (names and the TP plan's module types stay)."""

    calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        CountingLinear.calls += 1
        return super().forward(x)


class CountLinears:
    name = "count-linears"

    def convert(self, model: torch.nn.Module) -> None:
        for module in model.modules():
            if type(module) is torch.nn.Linear:
                module.__class__ = CountingLinear


STEPS = 3


def engine_losses(converted: bool) -> tuple[list[float], int]:
    """Losses of STEPS steps of the 2 x 2 job through build_trainer, with the toy converter
    registered or not; and this rank's data-parallel rank, asked of the job's mesh."""
    cfg = load_config(overrides=[
        "model.name='small'", "data.seq_len=32", "data.synthetic_tokens=20000",
        "parallel.strategy='fsdp'", "parallel.tp=2", "data.micro_batch=2",
        "data.grad_accum=2", "checkpoint.enabled=false",
    ])
    world = dist.get_world_size()
    job = prepare_job(cfg, world, detect_device("cpu"), world)
    factory = lambda _cfg: CountLinears()  # noqa: E731 (a feature's factory reads its section)
    if converted:
        CONVERTERS.append(factory)
    try:
        trainer = build_trainer(cfg, job, torch.device("cpu"))
    finally:
        if converted:
            CONVERTERS.remove(factory)
    batches = iter(build_loader(
        job.datasets[0], micro_batch=2, grad_accum=job.grad_accum, dp_rank=trainer.dp_rank,
        dp_size=trainer.dp_size, seed=cfg.train.seed, num_steps=STEPS,
    ))
    losses = [mean_over_ranks(trainer.train_step(batches).loss)[0] for _ in range(STEPS)]
    return losses, trainer.dp_rank


def main(out: str) -> None:
    faulthandler.enable()  # a crash in C++ (gloo, teardown) prints where it happened
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    figures, full = measured(ParallelDims.from_strategy("fsdp", dist.get_world_size(), tp=2))
    figures["plain_losses"], figures["dp_rank"] = engine_losses(converted=False)
    figures["converted_losses"], _ = engine_losses(converted=True)
    figures["linear_calls"] = CountingLinear.calls
    if rank == 0:
        torch.save(full, Path(out) / "gathered.pt")
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(figures))
    destroy_process_group()  # the models' cycles freed first, as the trainer leaves


def measured(dims: ParallelDims) -> tuple[dict, dict[str, torch.Tensor]]:
    """This rank's storage figures, and the parameters gathered whole."""
    _, model = built(dims)
    figures = {
        "param_bytes": sum(local_bytes(p) for p in model.parameters()),
        "grad_bytes_sharded": grad_bytes_after_one_micro_batch(dims, True),
        "grad_bytes_unsharded": grad_bytes_after_one_micro_batch(dims, False),
    }
    return figures, {plain_name(n): p.full_tensor() for n, p in model.named_parameters()}


if __name__ == "__main__":
    main(*sys.argv[1:])
