"""AdamW's three step implementations (optim.implementation) side by side on this machine:
the per-tensor loop (torch's default off CUDA, what bench/raw_loop.py runs on a CPU),
the foreach step (torch's CUDA default) and the fused kernel (trainwise's default), over
the parameters of trainwise's models, with gradients set. Prints each one's time a step,
its rate against foreach, and the rate the planner's bytes a parameter predict
(plan.model.compute.ADAMW_STEP: a memory-bound step runs at bytes / bandwidth), so that the
pricing's ratio meets a measured one. Then the fused step as the non-finite guard runs it:
with the host's read of whether the gradient norm is finite before it (`host read`, what
foreach and for-loop still do; on a GPU a wait for the step) and armed to skip itself on
the device instead (`on device`: `found_inf`, run/engine/guard.py, what trainwise runs),
with its cost over the read.

    .venv/bin/python bench/optimizer_step.py                  # tiny and small, 1 thread
    .venv/bin/python bench/optimizer_step.py --models small,gpt2-124m --threads 2
    python bench/optimizer_step.py --device cuda --models small,gpt2-124m,llama-1b  # a GPU

On a GPU the steps of a round are queued without waiting, as a training loop queues them,
and the round's clock stops once the device has finished them: there the guard's host read
is a wait for every step, which the device-side skip removes (what its saving is on that GPU).

Steps alternate between the implementations, round after round, so that the machine's
drift falls on all three alike; the median of the rounds is printed.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from trainwise.config.schema import OptimConfig  # noqa: E402
from trainwise.models import ModelSpec, build_model  # noqa: E402
from trainwise.plan.model.compute import ADAMW_STEP  # noqa: E402
from trainwise.run.engine.guard import skip_if_nonfinite  # noqa: E402
from trainwise.run.engine.optim import build_optimizer  # noqa: E402

KINDS = ("for-loop", "foreach", "fused")
GUARDS = ("host read", "on device")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="tiny,small", help="comma-separated presets")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--rounds", type=int, default=7, help="alternating rounds")
    p.add_argument("--steps", type=int, default=20, help="timed steps a round")
    p.add_argument("--device", default="cpu", help="cpu, or cuda for this machine's GPU")
    return p.parse_args()


def optimizers(preset: str, device: torch.device) -> dict[str, torch.optim.Optimizer]:
    """One copy of the model's parameters on `device`, with gradients, per implementation."""
    out = {}
    for kind in KINDS:
        torch.manual_seed(0)
        model = build_model(ModelSpec(name=preset, vocab_size=256, seq_len=64)).module.to(device)
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        opt = build_optimizer([model], OptimConfig(implementation=kind))
        for _ in range(3):  # the state exists and the kernels are warm
            opt.step()
        out[kind] = opt
    return out


def seconds_a_step(opt: torch.optim.Optimizer, steps: int, guard: str | None = None) -> float:
    """The step's mean time; `guard`: with the non-finite guard's work before it."""
    norm = torch.linalg.vector_norm(
        torch.stack([p.grad.norm() for g in opt.param_groups for p in g["params"]]))
    finish(norm)
    start = time.perf_counter()
    for _ in range(steps):
        if guard == "on device":
            skip_if_nonfinite(opt, norm)
            opt.step()
        elif guard is None or bool(torch.isfinite(norm)):
            opt.step()
    finish(norm)
    return (time.perf_counter() - start) / steps


def finish(tensor: torch.Tensor) -> None:
    """Wait until the device has run what was queued (a no-op on the CPU)."""
    if tensor.device.type == "cuda":
        torch.cuda.synchronize(tensor.device)


def main() -> int:
    args = parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("bench/optimizer_step.py: --device cuda, but this machine has no CUDA device")
        return 2
    torch.set_num_threads(args.threads)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else (
        f"CPU, {args.threads} thread(s)")
    print(f"AdamW step, {where}, median of {args.rounds} alternating rounds "
          f"of {args.steps} steps")
    print(f"{'model':<12}{'params':>11}{'tensors':>9}  " + "".join(f"{k:>11}" for k in KINDS)
          + "   fused / foreach: measured, by bytes")
    guarded: dict[str, dict[str, float]] = {}
    for preset in [m.strip() for m in args.models.split(",") if m.strip()]:
        opts = optimizers(preset, device)
        times: dict[str, list[float]] = {k: [] for k in (*KINDS, *GUARDS)}
        for _ in range(args.rounds):
            for kind in KINDS:
                times[kind].append(seconds_a_step(opts[kind], args.steps))
            for guard in GUARDS:
                times[guard].append(seconds_a_step(opts["fused"], args.steps, guard))
            opts["fused"].__dict__.pop("found_inf", None)  # the plain fused step's rounds
        median = {k: statistics.median(v) for k, v in times.items()}
        params = [p for g in opts["fused"].param_groups for p in g["params"]]
        count = sum(p.numel() for p in params)
        measured = median["foreach"] / median["fused"]
        by_bytes = ADAMW_STEP["foreach"].bytes_per_param / ADAMW_STEP["fused"].bytes_per_param
        cells = "".join(f"{median[k] * 1e3:>9.3f}ms" for k in KINDS)
        print(f"{preset:<12}{count:>11,}{len(params):>9}  {cells}   "
              f"{measured:.2f}x, {by_bytes:.2f}x")
        guarded[preset] = median
    print("\nThe fused step with the non-finite guard: " + ", ".join(GUARDS))
    for preset, median in guarded.items():
        host, device = (median[g] for g in GUARDS)
        print(f"{preset:<12}{host * 1e3:>9.3f}ms{device * 1e3:>9.3f}ms   on device - host read: "
              f"{(device - host) * 1e6:+.0f} us a step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
