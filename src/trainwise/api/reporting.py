"""`report()` and `write_report()`: where a run's time and money went, from its directory."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from trainwise.report.analysis import RunReport


def report(run_dir: str | Path) -> RunReport:
    """Where a run's time and money went, from its run directory alone: the headline,
    time per stage, cost, plan versus actual, curves, advice and where to look next.
    Writes nothing (write_report draws the page). A directory that is no run, or has no
    step yet, is a ReportError (a ConfigError)."""
    from trainwise.report.analysis import analyse
    from trainwise.report.rundir import load_run

    return analyse(load_run(run_dir))


def write_report(reports: RunReport | Sequence[RunReport], path: str | Path) -> Path:
    """The HTML page of one report, or of several side by side, written whole or not at
    all (a reader never sees half a page); its path."""
    from trainwise.report.analysis import RunReport
    from trainwise.report.run_html import render_html
    from trainwise.whole_file import write_whole

    page = Path(path)
    text = render_html([reports] if isinstance(reports, RunReport) else list(reports))
    page.parent.mkdir(parents=True, exist_ok=True)
    write_whole(page, text)
    return page


