"""How often to checkpoint, and what failures cost: the one home of the interval formula.

Both the planner (``trainwise plan``) and the runtime (choosing ``every_steps`` when the
config says "auto") call these functions, so the two never disagree.

Model (first order, as in the sources below): failures arrive as a Poisson process with mean
time between failures M; writing a checkpoint stalls the loop for δ seconds; after a failure
the job restarts (R seconds) and redoes the work since the last checkpoint.

- Young, J. W. (1974). "A first order approximation to the optimum checkpoint interval."
  Communications of the ACM 17(9): 530-531. τ = sqrt(2δM).
- Daly, J. T. (2006). "A higher order estimate of the optimum checkpoint interval for
  restart dumps." Future Generation Computer Systems 22(3): 303-312. Its first-order
  form: τ = sqrt(2δM) − δ for δ < M/2, else τ = M.

Node failures are taken as independent with the same rate, so a job on n nodes fails n
times as often as one node: M_sys = M_node / n (exponential lifetimes in series: the
failure rates add).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

SECONDS_PER_HOUR = 3600.0
SECONDS_PER_DAY = 86400.0


def _positive(name: str, value: float) -> float:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")
    return float(value)


def _non_negative(name: str, value: float) -> float:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    return float(value)


def _nodes(nodes: int) -> int:
    if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
        raise ValueError(f"nodes must be an integer >= 1, got {nodes!r}")
    return nodes


def system_mtbf_s(mtbf_hours_per_node: float, nodes: int) -> float:
    """Mean time between failures of the whole job, in seconds.

    With independent, identically failing nodes the job fails whenever any node does, so the
    failure rates add: M_sys = M_node / nodes. ``mtbf_hours_per_node`` is one node's MTBF in
    hours.
    """
    m = _positive("mtbf_hours_per_node", mtbf_hours_per_node)
    return m * SECONDS_PER_HOUR / _nodes(nodes)


def optimal_interval_s(save_s: float, mtbf_s: float) -> float:
    """Compute time between checkpoints (seconds) that minimises the expected waste.

    Daly 2006, first-order form: τ = sqrt(2δM) − δ when δ < M/2, else τ = M, where δ =
    ``save_s`` (the time the loop stalls to save) and M = ``mtbf_s`` (the system MTBF).
    Young 1974's τ = sqrt(2δM) is the same estimate without the −δ correction (it measures
    the period from the start of one save to the next rather than the compute between saves).
    """
    delta = _positive("save_s", save_s)
    m = _positive("mtbf_s", mtbf_s)
    if delta >= m / 2:
        return m
    return math.sqrt(2.0 * delta * m) - delta


def expected_waste_fraction(
    interval_s: float, save_s: float, mtbf_s: float, restart_s: float = 0.0
) -> float:
    """First-order expected share of wall time lost to checkpointing and failures, in [0, 1].

    With period T = τ + δ (compute ``interval_s`` plus the save stall ``save_s``):
    δ/T (the saves) + T/(2M) (on average half a period is redone per failure, one failure per
    M seconds) + R/M (a restart per failure). This is the cost function whose minimum over T
    gives T = sqrt(2δM), i.e. Young's interval and Daly's first-order τ = sqrt(2δM) − δ.
    It is a first-order estimate; it can exceed 1 when failures are as frequent as saves, so
    it is clamped to [0, 1].
    """
    tau = _positive("interval_s", interval_s)
    delta = _positive("save_s", save_s)
    m = _positive("mtbf_s", mtbf_s)
    r = _non_negative("restart_s", restart_s)
    period = tau + delta
    waste = delta / period + period / (2.0 * m) + r / m
    return min(1.0, max(0.0, waste))


def interval_steps(
    save_s: float,
    step_s: float,
    mtbf_hours_per_node: float,
    nodes: int,
    max_steps: int | None = None,
) -> int:
    """Optimal checkpoint interval in training steps: ``optimal_interval_s`` / ``step_s``,
    rounded to the nearest step, at least 1, at most ``max_steps`` when given (e.g. the
    run's total steps, so a short run still saves at its end)."""
    step = _positive("step_s", step_s)
    if max_steps is not None and (
        isinstance(max_steps, bool) or not isinstance(max_steps, int) or max_steps < 1
    ):
        raise ValueError(f"max_steps must be an integer >= 1 or None, got {max_steps!r}")
    tau = optimal_interval_s(save_s, system_mtbf_s(mtbf_hours_per_node, nodes))
    steps = max(1, round(tau / step))
    if max_steps is not None:
        steps = min(steps, max_steps)
    return steps


@dataclass(frozen=True)
class FailureCost:
    """What failures are expected to cost a job checkpointing every ``interval_s``.

    interval_s: compute seconds between checkpoints.
    expected_loss_per_failure_s: wall seconds one failure costs on average: the restart plus
        half an interval of recomputation.
    failures_per_day: expected failures per 24 h of wall time (86400 / M_sys).
    waste_fraction: expected share of wall time lost to saves, recomputation and restarts
        (``expected_waste_fraction``).
    """

    interval_s: float
    expected_loss_per_failure_s: float
    failures_per_day: float
    waste_fraction: float


def failure_cost(
    save_s: float,
    restart_s: float,
    mtbf_hours_per_node: float,
    nodes: int,
    interval_s: float | None = None,
) -> FailureCost:
    """Expected cost of failures for a job on ``nodes`` nodes that saves in ``save_s`` and
    restarts in ``restart_s``. ``interval_s`` defaults to the optimum (``optimal_interval_s``).
    A failure lands uniformly within an interval, so on average half an interval of work is
    redone (Young 1974; Daly 2006): loss per failure = restart_s + interval_s / 2."""
    delta = _positive("save_s", save_s)
    r = _non_negative("restart_s", restart_s)
    m = system_mtbf_s(mtbf_hours_per_node, nodes)
    tau = (
        optimal_interval_s(delta, m) if interval_s is None else _positive("interval_s", interval_s)
    )
    return FailureCost(
        interval_s=tau,
        expected_loss_per_failure_s=r + tau / 2.0,
        failures_per_day=SECONDS_PER_DAY / m,
        waste_fraction=expected_waste_fraction(tau, delta, m, r),
    )
