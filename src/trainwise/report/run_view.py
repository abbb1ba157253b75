"""The run report as text, Markdown and JSON. The rows are built once here and shared with
the HTML page (report.run_html), so that every format shows the same numbers."""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Any

from trainwise.plan.units import fmt_bytes, fmt_gpu_hours, fmt_params, fmt_seconds, fmt_usd_exact
from trainwise.report.analysis import PLAN_ERROR_FLAG, PlanCheck, RunReport
from trainwise.report.drilldown import GROUPS
from trainwise.report.plan_view import md_table

SCHEMA_VERSION = 1
Rows = list[tuple[str, ...]]


def _num(x: float | None, unit: str) -> str:
    if x is None:
        return "-"
    if unit == "bytes":
        return fmt_bytes(x)
    if unit == "s":
        return fmt_seconds(x) + " s"
    if unit == "x":  # a ratio (the experts' load imbalance)
        return f"{x:.2f} x"
    if unit == "share":  # of the step
        return f"{x:.1%}"
    return f"{x:,.0f} {unit}"


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.2f} ms"


def summary_rows(r: RunReport) -> Rows:
    h = r.headline
    params = f", {h.params:,} parameters" if h.params else ""
    if h.trainable_params is not None and h.total_params:  # LoRA
        params = f", {fmt_params(h.trainable_params, h.total_params)}"
    machines = f" ({h.nodes} machines)" if h.nodes > 1 else ""
    steps = f"{h.steps_done}" + (f" of {h.steps_planned}" if h.steps_planned else "")
    if h.preempted:
        steps += " (preempted)"
    tokens = f", {h.tokens:,} tokens" if h.tokens else ""
    loss = f"{r.curves.loss[0]:.4f} -> {h.final_loss:.4f}"
    if h.final_eval_loss is not None:
        loss += f" (held-out {h.final_eval_loss:.4f})"
    speed = (
        f"{h.tokens_per_s:,.0f} tokens/s" if h.tokens_per_s and h.tokens_per_s != h.samples_per_s
        else f"{h.samples_per_s or 0:,.0f} samples/s"
    )
    stops = [("stops", "; ".join(h.stops))] if h.stops else []
    return [
        ("run", h.run),
        ("model", f"{h.model}{params}, {h.precision}"),
        ("strategy", f"{h.layout} on {h.world} x {h.device}{machines}"),
        ("why", h.reason),
        ("steps", f"{steps}{tokens}, wall {fmt_seconds(h.wall_s)} s"),
        *stops,
        ("loss", loss),
        ("speed", f"{speed} (steady steps, median)"),
        (
            "cost",
            f"{fmt_gpu_hours(r.cost.total_gpu_hours)} GPU-h = {fmt_usd_exact(r.cost.total_usd)}",
        ),
    ]


STAGE_COLUMNS = ("stage", "seconds", "share", "plan per step", "measured per step")


def stage_rows(r: RunReport) -> Rows:
    total = sum(r.stages.total_s.values()) or 1.0
    plan = r.stages.planned_per_step or {}
    rows = []
    for name, seconds in r.stages.total_s.items():
        planned = plan.get(name)
        measured = r.stages.measured_per_step.get(name)
        rows.append((
            name, f"{seconds:.3f}", f"{seconds / total:.1%}",
            _planned(name, planned, plan),
            "-" if measured is None else fmt_seconds(measured) + " s",
        ))
    return rows


def _planned(name: str, planned: float | None, plan: dict) -> str:
    if not plan or name == "restart downtime":
        return "-"
    if planned is None and name == "pipeline bubble":
        return "-"  # a plan that does not price the pipeline
    if planned is None:
        return "in compute"  # the planner times the optimizer with forward and backward
    return fmt_seconds(planned) + " s"


COST_COLUMNS = ("term", "GPU-hours", "USD", "share")


def cost_rows(r: RunReport) -> Rows:
    total = r.cost.total_gpu_hours or 1.0
    rows = [
        (t.name, fmt_gpu_hours(t.gpu_hours), fmt_usd_exact(t.usd), f"{t.gpu_hours / total:.1%}")
        for t in r.cost.terms
    ]
    rows.append(
        ("total", fmt_gpu_hours(r.cost.total_gpu_hours), fmt_usd_exact(r.cost.total_usd), "100%")
    )
    return rows


def price_line(r: RunReport) -> str:
    c = r.cost
    return f"at {fmt_usd_exact(c.price_per_gpu_hour)} per GPU-hour ({c.price_source}), {r.headline.world} workers"


PLAN_COLUMNS = ("figure", "plan", "actual", "error", "assumption to check")
PLAN_PROSE = ("assumption to check",)  # sentences: they wrap on the page


def plan_rows(r: RunReport) -> Rows:
    return [_plan_row(c) for c in r.plan_vs_actual]


def _plan_row(c: PlanCheck) -> tuple[str, ...]:
    error = "-" if c.error is None else f"{c.error:+.0%}"
    if c.flagged:
        error += " !"
    return (c.name, _num(c.planned, c.unit), _num(c.actual, c.unit), error,
            (c.reason or c.assumption) if c.flagged else "")


def calibrate_line(r: RunReport) -> str | None:
    if any(c.defaults for c in r.plan_vs_actual):
        return (
            "the plan's figures are uncalibrated defaults (the catalog's and plan.* "
            "assumptions), not measurements of this machine, so its errors are not marked: "
            f"`trainwise doctor --nproc {r.headline.world}` measures this machine for later "
            f"plans and runs (or `trainwise plan --calibrate {r.headline.path}`)"
        )
    if not any(c.flagged for c in r.plan_vs_actual):
        return None
    return (
        f"! marks an error over {PLAN_ERROR_FLAG:.0%}: `trainwise plan --calibrate "
        f"{r.headline.path}` replaces the plan's assumptions with this run's measurements"
    )


PROFILE_COLUMNS = ("rank", "steps", "window", *(g for g in GROUPS))
ATTRIBUTED_COLUMNS = ("stage", "plan per step", "loop timers", "trace (rank 0)")
OPERATOR_COLUMNS = ("operator", "group", "calls", "self time", "share of window")
HANG_COLUMNS = ("step", "stage", "cause", "did not arrive", "reported by")


def profile_rows(r: RunReport) -> Rows:
    """Each traced rank's window, split by group (shares of the window)."""
    return [
        (str(p.rank), f"{p.steps[0]}-{p.steps[-1]}" if p.steps else "-", _num(p.window_s, "s"),
         *(f"{p.groups_s[g] / p.window_s:.0%}" if p.window_s else "-" for g in GROUPS))
        for p in r.drill.profiles
    ]


def attributed_rows(r: RunReport) -> Rows:
    """A traced step by the plan's stages: the plan, the loop's timers, the trace."""
    rows = []
    for a in r.drill.attributed:
        plan = "in compute" if a.plan is None and a.stage == "optimizer" else _ms(a.plan)
        rows.append((a.stage, plan, _ms(a.loop), _ms(a.trace)))
    return rows


def operator_rows(r: RunReport) -> Rows:
    return [(o.name, o.group, str(o.calls), _ms(o.self_s), f"{o.share:.1%}") for o in r.drill.top]


def hang_rows(r: RunReport) -> Rows:
    return [
        (str(h.step), h.stage, h.cause, ", ".join(map(str, h.absent)) or "unknown",
         ", ".join(map(str, h.seen_by)))
        for h in r.drill.hangs
    ]


def drill_lines(r: RunReport) -> list[str]:
    """The files to open next, one line each."""
    d = r.drill
    out = [f"trace: {t}" for t in d.traces if "trace" in t]
    out.append(f"memory: {d.memory}")
    out += [f"stacks of rank {rank}: hang/rank-{rank}.txt" for rank in d.dumps]
    return out


def _drill_text(r: RunReport) -> list[str]:
    out = ["", "Where to look next"]
    if r.drill.profiles:
        out += [*_text_table(PROFILE_COLUMNS, profile_rows(r))]
        out += ["", "A traced step by stage", *_text_table(ATTRIBUTED_COLUMNS, attributed_rows(r))]
        out += ["", "Top operators (rank 0)", *_text_table(OPERATOR_COLUMNS, operator_rows(r))]
    if r.drill.hangs:
        out += ["", "Hangs", *_text_table(HANG_COLUMNS, hang_rows(r))]
    return out + ["", *(f"  {line}" for line in drill_lines(r))]


def render_text(r: RunReport) -> str:
    out = [f"trainwise report: {r.headline.run}"]
    out += [f"  {k:<9}  {v}" for k, v in summary_rows(r)]
    out += ["", "Time per stage", *_text_table(STAGE_COLUMNS, stage_rows(r))]
    out += ["", f"Cost, {price_line(r)}", *_text_table(COST_COLUMNS, cost_rows(r))]
    if r.plan_vs_actual:
        out += ["", "Plan versus actual", *_text_table(PLAN_COLUMNS, plan_rows(r))]
        line = calibrate_line(r)
        if line:
            out.append("  " + line)
    out += ["", "Advice"]
    out += [
        f"  {i}. {a.title}: {a.evidence}. Change: {a.change}. Saving: {a.saving}."
        for i, a in enumerate(r.advice, 1)
    ] or ["  none: no warning held during the run"]
    out += _drill_text(r)
    if r.notes:
        out += ["", "Notes", *(f"  - {n}" for n in r.notes)]
    return "\n".join(out)


def _text_table(columns: tuple[str, ...], rows: Rows) -> list[str]:
    widths = [max(len(str(x)) for x in col) for col in zip(columns, *rows, strict=True)]

    def line(cells):
        return (
            "  "
            + "  ".join(
                str(c).ljust(w) if i == 0 or i == len(cells) - 1 else str(c).rjust(w)
                for i, (c, w) in enumerate(zip(cells, widths, strict=True))
            ).rstrip()
        )

    return [line(columns), *(line(row) for row in rows)]


def render_markdown(r: RunReport) -> str:
    out = [f"# trainwise report: {r.headline.run}", ""]
    out += [f"- **{k}**: {v}" for k, v in summary_rows(r)]
    out += ["", "## Time per stage", "", *md_table(STAGE_COLUMNS, stage_rows(r))]
    out += ["", "## Cost", "", price_line(r), "", *md_table(COST_COLUMNS, cost_rows(r))]
    if r.plan_vs_actual:
        out += ["", "## Plan versus actual", "", *md_table(PLAN_COLUMNS, plan_rows(r))]
        line = calibrate_line(r)
        if line:
            out += ["", line]
    out += ["", "## Advice", ""]
    out += [
        f"{i}. **{a.title}**: {a.evidence}. Change: {a.change}. Saving: {a.saving}."
        for i, a in enumerate(r.advice, 1)
    ] or ["None: no warning held during the run."]
    out += ["", "## Where to look next", ""]
    if r.drill.profiles:
        out += [*md_table(PROFILE_COLUMNS, profile_rows(r)), ""]
        out += [*md_table(ATTRIBUTED_COLUMNS, attributed_rows(r)), ""]
        out += [*md_table(OPERATOR_COLUMNS, operator_rows(r)), ""]
    if r.drill.hangs:
        out += [*md_table(HANG_COLUMNS, hang_rows(r)), ""]
    out += [f"- {line}" for line in drill_lines(r)]
    if r.notes:
        out += ["", "## Notes", "", *(f"- {n}" for n in r.notes)]
    return "\n".join(out) + "\n"


def to_json(reports: list[RunReport]) -> str:
    body: dict[str, Any] = {"schema_version": SCHEMA_VERSION, "runs": [asdict(r) for r in reports]}
    return json.dumps(body, indent=1) + "\n"


COMPARE_COLUMNS = ("", "strategy", "workers", "step time", "tokens/s", "peak memory",
                   "final loss", "cost", "failures")


def compare_rows(reports: list[RunReport]) -> Rows:
    rows = []
    for r in reports:
        h = r.headline
        step = r.stages.measured_per_step
        rows.append((
            h.run, h.layout, str(h.world), fmt_seconds(sum(step.values())) + " s",
            f"{h.tokens_per_s or h.samples_per_s or 0:,.0f}",
            fmt_bytes(max(r.curves.mem_bytes, default=0)),
            f"{h.final_loss:.4f}", fmt_usd_exact(r.cost.total_usd), str(r.cost.failures),
        ))
    return rows


def render_compare_text(reports: list[RunReport]) -> str:
    return "\n".join(
        ["trainwise report: comparison", *_text_table(COMPARE_COLUMNS, compare_rows(reports))]
    )


def render_compare_markdown(reports: list[RunReport]) -> str:
    out = ["# trainwise report: comparison", "", *md_table(COMPARE_COLUMNS, compare_rows(reports))]
    for r in reports:
        out += ["", render_markdown(r).replace("# trainwise report", "## trainwise report", 1)]
    return "\n".join(out)
