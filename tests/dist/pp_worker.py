"""A torchrun worker for test_pipeline: trains each case of CASES (a pipeline layout, a
schedule, a model) a few steps through the engine (build_trainer: stages, mesh, the
pipeline step) inside one process group, runs one step with a NaN loss (the guard skips
its update), evaluates once, and writes the losses, the held-out
loss and the step's telemetry split per case. `case_losses` is also how the test trains
the one-process reference of a case (without a process group). Not a test."""

from __future__ import annotations

import faulthandler
import json
import math
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from trainwise.config import load_config
from trainwise.data import build_eval_loader, build_loader
from trainwise.hardware import detect_device
from trainwise.run.engine.step import mean_over_ranks
from trainwise.run.engine.trainer import build_trainer
from trainwise.run.job.distributed import destroy_process_group
from trainwise.run.job.resolve import prepare_job

STEPS = 3
# The Llama config the test writes (4 layers: 2 stages x 2 per rank divide them).
LLAMA = {
    "model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
    "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
    "rope_theta": 5000.0, "hidden_act": "silu",
}
SFT = ["data.dataset='tokens'", "data.path='{root}/sft'", "data.seq_len=128",
       "data.val_fraction=0.2"]
# name -> (model, world, schedule, pp_virtual, micro_batch, grad_accum, extra overrides:
# data.* and lora.* ones apply to the one-process reference too)
# `small` is the built-in GPT preset (6 layers, tied head: the embedding's gradient crosses
# the pipeline); `llama` an HF Llama config read into the same GPT (untied).
CASES = {
    "small-gpipe": ("small", 2, "GPipe", 1, 4, 1, []),
    "small-1f1b-accum": ("small", 2, "1F1B", 1, 2, 2, []),
    "small-interleaved1f1b": ("small", 2, "Interleaved1F1B", 3, 4, 1, []),
    "small-interleavedzb": ("small", 2, "InterleavedZeroBubble", 3, 4, 1, []),
    "llama-gpipe": ("llama", 2, "GPipe", 1, 4, 1, []),
    "llama-1f1b": ("llama", 2, "1F1B", 1, 4, 1, ["parallel.pp_microbatches=2"]),
    "llama-interleaved1f1b-accum": ("llama", 2, "Interleaved1F1B", 2, 2, 2, []),
    "llama-interleavedzb": ("llama", 2, "InterleavedZeroBubble", 2, 4, 1, []),
    "llama-zbv": ("llama", 2, "ZBVZeroBubble", 2, 4, 1, []),
    # LoRA's converter runs before the split: each stage trains its own blocks' adapters.
    "llama-1f1b-lora": ("llama", 2, "1F1B", 1, 4, 1, ["lora.rank=4", "lora.alpha=8"]),
    # Packed SFT data (the test prepares it): ignored prompt targets, examples' ids to every
    # stage; the losses are the loader micro-batches' means, averaged, as without stages.
    "small-sft-packed-accum": ("small", 2, "1F1B", 1, 2, 2, SFT),
}
# Four processes: pipeline x FSDP shards, x replicas (FSDP2's replication: DDP's reducer
# does not follow the schedule), x tensor parallelism.
CASES_4 = {
    "small-1f1b-fsdp2": ("small", 4, "1F1B", 1, 4, 1, ["parallel.strategy='fsdp'"]),
    "small-gpipe-ddp2": ("small", 4, "GPipe", 1, 4, 1, []),
    "llama-interleaved1f1b-tp2": (
        "llama", 4, "Interleaved1F1B", 2, 4, 1, ["parallel.tp=2"]
    ),
}


BOTH = ("data.", "lora.")  # extra keys the one-process reference takes too


def overrides(case: tuple, root: Path, pipeline: bool) -> list[str]:
    model, _, schedule, virtual, mb, accum, extra = case
    name = f"hf:{root / 'llama'}" if model == "llama" else model
    keys = [
        f"model.name='{name}'", "model.impl='trainwise'", "data.seq_len=32",
        "data.synthetic_tokens=20000", f"data.micro_batch={mb}", f"data.grad_accum={accum}",
        "checkpoint.enabled=false", "parallel.strategy='ddp'", "optim.lr=0.003",
    ]
    keys += [e.format(root=root) for e in extra if e.startswith(BOTH)]
    if pipeline:
        keys += [
            "parallel.pp=2", f"parallel.pp_schedule='{schedule}'",
            f"parallel.pp_virtual={virtual}", *(e for e in extra if not e.startswith(BOTH)),
        ]
    else:
        keys[keys.index("parallel.strategy='ddp'")] = "parallel.strategy='single'"
    return keys


def case_losses(case: tuple, root: Path, pipeline: bool) -> dict:
    """STEPS training losses, then the held-out loss, of `case` on this process group's
    ranks (`pipeline`) or on one process; and the split of the last step (pipeline)."""
    cfg = load_config(overrides=overrides(case, root, pipeline))
    world = dist.get_world_size() if pipeline else 1
    job = prepare_job(cfg, world, detect_device("cpu"), world)
    trainer = build_trainer(cfg, job, torch.device("cpu"))
    batches = iter(build_loader(
        job.datasets[0], micro_batch=cfg.data.micro_batch, grad_accum=job.grad_accum,
        dp_rank=trainer.dp_rank, dp_size=trainer.dp_size, seed=cfg.train.seed,
        num_steps=STEPS + 1,
    ))
    results = [trainer.train_step(batches) for _ in range(STEPS)]
    before = optimized_state(trainer)
    trainer.step.poison = True  # a NaN loss: every rank must skip the same update
    poisoned = trainer.train_step(batches)
    trainer.step.poison = False
    # Skipped on the device (the fused AdamW's found_inf): this rank's shards of the
    # parameters, both moments and the step count as they were.
    kept = all(torch.equal(a, b) for a, b in zip(before, optimized_state(trainer), strict=True))
    evaluation = build_eval_loader(
        job.datasets[1], micro_batch=cfg.data.micro_batch, max_batches=2,
        dp_rank=trainer.dp_rank, dp_size=trainer.dp_size, seed=cfg.train.seed,
    )
    spans, sync = results[-1].spans()
    return {
        "losses": [mean_over_ranks(r.loss)[0] for r in results],
        "grad_norms": [float(r.grad_norm) for r in results],
        "eval": trainer.evaluate(evaluation),
        "spans": spans, "sync": sync, "layout": job.dims.describe(),
        "dp_rank": trainer.dp_rank, "parts": len(trainer.parts),
        "kept_gathered": kept_gathered(trainer.parts),
        # The loss as the recorder reads it: reduced over the ranks (the last stage's).
        "guard": [bool(poisoned.finite), math.isnan(mean_over_ranks(poisoned.loss)[0]), kept],
    }


def optimized_state(trainer: object) -> list[torch.Tensor]:
    """Copies of this rank's parameters (its shards) and their optimizer state."""
    opt = trainer.optimizer
    out = []
    for p in (p for group in opt.param_groups for p in group["params"]):
        for t in (p, *(opt.state[p][k] for k in ("exp_avg", "exp_avg_sq", "step"))):
            out.append((t.to_local() if isinstance(t, DTensor) else t).detach().clone())
    return out


def kept_gathered(parts: list) -> list[bool]:
    """For each FSDP unit of the rank's stages, whether FSDP keeps it gathered after
    forward (no post-forward reshard), as torch holds it (empty without FSDP)."""
    from torch.distributed.fsdp import FSDPModule

    groups = [
        m._get_fsdp_state()._fsdp_param_group
        for part in parts for m in part.modules() if isinstance(m, FSDPModule)
    ]
    return [not g._reshard_after_forward for g in groups if g is not None]


def main(root: str, which: str) -> None:
    faulthandler.enable()  # a crash in C++ (gloo, teardown) prints where it happened
    dist.init_process_group("gloo")
    cases = CASES if which == "2" else CASES_4
    out = {name: case_losses(case, Path(root), True) for name, case in cases.items()}
    (Path(root) / f"rank{dist.get_rank()}.json").write_text(json.dumps(out))
    destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
