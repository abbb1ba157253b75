"""What the plan says beside its answer: the best few alternatives with the reason each
loses, and, when nothing fits, the smallest changes that would make something fit."""

from __future__ import annotations

from dataclasses import replace

from trainwise.errors import ConfigError
from trainwise.hardware.catalog import default_catalog
from trainwise.plan.constraints import relaxed
from trainwise.plan.estimate import SIMPLER_WITHIN, StrategyPlan
from trainwise.plan.inputs import PlanInputs
from trainwise.plan.search import Allowed, Choice, Goal, describe_setup, recommend, score
from trainwise.plan.units import fmt_bytes, fmt_hours, fmt_usd

ALTERNATIVES = 4  # rows in the alternatives table
MORE_GPUS = (2, 4, 8, 16, 32, 64)  # multiples of the GPUs tried when nothing fits


def distinct(choice: Choice, count: int = ALTERNATIVES) -> list[StrategyPlan]:
    """The best alternatives with a layout family (plan name) or checkpointing mode of
    their own: variants of the winner that differ only in a shard group are noise."""
    seen = {(choice.plan.name, choice.ac)}
    out = []
    for other in choice.alternatives:
        key = (other.name, other.setup.ac if other.setup else "")
        if key not in seen:
            seen.add(key)
            out.append(other)
        if len(out) == count:
            break
    return out


def why_it_loses(other: StrategyPlan, best: StrategyPlan, goal: Goal) -> str:
    """One phrase: by how much `other` is dearer or slower, or that it is within
    SIMPLER_WITHIN and the simpler configuration wins; its memory margin."""
    margin = 1 - other.memory.total / other.budget_bytes
    room = f"{margin:.0%} memory margin"
    time_first = goal.objective == "time" or goal.budget_usd is not None
    if time_first:
        diff = other.hours_to_train - best.hours_to_train
        if diff >= 0:
            return f"takes {fmt_hours(diff)} longer ({fmt_hours(other.hours_to_train)}); {room}"
        if score(other, goal) >= score(best, goal) / (1 + SIMPLER_WITHIN):
            return f"{fmt_hours(-diff)} faster, within 1 %: the simpler one wins; {room}"
        return f"{fmt_hours(-diff)} faster but over the budget; {room}"
    diff = other.cost.total_usd - best.cost.total_usd
    if diff >= 0:
        return f"costs {fmt_usd(diff)} more ({fmt_usd(other.cost.total_usd)}); {room}"
    if score(other, goal) >= score(best, goal) / (1 + SIMPLER_WITHIN):
        return f"costs {fmt_usd(-diff)} less, within 1 %: the simpler one wins; {room}"
    return f"costs {fmt_usd(-diff)} less but misses the deadline; {room}"


def nearest_relaxed(inputs: PlanInputs, allowed: Allowed, goal: Goal) -> str | None:
    """When nothing fits under the user's settings: the best configuration (by the goal)
    that fits with one of them searched again, and which one; all of them, when no single
    one is enough. None when no setting was given or nothing fits even then."""
    found = []
    for fields, words in allowed.given:
        choice = _fitting(inputs, relaxed(allowed, fields), goal)
        if choice is not None:
            found.append((score(choice.plan, goal), words, choice))
    if found:
        _, words, choice = min(found, key=lambda t: t[0])
        return f"The nearest configuration that fits relaxes {words}: {_figures(choice)}."
    if len(allowed.given) < 2:
        return None
    free = allowed
    for fields, _ in allowed.given:
        free = relaxed(free, fields)
    choice = _fitting(inputs, free, goal)
    if choice is None:
        return None
    every = "; ".join(words for _, words in allowed.given)
    return f"Relaxing all of {every}, this fits: {_figures(choice)}."


def _fitting(inputs: PlanInputs, allowed: Allowed, goal: Goal) -> Choice | None:
    try:
        choice = recommend(inputs, allowed, goal)
    except ConfigError:  # a limit (deadline, budget) or a batch no layout runs
        return None
    return choice if choice.fits else None


def smallest_changes(inputs: PlanInputs, allowed: Allowed, goal: Goal) -> list[str]:
    """When nothing fits: the configuration that fits if one of the user's settings is
    relaxed, the fewest GPUs (a multiple of today's) at which something does, and the
    cheapest larger GPU of the catalog on which it does at today's count, each with its
    numbers; the knobs the search was not allowed to turn."""
    nearest = nearest_relaxed(inputs, allowed, goal)
    out = [nearest] if nearest else []
    for factor in MORE_GPUS:
        # (None: the settings given run no layout of that many, e.g. a fixed global batch)
        more = _fitting(inputs.with_gpus(inputs.gpus * factor), allowed, goal)
        if more is not None:
            out.append(f"With {inputs.gpus * factor} GPUs it fits: {_figures(more)}.")
            break
    larger = []
    hw = inputs.hardware
    for spec in default_catalog().gpus.values():
        peak = spec.peak(inputs.workload.precision)
        if spec.memory_bytes <= hw.memory_bytes or peak is None:
            continue
        bigger = replace(
            hw,
            gpu=spec.name,
            memory_bytes=spec.memory_bytes,
            peak_flops=peak,
            intra_bps=spec.intra_node.bytes_per_s if spec.intra_node else hw.intra_bps,
            price_per_gpu_hour=spec.price_per_hour,
        )
        found = _fitting(replace(inputs, hardware=bigger), allowed, goal)
        if found is not None:
            larger.append((found.plan.cost.total_usd, spec.name, found))
    if larger:
        _, name, found = min(larger, key=lambda t: t[0])
        out.append(f"On {inputs.gpus} x {name} it fits: {_figures(found)}.")
    if not allowed.knobs:
        out.append(
            "The job's own knobs were kept: full activation checkpointing (parallel.ac = "
            "'full'), a smaller data.micro_batch with more data.grad_accum, or cpu offload "
            "need less memory."
        )
    return out


def _figures(choice: Choice) -> str:
    p = choice.plan
    return (
        f"{describe_setup(choice.setup)} needs {fmt_bytes(p.memory.total)} per GPU, "
        f"{fmt_hours(p.hours_to_train)}, {fmt_usd(p.cost.total_usd)}"
    )
