"""The planner: pure functions from a workload to memory, time, cost and reliability
estimates (no torch)."""

from trainwise.plan.advisor import (
    Decision,
    choose_accumulation,
    decide_auto,
    describe,
    fmt_bytes,
    runtime_allowed,
)
from trainwise.plan.model.flops import flops_per_token, matmul_params, mfu
from trainwise.plan.model.memory import MemoryEstimate, Workload, activation_bytes, estimate_memory
from trainwise.plan.model.precision import BYTES, OPTIMIZER_STATE_BYTES
from trainwise.plan.model.reliability import (
    FailureCost,
    expected_waste_fraction,
    failure_cost,
    interval_steps,
    optimal_interval_s,
    system_mtbf_s,
)

__all__ = [
    "BYTES",
    "OPTIMIZER_STATE_BYTES",
    "Decision",
    "FailureCost",
    "MemoryEstimate",
    "Workload",
    "activation_bytes",
    "choose_accumulation",
    "decide_auto",
    "describe",
    "estimate_memory",
    "expected_waste_fraction",
    "failure_cost",
    "flops_per_token",
    "fmt_bytes",
    "interval_steps",
    "matmul_params",
    "mfu",
    "optimal_interval_s",
    "runtime_allowed",
    "system_mtbf_s",
]
