"""How evenly a step's routing spread the tokens, torch-free: the figures the runtime
measures from its tokens per expert and the planner's `moe.imbalance` stands for (one
definition for both, so a calibration reads a run's figure as the planner means it).

A step's load is its tokens per expert of every MoE layer ([layers][experts]: each token's
top_k copies, over all ranks). Per layer:
- the expert imbalance: the busiest expert's tokens over the mean (1 = even, at most
  E / top_k: each token's copies go to top_k different experts). What the rank imbalance
  tends to as ep grows to the experts.
- the ep imbalance: the busiest expert-parallel rank's routed tokens over the mean, the
  experts split as expert parallelism splits them (E / ep consecutive experts a rank);
  the figure the planner's moe.imbalance is (the slowest rank's expert GEMMs and
  all-to-all wait for it). Computed from the tokens summed over every ep group, so it is
  the imbalance of the average group's ranks.
The step's figure is each one's mean over the layers (the step's expert time is their
sum). Layers that routed nothing (dense layers, or none this step) are left out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class StepLoad:
    """A step's routing load: tokens per expert summed over the MoE layers, and the
    imbalance figures (means over the layers); `ep_imbalance` None at ep 1."""

    tokens: list[int]
    expert_imbalance: float
    ep_imbalance: float | None


def busiest_over_mean(loads: Sequence[float]) -> float:
    """The largest of `loads` over their mean (1.0 when all are equal)."""
    return max(loads) * len(loads) / sum(loads)


def rank_loads(tokens: Sequence[float], ep: int) -> list[float]:
    """The tokens each of `ep` ranks gets when they hold E / ep consecutive experts each."""
    per = len(tokens) // ep
    return [sum(tokens[r * per : (r + 1) * per]) for r in range(ep)]


def step_load(layers: Sequence[Sequence[float]], ep: int) -> StepLoad | None:
    """The load figures of one step's tokens per expert per layer (None when no layer
    routed a token)."""
    routed = [list(layer) for layer in layers if sum(layer) > 0]
    if not routed:
        return None
    experts = len(routed[0])
    tokens = [round(sum(layer[e] for layer in routed)) for e in range(experts)]
    expert = sum(busiest_over_mean(layer) for layer in routed) / len(routed)
    ranks = (
        sum(busiest_over_mean(rank_loads(layer, ep)) for layer in routed) / len(routed)
        if ep > 1 else None
    )
    return StepLoad(tokens, expert, ranks)
