"""A torchrun worker for test_pretrained_dist: for each (strategy, impl) given, build the
model of a Hugging Face directory, wrap it (DDP, FSDP2, or `tp`: tensor parallelism over
all ranks), load the pretrained weights into
the wrapped model, and save this rank's bytes read and first-forward logits. Not a test."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from trainwise.config.parallel_dims import ParallelDims
from trainwise.models import ModelSpec, build_model
from trainwise.run.parallelize import parallelize


def main(model_dir: str, out: str, *runs: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    idx = torch.load(Path(model_dir) / "idx.pt")
    results = {}
    for run in runs:  # "fsdp:trainwise", ...
        strategy, impl = run.split(":")
        bundle = build_model(ModelSpec(name=f"hf:{model_dir}", seq_len=16, impl=impl))
        tp = world if strategy == "tp" else 1  # all ranks one tensor-parallel group
        dims = ParallelDims(tp=tp) if tp > 1 else ParallelDims.from_strategy(strategy, world)
        plan = bundle.tp_plan(True) if tp > 1 else None
        model = parallelize(
            bundle.module, bundle.blocks, dims, device=torch.device("cpu"), tp_plan=plan
        )
        results[run] = bundle.load_weights(model)
        with torch.no_grad():
            logits = model(idx)
            if isinstance(logits, DTensor):  # TP: sharded by vocabulary
                logits = logits.full_tensor()
            torch.save(logits, Path(out) / f"{strategy}-{impl}-rank{rank}.pt")
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
