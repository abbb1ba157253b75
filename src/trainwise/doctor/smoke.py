"""The smoke test, the first thing to run on a new job: a few steps on one batch must
lower its loss (the model, loss and optimizer are wired to learn); a checkpoint written
and read back through the run's own Checkpointer restores the state exactly; and the same
steps in fp32 show what the configured lower precision costs in loss."""

from __future__ import annotations

import gc
import itertools
import logging
import shutil
import statistics
import time

import torch
from torch.distributed.tensor import DTensor
from torch.optim.lr_scheduler import LambdaLR

from trainwise.doctor.context import Context
from trainwise.doctor.result import CheckResult
from trainwise.jsonl import read_objects
from trainwise.run.engine.step import mean_over_ranks
from trainwise.run.engine.trainer import Trainer, build_checkpointer, build_trainer

MIN_FALL = 0.01  # the loss must fall by at least this share over the smoke steps
PRECISION_GAP = 0.05  # a lower-precision loss further than this share from fp32's: warn
# A save below this size is timed after a warm-up save (a larger one's one-time costs
# are small beside its bytes).
WARM_SAVE_BYTES = 256 * 2**20
SMALL_SAVES = 3  # timed saves of a small checkpoint, after the warm-up one
SMOKE_DIR = "doctor-smoke"  # inside the run directory; removed afterwards


def overfit(ctx: Context, precision: str | None = None) -> tuple[Trainer, list, list[float]]:
    """The configured job on one batch for doctor.smoke_steps steps at the constant peak
    learning rate (warm-up would hide a dead optimizer): the trainer, the batch, losses."""
    trainer = build_trainer(
        ctx.cfg, ctx.job, ctx.device, precision=precision, faults=ctx.faults
    )
    trainer.step.scheduler = LambdaLR(trainer.optimizer, lambda _: 1.0)
    batch = ctx.batches(trainer)
    source = itertools.cycle(batch)
    losses = []
    for _ in range(ctx.cfg.doctor.smoke_steps):
        res = trainer.train_step(source, probe=False)
        losses.append(mean_over_ranks(res.loss)[0])
    return trainer, batch, losses


def _local(t: torch.Tensor) -> torch.Tensor:
    return (t.to_local() if isinstance(t, DTensor) else t).detach().clone()


def snapshot(trainer: Trainer) -> dict[str, torch.Tensor]:
    """This rank's model and optimizer tensors by name (shards as held)."""
    out = {f"model.{k}": _local(v) for part in trainer.parts for k, v in part.state_dict().items()}
    for pid, state in trainer.optimizer.state_dict()["state"].items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                out[f"optim.{pid}.{key}"] = _local(value)
    return out


def roundtrip(ctx: Context, trainer: Trainer, batch: list) -> tuple[list[str], float]:
    """Save through the run's Checkpointer, change every weight and the optimizer state,
    load it back: the names of the tensors that differ (on any rank) and the save time."""
    folder = ctx.run_dir / SMOKE_DIR
    ckpt = build_checkpointer(
        ctx.cfg, ctx.job, ctx.env, ctx.device, folder, trainer,
        logging.getLogger("trainwise.doctor"), ctx.host, root=folder / "checkpoints",
    )
    step = ctx.cfg.doctor.smoke_steps
    before = snapshot(trainer)
    try:
        # A small save is timed after a warm-up save (the first pays one-time costs:
        # imports, DCP's caches, the writer's threads), as the median of a few: a save as
        # the run makes it, the planner's figure. A large one once.
        small = ctx.planned().checkpoint.size_bytes < WARM_SAVE_BYTES
        seconds = []
        for k in range(step, step + SMALL_SAVES + 1) if small else [step]:
            start = time.perf_counter()
            ckpt.save(k, 0, time.time(), {"doctor": True}, sync=True)
            seconds.append(ctx.slowest(time.perf_counter() - start))
        # The run's own figure where rank 0 has it: the checkpoint events' save_s.
        recorded = [e["save_s"] for e in read_objects(folder / "events.jsonl")
                    if e.get("kind") == "checkpoint" and e.get("save_s") is not None]
        save_s = statistics.median(recorded[1:] or recorded or seconds[1:] or seconds)
        with torch.no_grad():
            for p in (p for part in trainer.parts for p in part.parameters()):
                p.add_(1.0)
        trainer.train_step(itertools.cycle(batch), probe=False)  # moves the optimizer state
        path, _ = ckpt.find()
        assert path is not None, "the smoke checkpoint was not committed"
        ckpt.load(path)
        after = snapshot(trainer)
    finally:
        ckpt.close()
    differ = sorted(k for k in before if k not in after or not torch.equal(before[k], after[k]))
    differ += sorted(set(after) - set(before))
    differ = sorted({name for names in ctx.gather(differ) for name in names})
    if ctx.env.is_main:
        shutil.rmtree(folder, ignore_errors=True)
    return differ, save_s


def check_smoke(ctx: Context) -> CheckResult:
    c = ctx.cfg
    if ctx.device.type == "cuda":
        gc.collect()  # the earlier checks' models: not part of this step's peak
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(ctx.device)
    trainer, batch, losses = overfit(ctx)
    if ctx.device.type == "cuda":
        ctx.measured["smoke_peak_bytes"] = float(torch.cuda.max_memory_allocated(ctx.device))
    first, last = losses[0], losses[-1]
    learns = last < first * (1 - MIN_FALL)
    differ, save_s = roundtrip(ctx, trainer, batch)
    ctx.measured["smoke_save_s"] = save_s
    del trainer
    dtype = c.precision.dtype
    data: dict = {"losses": losses, "checkpoint_differs": differ, "save_s": save_s}
    parts = [f"loss {first:.4f} -> {last:.4f} in {len(losses)} steps on one batch"]
    parts.append(
        f"checkpoint restored {'exactly' if not differ else f'{len(differ)} tensors wrong'} "
        f"(saved in {save_s:.2f} s)"
    )
    gap = None
    if dtype != "fp32":
        _, _, losses32 = overfit(ctx, "fp32")
        # On the scale of the starting loss: the final one may be near zero.
        gap = (last - losses32[-1]) / losses32[0]
        data.update(fp32_losses=losses32, precision_gap=gap)
        parts.append(
            f"{dtype} ends at {last:.4f} against fp32's {losses32[-1]:.4f} ({gap:+.2%} of the "
            "starting loss)"
        )
    status, fix = "pass", None
    if not learns:
        status = "fail"
        fix = (
            f"the loss did not fall by {MIN_FALL:.0%}: the model is not learning; check "
            f"optim.lr (now {c.optim.lr:g}), that the parameters require gradients, and the "
            "loss function"
        )
    elif differ:
        status = "fail"
        fix = (
            "a saved and reloaded state differs in " + ", ".join(differ[:3])
            + (" ..." if len(differ) > 3 else "") + ": please report it with trainwise env"
        )
    elif gap is not None and abs(gap) > PRECISION_GAP:
        status = "warn"
        fix = f"{dtype} moves the loss by {gap:+.1%}: train in fp32 or keep reduce_dtype fp32"
    return CheckResult(
        name="smoke", title="smoke test: learns, checkpoints, precision",
        status=status, measured="; ".join(parts),
        expected=f"loss falls >= {MIN_FALL:.0%}; identical state after reload",
        detail="the configured model, optimizer and strategy on one repeated batch",
        fix=fix, data=data,
    )
