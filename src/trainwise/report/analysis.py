"""The report's figures, computed from a run directory and nothing else: pure functions of
the files (`RunFiles`), so that every number on the page can be recomputed by hand.

- Steps: each step counts once, as its last attempt ran it (an elastic restart redoes the
  steps since its checkpoint; that repeated work is the failures' cost, from the events).
- Steady state: the steps after the first WARMUP_STEPS (allocation, warm caches), less any
  checkpoint stall, are what the plan's per-step figures are compared with.
- Cost: the product's formula with measured terms (`plan.cost.run_cost`).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any

from trainwise.plan.advisor import loader_fixes
from trainwise.plan.calibrate import WARMUP_STEPS
from trainwise.plan.estimate import SIMPLER_WITHIN, config_keys
from trainwise.plan.model.cost import CostTerm, run_cost
from trainwise.plan.planner import COMM_BOUND_SHARE
from trainwise.plan.units import PLAN_TOLERANCE, fmt_gpu_hours, fmt_usd_exact
from trainwise.records import MemoryFigures, RunPlan, StepRecord
from trainwise.report.drilldown import DrillDown, drill_down
from trainwise.report.rundir import RunFiles
from trainwise.run.observe.events import RetryCost, resumptions, retry_cost
from trainwise.run.observe.wall import LAUNCH_ENDS, run_wall_s

# The measured stages of a step (metrics.jsonl) and their names on the page.
STAGES = (
    ("data_s", "data wait"),
    ("compute_s", "compute"),
    ("bubble_s", "pipeline bubble"),  # pipeline parallelism only
    ("sync_s", "exposed sync"),
    ("optim_s", "optimizer"),
    ("ckpt_s", "checkpoint stall"),
)
PLAN_ERROR_FLAG = PLAN_TOLERANCE  # a plan figure off by more than this names its assumption
DATA_BOUND_SHARE = 0.10  # the loop's own warning level (logging.data_wait_warn's default)
WINDOWS = 10  # step windows in the stage picture
# The memory a step record measured (mem_kind) that the plan's per-worker figure is
# compared with, and what a miss points at. A whole resident set is not comparable.
MEMORY_ASSUMPTION = {
    "cuda_peak": "the memory model (activations, buffers)",
    "rss_added": "the memory model, and the CPU runtime's own memory beyond the tensors "
    "(allocator cache, thread arenas, library code: --calibrate measures it)",
}


@dataclass(frozen=True)
class Headline:
    run: str
    path: str  # the run directory as typed in a command (rundir.typed_path)
    model: str
    params: int | None
    layout: str  # as people read it (ParallelDims.name): pp 2 x fsdp 2
    reason: str
    world: int
    nodes: int
    device: str
    precision: str
    steps_planned: int | None
    steps_done: int
    tokens: int | None
    wall_s: float
    final_loss: float
    final_eval_loss: float | None
    tokens_per_s: float | None
    samples_per_s: float | None
    preempted: bool  # the run's last end was a planned stop (it can be resumed)
    stops: list[str] = field(default_factory=list)  # each planned stop and what followed
    trainable_params: int | None = None  # LoRA (job.json); None: every parameter trains
    total_params: int | None = None


@dataclass(frozen=True)
class StageWindow:
    first_step: int
    last_step: int
    seconds_per_step: dict[str, float]  # stage name -> mean seconds per step


@dataclass(frozen=True)
class StageSplit:
    total_s: dict[str, float]  # stage name -> seconds over the run (downtime included)
    windows: list[StageWindow]
    # The plan's split of one steady step; its compute includes the optimizer (None there).
    planned_per_step: dict[str, float | None] | None
    measured_per_step: dict[str, float]  # the steady steps' median split


@dataclass(frozen=True)
class Costs:
    terms: list[CostTerm]
    total_gpu_hours: float
    total_usd: float
    price_per_gpu_hour: float
    price_source: str
    failures: int
    downtime_s: float
    recomputed_s: float


@dataclass(frozen=True)
class PlanCheck:
    name: str
    unit: str
    planned: float | None
    actual: float | None
    error: float | None  # (actual - planned) / planned
    flagged: bool
    assumption: str  # which of the plan's inputs this figure rests on
    reason: str | None = None  # why the miss is not the plan's, when the files show it
    # The plan rested on uncalibrated defaults (plan.json "calibrated": false): a miss is
    # the machine's unmeasured figures, not an error of the model; not flagged.
    defaults: bool = False


@dataclass(frozen=True)
class Advice:
    title: str
    evidence: str
    change: str
    saving: str


@dataclass(frozen=True)
class Curves:
    step: list[int]
    loss: list[float]
    eval_step: list[int]
    eval_loss: list[float]
    tokens_per_s: list[float]
    data_share: list[float]
    mem_bytes: list[int]
    mem_kind: str
    checkpoints: list[int]  # steps saved
    restarts: list[int]  # steps a restarted attempt resumed from


@dataclass(frozen=True)
class RunReport:
    headline: Headline
    stages: StageSplit
    cost: Costs
    plan_vs_actual: list[PlanCheck]
    curves: Curves
    advice: list[Advice]
    notes: list[str] = field(default_factory=list)
    drill: DrillDown = field(default_factory=DrillDown)  # where to look next


def analyse(run: RunFiles) -> RunReport:
    notes: list[str] = []
    head = headline(run)
    failures = retry_cost(run.events, max(head.world, 1))
    stages = stage_split(run, failures, notes)
    costs = cost_of(run, head.world, failures, notes)
    checks = plan_vs_actual(run, stages, notes)
    return RunReport(
        headline=head,
        stages=stages,
        cost=costs,
        plan_vs_actual=checks,
        curves=curves(run),
        advice=advice(run, stages, costs, checks),
        notes=notes + _profiled_note(run),
        drill=drill_down(run),
    )


def _profiled_note(run: RunFiles) -> list[str]:
    traced = [r.step for r in run.records if r.profiled]
    if not traced:
        return []
    return [
        f"steps {traced[0]}-{traced[-1]} ran under the profiler (logging.profile_steps, and "
        "the step that waited for the traces to be written): left out of the medians and "
        "the plan comparison"
    ]


def _section(run: RunFiles, name: str) -> dict[str, Any]:
    value = run.config.get(name, {})
    return value if isinstance(value, dict) else {}


def headline(run: RunFiles) -> Headline:
    job, recs, s = run.job, run.records, run.summary
    last = recs[-1]
    evals = [r for r in recs if r.eval_loss is not None]
    world = int(job.world or 1)
    ready = [e for e in run.events if e["kind"] == "ready"]
    nodes = ready[-1].get("nodes") if ready and ready[-1].get("nodes") else 1
    return Headline(
        run=run.name,
        path=run.typed,
        model=str(_section(run, "model").get("name", s.model if s and s.model else "?")),
        params=job.params,
        trainable_params=job.trainable_params,
        total_params=job.total_params,
        # Runs from before job.json had layout_name: the shortcut they recorded.
        layout=str(job.layout_name or job.strategy or "?"),
        reason=str(job.reason or ""),
        world=world,
        nodes=int(nodes),
        device=str(job.device or "?"),
        precision=str(job.precision or "?"),
        steps_planned=_section(run, "train").get("steps"),
        steps_done=int(last.step),
        tokens=last.tokens,
        wall_s=wall_seconds(run),
        final_loss=float(last.loss),
        final_eval_loss=float(evals[-1].eval_loss) if evals else None,
        tokens_per_s=_median([r.tokens_per_s for r in steady(recs)]),
        samples_per_s=_median([r.samples_per_s for r in steady(recs)]),
        preempted=_last_end(run.events) == "preempted",
        stops=[stop.line() for stop in resumptions(run.events)],
    )


def _last_end(events: list[dict[str, Any]]) -> str | None:
    ends = [e["kind"] for e in events if e["kind"] in LAUNCH_ENDS]
    return ends[-1] if ends else None


def wall_seconds(run: RunFiles) -> float:
    """The run's wall time, as the terminal summary gives it (run.wall.run_wall_s)."""
    return run_wall_s([r.to_dict() for r in run.all_records], run.events)


def steady(records: list[StepRecord]) -> list[StepRecord]:
    """The steps after warm-up (all of them when the run is too short to have any)."""
    later = [r for r in records if r.step > WARMUP_STEPS and not r.profiled]
    return later or records


def calm(records: list[StepRecord]) -> list[StepRecord]:
    """The steady steps without a checkpoint stall: what the plan's step is compared with."""
    return [r for r in steady(records) if not r.ckpt_s] or steady(records)


def _figure(record: StepRecord, key: str) -> float:
    """A stage's seconds in a step record (`key`: one of STAGES' fields); 0 when unmeasured."""
    return float(getattr(record, key) or 0.0)


def stage_split(run: RunFiles, failures: RetryCost, notes: list[str]) -> StageSplit:
    recs = run.records
    # The bubble only for a pipeline's run (the records of others have none).
    piped = any(r.bubble_s is not None for r in recs)
    stages = [s for s in STAGES if s[0] != "bubble_s" or piped]
    total = {name: sum(_figure(r, key) for r in recs) for key, name in stages}
    total["restart downtime"] = failures.downtime_s
    if any(r.sync_s is None for r in recs) and int(run.job.world or 1) > 1:
        notes.append("exposed sync is measured by probes; steps before the first probe count 0")
    a2a = [r.a2a_s for r in calm(recs) if r.a2a_s is not None]
    if a2a:
        notes.append(
            f"exposed sync includes expert parallelism's all-to-alls (dispatch and combine, "
            f"forward and backward: {_median(a2a):.3g} s a step, timed on every step)"
        )
    tp = [r.tp_s for r in calm(recs) if r.tp_s is not None]
    if tp:
        notes.append(
            f"exposed sync includes the tensor-parallel collectives inside forward and backward "
            f"({_median(tp):.3g} s a step, timed on probe steps), as the plan counts them"
        )
    size = max(1, -(-len(recs) // WINDOWS))
    windows = [
        StageWindow(
            first_step=chunk[0].step,
            last_step=chunk[-1].step,
            seconds_per_step={
                name: sum(_figure(r, key) for r in chunk) / len(chunk)
                for key, name in stages
            },
        )
        for chunk in (recs[i : i + size] for i in range(0, len(recs), size))
    ]
    quiet = calm(recs)
    measured = {name: _median([_figure(r, key) for r in quiet]) or 0.0 for key, name in stages}
    measured["checkpoint stall"] = 0.0
    planned: dict[str, float | None] | None = None
    if run.plan is not None:
        step = run.plan.step
        planned = {
            "data wait": step.data,
            # The planner times forward, backward and the optimizer as one compute term.
            "compute": step.compute,
            "exposed sync": step.exposed_comm,
            "optimizer": None,
            "checkpoint stall": 0.0,
        }
        if piped:  # the planner's bubble, when it prices the pipeline
            planned["pipeline bubble"] = step.bubble
    return StageSplit(total, windows, planned, measured)


def cost_of(run: RunFiles, gpus: int, cost: RetryCost, notes: list[str]) -> Costs:
    """Each step is charged at the workers of the attempt that ran it (an elastic job can
    shrink); failures (`cost`) at the job's full size (`gpus`), an upper bound when it
    shrank."""
    price, source = _price(run)
    workers = {e.get("attempt", 0): int(e["world"]) for e in run.events
               if e["kind"] == "ready" and e.get("world")}
    if len(set(workers.values())) > 1:
        sizes = " -> ".join(str(workers[a]) for a in sorted(workers))
        notes.append(f"the job ran on {sizes} workers; each step is charged at its attempt's")

    def gpu_seconds(key: str) -> float:
        return sum(_figure(r, key) * workers.get(r.attempt or 0, gpus) for r in run.records)

    terms = run_cost(
        price_per_gpu_hour=price,
        step_gpu_s=gpu_seconds("step_s"),
        exposed_comm_gpu_s=gpu_seconds("sync_s"),
        checkpoint_stall_gpu_s=gpu_seconds("ckpt_s"),
        retry_gpu_s=(cost.downtime_s + cost.recomputed_s) * gpus,
    )
    if run.plan is None:
        notes.append("no plan.json: the plan-versus-actual rows are missing")
    return Costs(
        terms=terms,
        total_gpu_hours=sum(t.gpu_hours for t in terms),
        total_usd=sum(t.usd for t in terms),
        price_per_gpu_hour=price,
        price_source=source,
        failures=cost.failures,
        downtime_s=cost.downtime_s,
        recomputed_s=cost.recomputed_s,
    )


def _price(run: RunFiles) -> tuple[float, str]:
    given = _section(run, "cost").get("price_per_gpu_hour")
    if given is not None:
        return float(given), "cost.price_per_gpu_hour"
    if run.plan is not None and run.plan.price_per_gpu_hour is not None:
        return float(run.plan.price_per_gpu_hour), f"the catalog's {run.job.device}"
    return 0.0, "unknown (set cost.price_per_gpu_hour)"


def plan_vs_actual(run: RunFiles, stages: StageSplit, notes: list[str]) -> list[PlanCheck]:
    plan, job = run.plan, run.job
    if plan is None:
        return []
    step_s = _median([r.step_s for r in calm(run.records)])
    tokens = job.tokens_per_step
    mem = max((int(r.mem_bytes or 0) for r in run.records), default=0)
    mem_kind = run.records[-1].mem_kind or ""
    saves = [e for e in run.events if e["kind"] == "checkpoint" and e.get("save_s") is not None]
    slow_part = _largest_miss(stages, plan)
    defaults = plan.calibrated is False  # older plan.json files do not say
    speed = machine_changed(plan, "calibration_step_s", plan.step.total, step_s, "a step")
    save_s = _median([e["save_s"] for e in saves])
    disk = machine_changed(
        plan, "calibration_save_s", plan.checkpoint.save_s, save_s, "a save"
    )
    rows = [
        _check("step time", "s", plan.step.total, step_s, slow_part, reason=speed,
               defaults=defaults),
        _check(
            "tokens/s",
            "tokens/s",
            plan.tokens_per_s,
            tokens / step_s if tokens and step_s else None,
            slow_part,
            reason=speed,
            defaults=defaults,
        ),
        _check(
            "memory per worker",
            "bytes",
            planned_memory(plan.memory_per_gpu, mem_kind),
            mem or None,
            MEMORY_ASSUMPTION.get(mem_kind, MEMORY_ASSUMPTION["cuda_peak"]),
            comparable=mem_kind in MEMORY_ASSUMPTION,
            defaults=defaults,
        ),
        _check(
            "checkpoint save",
            "s",
            plan.checkpoint.save_s,
            save_s,
            "the checkpoint write speed and fixed latency (checkpoint.write_gbps, "
            "save_latency_s; trainwise doctor measures them)",
            reason=disk,
            defaults=defaults,
        ),
    ]
    # Expert parallelism's all-to-alls, as a share of the step (the plan's share of its
    # step; the run's median step's).
    a2a = _median([r.a2a_s / r.step_s for r in calm(run.records) if r.a2a_s and r.step_s])
    if a2a is not None and plan.all_to_all_s is not None:
        rows.append(_check(
            "all-to-all share", "share", plan.all_to_all_s / plan.step.total, a2a,
            "the all-to-all's link rate (the plan's intra- and inter-node links; trainwise "
            "doctor times all_to_all_single) and moe.imbalance",
            defaults=defaults,
        ))
    # The steady steps' (a checkpoint stall does not change the routing), as summary.json.
    imbalance = _median([r.ep_imbalance for r in steady(run.records) if r.ep_imbalance])
    if imbalance is not None:
        rows.append(_check(
            "expert load imbalance", "x", plan.moe_imbalance, imbalance,
            "moe.imbalance (the busiest expert-parallel rank's routed tokens over the mean; "
            "this run's summary.json ep_imbalance is the figure to calibrate it with)",
            defaults=defaults,
        ))
    if mem_kind == "rss_peak":
        notes.append(
            "memory on CPU is the process's peak resident set (Python and torch included), "
            "not comparable with the plan's tensors: not flagged"
        )
    return rows


def planned_memory(memory: MemoryFigures, mem_kind: str) -> float | None:
    """The plan's figure for what the run measured: on a GPU the allocator's peak, so the
    tensors without the overhead (the CUDA context and fragmentation, which
    max_memory_allocated does not count); on CPU the whole total (its overhead is the
    runtime's own memory, measured by a calibration, which the resident set holds)."""
    if mem_kind == "cuda_peak" and memory.total is not None:
        return memory.total - (memory.overhead or 0)
    return memory.total


def machine_changed(
    plan: RunPlan, key: str, planned: float | None, actual: float | None, what: str
) -> str | None:
    """Why a calibrated plan missed this run's time, when the files show it: the plan was
    calibrated on a run (plan.json `key`: calibration_step_s or calibration_save_s) whose
    measured figure this run's differs from, in the direction of the miss and by at least
    as much as the plan differs from that run's own figure: the machine, more than the
    model, changed between the runs. Both measured figures are stated, and the plan's own
    distance from its calibration run (the medians of a step's parts, which the plan adds,
    need not add up to the median step on a noisy machine)."""
    before = getattr(plan, key)
    if not before or not actual or not planned:
        return None
    machine, own = actual / before, planned / before  # measured/measured, plan/measured
    # Whether the miss is flagged is the caller's: a step 22 % faster than planned is a
    # tokens/s 28 % over plan.
    same_way = (machine > 1) == (actual > planned)
    if actual == planned or not same_way or abs(math.log(machine)) < abs(math.log(own)):
        return None
    return (
        f"the machine's speed changed: {what} took {actual:.3g} s here and {before:.3g} s "
        f"in {plan.calibration_source} ({machine - 1:+.0%}; other load on the machine?), "
        f"whose measurements the plan takes ({own - 1:+.0%} from that run's own)"
    )


def _largest_miss(stages: StageSplit, plan: RunPlan) -> str:
    """The assumption behind the stage whose seconds per step the plan missed by most."""
    m, p = stages.measured_per_step, stages.planned_per_step or {}
    misses = {
        f"the achieved compute rate (plan.efficiency = {plan.efficiency or 'modelled'})":
            m["compute"] + m["optimizer"] - (p.get("compute") or 0.0),
        "the link bandwidth (cluster.intra_node_gbps / inter_node_gbps; trainwise doctor "
        "measures it)": m["exposed sync"] - (p.get("exposed sync") or 0.0),
        "the loader's rate (trainwise doctor measures it)":
            m["data wait"] - (p.get("data wait") or 0.0),
    }
    return max(misses, key=lambda k: abs(misses[k]))


def _check(
    name: str,
    unit: str,
    planned: float | None,
    actual: float | None,
    assumption: str,
    comparable: bool = True,
    reason: str | None = None,
    defaults: bool = False,
) -> PlanCheck:
    error = (actual - planned) / planned if planned and actual is not None else None
    flagged = (
        comparable and not defaults and error is not None and abs(error) > PLAN_ERROR_FLAG
    )
    return PlanCheck(
        name, unit, planned, actual, error, flagged, assumption, reason if flagged else None,
        defaults,
    )


def curves(run: RunFiles) -> Curves:
    recs = run.records
    shares = [_figure(r, "data_s") / float(r.step_s) if r.step_s else 0.0 for r in recs]
    ready = [e for e in run.events if e["kind"] == "ready" and e.get("attempt", 0) > 0]
    return Curves(
        step=[r.step for r in recs],
        loss=[float(r.loss) for r in recs],
        eval_step=[r.step for r in recs if r.eval_loss is not None],
        eval_loss=[float(r.eval_loss) for r in recs if r.eval_loss is not None],
        tokens_per_s=[float(r.tokens_per_s or 0.0) for r in recs],
        data_share=shares,
        mem_bytes=[int(r.mem_bytes or 0) for r in recs],
        mem_kind=str(recs[-1].mem_kind or ""),
        checkpoints=sorted({int(e["step"]) for e in run.events if e["kind"] == "checkpoint"}),
        restarts=sorted(
            [int(e.get("step", 0)) for e in ready]
            + [r.resumed_step for r in resumptions(run.events) if r.resumed_step is not None]
        ),
    )


def advice(
    run: RunFiles, stages: StageSplit, costs: Costs, checks: list[PlanCheck]
) -> list[Advice]:
    out: list[Advice] = []
    step_total = sum(_figure(r, "step_s") for r in run.records) or 1.0
    price = costs.price_per_gpu_hour
    gpus = int(run.job.world or 1)
    data_share = stages.total_s["data wait"] / step_total
    doctor = {c["name"]: c for c in (run.doctor or {}).get("checks", [])}
    if data_share > DATA_BOUND_SHARE:
        hours = stages.total_s["data wait"] * gpus / 3600
        workers = _section(run, "data").get("num_workers")
        out.append(Advice(
            title="data-bound",
            evidence=f"the workers waited for batches {data_share:.0%} of the step time"
            + _doctor_said(doctor, "data"),
            change=loader_fixes(workers, run.job.device_kind == "cuda"),
            saving=f"up to {fmt_gpu_hours(hours)} GPU-h ({fmt_usd_exact(hours * price)}) on a run like this "
            "one, if the loader kept up",
        ))
    # Expert parallelism's all-to-alls are in the exposed sync: advised on apart.
    a2a_s = sum(_figure(r, "a2a_s") for r in run.records)
    sync_s = stages.total_s["exposed sync"] - a2a_s
    sync_share = sync_s / step_total
    if sync_share > COMM_BOUND_SHARE:
        hours = sync_s * gpus / 3600
        change = (
            "raise data.grad_accum or data.micro_batch (fewer syncs per sample), or compare "
            f"strategies with `trainwise plan --calibrate {run.typed}`"
        )
        saving = f"up to {fmt_gpu_hours(hours)} GPU-h ({fmt_usd_exact(hours * price)}) of waiting"
        better = faster_strategy(run)
        if better:
            name, gain = better
            work = (step_total - stages.total_s["checkpoint stall"]) * gpus / 3600
            change = (
                f"{config_keys(name)}: the planner predicts a step {gain:.0%} "
                f"shorter than {run.job.strategy}'s here; or {change}"
            )
            saving = f"{fmt_gpu_hours(work * gain)} GPU-h ({fmt_usd_exact(work * gain * price)}), the planner's {gain:.0%} of the steps' time"
        out.append(Advice(
            title="communication-bound",
            evidence=f"{sync_share:.0%} of the step time waited for gradient sync (over "
            f"{COMM_BOUND_SHARE:.0%})" + _doctor_said(doctor, "bandwidth"),
            change=change,
            saving=saving + " on a run like this",
        ))
    if a2a_s / step_total > COMM_BOUND_SHARE:
        hours = a2a_s * gpus / 3600
        out.append(Advice(
            title="all-to-all-bound",
            evidence=f"{a2a_s / step_total:.0%} of the step time waited for expert "
            f"parallelism's all-to-alls (over {COMM_BOUND_SHARE:.0%})"
            + _doctor_said(doctor, "bandwidth"),
            change="a smaller parallel.ep (fewer ranks exchange the tokens; an ep group "
            "inside one machine), a larger data.micro_batch (fewer exchanges per sample), or "
            f"compare layouts with `trainwise plan --calibrate {run.typed}`",
            saving=f"up to {fmt_gpu_hours(hours)} GPU-h ({fmt_usd_exact(hours * price)}) of "
            "waiting on a run like this",
        ))
    scaling = doctor.get("scaling")
    if scaling and scaling.get("status") == "warn":
        out.append(Advice(
            title="past the scaling knee",
            evidence=f"the doctor measured: {scaling.get('measured')}",
            change=scaling.get("fix") or "run on fewer workers",
            saving="the workers beyond the knee cost more than they add",
        ))
    off = [c for c in checks if c.flagged]
    if off:
        names = ", ".join(f"{c.name} {c.error:+.0%}" for c in off if c.error is not None)
        out.append(Advice(
            title="the plan was off",
            evidence=f"{names} (more than {PLAN_ERROR_FLAG:.0%})",
            change="check " + "; ".join(sorted({c.assumption for c in off}))
            + f"; `trainwise plan --calibrate {run.typed}` replaces the assumptions with "
            "this run's measurements",
            saving="a plan that matches the machine picks the cheaper strategy next time",
        ))
    if costs.failures:
        retry = next(t for t in costs.terms if t.name == "failure retry")
        out.append(Advice(
            title="failures cost time",
            evidence=f"{costs.failures} failure(s): {costs.downtime_s:.1f} s restarting, "
            f"{costs.recomputed_s:.1f} s recomputing",
            change="save more often (checkpoint.interval = \"auto\" takes the Young/Daly "
            "optimum) and use async saves to keep the stall small",
            saving=f"at most the {fmt_gpu_hours(retry.gpu_hours)} GPU-h ({fmt_usd_exact(retry.usd)}) they "
            "cost",
        ))
    return out


def faster_strategy(run: RunFiles) -> tuple[str, float] | None:
    """The plan's fastest other strategy that fits on the same workers, and the share of
    the step it saves, when that is more than the planner's SIMPLER_WITHIN."""
    plan = run.plan
    if plan is None:
        return None
    current = plan.step.total
    fits = [a for a in plan.alternatives if a.fits and a.name != plan.name]
    if not current or not fits:
        return None
    best = min(fits, key=lambda a: a.step_total or 0.0)
    gain = 1 - (best.step_total or 0.0) / current
    return (str(best.name), gain) if gain > SIMPLER_WITHIN else None


def _doctor_said(doctor: dict[str, dict], name: str) -> str:
    check = doctor.get(name)
    if not check or check.get("status") not in ("warn", "fail"):
        return ""
    return f"; the doctor warned before the run: {check.get('measured')}"


def _median(values: list[Any]) -> float | None:
    nums = [float(v) for v in values if v is not None]
    return statistics.median(nums) if nums else None
