"""What a job costs: the product's formula, each term shown.

    total = GPU-hours of work x price
          + communication wait (GPU-hours spent on exposed communication x price)
          + failure retry (checkpoint stalls, restarts and recomputed work, x price)

Failures: the job's MTBF is one node's divided by the nodes (plan.reliability); each
failure costs the restart plus, on average, half a checkpoint interval of recomputation
(Young 1974; Daly 2006); the interval is the Young/Daly optimum from the save time, the
same function the runtime uses for `checkpoint.interval = "auto"`.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainwise.plan.model.reliability import SECONDS_PER_HOUR, failure_cost, system_mtbf_s


@dataclass(frozen=True)
class CheckpointPlan:
    size_bytes: float  # model and optimizer state, all ranks together
    save_s: float  # the stall of one save
    interval_min: float  # compute minutes between saves (Young/Daly)
    expected_failures: float  # over the whole job
    loss_per_failure_s: float  # restart + half an interval


@dataclass(frozen=True)
class Cost:
    gpu_hours: float
    compute_usd: float
    comm_wait_usd: float
    failure_retry_usd: float
    total_usd: float
    wall_hours: float


def checkpoint_plan(
    size_bytes: float,
    write_bps_per_node: float,
    nodes: int,
    train_s: float,
    mtbf_hours_per_node: float,
    restart_s: float,
    latency_s: float = 0.0,
) -> CheckpointPlan:
    """Every node writes its ranks' shards in parallel (DCP), so a save takes the state
    over the nodes' summed bandwidth, after a fixed `latency_s` (planning, metadata, the
    commit's renames and syncs: what a tiny checkpoint costs)."""
    save_s = latency_s + size_bytes / (write_bps_per_node * nodes)
    mtbf_s = system_mtbf_s(mtbf_hours_per_node, nodes)
    failure = failure_cost(save_s, restart_s, mtbf_hours_per_node, nodes)
    tau = failure.interval_s
    saves = train_s / tau
    # Failures arrive over the whole wall time, which the saves lengthen; the retry time
    # itself is second order and left out (first-order model, as Young's).
    failures = (train_s + saves * save_s) / mtbf_s
    return CheckpointPlan(
        size_bytes, save_s, tau / 60.0, failures, failure.expected_loss_per_failure_s
    )


def job_cost(
    gpus: int,
    price_per_gpu_hour: float,
    train_s: float,
    exposed_comm_share: float,
    ckpt: CheckpointPlan,
) -> Cost:
    """`train_s`: wall seconds of training steps alone; `exposed_comm_share`: the share of a
    step spent waiting for communication."""
    saves_s = train_s / (ckpt.interval_min * 60.0) * ckpt.save_s
    retry_s = saves_s + ckpt.expected_failures * ckpt.loss_per_failure_s
    to_gpu_hours = gpus / SECONDS_PER_HOUR
    comm_h = train_s * exposed_comm_share * to_gpu_hours
    work_h = train_s * to_gpu_hours - comm_h
    retry_h = retry_s * to_gpu_hours
    price = price_per_gpu_hour
    total_h = work_h + comm_h + retry_h
    return Cost(
        gpu_hours=total_h,
        compute_usd=work_h * price,
        comm_wait_usd=comm_h * price,
        failure_retry_usd=retry_h * price,
        total_usd=total_h * price,
        wall_hours=(train_s + retry_s) / SECONDS_PER_HOUR,
    )


@dataclass(frozen=True)
class CostTerm:
    name: str
    gpu_hours: float
    usd: float


def run_cost(
    price_per_gpu_hour: float,
    step_gpu_s: float,
    exposed_comm_gpu_s: float,
    checkpoint_stall_gpu_s: float,
    retry_gpu_s: float,
) -> list[CostTerm]:
    """The formula above with a finished run's measured terms (the report), in GPU-seconds
    (each step's seconds times the workers it ran on): `step_gpu_s` for the steps (each
    once), of which `exposed_comm_gpu_s` waited for communication and
    `checkpoint_stall_gpu_s` for saves; `retry_gpu_s`, the restart downtime and recomputed
    work of failures (run.events.retry_cost). The terms add up to the run's GPU-hours. The
    plan counts checkpoint stalls under failure retry; measured, they are a term of their own."""
    seconds = (
        ("compute", step_gpu_s - exposed_comm_gpu_s - checkpoint_stall_gpu_s),
        ("communication wait", exposed_comm_gpu_s),
        ("checkpoint stall", checkpoint_stall_gpu_s),
        ("failure retry", retry_gpu_s),
    )
    hours = [(name, max(s, 0.0) / SECONDS_PER_HOUR) for name, s in seconds]
    return [CostTerm(name, h, h * price_per_gpu_hour) for name, h in hours]
