"""What an experiment tracker costs the training loop's thread: one process trains the
tiny GPT (fp32, one thread, fused AdamW) and hands every 10 steps' records to trainwise's
metrics writer thread, as rank 0 does, with

- `none`: metrics.jsonl only;
- `tensorboard`: trainwise's TensorBoard tracker (a point every 10 steps, its scalars in
  one event);
- `add_scalar`: the same points written one event per scalar with SummaryWriter.add_scalar
  (as Lightning's TensorBoardLogger writes its metrics).

The writer thread has a core of its own here (the loop uses one of two), so what this
measures is the GIL: the tracker's Python work holds it while the loop's thread, back from
each operation (torch runs operations without it), waits to take it again. Alternating
rounds; per variant the mean step, the mean excess of the step after a hand-off over the
others, and the mean step over `none`'s.

    .venv/bin/python bench/tracker_cost.py [--rounds 5] [--steps 300]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from trainwise.models import ModelSpec, build_model
from trainwise.records import StepRecord
from trainwise.run.observe.telemetry import MetricsWriter
from trainwise.run.observe.trackers import TensorBoard, Trackers

VARIANTS = ("none", "tensorboard", "add_scalar")
FLUSH_EVERY = 10  # logging.flush_every's and logging.tensorboard_every's defaults
WARMUP = 20
SEQ, VOCAB, MICRO = 64, 256, 16


class PerScalar(TensorBoard):
    """The same TensorBoard points, written one event per scalar."""

    def _write(self, points: dict[str, float], step: int) -> None:
        for tag, value in points.items():
            self.writer.add_scalar(tag, value, step)


def step_record(step: int, loss: float, elapsed: float) -> StepRecord:
    return StepRecord(
        step=step, loss=loss, eval_loss=None, lr=1e-3, grad_norm=0.5, step_s=0.025,
        data_s=0.0003, compute_s=0.022, sync_s=0.001, optim_s=0.001, ckpt_s=0.0,
        tokens=step * SEQ * MICRO, tokens_per_s=40000.0, samples_per_s=625.0, mfu=None,
        mem_bytes=1 << 26, mem_kind="rss_added", elapsed_s=elapsed, time=time.time(), attempt=0,
    )


def writer_for(variant: str, run_dir: Path) -> MetricsWriter:
    made = {"tensorboard": TensorBoard, "add_scalar": PerScalar}
    trackers = None if variant == "none" else Trackers(
        run_dir, [made[variant](run_dir, FLUSH_EVERY)])
    return MetricsWriter(run_dir, trackers)


def run(variant: str, steps: int) -> list[float]:
    """The loop's step times in seconds, the warm-up left out."""
    torch.manual_seed(0)
    model = build_model(ModelSpec(name="tiny", vocab_size=VOCAB, seq_len=SEQ)).module
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    x = torch.randint(0, VOCAB, (MICRO, SEQ))
    y = torch.randint(0, VOCAB, (MICRO, SEQ))
    with tempfile.TemporaryDirectory() as tmp:
        writer = writer_for(variant, Path(tmp))
        writer.write()  # the trackers open (an import) on the writer thread before the loop
        writer.sync()
        pending, times, start = [], [], time.perf_counter()
        for step in range(1, steps + 1):
            t0 = time.perf_counter()
            logits = model(x)
            loss = torch.nn.functional.cross_entropy(logits.view(-1, VOCAB), y.view(-1))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - t0)
            pending.append(step_record(step, float(loss), time.perf_counter() - start))
            if step % FLUSH_EVERY == 0:
                writer.write(*pending)
                pending = []
        writer.close()
        if writer.trackers is not None:
            writer.trackers.close(finished=True)
    return times[WARMUP:]


def summarize(times: list[list[float]]) -> tuple[float, float]:
    """(mean step ms, mean excess ms of the step after a hand-off over the others)."""
    after, others = [], []
    for run_times in times:
        for i, t in enumerate(run_times):
            # Index 0 is step WARMUP + 1, the step after the hand-off at step WARMUP.
            (after if i % FLUSH_EVERY == 0 else others).append(t)
    mean = statistics.mean(t for run_times in times for t in run_times)
    return 1000 * mean, 1000 * (statistics.mean(after) - statistics.mean(others))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=300)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    results: dict[str, list[list[float]]] = {v: [] for v in VARIANTS}
    for rnd in range(args.rounds):
        for variant in VARIANTS if rnd % 2 == 0 else VARIANTS[::-1]:
            results[variant].append(run(variant, args.steps))
            mean, excess = summarize(results[variant][-1:])
            print(f"round {rnd + 1} {variant:12s} {mean:6.2f} ms a step, "
                  f"the step after a hand-off {excess:+.2f} ms", flush=True)
    base, _ = summarize(results["none"])
    print(f"\n{'variant':12s} {'ms a step':>10s} {'after a hand-off':>17s} {'/ none':>7s}")
    for variant in VARIANTS:
        mean, excess = summarize(results[variant])
        print(f"{variant:12s} {mean:10.2f} {excess:+16.2f} {mean / base:7.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
