"""The planner's decision: search the space (plan.space) for the configuration to run,
price each candidate with the same models (plan.estimate.price), keep those that fit, and
rank them. The one chooser: `trainwise plan` prints it and the runtime's `auto` runs it
(narrowed to the job's own choices: plan.advisor.runtime_allowed). A layout's knobs and
which of them are priced: plan.knobs; the pipeline layouts' candidates: plan.pipeline_search.

Ranking: the objective (cost or time); with a deadline the cheapest that finishes in time;
with a budget the fastest within it. Within SIMPLER_WITHIN of the best, the simplest wins
(no tensor parallelism, no offload, the simpler data-parallel layout, less recomputation,
fewer micro-batches): fewer moving parts to debug for a difference the models cannot
resolve.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from trainwise.config.parallel_dims import ParallelDims
from trainwise.errors import ConfigError
from trainwise.plan.estimate import (
    SIMPLER_WITHIN,
    SIMPLICITY,
    Setup,
    StrategyPlan,
    job_figures,
    layout_name,
    price,
    step_floor,
)
from trainwise.plan.inputs import PlanInputs
from trainwise.plan.knobs import Candidate, knob_memory, layout_candidates, layout_knobs
from trainwise.plan.model.cost import Cost
from trainwise.plan.pipeline_search import FLOOR_SLACK, pipeline_plans
from trainwise.plan.pipeline_search import least_memory as staged_least_memory
from trainwise.plan.space import (
    AC_MODES,
    EVERYTHING,
    SCHEDULE_ORDER,
    Allowed,
    exact,
    exact_batch,
    layouts,
    replica_batch,
)
from trainwise.plan.units import fmt_bytes, fmt_hours, fmt_usd

__all__ = ["EVERYTHING", "Allowed", "Choice", "Goal", "best_only", "recommend"]


@dataclass(frozen=True)
class Goal:
    """What "best" means: `objective` cost or time; a deadline (hours: the cheapest that
    finishes in time) or a budget (USD: the fastest within it) when given."""

    objective: str = "cost"
    deadline_hours: float | None = None
    budget_usd: float | None = None


@dataclass(frozen=True)
class Choice:
    """The configuration to run, its priced plan, whether it fits, and why it was chosen;
    `alternatives`: the others that fit and meet the goal, best first."""

    plan: StrategyPlan
    fits: bool
    why: str  # the reason, without the configuration
    alternatives: list[StrategyPlan] = field(default_factory=list)
    batch_note: str = ""  # the global batch changed to one a job runs (space.exact_batch)

    @property
    def reason(self) -> str:
        """One line: the configuration and why (the runtime's summary says it)."""
        return f"{describe_setup(self.setup)}: {self.why}"

    @property
    def setup(self) -> Setup:
        assert self.plan.setup is not None
        return self.plan.setup

    @property
    def dims(self):
        return self.setup.dims

    @property
    def ac(self) -> str:
        return self.setup.ac

    @property
    def micro_batch(self) -> int:
        return self.setup.micro_batch

    @property
    def grad_accum(self) -> int:
        return self.setup.grad_accum

    @property
    def accumulate(self) -> str:
        return self.setup.accumulate

    def config_keys(self) -> dict[str, object]:
        return setup_keys(self.setup)


def setup_keys(setup: Setup) -> dict[str, object]:
    """The job-file keys that run `setup` (dotted, as `--set` and the TOML write them)."""
    dims = setup.dims
    keys = dict(dims.config_keys())
    if dims.tp > 1:
        keys["parallel.tp"] = dims.tp
    if dims.pp > 1:
        keys["parallel.pp_schedule"] = setup.schedule
        keys["parallel.pp_virtual"] = setup.virtual
        keys["parallel.pp_microbatches"] = setup.grad_accum
    keys["parallel.ac"] = setup.ac
    if dims.fsdp and setup.grad_accum > 1:
        keys["parallel.accumulate"] = setup.accumulate
    keys["data.micro_batch"] = setup.micro_batch
    keys["data.grad_accum"] = setup.grad_accum
    return keys


def describe_setup(setup: Setup) -> str:
    """`dp_replicate 8 x dp_shard 16 x tp 8 (fsdp-full), ac full, micro-batch 1 x 8`."""
    dims = setup.dims
    extras = [f"ac {setup.ac}", f"micro-batch {setup.micro_batch} x {setup.grad_accum}"]
    if dims.pp > 1:
        virtual = f" x {setup.virtual} virtual" if setup.virtual > 1 else ""
        extras.insert(0, f"{setup.schedule}{virtual}")
    if dims.fsdp and setup.grad_accum > 1 and dims.pp == 1:
        extras.append(f"{setup.accumulate} accumulation")
    return f"{dims.describe()} ({layout_name(dims)}), " + ", ".join(extras)


def simplicity(s: StrategyPlan) -> tuple:
    """Sort key: simplest first (see the module's docstring)."""
    assert s.setup is not None
    return setup_simplicity(s.setup)


def setup_simplicity(setup: Setup) -> tuple:
    dims = setup.dims
    return (
        dims.pp,
        SCHEDULE_ORDER.index(setup.schedule),
        setup.virtual,
        dims.tp,
        dims.ep,
        dims.cpu_offload,
        SIMPLICITY.index(dims.plan_name),
        AC_MODES.index(setup.ac),
        setup.accumulate == "sharded",
        setup.grad_accum,
        -dims.dp_shard,
    )


def candidates(
    inputs: PlanInputs, allowed: Allowed
) -> tuple[list[Candidate], list[ParallelDims]]:
    """layout_candidates over every layout without pipeline stages that runs the global
    batch exactly, and every layout that does (none: no layout runs it with the user's
    settings): the pipeline ones' candidates are plan.pipeline_search's."""
    fitting: list[Candidate] = []
    searched: list[ParallelDims] = []
    for dims in layouts(inputs, allowed):
        knobs = layout_knobs(inputs, dims, allowed) if exact(inputs, dims, allowed) else []
        if knobs:
            if dims.pp == 1:
                fitting += layout_candidates(inputs, dims, knobs)
            searched.append(dims)
    return fitting, searched


def search(
    inputs: PlanInputs, allowed: Allowed = EVERYTHING, goal: Goal | None = None
) -> tuple[list[StrategyPlan], list[ParallelDims]]:
    """(the fitting candidates priced: every one without pipeline stages, and those with
    stages that could be chosen by `goal` (default: the inputs' objective;
    plan.pipeline_search); the layouts searched: those that run the global batch
    exactly)."""
    goal = goal or Goal(inputs.objective)
    device_fits, searched = candidates(inputs, allowed)
    priced = (price(inputs, setup, memory=mem) for setup, mem in device_fits)
    fitting = [plan for plan in priced if plan.fits]  # fits: the host's memory too
    return fitting + staged(inputs, searched, allowed, goal, fitting), searched


def staged(
    inputs: PlanInputs, searched: list[ParallelDims], allowed: Allowed, goal: Goal,
    flat: list[StrategyPlan],
) -> list[StrategyPlan]:
    """The fitting plans of the pipeline layouts among `searched` that could be chosen
    beside the plans without stages `flat` (pipeline_search.pipeline_plans)."""
    stages = [dims for dims in searched if dims.pp > 1]
    if not stages:
        return []
    best = min((score(s, goal) for s in flat if meets(s, goal)), default=math.inf)
    return pipeline_plans(
        inputs, stages, allowed, lambda cost: cost_score(cost, goal),
        lambda s: meets(s, goal), best,
    )


def least_memory(
    inputs: PlanInputs, searched: list[ParallelDims], allowed: Allowed
) -> StrategyPlan:
    """The setting of the `searched` layouts that needs the least device memory (the
    simplest of equals), priced: what a plan shows when nothing fits (of the pipeline
    layouts, those pipeline_search.least_memory cannot rule out)."""
    every = [
        (setup, knob_memory(inputs, setup))
        for dims in searched if dims.pp == 1
        for knob in layout_knobs(inputs, dims, allowed)
        for setup in (knob.setup(dims, m, replica_batch(inputs, dims)) for m in knob.micros)
    ]
    stages = [dims for dims in searched if dims.pp > 1]
    flat = min((memory.total for _, memory in every), default=math.inf)
    every += staged_least_memory(inputs, stages, allowed, flat)
    least, _ = min(every, key=lambda c: (c[1].total, setup_simplicity(c[0])))
    return price(inputs, least)


def meets(s: StrategyPlan, goal: Goal) -> bool:
    """Whether `s` meets the goal's limits, its deadline and its budget when given (rank's
    pool)."""
    if goal.deadline_hours is not None and s.cost.wall_hours > goal.deadline_hours:
        return False
    return goal.budget_usd is None or s.cost.total_usd <= goal.budget_usd


def score(s: StrategyPlan, goal: Goal) -> float:
    return cost_score(s.cost, goal)


def cost_score(cost: Cost, goal: Goal) -> float:
    if goal.budget_usd is not None or goal.objective == "time":
        return cost.wall_hours
    return cost.total_usd


def rank(fitting: list[StrategyPlan], goal: Goal) -> list[StrategyPlan]:
    """Those that meet the goal's limit, best first; the simplest within SIMPLER_WITHIN of
    the best leads. ConfigError (one line, by how much) when a limit is met by none."""
    pool = fitting
    if goal.deadline_hours is not None:
        pool = [s for s in fitting if s.cost.wall_hours <= goal.deadline_hours]
        if fitting and not pool:
            fastest = min(fitting, key=lambda s: s.cost.wall_hours)
            raise ConfigError(
                f"--deadline {fmt_hours(goal.deadline_hours)}: nothing that fits finishes in "
                f"time; the fastest takes {fmt_hours(fastest.hours_to_train)} "
                f"({fmt_hours(fastest.hours_to_train - goal.deadline_hours)} over): give "
                "more time or more GPUs (--gpus)"
            )
    if goal.budget_usd is not None:
        pool = [s for s in pool if s.cost.total_usd <= goal.budget_usd]
        if fitting and not pool:
            cheapest = min(fitting, key=lambda s: s.cost.total_usd)
            raise ConfigError(
                f"--budget {fmt_usd(goal.budget_usd)}: nothing that fits costs that little; "
                f"the cheapest costs {fmt_usd(cheapest.cost.total_usd)} "
                f"({fmt_usd(cheapest.cost.total_usd - goal.budget_usd)} over): raise it"
            )
    ordered = sorted(pool, key=lambda s: (score(s, goal), simplicity(s)))
    if not ordered:
        return []
    best = score(ordered[0], goal)
    close = [s for s in ordered if score(s, goal) <= best * (1 + SIMPLER_WITHIN)]
    lead = min(close, key=simplicity)
    return [lead] + [s for s in ordered if s is not lead]


def limit_counts(gpus: int) -> list[int]:
    """The GPU counts a deadline or a budget weighs: the count given and its halvings. At
    one count, time and cost rise together; fewer GPUs are cheaper (less communication)
    and slower, which is the trade-off a limit settles."""
    counts = [gpus]
    while counts[-1] % 2 == 0:
        counts.append(counts[-1] // 2)
    return counts


def recommend(
    inputs: PlanInputs, allowed: Allowed = EVERYTHING, goal: Goal | None = None
) -> Choice:
    """The configuration to run `inputs` with: the best that fits by `goal` (default: the
    inputs' objective); when nothing fits, the one that needs the least device memory.
    With a deadline or a budget, on inputs.gpus or fewer (limit_counts)."""
    goal = goal or Goal(inputs.objective)
    inputs, note = exact_batch(inputs, allowed)
    fitting, searched = search(inputs, allowed, goal)
    if not searched:
        raise ConfigError(_unmeetable(inputs, allowed))
    if goal.deadline_hours is not None or goal.budget_usd is not None:
        for n in limit_counts(inputs.gpus)[1:]:
            fitting += search(inputs.with_gpus(n), allowed, goal)[0]
    ordered = rank(fitting, goal)
    if not ordered:
        least = least_memory(inputs, searched, allowed)
        return Choice(least, False, _reason_unfit(inputs, least), batch_note=note)
    best = ordered[0]
    return Choice(best, True, _reason(best, ordered, goal), ordered[1:], note)


def best_only(inputs: PlanInputs, allowed: Allowed = EVERYTHING, goal: Goal | None = None) -> Choice:
    """recommend's configuration, without its alternatives (the sweep's curve asks only
    for the best): the same answer, for a fraction of the pricing (contenders). Its `why`
    says only what it is; with a deadline or a budget, recommend itself."""
    goal = goal or Goal(inputs.objective)
    if goal.deadline_hours is not None or goal.budget_usd is not None:
        return recommend(inputs, allowed, goal)
    inputs, note = exact_batch(inputs, allowed)
    device_fits, searched = candidates(inputs, allowed)
    if not searched:
        raise ConfigError(_unmeetable(inputs, allowed))
    flat = contenders(inputs, device_fits, goal)
    ordered = rank(flat + staged(inputs, searched, allowed, goal, flat), goal)
    if not ordered:
        least = least_memory(inputs, searched, allowed)
        return Choice(least, False, _reason_unfit(inputs, least), batch_note=note)
    return Choice(ordered[0], True, "the best by the goal", batch_note=note)


def contenders(inputs: PlanInputs, device_fits: list[Candidate], goal: Goal) -> list:
    """The fitting plans among `device_fits` that rank() could put first, in their order.
    Candidates are priced in the order of their floor (estimate.step_floor: the compute
    alone, per token; the score grows with a step's seconds), until a floor's score
    exceeds the best score found by more than SIMPLER_WITHIN: what is left scores higher
    still, so it can be neither the best nor the simpler one within reach."""
    floors = [step_floor(inputs, setup) for setup, _ in device_fits]
    found: dict[int, StrategyPlan] = {}
    bar = math.inf
    for i in sorted(range(len(device_fits)), key=lambda i: floors[i][1] / floors[i][0]):
        tokens, seconds = floors[i]
        floor = cost_score(job_figures(inputs, tokens, seconds, 0.0)[1], goal)
        if floor > bar * (1 + SIMPLER_WITHIN) * (1 + FLOOR_SLACK):
            break
        setup, mem = device_fits[i]
        plan = price(inputs, setup, memory=mem)
        if plan.fits:  # the host's memory too
            found[i] = plan
            bar = min(bar, score(plan, goal))
    return [found[i] for i in sorted(found)]


def _unmeetable(inputs: PlanInputs, allowed: Allowed) -> str:
    """One line: no layout of the GPUs runs the global batch with the settings given."""
    words = ", ".join(text for _, text in allowed.given) or "the job's settings"
    batch = f"a global batch of {inputs.global_batch}" if inputs.global_batch else "the batch"
    return (
        f"{words}: no layout of {inputs.gpus} GPUs runs {batch} with these settings; "
        "change or remove one of them"
    )


def _reason(best: StrategyPlan, ordered: list[StrategyPlan], goal: Goal) -> str:
    what = "the fastest" if goal.objective == "time" else "the cheapest"
    if goal.deadline_hours is not None:
        what = f"the cheapest that finishes within {fmt_hours(goal.deadline_hours)}"
    elif goal.budget_usd is not None:
        what = f"the fastest within {fmt_usd(goal.budget_usd)}"
    top = min(ordered, key=lambda s: score(s, goal))
    simpler = "" if top is best else ", the simplest within 1 % of the best"
    return (
        f"{what} of {len(ordered)} that fit{simpler} "
        f"({fmt_bytes(best.memory.total)} per GPU, {best.step.exposed_comm / best.step.total:.0%} "
        f"of a step waiting on communication, {fmt_hours(best.hours_to_train)}, "
        f"{fmt_usd(best.cost.total_usd)})" + _pipeline_gain(best, ordered, goal)
    )


def _pipeline_gain(best: StrategyPlan, ordered: list[StrategyPlan], goal: Goal) -> str:
    """With pipeline stages: the stage that holds the most, the bubble's share of the step,
    and how much faster it is than the best plan without stages (by the same goal), if any
    fits."""
    if best.setup is None or best.setup.dims.pp == 1:
        return ""
    stage = best.memory.phase.split(",")[0]
    said = f"; {stage} holds the most, the bubble is {best.step.bubble / best.step.total:.0%} of a step"
    flat = [s for s in ordered if s.setup is not None and s.setup.dims.pp == 1]
    if not flat:
        return said + "; no plan without pipeline stages among those that fit"
    other = rank(flat, goal)[0]  # what a plan without stages recommends
    assert other.setup is not None
    return said + (
        f"; {other.hours_to_train / best.hours_to_train:.2f}x as fast as the best without "
        f"pipeline stages ({layout_name(other.setup.dims)}, {fmt_hours(other.hours_to_train)})"
    )


def _reason_unfit(inputs: PlanInputs, least: StrategyPlan) -> str:
    said = (
        f"nothing fits; this needs the least, {fmt_bytes(least.memory.total)} per GPU against "
        f"{fmt_bytes(least.budget_bytes)} usable"
    )
    return said + headroom_note(inputs, least)


def headroom_note(inputs: PlanInputs, plan: StrategyPlan) -> str:
    """When the headroom alone decides (the plan fits the GPU's memory, not with the share
    kept free), what says so and the headroom that admits it; else ""."""
    memory, total = inputs.hardware.memory_bytes, plan.memory.total
    if plan.fits or total > memory or total <= plan.budget_bytes:
        return ""
    admits = math.floor(100 * (1 - total / memory)) / 100  # in whole percent, rounded down
    return (
        f"; it fits in {fmt_bytes(total)} of the GPU's {fmt_bytes(memory)}, but not with the "
        f"{inputs.headroom:.0%} headroom kept free (parallel.headroom): --headroom "
        f"{admits:g} admits it"
    )
