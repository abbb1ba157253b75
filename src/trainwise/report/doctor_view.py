"""The doctor's checklist for people: a numbered list in the terminal (colour only when
it is one) and a self-contained HTML page with the bandwidth and scaling pictures."""

from __future__ import annotations

import html
from typing import Any

from trainwise.doctor.result import SYMBOLS, CheckResult, DoctorRecord
from trainwise.report.figures import (
    FIGURE_WIDTH,
    LINE_COLOURS,
    SVG_RC,
    figure_html,
    legend,
    new_figure,
)
from trainwise.report.plan_html import CSS

LINK_WORDS = {"intra_node": "within a node", "inter_node": "between nodes"}
STYLES = {"pass": "green", "warn": "yellow", "fail": "bold red", "skip": "dim"}
WORDS = {"pass": "passed", "warn": "warnings", "fail": "failed", "skip": "skipped"}


def counts_line(record: DoctorRecord) -> str:
    counts = {s: sum(c.status == s for c in record.checks) for s in WORDS}
    said = ", ".join(f"{n} {WORDS[s]}" for s, n in counts.items() if n)
    return (
        f"{said} on {record.world} worker{'s' if record.world > 1 else ''} "
        f"({record.device}, {record.strategy}) in {record.elapsed_s:.2g} s"
    )


def check_lines(index: int, check: CheckResult) -> list[tuple[str, str]]:
    """(text, status) lines of one check: the headline, then detail and fix indented."""
    figures = check.measured
    if check.expected:
        figures += f"  (expected {check.expected})" if figures else f"expected {check.expected}"
    lines = [(f"{index:>2}. {SYMBOLS[check.status]} {check.title}: {figures}", check.status)]
    table = _differences_table(check)
    if table:
        lines += [(f"       {row}", "detail") for row in table]
    elif check.detail:
        lines.append((f"       {check.detail}", "detail"))
    if check.fix and check.status in ("warn", "fail"):
        lines.append((f"       fix: {check.fix}", check.status))
    return lines


def _differences_table(check: CheckResult) -> list[str]:
    """The versions check's differences as a table: field, value, ranks."""
    diffs = check.data.get("differences") if check.name == "versions" else None
    if not diffs:
        return []
    rows = [("field", "value", "ranks")] + [
        (field, value, ",".join(map(str, ranks)))
        for field, values in diffs.items()
        for value, ranks in values.items()
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(2)]
    return [f"{a:<{widths[0]}}  {b:<{widths[1]}}  {c}" for a, b, c in rows]


def render_text(record: DoctorRecord) -> str:
    out = [f"trainwise doctor: {counts_line(record)}"]
    for i, check in enumerate(record.checks, 1):
        out += [text for text, _ in check_lines(i, check)]
    out.append(f"results: {record.run_dir}/doctor.json")
    return "\n".join(out)


def render_terminal(record: DoctorRecord, console: Any = None) -> None:
    """The checklist with colours in a terminal; rich writes plain text otherwise."""
    from rich.console import Console
    from rich.text import Text

    console = console or Console(highlight=False, soft_wrap=True)
    console.print(Text(f"trainwise doctor: {counts_line(record)}", style="bold"))
    for i, check in enumerate(record.checks, 1):
        for text, status in check_lines(i, check):
            console.print(Text(text, style=STYLES.get(status, "")))
    console.print(f"results: {record.run_dir}/doctor.json")


def render_html(record: DoctorRecord) -> str:
    rows = []
    for i, c in enumerate(record.checks, 1):
        fix = html.escape(c.fix) if c.fix and c.status in ("warn", "fail") else ""
        rows.append(
            f'<tr class="{c.status}"><td>{i}</td><td>{SYMBOLS[c.status]} {c.status}</td>'
            f'<td class="l">{html.escape(c.title)}</td><td class="l">{html.escape(c.measured)}'
            f'</td><td class="l">{html.escape(c.expected)}</td>'
            f'<td class="l">{html.escape(c.detail)}<br><b>{fix}</b></td></tr>'
        )
    figures = [f for f in (_bandwidth_figure(record), _scaling_figure(record)) if f]
    extra = (
        "tr.fail td{background:#fdecea}tr.warn td{background:#fff4e0}"
        "tr.pass td:nth-child(2){color:#1b7a2f}td{white-space:normal;vertical-align:top}"
    )
    return (
        '<!doctype html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>trainwise doctor</title><style>{CSS}{extra}</style></head><body><main>\n"
        f'<h1>trainwise doctor</h1>\n<p class="headline">{html.escape(counts_line(record))}'
        "</p>\n<table><thead><tr><th>#</th><th>status</th><th>check</th><th>measured</th>"
        "<th>expected</th><th>what it means</th></tr></thead><tbody>\n"
        + "\n".join(rows)
        + "\n</tbody></table>\n"
        + "\n".join(figures)
        + "\n</main></body></html>\n"
    )


def ops_index(series: list[tuple[str, str]], op: str) -> int:
    """One colour per collective; the link shows in the line style."""
    return list(dict.fromkeys(o for _, o in series)).index(op)


def _check(record: DoctorRecord, name: str) -> CheckResult | None:
    return next((c for c in record.checks if c.name == name and c.data.get("rows")), None)


def _bandwidth_figure(record: DoctorRecord) -> str | None:
    check = _check(record, "bandwidth")
    if check is None:
        return None
    import matplotlib

    rows = check.data["rows"]
    series = list(dict.fromkeys((r["link"], r["op"]) for r in rows))
    both = len({link for link, _ in series}) > 1
    labels = [f"{op} ({LINK_WORDS[link]})" if both else op for link, op in series]
    with matplotlib.rc_context(SVG_RC):
        fig = new_figure(FIGURE_WIDTH, 3.6, 0.8, 0.6, labels)
        ax = fig.add_subplot()
        for (link, op), label in zip(series, labels, strict=True):
            mine = [r for r in rows if r["op"] == op and r["link"] == link]
            ax.plot(
                [r["bytes"] for r in mine], [r["busbw"] / 1e9 for r in mine],
                marker="o" if link == "intra_node" else "s",
                linestyle="-" if link == "intra_node" else "--",
                color=LINE_COLOURS[ops_index(series, op) % len(LINE_COLOURS)], label=label,
            )
        ax.set_xscale("log", base=2)
        ax.set_xlabel("message size (bytes)")
        ax.set_ylabel("bus bandwidth (GB/s)")
        legend(ax)
        return figure_html(
            fig, "bw", "Bus bandwidth by message size",
            "Bus bandwidth (nccl-tests' definition) of each collective by message size.",
        )


def _scaling_figure(record: DoctorRecord) -> str | None:
    check = _check(record, "scaling")
    if check is None:
        return None
    import matplotlib

    rows = check.data["rows"]
    workers = [r["workers"] for r in rows]
    with matplotlib.rc_context(SVG_RC):
        labels = ["measured", "plan"]
        fig = new_figure(FIGURE_WIDTH, 3.2, 0.8, 0.6, labels)
        ax = fig.add_subplot()
        ax.plot(workers, [100 * r["efficiency"] for r in rows], marker="o",
                color=LINE_COLOURS[0], label="measured")
        ax.plot(workers, [100 * r["plan_efficiency"] for r in rows], marker="s",
                linestyle="--", color=LINE_COLOURS[1], label="plan")
        ax.set_xticks(workers)
        ax.set_xlabel("workers")
        ax.set_ylabel("scaling efficiency (%)")
        ax.set_ylim(0, max(110, *(100 * r["efficiency"] for r in rows)))
        legend(ax)
        return figure_html(
            fig, "scaling", "Scaling efficiency by worker count",
            "Throughput per worker against one worker's, measured and as planned.",
        )
