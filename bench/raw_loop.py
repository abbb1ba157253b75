"""A minimal hand-written torchrun training loop: the competitor of `bench/overhead.py`.

It trains exactly what `trainwise train` trains by default (the same `build_model` call
and per-parameter seeded initial weights, the same synthetic data and sampler, AdamW
with the same hyperparameters and lr schedule, clipping at 1.0) on one of four layouts,
each written with PyTorch's own pieces as a user would write it:

- ddp: DistributedDataParallel;
- fsdp: FSDP2's fully_shard per block and on the root;
- tp: DTensor's parallelize_module with the GPT's tensor-parallel plan (sequence
  parallel), the loss under loss_parallel;
- pp: torch.distributed.pipelining, one stage per rank (the GPT cut where trainwise cuts
  it), Schedule1F1B over micro-batches of one sample, the tied embedding's gradient summed
  over its two copies.

Nothing else: no logging, no loss all-reduce, no probes, no checkpoints, no TensorBoard
inside the loop. Rank 0 records time.perf_counter() at the end of every step and writes
them to a JSON file.

    python -m torch.distributed.run --standalone --nproc-per-node 2 bench/raw_loop.py \
        --layout ddp --steps 150 --out /tmp/raw.json
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.pipelining import PipelineStage, Schedule1F1B
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel, parallelize_module
from torch.nn.parallel import DistributedDataParallel

from trainwise.config.schema import ScheduleConfig
from trainwise.data import build_datasets, build_loader
from trainwise.models import ModelSpec, build_model
from trainwise.models.pipeline import split_gpt
from trainwise.run.engine.materialize import materialize
from trainwise.run.engine.optim import build_scheduler
from trainwise.run.engine.parallelize import has_persistent_buffers

# trainwise's defaults (config/schema.py), spelled out so that the loop stands alone.
SEQ_LEN = 64
VOCAB = 256
SYNTHETIC_TOKENS = 1_000_000
VAL_FRACTION = 0.05
SEED = 0
LR, BETAS, EPS, WEIGHT_DECAY = 3e-3, (0.9, 0.95), 1e-8, 0.0
GRAD_CLIP = 1.0
LAYOUTS = ("ddp", "fsdp", "tp", "pp")
TIED = "tok_emb.weight"  # the embedding the GPT's head reuses (tie_embeddings)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layout", choices=LAYOUTS, required=True)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--micro-batch", type=int, default=16)
    p.add_argument("--model", default="tiny")
    p.add_argument("--out", type=Path, required=True, help="JSON written by rank 0")
    p.add_argument("--as-trainwise", action="store_true",
                   help="trainwise's choices where a plain loop's differ: AdamW fused (a "
                   "group per tensor kind), under ddp the gradients as views of its "
                   "buckets and no broadcast of buffers that are not saved, and under "
                   "fsdp the last block kept gathered")
    return p.parse_args()


def meta_model(spec: ModelSpec):
    with torch.device("meta"):
        return build_model(spec)


def build_ddp(spec: ModelSpec, as_trainwise: bool = False):
    """Whole weights first (DDP checks the replicas at wrapping), then DDP (`as_trainwise`:
    the gradients as views of its buckets, and the buffers broadcast before each forward
    only where one is persistent, as trainwise's apply_ddp)."""
    bundle = meta_model(spec)
    module = bundle.module
    materialize(module, bundle.init_parameter, SEED, torch.device("cpu"))
    if not as_trainwise:
        return DistributedDataParallel(module), bundle
    return DistributedDataParallel(
        module, gradient_as_bucket_view=True, forward_sync_buffers=has_persistent_buffers(module)
    ), bundle


def build_fsdp(spec: ModelSpec, world: int, keep_last: bool = False):
    """fully_shard per block and on the root, fp32, as a user writes it (`keep_last`: the
    last block not resharded after forward either, as trainwise's apply_fsdp); the weights
    filled shard by shard afterwards."""
    bundle = meta_model(spec)
    model = bundle.module
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
    mp = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    last = len(bundle.blocks) - 1
    for i, block in enumerate(bundle.blocks):
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=i < last or not keep_last)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=False)
    materialize(model, bundle.init_parameter, SEED, torch.device("cpu"))
    return model, bundle


def build_tp(spec: ModelSpec, world: int):
    """The GPT's own tensor-parallel plan (sequence parallel, as trainwise's default for
    tp > 1) over all ranks; the weights filled shard by shard afterwards."""
    bundle = meta_model(spec)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    for plan in bundle.tp_plan(True):
        parallelize_module(bundle.module, mesh, plan)
    materialize(bundle.module, bundle.init_parameter, SEED, torch.device("cpu"))
    return bundle.module, bundle


def build_stage(spec: ModelSpec, rank: int, world: int):
    """This rank's stage of the GPT (one per rank), cut as trainwise cuts it: the blocks
    split evenly, the embeddings on the first, the norm and the tied head on the last."""
    bundle = meta_model(spec)
    stage = split_gpt(bundle.module, rank, world)
    materialize(stage, bundle.init_parameter, SEED, torch.device("cpu"))
    return stage, bundle


def grad_norm(params: list[torch.Tensor]) -> torch.Tensor:
    """The global gradient norm (torchtitan's clip_grad_norm_ for a model holding both
    DTensor and plain parameters): one norm per mesh, completed over its ranks, combined."""
    groups: dict[object, list[torch.Tensor]] = {}
    for p in params:
        groups.setdefault(p.device_mesh if isinstance(p, DTensor) else None, []).append(p.grad)
    norms = []
    for grads in groups.values():
        norm = torch.nn.utils.get_total_norm(grads)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    if len(norms) == 1:
        return norms[0]
    return torch.linalg.vector_norm(torch.stack([n.float() for n in norms]))


def clip(params: list[torch.Tensor], norm: torch.Tensor) -> None:
    groups: dict[object, list[torch.Tensor]] = {}
    for p in params:
        groups.setdefault(p.device_mesh if isinstance(p, DTensor) else None, []).append(p)
    for group in groups.values():
        torch.nn.utils.clip_grads_with_norm_(group, GRAD_CLIP, norm)


class PipelineLoop:
    """One step of the pipeline: the schedule over this rank's stage, the tied embedding's
    two copies summed, the norm completed over the stages (the tied copy counted once)."""

    def __init__(self, stage: torch.nn.Module, rank: int, world: int, loss_fn, microbatches: int):
        self.stage, self.first, self.last = stage, rank == 0, rank == world - 1
        self.microbatches = microbatches

        def mean_part(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            return loss_fn(output, target) / microbatches  # the batch's mean, summed

        pipe = PipelineStage(stage, rank, world, torch.device("cpu"))
        self.schedule = Schedule1F1B(pipe, microbatches, loss_fn=mean_part, scale_grads=False)

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        losses: list[torch.Tensor] = []
        self.schedule.step(*((x,) if self.first else ()), target=y, losses=losses)
        tied = dict(self.stage.named_parameters())[TIED]
        dist.all_reduce(tied.grad)  # pp 2: the first stage's embedding and the last's head
        head_copy = self.last and not self.first
        counted = [p for n, p in self.stage.named_parameters() if not (head_copy and n == TIED)]
        squared = torch.nn.utils.get_total_norm([p.grad for p in counted]).float().square()
        dist.all_reduce(squared)
        torch.nn.utils.clip_grads_with_norm_(self.stage.parameters(), GRAD_CLIP, squared.sqrt())
        if self.last:
            return torch.stack(losses).sum().detach()
        return torch.zeros(())


def main() -> None:
    args = parse_args()
    dist.init_process_group("gloo")
    # RAW_LOOP_SIDE_GROUPS=N holds N idle gloo groups, as trainwise holds its checkpoint,
    # control and diagnosis groups: each keeps a thread that wakes every 10 ms
    # (docs/development.md measures what three cost this loop).
    for _ in range(int(os.environ.get("RAW_LOOP_SIDE_GROUPS", "0"))):
        dist.new_group(backend="gloo")  # kept by torch's registry of groups
    rank, world = dist.get_rank(), dist.get_world_size()
    data_parallel = args.layout in ("ddp", "fsdp")
    dp_rank, dp_size = (rank, world) if data_parallel else (0, 1)

    train_ds, _, info = build_datasets(
        "synthetic",
        seq_len=SEQ_LEN,
        val_fraction=VAL_FRACTION,
        seed=SEED,
        vocab_size=VOCAB,
        synthetic_tokens=SYNTHETIC_TOKENS,
    )
    spec = ModelSpec(name=args.model, vocab_size=info.vocab_size, seq_len=SEQ_LEN)
    if args.layout == "ddp":
        model, bundle = build_ddp(spec, as_trainwise=args.as_trainwise)
    elif args.layout == "fsdp":
        model, bundle = build_fsdp(spec, world, keep_last=args.as_trainwise)
    elif args.layout == "tp":
        model, bundle = build_tp(spec, world)
    else:
        model, bundle = build_stage(spec, rank, world)
    torch.manual_seed(SEED + 1 + dp_rank)  # dropout: per data-parallel rank
    loss_fn = bundle.loss_fn
    pipeline = PipelineLoop(model, rank, world, loss_fn, args.micro_batch) if (
        args.layout == "pp"
    ) else None

    params = [p for p in model.parameters() if p.requires_grad]
    groups: list = params
    if args.as_trainwise:  # a fused kernel takes no mix of DTensors and plain tensors
        kinds = ([p for p in params if isinstance(p, DTensor)],
                 [p for p in params if not isinstance(p, DTensor)])
        groups = [{"params": kind} for kind in kinds if kind]
    optimizer = torch.optim.AdamW(groups, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY,
                                  fused=True if args.as_trainwise else None)
    scheduler = build_scheduler(optimizer, args.steps, ScheduleConfig())
    loader = build_loader(
        train_ds,
        micro_batch=args.micro_batch,
        grad_accum=1,
        dp_rank=dp_rank,
        dp_size=dp_size,
        seed=SEED,
        num_steps=args.steps,
    )

    ends: list[float] = []
    first = last = None
    for x, y in loader:
        if pipeline is not None:
            loss = pipeline(x, y)
        elif args.layout == "tp":
            with loss_parallel():
                loss = loss_fn(model(x), y)
                loss.backward()
            loss = loss.to_local()
            clip(params, grad_norm(params))
        else:
            loss = loss_fn(model(x), y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, GRAD_CLIP)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        last = loss.detach()  # kept, not read: reading it would add a sync to the loop
        first = last if first is None else first
        ends.append(time.perf_counter())

    # After the timed loop: the losses averaged over the data-parallel replicas (a
    # pipeline's loss is on its last stage), to check that both loops train alike.
    losses = torch.stack([first, last])
    dist.all_reduce(losses)
    losses /= world if data_parallel else (1 if args.layout == "pp" else world)
    if rank == 0:
        record = {
            "layout": args.layout,
            "world": world,
            "steps": len(ends),
            "tokens_per_step": args.micro_batch * SEQ_LEN * dp_size,
            "step_end_s": ends,
            "first_loss": float(losses[0]),
            "final_loss": float(losses[1]),
        }
        args.out.write_text(json.dumps(record) + "\n")
    dist.barrier()  # leave together: a rank destroying the group alone can hang on gloo
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
