"""The GEMM sweep of a calibration: torch.matmul timed over a small set of shapes on this
device, the achieved FLOP/s of each, as a GemmTable the planner's compute model uses in
place of its per-generation efficiencies (plan.gemm). The benchmark pattern of nanoGPT's
bench.py and ml-engineering's mamf-finder: warm up, then time between synchronisations."""

from __future__ import annotations

import time

import torch

from trainwise.dtypes import TORCH_DTYPES
from trainwise.plan.model.gemm import GemmTable

# Shapes (M, N, K) a transformer's projections take: tokens x width x width, and the wide
# MLP; from 1k to 16k tokens. Tests pass tiny ones.
SHAPES = tuple(
    (m, n, k)
    for m in (1024, 4096, 16384)
    for n, k in ((2048, 2048), (4096, 4096), (14336, 4096), (4096, 14336))
)
WARMUP = 3
ITERATIONS = 10


def measure_gemm_table(
    device: str = "cuda",
    dtype: str = "bf16",
    shapes: tuple[tuple[int, int, int], ...] = SHAPES,
    iterations: int = ITERATIONS,
) -> GemmTable:
    """Time `a @ b` for each (m, n, k) of `shapes` on `device` in `dtype`."""
    rates = tuple(_rate(m, n, k, device, TORCH_DTYPES[dtype], iterations) for m, n, k in shapes)
    name = torch.cuda.get_device_name() if device == "cuda" else device
    return GemmTable(device=name, dtype=dtype, shapes=tuple(shapes), flops_per_s=rates)


def _rate(m: int, n: int, k: int, device: str, dtype: torch.dtype, iterations: int) -> float:
    a = torch.randn(m, k, device=device, dtype=dtype)
    b = torch.randn(k, n, device=device, dtype=dtype)
    for _ in range(WARMUP):
        a @ b
    _sync(device)
    start = time.perf_counter()
    for _ in range(iterations):
        a @ b
    _sync(device)
    seconds = (time.perf_counter() - start) / iterations
    return 2.0 * m * n * k / seconds


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
