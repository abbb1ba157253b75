"""The plan for people: one table (a row per strategy), the recommendation, the three
questions, the warnings and the sweep — in the terminal (rich) or as Markdown. Both read
the same rows, so they never disagree."""

from __future__ import annotations

from collections.abc import Sequence

from trainwise.hardware.catalog import GB
from trainwise.plan.planner import Plan
from trainwise.plan.units import fmt_bytes, fmt_hours, fmt_seconds, fmt_usd

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
TIME_TITLE = "Step in seconds (comm: exposed communication), throughput, time and cost"
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


def _name(plan: Plan, name: str) -> str:
    """The recommended strategy is marked with a star (the terminal adds colour)."""
    return name + ("*" if name == plan.recommendation.strategy else "")


def memory_rows(plan: Plan) -> list[list[str]]:
    rows = []
    for s in plan.strategies:
        m = s.memory
        rows.append(
            [
                _name(plan, s.name),
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
            _name(plan, s.name),
            fmt_seconds(s.step.compute),
            fmt_seconds(s.step.exposed_comm),
            fmt_seconds(s.step.data),
            fmt_seconds(s.step.total),
            f"{s.tokens_per_s:,.0f}",
            f"{s.mfu:.0%}",
            fmt_hours(s.hours_to_train),
            fmt_usd(s.cost.total_usd),
        ]
        for s in plan.strategies
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
    batch = f"global batch {i.global_batch}" if i.global_batch else "global batch = micro x GPUs"
    return (
        f"{i.model} ({shape}), seq {w.seq_len}, micro-batch {w.micro_batch}, {batch}, "
        f"{w.precision}, {w.optimizer}, ac {w.ac}; {i.gpus} x {i.hardware.gpu} on "
        f"{i.nodes} node{'s' if i.nodes > 1 else ''}; {i.tokens:.3g} tokens to train"
    )


def cost_line(plan: Plan) -> str:
    s = plan.strategy(plan.recommendation.strategy)
    c = s.cost
    return (
        f"Cost of {s.name}: {fmt_usd(c.compute_usd)} compute + {fmt_usd(c.comm_wait_usd)} "
        f"communication wait + {fmt_usd(c.failure_retry_usd)} failure retry = "
        f"{fmt_usd(c.total_usd)} ({c.gpu_hours:,.0f} GPU-hours); checkpoint every "
        f"{s.checkpoint.interval_min:.0f} min."
    )


def render_terminal(plan: Plan, console=None, simulation: list[dict] | None = None) -> None:
    from rich.console import Console
    from rich.markup import escape

    console = console or Console()
    console.print(f"[bold]trainwise plan[/]: {escape(headline(plan))}")
    for note in plan.calibration:
        console.print(f"  calibrated: {escape(note)}")
    fits = {s.name: s.fits for s in plan.strategies}
    for title, columns, rows in (
        (MEMORY_TITLE, MEMORY_COLUMNS, memory_rows(plan)),
        (TIME_TITLE, TIME_COLUMNS, time_rows(plan)),
    ):
        styles = [
            "bold green" if row[0].endswith("*") else ("" if fits[row[0]] else "dim")
            for row in rows
        ]
        console.print(_rich_table(title, columns, rows, styles, no_wrap_strategy=True))
    rec = plan.recommendation
    console.print(f"[bold]Recommendation: {rec.strategy}[/] (scenario: {rec.scenario})")
    for reason in rec.reasons:
        console.print(f"  - {escape(reason)}")
    console.print(f"  {escape(cost_line(plan))}")
    console.print("\n[bold]The three questions[/]")
    for q, a in plan.questions:
        console.print(f"  [bold]{escape(q)}[/] {escape(a)}")
    if simulation:
        console.print(
            _rich_table(SIMULATION_TITLE, SIMULATION_COLUMNS, simulation_rows(simulation))
        )
    if plan.sweep:
        console.print(
            _rich_table("Scaling sweep", SWEEP_COLUMNS, sweep_rows(plan), title_justify="center")
        )
    if plan.warnings:
        console.print("\n[bold yellow]Warnings[/]")
        for warning in plan.warnings:
            console.print(f"  ! {escape(warning)}", style="yellow")


def _rich_table(
    title: str,
    columns: tuple[str, ...],
    rows: list[list[str]],
    styles: list[str] | None = None,
    title_justify: str = "left",
    no_wrap_strategy: bool = False,
):
    """A terminal table: the strategy column left-aligned, the figures right-aligned."""
    from rich import box
    from rich.table import Table

    table = Table(title=title, box=box.SIMPLE_HEAD, pad_edge=False, title_justify=title_justify)
    for col in columns:
        left = col == "strategy"
        table.add_column(
            col, justify="left" if left else "right", no_wrap=left and no_wrap_strategy
        )
    for row, style in zip(rows, styles or [""] * len(rows), strict=True):
        table.add_row(*row, style=style)
    return table


def md_table(columns: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """A Markdown table (pipes in cells escaped); the plan's and the run report's."""
    out = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    out += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows]
    return out


def render_markdown(plan: Plan, simulation: list[dict] | None = None) -> str:
    rec = plan.recommendation
    out = ["# trainwise plan", "", headline(plan), ""]
    out += [f"- calibrated: {note}" for note in plan.calibration] + (
        [""] if plan.calibration else []
    )
    out += [f"## {MEMORY_TITLE}", ""] + md_table(MEMORY_COLUMNS, memory_rows(plan))
    out += ["", f"## {TIME_TITLE}", ""]
    out += md_table(TIME_COLUMNS, time_rows(plan))
    out += ["", f"## Recommendation: {rec.strategy} (scenario: {rec.scenario})", ""]
    out += [f"- {reason}" for reason in rec.reasons] + [f"- {cost_line(plan)}", ""]
    out += ["## The three questions", ""]
    for q, a in plan.questions:
        out += [f"**{q}** {a}", ""]
    if simulation:
        out += [f"## {SIMULATION_TITLE}", ""]
        out += md_table(SIMULATION_COLUMNS, simulation_rows(simulation)) + [""]
    if plan.sweep:
        out += ["## Scaling sweep", ""] + md_table(SWEEP_COLUMNS, sweep_rows(plan)) + [""]
    if plan.warnings:
        out += ["## Warnings", ""] + [f"- {w}" for w in plan.warnings] + [""]
    return "\n".join(out)
