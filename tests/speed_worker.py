"""The standard tiny launch that sizes every time limit of the tests (helpers.machine_speed):
a torchrun worker that imports what a training worker imports (DDP, DTensor, DCP), joins
a gloo group, trains a two-block transformer of the tiny GPT's size under DDP a few steps
and, on rank 0, writes its median step's seconds to OUT. Plain torch, no trainwise: a
broken trainwise must fail its own tests, not the limits of all the others. Not a test."""

from __future__ import annotations

import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint  # noqa: F401 (a training worker's imports, timed too)
import torch.distributed.tensor  # noqa: F401
from torch import nn
from torch.nn.parallel import DistributedDataParallel

STEPS = 6  # the first is a warm-up; the median of the others is the step


def tiny_model() -> nn.Module:
    """About the tiny GPT: 2 blocks of width 64, 4 heads, a 256-wide MLP, 256 tokens."""
    block = nn.TransformerEncoderLayer(64, 4, 256, dropout=0.0, batch_first=True)
    return nn.Sequential(
        nn.Embedding(256, 64), nn.TransformerEncoder(block, 2, enable_nested_tensor=False),
        nn.Linear(64, 256),
    )


def main(out: str) -> None:
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DistributedDataParallel(tiny_model())
    optimizer = torch.optim.AdamW(model.parameters())
    tokens = torch.randint(0, 256, (8, 64), generator=torch.Generator().manual_seed(1))
    seconds = []
    for _ in range(STEPS):
        start = time.perf_counter()
        logits = model(tokens)
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten())
        loss.backward()  # DDP's all-reduce: the step waits for the slower rank
        optimizer.step()
        optimizer.zero_grad()
        seconds.append(time.perf_counter() - start)
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps({"step_s": statistics.median(seconds[1:])}))
    # As trainwise's workers leave (run/job/distributed.py): DDP's reference cycles keep the
    # group's pending work alive, and a rank that tore down alone left the other waiting.
    del model, optimizer
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
    gc.freeze()  # and skip the exit's collection over torch's heap (trainwise/process_exit.py)


if __name__ == "__main__":
    main(*sys.argv[1:])
