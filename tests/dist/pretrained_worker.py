"""A torchrun worker for test_pretrained: build a model from a Hugging Face directory,
wrap it by a strategy, load the pretrained weights into the wrapped (sharded) model, and
write this rank's bytes read and first-forward logits. Not a test module itself."""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

from trainwise.config.parallel_dims import ParallelDims
from trainwise.models import ModelSpec, build_model
from trainwise.run.parallelize import parallelize


def main(model_dir: str, strategy: str, impl: str, out: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    bundle = build_model(ModelSpec(name=f"hf:{model_dir}", seq_len=16, impl=impl))
    dims = ParallelDims.from_strategy(strategy, world)
    model = parallelize(bundle.module, bundle.blocks, dims, device=torch.device("cpu"))
    loaded = bundle.load_weights(model)
    idx = torch.load(f"{model_dir}/idx.pt")
    with torch.no_grad():
        logits = model(idx)
    torch.save(logits, f"{out}-rank{rank}.pt")
    with open(f"{out}-rank{rank}.json", "w") as f:
        json.dump(loaded, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:5])
