"""`trainwise report RUN [RUN ...]`: where the time and the money went, from run
directories alone. One run: RUN/report.html is (re)written and the summary printed. Several:
one page compares them side by side. trainwise.api's report reads each run."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from trainwise.api import report, write_report

FORMATS = ("text", "md", "json", "html")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "report",
        help="where a run's time and money went, plan versus actual, as pictures",
        description="Read run directories written by `trainwise train` and report: time per "
        "stage, cost, plan versus actual, curves and advice. One run: writes RUN/report.html "
        "and prints the summary; several: compares them.",
    )
    p.add_argument("runs", nargs="+", metavar="RUN", help="run directories")
    p.add_argument(
        "--format",
        choices=FORMATS,
        default="text",
        help="what to print: text (default), md or json; html prints only the page's path",
    )
    p.add_argument(
        "-o",
        "--output",
        metavar="FILE",
        help="the HTML page (default: RUN/report.html for one run, report-compare.html "
        "here for several)",
    )
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    reports = [report(path) for path in args.runs]  # bad input: one line, exit 2
    page = Path(args.output) if args.output else default_page(args.runs)
    write_report(reports, page)
    if args.format == "html":
        print(page)
        return 0
    print(render(reports, args.format))
    print(f"trainwise: the report with its pictures is {page}", file=sys.stderr)
    return 0


def default_page(runs: list[str]) -> Path:
    return Path(runs[0]) / "report.html" if len(runs) == 1 else Path("report-compare.html")


def render(reports: list, fmt: str) -> str:
    from trainwise.report import run_view

    one = len(reports) == 1
    if fmt == "json":
        return run_view.to_json(reports).rstrip("\n")
    if fmt == "md":
        md = (
            run_view.render_markdown(reports[0])
            if one
            else run_view.render_compare_markdown(reports)
        )
        return md.rstrip("\n")
    if one:
        return run_view.render_text(reports[0])
    return "\n\n".join(
        [run_view.render_compare_text(reports), *(run_view.render_text(r) for r in reports)]
    )
