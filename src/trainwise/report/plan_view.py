"""The plan for people: one table (a row per strategy), the recommendation, the three
questions, the warnings and the sweep — in the terminal (rich) or as Markdown. Both read
the same rows, so they never disagree."""

from __future__ import annotations

from collections.abc import Sequence

from trainwise.hardware.catalog import GB
from trainwise.plan.emit import keys_toml
from trainwise.plan.estimate import StrategyPlan
from trainwise.plan.model.lora import param_counts
from trainwise.plan.model.performance import model_of
from trainwise.plan.planner import BEST, Plan
from trainwise.plan.search import describe_setup
from trainwise.plan.units import fmt_bytes, fmt_hours, fmt_params, fmt_seconds, fmt_usd

MEMORY_COLUMNS = (
    "strategy",
    "n",
    "params",
    "grads",
    "optim",
    "activ",
    "buffers",
    "overhd",
    "total",
    "fits",
)
TIME_COLUMNS = (
    "strategy",
    "compute",
    "bubble",
    "comm",
    "data",
    "step",
    "tok/s",
    "MFU",
    "time",
    "cost",
)
MEMORY_TITLE = (
    "Memory per GPU at the step's peak, GB (n: GPUs; activ: activations; overhd: CUDA "
    "context + fragmentation)"
)
TIME_TITLE = (
    "Step in seconds (bubble: pipeline stages idle; comm: exposed communication), "
    "throughput, time and cost"
)
SIMULATION_TITLE = (
    "Simulated peak per GPU (fake tensors, this machine's kernels) against the formula for "
    "the same kernels, and the plan's figure for the GPU"
)
SIMULATION_COLUMNS = ("strategy", "GPUs", "simulated", "formula", "gap", "plan (GPU)")
SWEEP_COLUMNS = ("GPUs", "strategy", "fits", "tokens/s", "scaling", "step s", "time", "cost")


def _gb_number(x: float | None) -> str:
    """GB as a bare number (the table's title carries the unit)."""
    if x is None:
        return "n/a"
    return f"{x / GB:.3g}" if x >= 1e7 or x == 0 else f"{x / GB:.1e}"


CHOSEN = "chosen"  # the tables' row of the search's answer when no named row is it


def is_chosen(plan: Plan, s: StrategyPlan) -> bool:
    """Whether `s` is the recommended configuration (its layout and knobs)."""
    best = plan.best
    return s is best or (s.setup is not None and s.setup == best.setup)


def table_plans(plan: Plan) -> list[tuple[str, StrategyPlan]]:
    """The tables' rows: the chosen configuration first (unless a named row is it), then
    each named strategy at the job's own knobs."""
    named = [(s.name, s) for s in plan.strategies]
    if any(is_chosen(plan, s) for s in plan.strategies):
        return named
    return [(CHOSEN, plan.best), *named]


def _name(plan: Plan, label: str, s: StrategyPlan) -> str:
    """The recommended row is marked with a star (the terminal adds colour)."""
    return label + ("*" if is_chosen(plan, s) else "")


def memory_rows(plan: Plan) -> list[list[str]]:
    rows = []
    for label, s in table_plans(plan):
        m = s.memory
        rows.append(
            [
                _name(plan, label, s),
                str(s.gpus),
                _gb_number(m.params),
                _gb_number(m.grads),
                _gb_number(m.optimizer),
                _gb_number(m.activations),
                _gb_number(m.buffers),
                _gb_number(m.overhead),
                _gb_number(m.total),
                "yes" if s.fits else "no",
            ]
        )
    return rows


def time_rows(plan: Plan) -> list[list[str]]:
    return [
        [
            _name(plan, label, s),
            fmt_seconds(s.step.compute),
            fmt_seconds(s.step.bubble),
            fmt_seconds(s.step.exposed_comm),
            fmt_seconds(s.step.data),
            fmt_seconds(s.step.total),
            f"{s.tokens_per_s:,.0f}",
            f"{s.mfu:.0%}",
            fmt_hours(s.hours_to_train),
            fmt_usd(s.cost.total_usd),
        ]
        for label, s in table_plans(plan)
    ]


def sweep_rows(plan: Plan) -> list[list[str]]:
    return [
        [
            str(r.gpus),
            r.strategy + (" (knee)" if plan.knees.get(r.strategy) == r.gpus else ""),
            "yes" if r.fits else "no",
            f"{r.tokens_per_s:,.0f}",
            f"{r.scaling_efficiency:.0%}",
            fmt_seconds(r.step_s),
            fmt_hours(r.hours_to_train),
            fmt_usd(r.total_usd),
        ]
        for r in plan.sweep
    ]


def simulation_rows(rows: list[dict]) -> list[list[str]]:
    return [
        [
            r["strategy"],
            str(r["gpus"]),
            fmt_bytes(r["simulated_peak_bytes"]),
            fmt_bytes(r["formula_peak_bytes"]),
            f"{r['gap']:+.1%}",
            fmt_bytes(r["plan_total_bytes"]),
        ]
        for r in rows
    ]


def headline(plan: Plan) -> str:
    i, w = plan.inputs, plan.inputs.workload
    shape = f"{w.params / 1e9:.2f}B parameters" if w.params >= 1e8 else f"{w.params:,} parameters"
    if w.lora is not None:
        shape = f"{fmt_params(*param_counts(w.params, w.shape, w.lora))}, LoRA rank {w.lora.rank}"
    if w.moe is not None:
        m, active = w.moe.moe, w.moe.active_params()
        count = f"{active / 1e9:.2f}B" if active >= 1e8 else f"{active:,}"
        shape += f", {count} active: {m.experts} experts, top {m.top_k}, imbalance {w.imbalance:.3g}"
    batch = f"global batch {i.global_batch}" if i.global_batch else "global batch = micro x GPUs"
    precision = w.precision if w.float8 == "none" else f"{w.precision} + float8 {w.float8}"
    return (
        f"{i.model} ({shape}), seq {w.seq_len}, micro-batch {w.micro_batch}, {batch}, "
        f"{precision}, {w.optimizer}, ac {w.ac}; {i.gpus} x {i.hardware.gpu} on "
        f"{i.nodes} node{'s' if i.nodes > 1 else ''}; {i.tokens:.3g} tokens to train"
    )


def cost_line(plan: Plan) -> str:
    s = plan.best
    c = s.cost
    return (
        f"Cost of {s.name}: {fmt_usd(c.compute_usd)} compute + {fmt_usd(c.comm_wait_usd)} "
        f"communication wait + {fmt_usd(c.failure_retry_usd)} failure retry = "
        f"{fmt_usd(c.total_usd)} ({c.gpu_hours:,.0f} GPU-hours); checkpoint every "
        f"{s.checkpoint.interval_min:.0f} min."
    )


def recommendation_title(plan: Plan) -> str:
    rec = plan.recommendation
    what = describe_setup(rec.choice.setup) if rec.choice else rec.strategy
    if rec.choice and not rec.choice.fits:  # no recommendation for what does not fit
        return f"Nothing fits under these settings; the least memory: {what}"
    return f"Recommendation: {what} (scenario: {rec.scenario})"


def config_lines(plan: Plan) -> list[str]:
    """The recommended settings as a job file's lines (what --emit writes them into)."""
    rec = plan.recommendation
    return keys_toml(rec.choice.config_keys()) if rec.choice and rec.choice.fits else []


def alternative_lines(plan: Plan) -> list[str]:
    """The best few alternatives, best first, each with why it loses."""
    return [
        f"{describe_setup(s.setup)}: {why}" if s.setup else f"{s.name}: {why}"
        for s, why in plan.recommendation.alternatives
    ]


def best_sweep_lines(plan: Plan) -> list[str]:
    return [
        f"{r.gpus} GPUs: {r.configuration or 'nothing fits'}"
        for r in plan.sweep
        if r.strategy == BEST
    ]


def render_terminal(plan: Plan, console=None, simulation: list[dict] | None = None) -> None:
    from rich.console import Console
    from rich.markup import escape

    console = console or Console()
    width = console.width
    console.print(f"[bold]trainwise plan[/]: {escape(headline(plan))}")
    console.print(f"  figures: {escape(model_of(plan.inputs).header())}")
    for note in plan.calibration:
        console.print(f"  calibrated: {escape(note)}")
    for title, columns, rows in (
        (MEMORY_TITLE, MEMORY_COLUMNS, memory_rows(plan)),
        (TIME_TITLE, TIME_COLUMNS, time_rows(plan)),
    ):
        styles = [
            "bold green" if is_chosen(plan, s) else ("" if s.fits else "dim")
            for _, s in table_plans(plan)
        ]
        for table in rich_tables(title, columns, rows, width, styles):
            console.print(table)
    console.print(f"[bold]{escape(recommendation_title(plan))}[/]")
    lines = config_lines(plan)
    if lines:
        console.print("  As a job file (trainwise plan --emit FILE writes the whole job):")
        for line in lines:
            console.print(f"    {escape(line)}", highlight=False)
    for reason in plan.recommendation.reasons:
        console.print(f"  - {escape(reason)}")
    console.print(f"  {escape(cost_line(plan))}")
    if plan.recommendation.alternatives:
        console.print("\n[bold]Alternatives[/], best first, and why each loses")
        for k, line in enumerate(alternative_lines(plan), 2):
            console.print(f"  {k}. {escape(line)}")
    console.print("\n[bold]The three questions[/]")
    for q, a in plan.questions:
        console.print(f"  [bold]{escape(q)}[/] {escape(a)}")
    if simulation:
        for table in rich_tables(
            SIMULATION_TITLE, SIMULATION_COLUMNS, simulation_rows(simulation), width
        ):
            console.print(table)
    if plan.sweep:
        for table in rich_tables("Scaling sweep", SWEEP_COLUMNS, sweep_rows(plan), width):
            console.print(table)
        for line in best_sweep_lines(plan):
            console.print(f"  best at {escape(line)}")
    if plan.warnings:
        console.print("\n[bold yellow]Warnings[/]")
        for warning in plan.warnings:
            console.print(f"  ! {escape(warning)}", style="yellow")


def column_groups(columns: Sequence[str], rows: Sequence[Sequence[str]], width: int) -> list:
    """The columns split into groups that fit `width` characters, each group after the
    first column (the row's name), so that no cell is ever cut: a table wider than the
    terminal (or a pipe's 80 columns) is stacked as several."""
    # Each column takes its widest cell, one space either side and one between columns.
    sizes = [max(len(c), *(len(r[k]) for r in rows)) + 3 for k, c in enumerate(columns)]
    groups: list[list[int]] = [[]]
    used = sizes[0] - 1
    for k in range(1, len(columns)):
        if groups[-1] and used + sizes[k] > width:
            groups.append([])
            used = sizes[0] - 1
        groups[-1].append(k)
        used += sizes[k]
    return [[0, *g] for g in groups]


def rich_tables(
    title: str,
    columns: Sequence[str],
    rows: list[list[str]],
    width: int,
    styles: list[str] | None = None,
) -> list:
    """Terminal tables: the first column left-aligned, the figures right-aligned, never
    wrapped or cut (column_groups stacks what does not fit)."""
    from rich import box
    from rich.table import Table
    from rich.text import Text

    groups = column_groups(columns, rows, width)
    more = " (in parts: each repeats the first column)" if len(groups) > 1 else ""
    out: list = [Text(title + more, style="italic")]
    for group in groups:
        table = Table(box=box.SIMPLE_HEAD, pad_edge=False)
        for k in group:
            table.add_column(columns[k], justify="left" if k == 0 else "right", no_wrap=True)
        for row, style in zip(rows, styles or [""] * len(rows), strict=True):
            table.add_row(*(row[k] for k in group), style=style)
        out.append(table)
    return out


def md_table(columns: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """A Markdown table (pipes in cells escaped); the plan's and the run report's."""
    out = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    out += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows]
    return out


def render_markdown(plan: Plan, simulation: list[dict] | None = None) -> str:
    rec = plan.recommendation
    out = ["# trainwise plan", "", headline(plan), ""]
    out += [f"- figures: {model_of(plan.inputs).header()}"]
    out += [f"- calibrated: {note}" for note in plan.calibration] + [""]
    out += [f"## {MEMORY_TITLE}", ""] + md_table(MEMORY_COLUMNS, memory_rows(plan))
    out += ["", f"## {TIME_TITLE}", ""]
    out += md_table(TIME_COLUMNS, time_rows(plan))
    out += ["", f"## {recommendation_title(plan)}", ""]
    lines = config_lines(plan)
    if lines:
        out += ["```toml", *lines, "```", ""]
    out += [f"- {reason}" for reason in rec.reasons] + [f"- {cost_line(plan)}", ""]
    if rec.alternatives:
        out += ["## Alternatives, best first, and why each loses", ""]
        out += [f"{k}. {line}" for k, line in enumerate(alternative_lines(plan), 2)] + [""]
    out += ["## The three questions", ""]
    for q, a in plan.questions:
        out += [f"**{q}** {a}", ""]
    if simulation:
        out += [f"## {SIMULATION_TITLE}", ""]
        out += md_table(SIMULATION_COLUMNS, simulation_rows(simulation)) + [""]
    if plan.sweep:
        out += ["## Scaling sweep", ""] + md_table(SWEEP_COLUMNS, sweep_rows(plan)) + [""]
        out += [f"- best at {line}" for line in best_sweep_lines(plan)] + [""]
    if plan.warnings:
        out += ["## Warnings", ""] + [f"- {w}" for w in plan.warnings] + [""]
    return "\n".join(out)
