"""A minimal hand-written torchrun training loop: the competitor of `bench/overhead.py`.

It trains exactly what `trainwise train` trains by default (the same `build_model` call
and per-parameter seeded initial weights, the same synthetic data and sampler, AdamW
with the same hyperparameters and lr schedule, clip_grad_norm_ 1.0, DDP or FSDP2 with
trainwise's settings) and nothing else: no logging, no loss all-reduce, no probes, no
TensorBoard inside the loop. Rank 0 records time.perf_counter() at the end of every step
and writes them to a JSON file.

    python -m torch.distributed.run --standalone --nproc-per-node 2 bench/raw_loop.py \
        --strategy ddp --steps 150 --out /tmp/raw.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

from trainwise.config.schema import ScheduleConfig
from trainwise.data import build_datasets, build_loader
from trainwise.models import ModelSpec, build_model
from trainwise.run.engine.materialize import materialize
from trainwise.run.engine.optim import build_scheduler

# trainwise's defaults (config/schema.py), spelled out so that the loop stands alone.
SEQ_LEN = 64
VOCAB = 256
SYNTHETIC_TOKENS = 1_000_000
VAL_FRACTION = 0.05
SEED = 0
LR, BETAS, EPS, WEIGHT_DECAY = 3e-3, (0.9, 0.95), 1e-8, 0.0
GRAD_CLIP = 1.0


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--strategy", choices=("ddp", "fsdp"), required=True)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--micro-batch", type=int, default=16)
    p.add_argument("--model", default="tiny")
    p.add_argument("--out", type=Path, required=True, help="JSON written by rank 0")
    return p.parse_args()


def wrap(model: torch.nn.Module, blocks: list[torch.nn.Module], strategy: str, world: int):
    if strategy == "ddp":
        return DistributedDataParallel(model)
    # As trainwise.run.engine.parallelize.apply_fsdp with shard = "full", fp32.
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
    mp = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    for block in blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=True)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=False)
    return model


def build_wrapped(spec: ModelSpec, strategy: str, world: int):
    """The model with trainwise's initial weights: built on the meta device and filled
    parameter by parameter from (seed, name) generators (trainwise.run.engine.materialize), whole
    before DDP, shard by shard after FSDP, as trainwise's build_model_for does. Drawing
    from the global RNG instead gives other weights, and the two loops no longer train
    alike."""
    with torch.device("meta"):
        bundle = build_model(spec)
    if strategy == "ddp":
        materialize(bundle.module, bundle.init_parameter, SEED, torch.device("cpu"))
        return wrap(bundle.module, bundle.blocks, strategy, world), bundle
    model = wrap(bundle.module, bundle.blocks, strategy, world)
    materialize(model, bundle.init_parameter, SEED, torch.device("cpu"))
    return model, bundle


def main() -> None:
    args = parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    train_ds, _, info = build_datasets(
        "synthetic",
        seq_len=SEQ_LEN,
        val_fraction=VAL_FRACTION,
        seed=SEED,
        vocab_size=VOCAB,
        synthetic_tokens=SYNTHETIC_TOKENS,
    )
    spec = ModelSpec(name=args.model, vocab_size=info.vocab_size, seq_len=SEQ_LEN)
    model, bundle = build_wrapped(spec, args.strategy, world)
    torch.manual_seed(SEED + 1 + rank)
    loss_fn = bundle.loss_fn

    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
    scheduler = build_scheduler(optimizer, args.steps, ScheduleConfig())
    loader = build_loader(
        train_ds,
        micro_batch=args.micro_batch,
        grad_accum=1,
        dp_rank=rank,
        dp_size=world,
        seed=SEED,
        num_steps=args.steps,
    )

    ends: list[float] = []
    first = last = None
    for x, y in loader:
        loss = loss_fn(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        last = loss.detach()  # kept, not read: reading it would add a sync to the loop
        first = last if first is None else first
        ends.append(time.perf_counter())

    # After the timed loop: the rank-mean losses, to check that both loops train alike.
    losses = torch.stack([first, last])
    dist.all_reduce(losses)
    losses /= world
    if rank == 0:
        record = {
            "strategy": args.strategy,
            "world": world,
            "steps": len(ends),
            "tokens_per_step": args.micro_batch * SEQ_LEN * world,
            "step_end_s": ends,
            "first_loss": float(losses[0]),
            "final_loss": float(losses[1]),
        }
        args.out.write_text(json.dumps(record) + "\n")
    dist.barrier()  # leave together: a rank destroying the group alone can hang on gloo
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
