"""The run report as one self-contained HTML page, mostly pictures with the numbers beside
them: the summary, time per stage (per step window, and the plan's split), the cost, plan
versus actual, the curves with checkpoints and restarts marked, the advice, and where to
look next (the profiled window, trace files, memory timeline, hang stacks). Several
runs side by side on one page.

Nothing is fetched: inline CSS, no script, the pictures are matplotlib's SVG written into
the page (report.figures). The numbers come from report.run_view's rows.
"""

from __future__ import annotations

import html

from trainwise.plan.units import fmt_usd_exact
from trainwise.report.analysis import STAGES, RunReport
from trainwise.report.drilldown import GROUPS
from trainwise.report.figures import (
    FIGURE_WIDTH,
    LINE_COLOURS,
    NOTE_SIZE,
    SVG_RC,
    figure_html,
    legend,
    new_figure,
    stacked_bars,
)
from trainwise.report.plan_html import CSS, html_table
from trainwise.report.run_view import (
    ATTRIBUTED_COLUMNS,
    COMPARE_COLUMNS,
    COST_COLUMNS,
    HANG_COLUMNS,
    OPERATOR_COLUMNS,
    PLAN_COLUMNS,
    PLAN_PROSE,
    PROFILE_COLUMNS,
    STAGE_COLUMNS,
    attributed_rows,
    calibrate_line,
    compare_rows,
    cost_rows,
    hang_rows,
    operator_rows,
    plan_rows,
    price_line,
    profile_rows,
    stage_rows,
    summary_rows,
)

# Okabe-Ito, colour-blind safe; one colour per stage, the same in every picture.
STAGE_COLOURS = {
    "data wait": "#E69F00",
    "compute": "#0072B2",
    "pipeline bubble": "#009E73",
    "exposed sync": "#D55E00",
    "optimizer": "#56B4E9",
    "checkpoint stall": "#CC79A7",
    "restart downtime": "#000000",
    "communication wait": "#D55E00",
    "failure retry": "#000000",
}
GROUP_COLOURS = {
    "compute": "#0072B2",
    "pipeline bubble": "#009E73",
    "communication": "#D55E00",
    "copies": "#009E73",
    "data": "#E69F00",
    "other": "#999999",
}
EXTRA_CSS = (
    ".advice li{margin:.4em 0}.flag{color:#b00020;font-weight:600}"
    "table.summary td{white-space:normal}"
    "details pre{max-height:30em;overflow:auto;font-size:.8em}"
)
ERROR_CLIP = 200.0  # percent: a bar beyond it is cut there (its label keeps the figure)


def render_html(reports: list[RunReport]) -> str:
    """One run's page, or several runs compared."""
    import matplotlib

    e = html.escape
    title = (
        f"trainwise report: {reports[0].headline.run}"
        if len(reports) == 1
        else "trainwise report: " + " vs ".join(r.headline.run for r in reports)
    )
    out = [
        "<!DOCTYPE html>", '<html lang="en">', "<head>", '<meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>{e(title)}</title>", f"<style>{CSS}{EXTRA_CSS}</style>", "</head>",
        "<body>", "<main>", f"<h1>{e(title)}</h1>",
    ]
    with matplotlib.rc_context(SVG_RC):
        if len(reports) > 1:
            out += _comparison(reports)
        for i, r in enumerate(reports):
            out += _run_section(r, f"r{i}", heading=len(reports) > 1)
    out += ["</main>", "</body>", "</html>", ""]
    return "\n".join(out)


def _run_section(r: RunReport, key: str, heading: bool) -> list[str]:
    e = html.escape
    out = [f'<section id="{key}">']
    if heading:
        out.append(f"<h2>{e(r.headline.run)}</h2>")
    out += ['<table class="summary">', *(f'<tr><th class="l">{e(k)}</th><td class="l">{e(v)}</td></tr>'
                         for k, v in summary_rows(r)), "</table>"]
    out += ["<h2>Where the time went</h2>",
            figure_html(_stage_figure(r), f"{key}-stages", "time per stage",
                        "Seconds per step by stage, per window of steps; beside them the "
                        "steady steps' median and the plan's split."),
            *html_table("Time per stage", STAGE_COLUMNS, stage_rows(r))]
    out += ["<h2>Where the money went</h2>",
            figure_html(_cost_figure(r), f"{key}-cost", "cost breakdown",
                        f"GPU-hours by term, {price_line(r)}."),
            *html_table("Cost", COST_COLUMNS, cost_rows(r))]
    if r.plan_vs_actual:
        out += ["<h2>Plan versus actual</h2>",
                figure_html(_plan_figure(r), f"{key}-plan", "plan versus actual",
                            "The error of each planned figure; the band is ±25 %."),
                *html_table("Plan versus actual", PLAN_COLUMNS, plan_rows(r),
                            prose=PLAN_PROSE)]
        line = calibrate_line(r)
        if line:
            out.append(f'<p class="flag">{e(line)}</p>')
    out += ["<h2>Curves</h2>",
            figure_html(_curves_figure(r), f"{key}-curves", "training curves",
                        "Over steps; dotted lines are checkpoints, dashed red lines the steps "
                        "a restart resumed from.")]
    out += ["<h2>Advice</h2>", '<ol class="advice">']
    out += [
        f"<li><strong>{e(a.title)}</strong>: {e(a.evidence)}. Change: {e(a.change)}. "
        f"Saving: {e(a.saving)}.</li>"
        for a in r.advice
    ] or ["<li>None: no warning held during the run.</li>"]
    out.append("</ol>")
    out += _drill_section(r, key)
    if r.notes:
        out += ["<h3>Notes</h3>", "<ul>", *(f"<li>{e(n)}</li>" for n in r.notes), "</ul>"]
    out.append("</section>")
    return out


def _drill_section(r: RunReport, key: str) -> list[str]:
    """Where to look next: the traced window, the files to open, the hangs with stacks."""
    e, d = html.escape, r.drill
    out = [f'<h2 id="{key}-next">Where to look next</h2>']
    if d.profiles:
        out += [figure_html(_profile_figure(r), f"{key}-profile", "profiled window by group",
                            "The traced steps' time on each rank, by the group of the operator "
                            "that spent it (self time); other: Python between operators, and "
                            "waiting (for a collective: see the step by stage)."),
                *html_table("Traced window, share by group", PROFILE_COLUMNS, profile_rows(r)),
                *html_table("A traced step by stage: plan, the loop's timers, the trace",
                            ATTRIBUTED_COLUMNS, attributed_rows(r)),
                *html_table("Top operators by self time (rank 0)", OPERATOR_COLUMNS,
                            operator_rows(r))]
    if d.hangs:
        out += html_table("Hangs: who did not arrive", HANG_COLUMNS, hang_rows(r))
    links = [f'<li><a href="{e(t)}">{e(t)}</a> (chrome://tracing, ui.perfetto.dev)</li>'
             for t in d.traces if "trace" in t]
    out += ['<ul class="next">', *links, f"<li>{e(d.memory)}</li>", "</ul>"]
    for rank, text in d.dumps.items():
        out += [f"<details><summary>Stacks of rank {rank} (hang/rank-{rank}.txt)</summary>",
                f"<pre>{e(text)}</pre></details>"]
    return out


def _profile_figure(r: RunReport):
    profiles = r.drill.profiles
    labels = list(GROUPS)
    fig = new_figure(FIGURE_WIDTH, 2.6, 0.8, 0.5, labels)
    ax = fig.add_subplot()
    parts = [(g, GROUP_COLOURS[g], [p.groups_s[g] for p in profiles]) for g in GROUPS]
    xs = stacked_bars(ax, parts, 0.6)
    ax.set_xticks(xs, [f"rank {p.rank}" for p in profiles])
    ax.set_ylabel("seconds in the window")
    legend(ax)
    return fig


def _comparison(reports: list[RunReport]) -> list[str]:
    return [
        '<section id="comparison">', "<h2>Side by side</h2>",
        *html_table("Runs", COMPARE_COLUMNS, compare_rows(reports)),
        figure_html(_compare_figure(reports), "cmp", "runs compared",
                    "Training loss over steps, and the steady step's time by stage, per run."),
        "</section>",
    ]


def _stage_figure(r: RunReport):
    names = [name for _, name in STAGES if name in r.stages.measured_per_step]
    windows = r.stages.windows
    labels = [f"{w.first_step}-{w.last_step}" if w.last_step > w.first_step else str(w.first_step)
              for w in windows]
    bars = [w.seconds_per_step for w in windows]
    labels.append("median")
    bars.append(r.stages.measured_per_step)
    if r.stages.planned_per_step:
        labels.append("plan")
        bars.append(r.stages.planned_per_step)
    fig = new_figure(FIGURE_WIDTH, 3.4, 0.8, 0.75, names)
    ax = fig.add_subplot()
    parts = [(name, STAGE_COLOURS[name], [b.get(name) or 0.0 for b in bars]) for name in names]
    xs = stacked_bars(ax, parts, width=0.7)
    ax.set_xticks(xs, labels, rotation=30 if len(xs) > 8 else 0)
    ax.tick_params(axis="x", labelsize=NOTE_SIZE)
    ax.set_xlabel("steps")
    ax.set_ylabel("seconds per step")
    ax.set_title("Time per stage", loc="left", fontweight="bold")
    ax.spines[["top", "right"]].set_visible(False)
    legend(ax)
    return fig


def _cost_figure(r: RunReport):
    terms = r.cost.terms
    fig = new_figure(FIGURE_WIDTH, 1.9, 0.4, 0.55, [t.name for t in terms])
    ax = fig.add_subplot()
    left = 0.0
    total = r.cost.total_gpu_hours or 1.0
    for t in terms:
        ax.barh([0], [t.gpu_hours], left=[left], height=0.5,
                color=STAGE_COLOURS.get(t.name, "#0072B2"), label=t.name)
        if t.gpu_hours / total > 0.08:
            ax.text(left + t.gpu_hours / 2, 0, f"{t.gpu_hours / total:.0%}", ha="center",
                    va="center", color="white", size=NOTE_SIZE)
        left += t.gpu_hours
    ax.set_yticks([])
    ax.set_xlim(0, total * 1.02)
    ax.set_xlabel(
        f"GPU-hours (total {r.cost.total_gpu_hours:.3g} = {fmt_usd_exact(r.cost.total_usd)})"
    )
    ax.set_title("Cost", loc="left", fontweight="bold")
    ax.spines[["top", "right", "left"]].set_visible(False)
    legend(ax)
    return fig


def _plan_figure(r: RunReport):
    checks = [c for c in r.plan_vs_actual if c.error is not None]
    fig = new_figure(FIGURE_WIDTH, 0.6 + 0.45 * max(len(checks), 1), 1.7, 0.55, [])
    ax = fig.add_subplot()
    ys = list(range(len(checks)))
    errors = [c.error * 100 for c in checks]  # type: ignore[operator]
    # Red: a calibrated plan missed; grey: the plan's uncalibrated defaults did.
    colours = [
        "#D55E00" if c.flagged else ("#999999" if c.defaults else "#009E73") for c in checks
    ]
    ax.axvspan(-25, 25, color="#eeeeee")
    ax.axvline(0, color="#444444", linewidth=0.8)
    shown = [max(-ERROR_CLIP, min(ERROR_CLIP, x)) for x in errors]
    ax.barh(ys, shown, color=colours, height=0.55)
    for y, err, bar in zip(ys, errors, shown, strict=True):
        cut = "+" if bar != err else ""  # cut at the clip: the label says by how much
        ax.text(bar, y, f" {err:+,.0f}%{cut} ", va="center", ha="left" if err >= 0 else "right",
                size=NOTE_SIZE)
    ax.set_yticks(ys, [c.name for c in checks])
    ax.invert_yaxis()
    span = max([abs(x) for x in shown] + [40.0]) * 1.35
    ax.set_xlim(-span, span)
    ax.set_xlabel("actual versus plan, %")
    ax.set_title("Plan versus actual", loc="left", fontweight="bold")
    ax.spines[["top", "right"]].set_visible(False)
    return fig


def _curves_figure(r: RunReport):
    from matplotlib.figure import Figure

    c = r.curves
    fig = Figure(figsize=(FIGURE_WIDTH, 5.6))
    fig.subplots_adjust(left=0.08, right=0.98, bottom=0.09, top=0.93, hspace=0.45, wspace=0.22)
    axes = fig.subplots(2, 2)
    memory = {"cuda_peak": "peak CUDA memory, MB", "rss_added": "peak resident set added, MB"}.get(
        c.mem_kind, "peak resident set, MB"
    )
    panels = (
        (axes[0][0], "loss", [("train", c.step, c.loss), ("held-out", c.eval_step, c.eval_loss)]),
        (axes[0][1], "tokens/s", [("", c.step, c.tokens_per_s)]),
        (axes[1][0], "data-wait share", [("", c.step, c.data_share)]),
        (axes[1][1], memory, [("", c.step, [m / 1e6 for m in c.mem_bytes])]),
    )
    for ax, title, series in panels:
        for i, (label, xs, ys) in enumerate(series):
            if xs:
                ax.plot(xs, ys, color=LINE_COLOURS[i], label=label or None,
                        marker="o" if len(xs) < 3 or i else None, markersize=3)
        for step in c.checkpoints:
            ax.axvline(step, color="#888888", linestyle=":", linewidth=0.8)
        for step in c.restarts:
            ax.axvline(step, color="#D55E00", linestyle="--", linewidth=1.0)
        ax.set_title(title, loc="left", fontsize=NOTE_SIZE + 1, fontweight="bold")
        ax.spines[["top", "right"]].set_visible(False)
        ax.tick_params(labelsize=NOTE_SIZE)
    axes[0][0].legend(fontsize=NOTE_SIZE, frameon=False)
    for ax in axes[1]:
        ax.set_xlabel("step", fontsize=NOTE_SIZE)
    return fig


def _compare_figure(reports: list[RunReport]):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(FIGURE_WIDTH, 3.4))
    fig.subplots_adjust(left=0.08, right=0.98, bottom=0.2, top=0.9, wspace=0.3)
    loss, stages = fig.subplots(1, 2)
    for i, r in enumerate(reports):
        colour = LINE_COLOURS[i % len(LINE_COLOURS)]
        loss.plot(r.curves.step, r.curves.loss, color=colour, label=r.headline.run[-28:])
    loss.set_title("training loss", loc="left", fontsize=NOTE_SIZE + 1, fontweight="bold")
    loss.set_xlabel("step", fontsize=NOTE_SIZE)
    loss.legend(fontsize=NOTE_SIZE, frameon=False)
    parts = [
        (name, STAGE_COLOURS[name], [r.stages.measured_per_step.get(name, 0.0) for r in reports])
        for _, name in STAGES
    ]
    xs = stacked_bars(stages, parts, width=0.6)
    stages.set_xticks(xs, [f"{r.headline.layout} x{r.headline.world}" for r in reports])
    stages.set_title("seconds per steady step", loc="left", fontsize=NOTE_SIZE + 1,
                     fontweight="bold")
    stages.legend(fontsize=NOTE_SIZE - 1, frameon=False)
    for ax in (loss, stages):
        ax.spines[["top", "right"]].set_visible(False)
        ax.tick_params(labelsize=NOTE_SIZE)
    return fig
