"""The compute seconds of one training step on one GPU: the forward, the backward and any
recomputation of the samples a data-parallel rank runs, on one of `tp` tensor-parallel
ranks. The one place the planner turns FLOPs into seconds.

Today: model FLOPs (plan.flops) times the recomputation factor, at the device's peak times
one efficiency (`plan.efficiency`, or a calibrated one), TP's narrower GEMMs at
plan.tensor_parallel.gemm_efficiency.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainwise.plan.flops import model_flops_per_token, recompute_factor
from trainwise.plan.inputs import PlanInputs
from trainwise.plan.memory import Workload
from trainwise.plan.tensor_parallel import gemm_efficiency


@dataclass(frozen=True)
class ComputeTime:
    """`seconds`: one rank's compute for its samples of a step; `one_gpu_tokens_per_s`:
    what one GPU that only computes (no TP, no communication) achieves on this workload,
    the reference of the scaling efficiency."""

    seconds: float
    one_gpu_tokens_per_s: float


def compute_time(inputs: PlanInputs, w: Workload, samples: float, tp: int) -> ComputeTime:
    """Compute of `samples` sequences of workload `w` (at its micro-batch and ac) on one of
    `tp` tensor-parallel ranks."""
    hw = inputs.hardware
    n_layer = w.shape.n_layer if w.shape else 1
    hw_flops = model_flops_per_token(w.params, w.shape, w.seq_len) * recompute_factor(
        w.ac, n_layer
    )
    rate = hw.peak_flops * inputs.efficiency
    seconds = samples * w.seq_len * hw_flops / (rate * tp * gemm_efficiency(tp))
    return ComputeTime(seconds, rate / hw_flops)
