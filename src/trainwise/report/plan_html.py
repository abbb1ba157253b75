"""The plan as one self-contained HTML page: the headline, the recommendation, three
pictures (memory per GPU, the cost breakdown, the scaling curve), the tables, the three
questions and the warnings.

Nothing on the page is fetched: the CSS is inline, there is no script, and the pictures are
matplotlib's SVG written into the page. The numbers in the text and tables come from
report.plan_view's helpers, so the page, the terminal and the Markdown never disagree.

matplotlib is imported only when a page is rendered. The figures are made with
`matplotlib.figure.Figure`, not pyplot: nothing is registered in pyplot's global figure
list (so nothing is left open), and the caller's backend is left alone.
"""

from __future__ import annotations

import html
from collections.abc import Sequence

from trainwise.hardware.catalog import GB
from trainwise.plan.planner import Plan
from trainwise.plan.units import fmt_bytes, fmt_usd
from trainwise.report.figures import (
    FIGURE_WIDTH,
    LINE_COLOURS,
    NOTE_SIZE,
    SVG_RC,
    TEXT_SIZE,
    figure_html,
    legend,
    new_figure,
    stacked_bars,
    text_width,
)
from trainwise.report.plan_view import (
    MEMORY_COLUMNS,
    MEMORY_TITLE,
    SWEEP_COLUMNS,
    TIME_COLUMNS,
    TIME_TITLE,
    alternative_lines,
    best_sweep_lines,
    config_lines,
    cost_line,
    headline,
    is_chosen,
    memory_rows,
    recommendation_title,
    sweep_rows,
    table_plans,
    time_rows,
)

# (MemoryEstimate field, legend label, colour): the Okabe-Ito palette, colour-blind safe.
MEMORY_PARTS = (
    ("params", "parameters", "#0072B2"),
    ("grads", "gradients", "#56B4E9"),
    ("optimizer", "optimizer state", "#009E73"),
    ("activations", "activations", "#E69F00"),
    ("buffers", "buffers", "#CC79A7"),
    ("overhead", "overhead", "#999999"),
)
COST_PARTS = (
    ("compute_usd", "compute", "#0072B2"),
    ("comm_wait_usd", "communication wait", "#E69F00"),
    ("failure_retry_usd", "failure retry", "#D55E00"),
)
SWEEP_TITLE = "Scaling sweep"
# The memory chart's broken axis: bars over CUT_RATIO times the readable scale are cut at
# CUT_AT times it.
CUT_RATIO = 4.0
CUT_AT = 1.3

CSS = """
body{font:15px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;color:#1b1b1b;
margin:0;background:#fff}
main{max-width:1000px;margin:0 auto;padding:1.5em}
h1{margin:.2em 0}h2{margin-top:1.6em;border-bottom:1px solid #ddd;padding-bottom:.2em}
.headline{color:#444}.cost{font-weight:600}
figure{margin:1.2em 0}figcaption{color:#555;font-size:.9em}
svg{max-width:100%;height:auto;display:block}
table{border-collapse:collapse;margin:.6em 0 1.4em;font-size:.9em}
caption{text-align:left;font-weight:600;padding:.3em 0}
th,td{padding:.25em .6em;border-bottom:1px solid #e4e4e4;text-align:right;white-space:nowrap}
th:first-child,td:first-child,th.l,td.l{text-align:left}
table{max-width:100%}th.prose,td.prose{white-space:normal;text-align:left;min-width:14em}
tr.rec td{background:#e8f5e9;font-weight:600}tr.nofit td{color:#888}
dt{font-weight:600;margin-top:.8em}dd{margin:.2em 0 0 1.2em}
.warnings li{color:#8a4b00}
"""


def render_html(plan: Plan) -> str:
    """The plan as one HTML page (a string), viewable without a network."""
    e = html.escape
    rec = plan.recommendation
    out = [
        "<!DOCTYPE html>",
        '<html lang="en">',
        "<head>",
        '<meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>trainwise plan: {e(plan.inputs.model)}</title>",
        f"<style>{CSS}</style>",
        "</head>",
        "<body>",
        "<main>",
        "<h1>trainwise plan</h1>",
        f'<p class="headline">{e(headline(plan))}</p>',
        '<section id="recommendation">',
        f"<h2>{e(recommendation_title(plan))}</h2>",
        f"<p>Scenario: <strong>{e(rec.scenario)}</strong></p>",
        *(
            [
                "<p>As a job file (<code>trainwise plan --emit FILE</code>):</p>",
                f"<pre>{e(chr(10).join(config_lines(plan)))}</pre>",
            ]
            if config_lines(plan)
            else []
        ),
        "<ul>",
        *(f"<li>{e(reason)}</li>" for reason in rec.reasons),
        "</ul>",
        f'<p class="cost">{e(cost_line(plan))}</p>',
        *(
            [
                "<h3>Alternatives, best first, and why each loses</h3>",
                '<ol start="2">',
                *(f"<li>{e(line)}</li>" for line in alternative_lines(plan)),
                "</ol>",
            ]
            if rec.alternatives
            else []
        ),
        "</section>",
        '<section id="pictures">',
        "<h2>Pictures</h2>",
        *_figures(plan),
        "</section>",
        '<section id="tables">',
        "<h2>Tables</h2>",
        *_strategy_table(plan, MEMORY_TITLE, MEMORY_COLUMNS, memory_rows(plan)),
        *_strategy_table(plan, TIME_TITLE, TIME_COLUMNS, time_rows(plan)),
    ]
    if plan.sweep:
        classes = ["" if r.fits else "nofit" for r in plan.sweep]
        out += html_table(SWEEP_TITLE, SWEEP_COLUMNS, sweep_rows(plan), classes)
        out += [
            "<ul>",
            *(f"<li>best at {e(line)}</li>" for line in best_sweep_lines(plan)),
            "</ul>",
        ]
    out += ["</section>", '<section id="questions">', "<h2>The three questions</h2>", "<dl>"]
    for question, answer in plan.questions:
        out += [f"<dt>{e(question)}</dt>", f"<dd>{e(answer)}</dd>"]
    out += ["</dl>", "</section>", '<section id="warnings" class="warnings">', "<h2>Warnings</h2>"]
    if plan.warnings:
        out += ["<ul>", *(f"<li>{e(w)}</li>" for w in plan.warnings), "</ul>"]
    else:
        out.append("<p>None.</p>")
    out += ["</section>", "</main>", "</body>", "</html>", ""]
    return "\n".join(out)


# Tables


def _strategy_table(
    plan: Plan, title: str, columns: Sequence[str], rows: list[list[str]]
) -> list[str]:
    """A table with a row per strategy (in plan.strategies' order, as plan_view builds it):
    the recommended one highlighted, those that do not fit greyed."""
    classes = [
        "rec" if is_chosen(plan, s) else ("" if s.fits else "nofit") for _, s in table_plans(plan)
    ]
    return html_table(title, columns, rows, classes)


def html_table(
    title: str,
    columns: Sequence[str],
    rows: Sequence[Sequence[str]],
    classes: Sequence[str] | None = None,
    prose: Sequence[str] = (),
) -> list[str]:
    """A captioned table; `classes` per row (e.g. the recommended one); `prose`: columns of
    sentences, which wrap so that the table keeps to the page's width. The plan's and the
    run report's pages share it."""
    e = html.escape
    classes = classes or [""] * len(rows)

    def align(column: str) -> str:
        return ' class="prose"' if column in prose else _align(column)

    out = ["<table>", f"<caption>{e(title)}</caption>", "<thead><tr>"]
    out += [f'<th scope="col"{align(c)}>{e(c)}</th>' for c in columns]
    out += ["</tr></thead>", "<tbody>"]
    for row, cls in zip(rows, classes, strict=True):
        cells = "".join(f"<td{align(c)}>{e(v)}</td>" for c, v in zip(columns, row, strict=True))
        out.append(f'<tr class="{cls}">{cells}</tr>' if cls else f"<tr>{cells}</tr>")
    out += ["</tbody>", "</table>"]
    return out


def _align(column: str) -> str:
    return ' class="l"' if column == "strategy" else ""


# Pictures


def _figures(plan: Plan) -> list[str]:
    import matplotlib

    with matplotlib.rc_context(SVG_RC):
        out = [
            figure_html(
                _memory_figure(plan),
                "memory",
                "memory per GPU",
                "Memory per GPU by strategy, GB. Solid line: the GPU's memory; dashed: the "
                "usable budget after headroom.",
            ),
            figure_html(
                _cost_figure(plan),
                "cost",
                "cost breakdown per strategy",
                "Cost of the whole training run by strategy: compute, communication wait and "
                "failure retry (checkpoint stalls, restarts, recomputed work).",
            ),
        ]
        if plan.sweep:
            out.append(
                figure_html(
                    _scaling_figure(plan),
                    "scaling",
                    "scaling curve: tokens per second versus GPUs",
                    "Throughput versus GPUs for each strategy. Hollow markers: does not fit; "
                    "dotted: ideal linear scaling (every GPU computing all the time); "
                    "rings: the scaling knee.",
                )
            )
    return out


def _strategy_label(plan: Plan, name: str, gpus: int, sep: str = " ") -> str:
    chosen = any(is_chosen(plan, s) for s in plan.strategies if s.name == name)
    star = " *" if chosen else ""
    return f"{name}{star}{sep}({gpus} GPU{'s' if gpus > 1 else ''})"


def _memory_figure(plan: Plan):
    strategies = plan.strategies
    hw = plan.inputs.hardware
    modelled = all(s.memory.activations is not None for s in strategies)
    parts = [
        (field, label + ("" if modelled or field != "activations" else " (not modelled)"), c)
        for field, label, c in MEMORY_PARTS
    ]
    lines = [f"{hw.gpu} memory", "usable budget"]
    ticks = [_strategy_label(plan, s.name, s.gpus) for s in strategies]
    cut = memory_cut(plan)
    notes = [
        fmt_bytes(s.memory.total)
        + ("" if s.fits else ", does not fit" + ("" if s.host_fits else " (host memory)"))
        + (" (bar cut)" if cut is not None and s.memory.total / GB > cut else "")
        for s in strategies
    ]
    left = text_width(ticks, TEXT_SIZE) + 0.25
    fig = new_figure(
        FIGURE_WIDTH, 0.95 + 0.4 * len(strategies), left, 0.5, [p[1] for p in parts] + lines
    )
    ax = fig.add_subplot()
    ends = _memory_bars(ax, strategies, parts, cut)
    ax.axvline(hw.memory_bytes / GB, color="#000000", linewidth=1.2, label=lines[0])
    budgets = {s.budget_bytes for s in strategies}
    if len(budgets) == 1:
        ax.axvline(budgets.pop() / GB, color="#000000", linestyle="--", linewidth=1, label=lines[1])
    else:  # each bar against its own budget
        for i, s in enumerate(strategies):
            ax.vlines(
                s.budget_bytes / GB,
                i - 0.4,
                i + 0.4,
                color="#000000",
                linestyle="--",
                linewidth=1,
                label=lines[1] if i == 0 else None,
            )
    # Room on the right of the longest bar for its note: the axes' width in inches against
    # the data's, so that total + note fits inside.
    axes_in = ax.get_position().width * FIGURE_WIDTH
    span = max([*ends, hw.memory_bytes / GB]) * 1.05
    for end, note in zip(ends, notes, strict=True):
        room = axes_in - text_width([note], NOTE_SIZE) - 0.15
        if room > 0.5:
            span = max(span, end * axes_in / room)
    for i, (end, note) in enumerate(zip(ends, notes, strict=True)):
        ax.text(end, i, " " + note, va="center", ha="left", fontsize=NOTE_SIZE)
    ax.set_xlim(0, span)
    ax.set_yticks(range(len(strategies)), ticks)
    ax.set_ylim(len(strategies) - 0.5, -0.5)  # the first strategy on top
    ax.set_xlabel("GB per GPU")
    ax.set_title("Memory per GPU", loc="left", fontweight="bold")
    ax.spines[["top", "right"]].set_visible(False)
    legend(ax)
    return fig


def memory_cut(plan: Plan) -> float | None:
    """Where the memory chart's axis breaks (GB), when a bar is more than CUT_RATIO times
    the readable scale (the largest of the GPU's memory and the bars within CUT_RATIO of
    it): the bars past it are cut there, so that one huge layout does not squash the ones
    that fit or nearly fit. None: no cut."""
    memory = plan.inputs.hardware.memory_bytes / GB
    totals = [s.memory.total / GB for s in plan.strategies]
    readable = max([memory] + [t for t in totals if t <= CUT_RATIO * memory])
    return readable * CUT_AT if max(totals) > CUT_RATIO * readable else None


def _memory_bars(ax, strategies: list, parts: list, cut: float | None) -> list[float]:
    """The stacked bars, each cut at `cut` (GB) with a break mark; their drawn ends."""
    ys = list(range(len(strategies)))
    starts = [0.0] * len(strategies)
    for field, label, colour in parts:
        widths = [(getattr(s.memory, field) or 0.0) / GB for s in strategies]
        if cut is not None:
            widths = [max(0.0, min(w, cut - a)) for a, w in zip(starts, widths, strict=True)]
        ax.barh(ys, widths, left=starts, height=0.6, color=colour, label=label)
        starts = [a + b for a, b in zip(starts, widths, strict=True)]
    for i, s in enumerate(strategies):
        if cut is not None and s.memory.total / GB > cut:  # a white gap with slanted edges
            ax.plot([cut * 0.97, cut * 0.99], [i + 0.38, i - 0.38], color="#ffffff", linewidth=3)
            ax.plot([cut * 0.955, cut * 0.975], [i + 0.38, i - 0.38], color="#000000", lw=0.8)
            ax.plot([cut * 0.985, cut * 1.005], [i + 0.38, i - 0.38], color="#000000", lw=0.8)
    return starts


def _cost_figure(plan: Plan):
    from matplotlib.ticker import FuncFormatter

    strategies = plan.strategies
    top = max([s.cost.total_usd for s in strategies] + [1.0]) * 1.12
    left = text_width([fmt_usd(top)], TEXT_SIZE) + 0.45
    fig = new_figure(FIGURE_WIDTH, 3.6, left, 0.6, [p[1] for p in COST_PARTS])
    ax = fig.add_subplot()
    parts = [
        (label, colour, [getattr(s.cost, field) for s in strategies])
        for field, label, colour in COST_PARTS
    ]
    xs = stacked_bars(ax, parts, width=0.6)
    for i, s in enumerate(strategies):
        ax.text(
            i, s.cost.total_usd, fmt_usd(s.cost.total_usd), ha="center", va="bottom", size=NOTE_SIZE
        )
    ax.set_ylim(0, top)
    ax.set_xticks(xs, [_strategy_label(plan, s.name, s.gpus, "\n") for s in strategies])
    ax.tick_params(axis="x", labelsize=NOTE_SIZE)
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: fmt_usd(v) if v else "$0"))
    ax.set_ylabel("USD, whole run")
    ax.set_title("Cost breakdown", loc="left", fontweight="bold")
    ax.spines[["top", "right"]].set_visible(False)
    legend(ax)
    return fig


def _scaling_figure(plan: Plan):
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    rows = plan.sweep
    order = [s.name for s in plan.strategies]
    swept = {r.strategy for r in rows}
    names = [n for n in order if n in swept] + sorted(swept - set(order))
    counts = sorted({r.gpus for r in rows})
    # Ideal: every GPU computing all the time. The plan's scaling efficiency is tokens/s over
    # exactly that, so any row gives the one-GPU rate back.
    per_gpu = {r.gpus: r.ideal_tokens_per_s for r in rows}
    ideal = [per_gpu[n] for n in counts]
    top = max([r.tokens_per_s for r in rows] + ideal) * 1.05
    left = text_width([f"{top:,.0f}"], TEXT_SIZE) + 0.45
    labels = [*names, "ideal linear scaling"]
    fig = new_figure(FIGURE_WIDTH, 3.8, left, 0.5, labels)
    ax = fig.add_subplot()
    knees: list[tuple[str, float, float]] = []
    if ideal:
        ax.plot(counts, ideal, linestyle=":", color="#555555", linewidth=1.5, label=labels[-1])
    for k, name in enumerate(names):
        colour = LINE_COLOURS[k % len(LINE_COLOURS)]
        mine = sorted((r for r in rows if r.strategy == name), key=lambda r: r.gpus)
        ax.plot([r.gpus for r in mine], [r.tokens_per_s for r in mine], color=colour, label=name)
        fit = [r for r in mine if r.fits]
        nofit = [r for r in mine if not r.fits]
        ax.scatter([r.gpus for r in fit], [r.tokens_per_s for r in fit], color=colour, s=24)
        ax.scatter(
            [r.gpus for r in nofit],
            [r.tokens_per_s for r in nofit],
            facecolors="#ffffff",
            edgecolors=colour,
            s=24,
            zorder=3,
        )
        at = plan.knees.get(name)
        point = next((r for r in mine if r.gpus == at), None)
        if point is not None:
            ax.scatter(
                [point.gpus],
                [point.tokens_per_s],
                s=150,
                facecolors="none",
                edgecolors="#000000",
                linewidths=1.2,
                zorder=4,
            )
            knees.append((f"knee of {name}", point.gpus, point.tokens_per_s))
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_locator(FixedLocator(counts))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}"))
    ax.set_ylim(0, top)
    ax.set_xlabel("GPUs")
    ax.set_ylabel("tokens/s")
    ax.set_title("Scaling", loc="left", fontweight="bold")
    _knee_labels(ax, knees)
    ax.grid(True, color="#eeeeee", linewidth=0.8)
    ax.spines[["top", "right"]].set_visible(False)
    legend(ax)
    return fig


def _knee_labels(ax, knees: list[tuple[str, float, float]]) -> None:
    """Each knee's label below and right of its ring, moved further down while it would
    overlap a label already placed (knees of several strategies are often at one point);
    a moved label keeps a thin line to its ring. Boxes are measured in points."""
    ax.get_xlim()  # settle the view limits, so that data positions map to the figure
    to_points = 72.0 / ax.figure.dpi
    line = NOTE_SIZE * 1.35
    placed: list[tuple[float, float, float, float]] = []  # x0, y0, x1, y1
    for text, x, y in sorted(knees, key=lambda k: (k[1], -k[2])):
        px, py = (v * to_points for v in ax.transData.transform((x, y)))
        width = text_width([text], NOTE_SIZE) * 72.0
        dy = -14.0
        while any(
            px + 8 < b[2] and b[0] < px + 8 + width and py + dy < b[3] and b[1] < py + dy + line
            for b in placed
        ):
            dy -= line
        placed.append((px + 8, py + dy, px + 8 + width, py + dy + line))
        ax.annotate(
            text,
            (x, y),
            xytext=(8, dy),
            textcoords="offset points",
            fontsize=NOTE_SIZE,
            arrowprops={"arrowstyle": "-", "color": "#777777", "lw": 0.6} if dy < -14 else None,
        )
