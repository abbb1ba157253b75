"""The plan: every strategy evaluated, the recommendation with its reasons, the three
questions answered, the warnings, and the scaling sweep with its knee."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from trainwise.config.parallel_dims import row_layout
from trainwise.hardware.catalog import GB
from trainwise.plan.advisor import describe, loader_fixes
from trainwise.plan.alternatives import distinct, smallest_changes, why_it_loses
from trainwise.plan.estimate import Setup, StrategyPlan, candidate_names, evaluate, price
from trainwise.plan.inputs import PlanInputs
from trainwise.plan.model.lora import param_counts
from trainwise.plan.model.memory import MemoryEstimate
from trainwise.plan.model.precision import BYTES, MASTER_BYTES, OPTIMIZER_STATE_BYTES
from trainwise.plan.model.reliability import SECONDS_PER_HOUR, system_mtbf_s
from trainwise.plan.search import (
    EVERYTHING,
    Allowed,
    Choice,
    Goal,
    best_only,
    describe_setup,
    headroom_note,
    recommend,
)
from trainwise.plan.space import exact_batch
from trainwise.plan.units import fmt_bytes, fmt_count, fmt_hours, fmt_usd

SMALL_MODEL_PARAMS = 1e9  # the product's guide: under 1B parameters is an `mvp`
DATA_BOUND_SHARE = 0.10  # the GPUs wait for data more than this share of a step
COMM_BOUND_SHARE = 0.10  # exposed communication above this share of a step: comm-bound
HEADROOM_WARNING = 0.10  # less free device memory than this share is a warning
KNEE_SHARE = 0.5  # past the knee, an added GPU buys less than half of its share


@dataclass(frozen=True)
class SweepRow:
    gpus: int
    strategy: str  # a named strategy, or BEST: the search's answer at this count
    fits: bool
    tokens_per_s: float
    scaling_efficiency: float
    step_s: float
    hours_to_train: float
    total_usd: float
    ideal_tokens_per_s: float  # the GPUs' count x one GPU that only computes
    configuration: str = ""  # BEST rows: the configuration chosen (describe_setup)


BEST = "best"  # the sweep's curve of the search's answer at each GPU count


@dataclass(frozen=True)
class Recommendation:
    strategy: str  # the chosen plan's row name (estimate.layout_name, or the asked one)
    scenario: str  # mvp | ddp | fsdp | offline-batch
    reasons: list[str]
    choice: Choice | None = None  # the configuration (None only in hand-built plans)
    # The best few others, each with why it loses (alternatives.why_it_loses).
    alternatives: list[tuple[StrategyPlan, str]] = field(default_factory=list)


@dataclass(frozen=True)
class Plan:
    inputs: PlanInputs
    strategies: list[StrategyPlan]
    recommendation: Recommendation
    questions: list[tuple[str, str]]
    warnings: list[str]
    sweep: list[SweepRow] = field(default_factory=list)
    knees: dict[str, int | None] = field(default_factory=dict)
    calibration: list[str] = field(
        default_factory=list
    )  # measured figures that replaced assumptions

    def strategy(self, name: str) -> StrategyPlan:
        for s in self.strategies:
            if s.name == name:
                return s
        raise KeyError(f"no strategy {name!r} in this plan")

    @property
    def best(self) -> StrategyPlan:
        """The recommended configuration's figures."""
        choice = self.recommendation.choice
        return choice.plan if choice else self.strategy(self.recommendation.strategy)


def make_plan(
    inputs: PlanInputs,
    counts: list[int] | None = None,
    calibration: list[str] | None = None,
    goal: Goal | None = None,
    allowed: Allowed = EVERYTHING,
) -> Plan:
    """The plan of `inputs`; `counts`: the GPU counts of a scaling sweep; `goal`: what
    "best" means (default: the inputs' objective); `allowed`: what the search may vary."""
    goal = goal or Goal(inputs.objective)
    allowed = with_row(allowed, inputs.strategy)
    inputs, batch_note = exact_batch(inputs, allowed)
    strategies = [evaluate(inputs, name) for name in candidate_names(inputs)]
    choice = choose(inputs, allowed, goal)
    if batch_note:  # the batch was changed here, before the search saw it
        choice = replace(choice, batch_note=batch_note)
    best = choice.plan
    single = strategies[0] if _dims(strategies[0]).single else evaluate(inputs, "single")
    # The scenario is the job's, whichever strategy was asked for.
    everything = (
        [evaluate(inputs, n) for n in candidate_names(replace(inputs, strategy=None))]
        if inputs.strategy
        else strategies
    )
    scenario = _scenario(inputs, single, [*everything, best])
    reasons = _reasons(inputs, choice, single, scenario, allowed, goal)
    rows: list[SweepRow] = []
    knees: dict[str, int | None] = {}
    if counts:
        rows = sweep(inputs, counts, allowed, goal)
        for name in {r.strategy for r in rows}:
            knees[name] = knee([r for r in rows if r.strategy == name])
    # What the planner assumed of a model read from its module comes first.
    # parallel.shard = 'full' asked of a layout with stages runs as grad_op: say so.
    shard_note = _dims(best).shard_note("full") if allowed.reshard_after_forward else ""
    notes = [batch_note, shard_note and f"{shard_note}."]
    warnings = [*inputs.notes, *(n for n in notes if n)] + _warnings(
        inputs, best, single, strategies, knees
    )
    questions = [
        ("Does one replica fit on one GPU?", _fit_answer(inputs, single)),
        (
            "Is the interconnect fast enough for sharding?",
            _network_answer(inputs, best, everything),
        ),
        ("What does a crash cost?", _crash_answer(inputs, best)),
    ]
    return Plan(
        inputs=inputs,
        strategies=strategies,
        recommendation=Recommendation(
            best.name,
            scenario,
            reasons,
            choice,
            [(other, why_it_loses(other, best, goal)) for other in distinct(choice)],
        ),
        questions=questions,
        warnings=warnings,
        sweep=rows,
        knees=knees,
        calibration=list(calibration or []),
    )


def choose(inputs: PlanInputs, allowed: Allowed = EVERYTHING, goal: Goal | None = None) -> Choice:
    """The search's answer (plan.search.recommend) under the user's settings; with
    inputs.strategy, among that strategy's layouts (the knobs the job does not set are
    searched)."""
    return recommend(inputs, with_row(allowed, inputs.strategy), goal)


def with_row(allowed: Allowed, name: str | None) -> Allowed:
    """`allowed` kept to the planner's row `name` (fsdp-full, hsdp, ...) when it does not
    name a strategy already (the CLI's constraints carry --strategy themselves)."""
    if name is None or allowed.strategy is not None:
        return allowed
    dims = row_layout(name)  # its kind and options
    fixed = {"strategy": dims.strategy, "cpu_offload": dims.cpu_offload}
    if dims.fsdp:
        fixed["reshard_after_forward"] = dims.reshard_after_forward
    return replace(allowed, **fixed)  # type: ignore[arg-type]


def _scenario(inputs: PlanInputs, single: StrategyPlan, strategies: list[StrategyPlan]) -> str:
    """The product's guide: mvp (under 1B parameters, one or two GPUs), ddp (a replica fits
    one GPU), fsdp (it does not, sharded it does), offline-batch (not even sharded, or only
    with cpu offload)."""
    replica = single.fits or any(s.fits and not _dims(s).fsdp for s in strategies)
    if replica:
        small = inputs.workload.params < SMALL_MODEL_PARAMS and inputs.gpus <= 2
        return "mvp" if small else "ddp"
    if any(s.fits and _dims(s).fsdp and not _dims(s).cpu_offload for s in strategies):
        return "fsdp"
    return "offline-batch"


def _dims(s: StrategyPlan):
    assert s.setup is not None
    return s.setup.dims


def _reasons(
    inputs: PlanInputs,
    choice: Choice,
    single: StrategyPlan,
    scenario: str,
    allowed: Allowed,
    goal: Goal,
) -> list[str]:
    hw, best = inputs.hardware, choice.plan
    usable = f"{fmt_bytes(best.budget_bytes)} usable of {fmt_bytes(hw.memory_bytes)} on a {hw.gpu}"
    out = []
    if single.fits:
        out.append(f"One replica needs {fmt_bytes(single.memory.total)}, which fits in {usable}.")
    else:
        out.append(
            f"One replica needs {fmt_bytes(single.memory.total)}, more than the {usable}; "
            "it has to be sharded, checkpointed or split."
        )
    if not choice.fits:
        out.append(f"Nothing fits: {describe_setup(choice.setup)} needs the least memory"
                   f"{headroom_note(inputs, best)}.")
        return out + smallest_changes(inputs, allowed, goal)
    out.append(f"Chosen as {choice.why}.")
    out.append(
        f"On {best.gpus} GPU{'s' if best.gpus > 1 else ''} it trains the {inputs.tokens:.3g} "
        f"tokens in {fmt_hours(best.hours_to_train)} for {fmt_usd(best.cost.total_usd)} at "
        f"{fmt_usd(hw.price_per_gpu_hour)} per GPU-hour."
    )
    if scenario == "offline-batch":
        out.append(
            "Only cpu offload fits: expect the host copies and the host optimizer to slow "
            "each step; suited to offline or preemptible capacity."
        )
    return out


def _fit_answer(inputs: PlanInputs, single: StrategyPlan) -> str:
    m, hw, w = single.memory, inputs.hardware, inputs.workload
    per_param = 2 * MASTER_BYTES + OPTIMIZER_STATE_BYTES[w.optimizer]
    trained = f"{per_param} bytes per parameter: fp32 weights, gradients and {w.optimizer} state"
    if w.lora is not None:  # the frozen base in the compute dtype, only the rest trains
        trainable, total = param_counts(w.params, w.shape, w.lora)
        trained = (
            f"LoRA: the frozen {fmt_count(total - trainable)} at {BYTES[w.precision]} bytes "
            f"({w.precision}), the {fmt_count(trainable)} trainable at {trained}"
        )
    states = f"model states {fmt_bytes(m.states)} ({trained})"
    detail = f"{states}; at its peak, in the {m.phase}: {describe(m)}"
    if single.fits:
        return (
            f"Yes. One replica needs {fmt_bytes(m.total)} ({detail}); a {hw.gpu} has "
            f"{fmt_bytes(hw.memory_bytes)}, {fmt_bytes(single.budget_bytes)} usable."
        )
    return (
        f"No. One replica needs {fmt_bytes(m.total)} ({detail}): {m.total / hw.memory_bytes:.1f}x "
        f"the {fmt_bytes(hw.memory_bytes)} of a {hw.gpu}, {fmt_bytes(m.total - single.budget_bytes)} over "
        "what is usable."
    )


def sharded_name(inputs: PlanInputs) -> str:
    whole_nodes = inputs.nodes > 1 and inputs.gpus % inputs.node_size == 0
    return "hsdp" if whole_nodes else "fsdp-full"


def _with_bandwidth(inputs: PlanInputs, bps: float) -> PlanInputs:
    """The link sharding crosses set to `bps`: between nodes when it spans them, else within."""
    hw = inputs.hardware
    if inputs.nodes > 1:
        hw = replace(hw, inter_bps=bps)
    else:
        hw = replace(hw, intra_bps=bps)
    return replace(inputs, hardware=hw)


def _priced(
    inputs: PlanInputs, subject: str | Setup, memory: MemoryEstimate | None = None
) -> StrategyPlan:
    """A named strategy at the job's knobs, or a searched configuration (`memory`: its
    estimate, when the caller has it)."""
    if isinstance(subject, str):
        return evaluate(inputs, subject)
    return price(inputs, subject, memory=memory)


def bandwidth_where(inputs: PlanInputs, subject: str | Setup, holds) -> float | None:
    """The lowest link bandwidth (bytes/s) at which `holds(plan)` is true, by bisection on a
    log scale between 1 MB/s and 10 TB/s; more bandwidth never slows a step, so `holds` is
    monotone. None when it does not hold even at 10 TB/s. (The links do not change a
    configuration's memory: it is estimated once.)"""
    memory = None if isinstance(subject, str) else _priced(inputs, subject).memory

    def priced(bps: float) -> StrategyPlan:
        return _priced(_with_bandwidth(inputs, bps), subject, memory)

    lo, hi = math.log(1e6), math.log(1e13)
    if not holds(priced(math.exp(hi))):
        return None
    if holds(priced(math.exp(lo))):
        return math.exp(lo)
    for _ in range(40):
        mid = (lo + hi) / 2
        if holds(priced(math.exp(mid))):
            hi = mid
        else:
            lo = mid
    return math.exp(hi)


def _network_answer(inputs: PlanInputs, best: StrategyPlan, strategies: list) -> str:
    """For the recommended strategy when it shards, else the sharded one that fits best."""
    if inputs.gpus == 1:
        return "Not asked: one GPU shards nothing. Plan with --gpus N to see the network's part."
    sharded = [s for s in strategies if _dims(s).fsdp and not _dims(s).cpu_offload]
    subject: str | Setup
    if best.setup is not None and best.setup.dims.fsdp and not best.setup.dims.cpu_offload:
        subject = best.setup
    elif any(s.fits for s in sharded):
        subject = min((s for s in sharded if s.fits), key=lambda s: s.cost.total_usd).name
    else:
        subject = sharded_name(inputs)
    one = evaluate(inputs, "single")
    plan = _priced(inputs, subject)
    name = plan.name
    hw = inputs.hardware
    link = hw.inter_bps if inputs.nodes > 1 else hw.intra_bps
    where = "between nodes" if inputs.nodes > 1 else "within the node"
    pays = bandwidth_where(inputs, subject, lambda p: p.tokens_per_s > one.tokens_per_s)
    hides = bandwidth_where(
        inputs, subject, lambda p: p.step.exposed_comm <= COMM_BOUND_SHARE * p.step.total + 1e-12
    )
    share = plan.step.exposed_comm / plan.step.total
    facts = (
        f"{name} on {inputs.gpus} GPUs moves {fmt_bytes(plan.comm_bytes_per_step_per_gpu)} per GPU "
        f"per step; with {link / GB:.3g} GB/s per GPU {where} that is {plan.step.comm:.2f} s "
        f"against {plan.step.compute:.2f} s of compute, {share:.0%} of the step exposed."
    )
    limits = []
    if hides is not None:
        limits.append(f"Communication stays under 10 % of the step above {hides / GB:.3g} GB/s")
    if pays is not None:
        limits.append(f"below {pays / GB:.3g} GB/s, sharding is slower than one GPU")
    verdict = (
        "Yes"
        if share <= COMM_BOUND_SHARE
        else ("Barely" if plan.tokens_per_s > one.tokens_per_s else "No")
    )
    return f"{verdict}. {facts} " + ("; ".join(limits) + "." if limits else "")


def _crash_answer(inputs: PlanInputs, best: StrategyPlan) -> str:
    ck = best.checkpoint
    nodes = 1 if _dims(best).single else inputs.nodes
    mtbf_h = system_mtbf_s(inputs.mtbf_hours, nodes) / SECONDS_PER_HOUR
    share = best.cost.failure_retry_usd / best.cost.total_usd if best.cost.total_usd else 0.0
    return (
        f"With {nodes} node{'s' if nodes > 1 else ''} at {inputs.mtbf_hours:,.0f} h MTBF each, "
        f"the job fails every {fmt_hours(mtbf_h)} on average: about {ck.expected_failures:.2g} "
        f"failures over {fmt_hours(best.hours_to_train)}. A checkpoint of "
        f"{fmt_bytes(ck.size_bytes)} stalls {ck.save_s:.1f} s; the Young/Daly interval is "
        f"{ck.interval_min:.0f} min, so a failure costs {ck.loss_per_failure_s / 60:.0f} min "
        f"(restart {inputs.restart_s / 60:.0f} min + half an interval recomputed). Failures "
        f"and saves together cost {fmt_usd(best.cost.failure_retry_usd)}, {share:.1%} of the "
        "total."
    )


def _warnings(
    inputs: PlanInputs,
    best: StrategyPlan,
    single: StrategyPlan,
    strategies: list[StrategyPlan],
    knees: dict[str, int | None],
) -> list[str]:
    out = list(best.notes)
    for s in strategies:
        if s.gpus == 1:  # the single row, or one GPU whatever the row
            continue
        if s.tokens_per_s < single.tokens_per_s:
            out.append(
                f"{s.name} on {s.gpus} GPUs is slower than one GPU ({s.tokens_per_s:,.0f} "
                f"against {single.tokens_per_s:,.0f} tokens/s): the network cannot keep up "
                "with this model's communication."
            )
    if best.step.data > DATA_BOUND_SHARE * best.step.total:
        out.append(
            f"Data-bound: the GPUs would wait for data {best.step.data / best.step.total:.0%} "
            f"of each step; {loader_fixes()}."
        )
    if best.fits and best.memory.total > (1 - HEADROOM_WARNING) * inputs.hardware.memory_bytes:
        free = 1 - best.memory.total / inputs.hardware.memory_bytes
        out.append(
            f"{best.name} leaves {free:.0%} of device memory free: under "
            f"{HEADROOM_WARNING:.0%}, allocator fragmentation can still run it out of memory."
        )
    if not best.host_fits:
        out.append(
            f"{best.name} needs {fmt_bytes(best.host_memory_per_node)} of host memory per node, more "
            f"than the {fmt_bytes(inputs.hardware.host_memory_bytes)} there."
        )
    # The knee of the sweep's best curve; without a sweep, of the chosen data-parallel
    # layout at the job's knobs (a proxy: a search per count would double the plan's time).
    name, knee_at = BEST, knees.get(BEST)
    family = _dims(best).plan_name
    if BEST not in knees and best.gpus > 1 and _dims(best).tp == _dims(best).pp == 1:
        counts = [2**k for k in range(int(math.log2(best.gpus)) + 2)]
        name = family
        knee_at = knee([_row(inputs.with_gpus(n), family) for n in counts])
    if knee_at is not None and best.gpus > knee_at:
        what = "the best configuration" if name == BEST else name
        out.append(
            f"{best.gpus} GPUs is past the scaling knee of {what} ({knee_at} GPUs): "
            "beyond it each added GPU buys less than half of its share."
        )
    return out


def _row(inputs: PlanInputs, name: str) -> SweepRow:
    return _as_row(evaluate(inputs, name), name)


def _as_row(s: StrategyPlan, name: str) -> SweepRow:
    return SweepRow(
        gpus=s.gpus,
        strategy=name,
        fits=s.fits,
        tokens_per_s=s.tokens_per_s,
        scaling_efficiency=s.scaling_efficiency,
        step_s=s.step.total,
        hours_to_train=s.hours_to_train,
        total_usd=s.cost.total_usd,
        ideal_tokens_per_s=s.tokens_per_s / s.scaling_efficiency,
    )


def sweep(
    inputs: PlanInputs,
    counts: list[int],
    allowed: Allowed = EVERYTHING,
    goal: Goal | None = None,
) -> list[SweepRow]:
    """At each count: every named strategy at the job's knobs, and the search's best (BEST
    rows, whose knee is the one that matters) by the goal's objective: a deadline or a
    budget is the job's, not every count's."""
    goal = Goal(goal.objective if goal else inputs.objective)
    rows = []
    for n in sorted(set(counts)):
        sized = inputs.with_gpus(n)
        for name in candidate_names(sized):
            if row_layout(name).single and n > 1:  # its own row at n = 1
                continue
            rows.append(_row(sized, name))
        if not inputs.strategy:
            rows.append(_best_row(best_only(sized, allowed, goal)))
    return rows


def _best_row(choice: Choice) -> SweepRow:
    s = choice.plan
    return replace(
        _as_row(s, BEST), configuration=describe_setup(choice.setup) if choice.fits else ""
    )


def knee(rows: list[SweepRow]) -> int | None:
    """The GPU count past which each added GPU buys less than half of its share: the first
    count n whose step to the next count adds less than KNEE_SHARE x (tokens/s per GPU at n)
    per added GPU. None when the curve never bends that far."""
    rows = sorted(rows, key=lambda r: r.gpus)
    for a, b in zip(rows, rows[1:], strict=False):
        per_gpu = a.tokens_per_s / a.gpus
        gain = (b.tokens_per_s - a.tokens_per_s) / (b.gpus - a.gpus)
        if gain < KNEE_SHARE * per_gpu:
            return a.gpus
    return None


def parse_sweep(text: str) -> list[int]:
    """'1,2,4,8' or '1..1024' (doubling from the first to the last)."""
    text = text.strip()
    if ".." in text:
        first, _, last = text.partition("..")
        a, b = int(first), int(last)
        if a < 1 or b < a:
            raise ValueError(f"{text!r}: a range is FIRST..LAST with 1 <= FIRST <= LAST")
        out = []
        while a <= b:
            out.append(a)
            a *= 2
        return out
    counts = [int(part) for part in text.split(",") if part.strip()]
    if not counts or any(n < 1 for n in counts):
        raise ValueError(f"{text!r}: GPU counts must be integers >= 1")
    return counts
