"""A torchrun worker for test_pretrained_dist: for each (strategy, impl) given, build the
model of a Hugging Face directory, wrap it (DDP, FSDP2, `tp`: tensor parallelism over all
ranks, or `fsdp_tp`: FSDP2 over 2-way tensor-parallel groups), load the pretrained
weights into the wrapped model, and save this rank's bytes read, bytes of parameters held
and first-forward logits. A run "strategy:impl@DIR" loads the model of DIR instead of the
launch's. Not a test."""

from __future__ import annotations

import faulthandler
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from trainwise.config.parallel_dims import ParallelDims
from trainwise.models import ModelSpec, build_model
from trainwise.run.engine.materialize import allocate
from trainwise.run.engine.parallelize import parallelize
from trainwise.run.job.distributed import destroy_process_group

CPU = torch.device("cpu")


def main(model_dir: str, out: str, *runs: str) -> None:
    faulthandler.enable()  # a crash in C++ (gloo, teardown) prints where it happened
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    idx = torch.load(Path(model_dir) / "idx.pt")
    results = {}
    for run in runs:
        run, _, own_dir = run.partition("@")
        inputs = torch.load(Path(own_dir) / "idx.pt") if own_dir else idx
        results[run] = _load(run, own_dir or model_dir, out, inputs)
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(results))
    destroy_process_group()  # the models' cycles freed first, as the trainer leaves


def _load(run: str, model_dir: str, out: str, idx: torch.Tensor) -> dict:
    """One entry of `runs` ("fsdp:trainwise", ...): wrap, load, save the first logits."""
    strategy, impl = run.split(":")
    spec = ModelSpec(name=f"hf:{model_dir}", seq_len=16, impl=impl)
    dims = _dims(strategy, dist.get_world_size())
    # As the trainer builds it: trainwise's GPT on the meta device, only the local
    # shards allocated after parallelizing; transformers' models whole.
    meta = (impl == "trainwise" and dims.fsdp) or dims.tp > 1
    with torch.device("meta" if meta else "cpu"):
        bundle = build_model(spec)
    plan = bundle.tp_plan(True) if dims.tp > 1 else None
    model = parallelize(bundle.module, bundle.blocks, dims, device=CPU, tp_plan=plan)
    if meta:
        allocate(model, CPU)
    result = bundle.load_weights(model)
    result["bytes_held"] = sum(_local_bytes(p) for p in model.parameters())
    with torch.no_grad():
        logits = model(idx)
        if isinstance(logits, DTensor):  # TP: sharded by vocabulary
            logits = logits.full_tensor()
        torch.save(logits, Path(out) / f"{strategy}-{impl}-rank{dist.get_rank()}.pt")
    return result


def _dims(strategy: str, world: int) -> ParallelDims:
    if strategy == "tp":  # all ranks one tensor-parallel group (DDP cannot replicate TP)
        return ParallelDims(tp=world)
    if strategy == "fsdp_tp":  # dp_shard x 2-way tp
        return ParallelDims(dp_shard=world // 2, tp=2, fsdp=True)
    return ParallelDims.from_strategy(strategy, world)


def _local_bytes(param: torch.Tensor) -> int:
    local = param.to_local() if isinstance(param, DTensor) else param
    return local.numel() * local.element_size()


if __name__ == "__main__":
    main(*sys.argv[1:])
