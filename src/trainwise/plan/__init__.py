"""The planner: pure functions from a workload to memory, time and cost estimates."""

from trainwise.plan.advisor import Decision, choose_strategy, describe, fmt_bytes
from trainwise.plan.flops import flops_per_token, matmul_params, mfu
from trainwise.plan.memory import MemoryEstimate, Workload, activation_bytes, estimate_memory
from trainwise.plan.precision import BYTES, OPTIMIZER_STATE_BYTES

__all__ = [
    "BYTES",
    "OPTIMIZER_STATE_BYTES",
    "Decision",
    "MemoryEstimate",
    "Workload",
    "activation_bytes",
    "choose_strategy",
    "describe",
    "estimate_memory",
    "flops_per_token",
    "fmt_bytes",
    "matmul_params",
    "mfu",
]
