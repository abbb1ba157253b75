"""Peak host memory per rank while a sharded model is built: whole on every rank then
sharded (the old way) against meta device -> parallelize -> materialised shard by shard.

Starts --nproc gloo workers with torchrun. Each builds the preset (--model) under FSDP2
over all ranks (--tp 1) or FSDP x TP (--tp 2), and reports the growth of its peak
resident memory (ru_maxrss) across the build, next to the bytes of its parameter shards,
the whole model's bytes and the largest single parameter (the meta path holds one full
parameter at a time). Figures are MB (10^6 bytes), the worst rank.

    .venv/bin/python bench/meta_init.py                          # gpt2-124m, 4 ranks
    .venv/bin/python bench/meta_init.py --model small --nproc 2

Not part of `make test`: resident memory depends on the allocator and the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

MB = 1e6


def peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / MB  # KB on Linux


def worker(model: str, tp: int, mode: str, out: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from trainwise.config.parallel_dims import ParallelDims
    from trainwise.models import ModelSpec, build_model
    from trainwise.run.engine.materialize import materialize
    from trainwise.run.engine.parallelize import parallelize

    dist.init_process_group("gloo")
    dims = ParallelDims.from_strategy("fsdp", dist.get_world_size(), tp=tp)
    cpu, spec = torch.device("cpu"), ModelSpec(model, seq_len=128)
    dist.barrier()
    before = peak_mb()
    if mode == "whole":
        torch.manual_seed(0)
        bundle = build_model(spec)
    else:
        with torch.device("meta"):
            bundle = build_model(spec)
    plan = bundle.tp_plan(True) if tp > 1 else None
    m = parallelize(bundle.module, bundle.blocks, dims, device=cpu, tp_plan=plan)
    if mode == "meta":
        materialize(m, bundle.init_parameter, 0, cpu)
    grown = peak_mb() - before
    local = [p.to_local() if isinstance(p, DTensor) else p for p in m.parameters()]
    figures = {
        "peak_growth_mb": grown,
        "shard_mb": sum(t.numel() * t.element_size() for t in local) / MB,
        "model_mb": sum(p.numel() * 4 for p in m.parameters()) / MB,
        "largest_param_mb": max(p.numel() * 4 for p in m.parameters()) / MB,
    }
    Path(out, f"{mode}-{dist.get_rank()}.json").write_text(json.dumps(figures))
    dist.destroy_process_group()


def launch(model: str, nproc: int, tp: int, mode: str, out: str) -> dict[str, float]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", __file__, "--worker", model, str(tp), mode, out]
    subprocess.run(cmd, env=env, check=True, capture_output=True)
    ranks = [json.loads(Path(out, f"{mode}-{r}.json").read_text()) for r in range(nproc)]
    return {k: max(r[k] for r in ranks) for k in ranks[0]}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5])
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt2-124m")
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--tp", type=int, default=1)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as out:
        rows = {
            mode: launch(args.model, args.nproc, args.tp, mode, out) for mode in ("whole", "meta")
        }
    first = next(iter(rows.values()))
    print(f"{args.model} on {args.nproc} ranks, tp {args.tp}: model {first['model_mb']:.1f} MB, "
          f"largest parameter {first['largest_param_mb']:.1f} MB")
    for mode, r in rows.items():
        print(
            f"  {mode:5s}  peak growth {r['peak_growth_mb']:8.1f} MB   shard {r['shard_mb']:7.1f} MB"
        )


if __name__ == "__main__":
    main()
