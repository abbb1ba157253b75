"""A worker for test_lora_dist: LoRA on a Hugging Face Llama directory, built by the
trainer as a run builds it (meta device, converter, parallelize, pretrained weights,
adapters), then: the first logits (B = 0: the base model's), a checksum of this rank's
frozen shards before and after a few SGD steps (SGD: a gradient off by a factor shows,
where Adam would normalise it away) from a nonzero B (so A's gradient is not zero at the
first step), each step's loss averaged over the ranks, the trained adapters whole, and
the frozen base's id with the weight files read to compute it.
Under torchrun (`python lora_worker.py DIR OUT TP TIMEOUT_S`: its collectives' limit, the
test's hang limit) or called in-process (one worker).
Not a test."""

from __future__ import annotations

import faulthandler
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from trainwise.checksum import new_hasher
from trainwise.config import load_config
from trainwise.models.hf_weights import _file_digest
from trainwise.run.engine.materialize import fill
from trainwise.run.engine.parallelize import reshard_all
from trainwise.run.engine.trainer import build_trainer
from trainwise.run.engine.worker import join_job
from trainwise.run.job.distributed import destroy_process_group

STEPS, GLOBAL_BATCH, VOCAB = 4, 4, 98


def overrides(folder: Path, world: int, tp: int, timeout_s: str | None = None) -> list[str]:
    dp = world // tp
    limit = [] if timeout_s is None else [f"parallel.timeout_s={timeout_s}"]
    return [*limit,
        f"model.name='hf:{folder}'", "model.impl='trainwise'", f"data.vocab_size={VOCAB}",
        "data.seq_len=16", "data.synthetic_tokens=4000", "checkpoint.enabled=false",
        f"data.micro_batch={GLOBAL_BATCH // dp}", f"parallel.tp={tp}",
        f"parallel.strategy='{'single' if world == 1 else 'fsdp'}'",
        "lora.rank=4", "lora.alpha=8", "optim.name='sgd'", "optim.lr=0.1", "schedule.warmup_steps=0",
        "cluster.device='cpu'",  # gloo, as the batches
    ]


def frozen_checksum(parts: list[torch.nn.Module]) -> str:
    digest = new_hasher()
    for part in parts:
        for name, p in part.named_parameters():
            if not p.requires_grad:
                local = p.to_local() if isinstance(p, DTensor) else p
                digest.update(name.encode())
                # A copy: numpy would pin the storage FSDP frees and reallocates.
                digest.update(local.detach().clone().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def run(folder: Path, world: int, tp: int, timeout_s: str | None = None) -> dict:
    """This worker's part of the run: first logits, frozen checksums, global losses."""
    cfg = load_config(overrides=overrides(folder, world, tp, timeout_s))
    _, _, device, job = join_job(cfg)
    trainer = build_trainer(job.cfg, job, device)
    model = trainer.parts[0]
    before = frozen_checksum(trainer.parts)  # sharded now (the first forward gathers)
    with torch.no_grad():
        logits = model(torch.load(folder / "idx.pt"))
        if isinstance(logits, DTensor):  # TP: sharded by vocabulary
            logits = logits.full_tensor()
    # A forward without backward leaves the units FSDP keeps gathered after forward (the
    # root, the last block) gathered: the fill below writes the shards, as a run's
    # evaluation frees them first.
    reshard_all(model)
    # A trained-looking B (the same values whatever the layout), so that A's gradient is
    # not zero at the first step and both adapters' gradients are compared.
    fill(model, lambda _, t, g: torch.nn.init.normal_(t, std=0.02, generator=g), 1,
         only=lambda name: name.endswith("lora_B.weight"))
    gen = torch.Generator().manual_seed(7)
    dp, rank = trainer.mesh.dp_size, trainer.mesh.dp_rank
    share = GLOBAL_BATCH // dp
    losses = []
    for _ in range(STEPS):
        x = torch.randint(0, VOCAB, (GLOBAL_BATCH, 16), generator=gen)
        y = torch.randint(0, VOCAB, (GLOBAL_BATCH, 16), generator=gen)
        mine = slice(rank * share, (rank + 1) * share)
        loss = trainer.train_step(iter([(x[mine], y[mine])])).loss.float()
        if dist.is_initialized():  # TP ranks hold the same loss: the mean is over dp
            dist.all_reduce(loss)
            loss /= dist.get_world_size()
        losses.append(loss.item())
    adapters = {
        n: (p.full_tensor() if isinstance(p, DTensor) else p).tolist()
        for n, p in model.named_parameters() if p.requires_grad
    }
    return {
        "adapters": adapters, "logits": logits.tolist(), "before": before, "after": frozen_checksum(trainer.parts),
        "losses": losses, "base_weights": job.base_weights,
        # Weight files this process read to identify the base (not to load it).
        "base_reads": _file_digest.cache_info().misses,
    }


def main(folder: str, out: str, tp: str, timeout_s: str) -> None:
    faulthandler.enable()
    result = run(Path(folder), int(os.environ["WORLD_SIZE"]), int(tp), timeout_s)
    (Path(out) / f"rank{dist.get_rank()}.json").write_text(json.dumps(result))
    destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
