"""Pictures for the HTML pages (plan, doctor): matplotlib figures written as inline SVG.

The figures are made with `matplotlib.figure.Figure`, not pyplot: nothing is registered in
pyplot's global figure list (so nothing is left open), and the caller's backend is left
alone. matplotlib is imported only when a picture is drawn.
"""

from __future__ import annotations

import html
import io
import re
from collections.abc import Sequence

LINE_COLOURS = ("#0072B2", "#E69F00", "#009E73", "#CC79A7", "#D55E00", "#56B4E9", "#000000")
# SVG text as <text> elements (small, searchable, read by screen readers) and a fixed hash
# salt, so the same plan always gives the same page.
TEXT_SIZE = 9  # points: ticks, axis labels
NOTE_SIZE = 8  # points: notes on the bars, legends
LEGEND_SIZE = NOTE_SIZE
FIGURE_WIDTH = 9.0  # inches; the page scales the pictures down to its width
SVG_RC = {"svg.fonttype": "none", "svg.hashsalt": "trainwise-plan", "font.size": TEXT_SIZE}
# Leave out the <metadata> block (a date, matplotlib's address).
SVG_METADATA = {"Creator": None, "Date": None, "Format": None, "Type": None}


def figure_html(fig, key: str, label: str, caption: str) -> str:
    picture = svg(fig, key, label)
    return f"<figure>\n{picture}\n<figcaption>{html.escape(caption)}</figcaption>\n</figure>"


def svg(fig, key: str, label: str) -> str:
    """`fig` as an inline <svg>: the XML prolog, doctype and comments stripped, every id
    prefixed with `key` (several pictures share a page, and matplotlib numbers its ids the
    same way in each), a role and an aria-label, and a <title>."""
    buf = io.StringIO()
    fig.savefig(buf, format="svg", metadata=SVG_METADATA)
    text = buf.getvalue()
    text = text[text.index("<svg") :]
    text = re.sub(r"<!--.*?-->", "", text, flags=re.DOTALL)
    text = re.sub(r'\bid="', f'id="{key}-', text)
    text = text.replace('href="#', f'href="#{key}-').replace("url(#", f"url(#{key}-")
    label = html.escape(label)
    head_end = text.index(">") + 1
    head = text[:head_end].replace("<svg ", f'<svg role="img" aria-label="{label}" ', 1)
    return f"{head}\n<title>{label}</title>{text[head_end:]}".rstrip()


def text_width(texts: Sequence[str], size: float) -> float:
    """Inches the widest of `texts` (lines of) takes at `size` points."""
    from matplotlib.font_manager import FontProperties
    from matplotlib.textpath import text_to_path

    prop = FontProperties(size=size)
    widths = [
        text_to_path.get_text_width_height_descent(line, prop, ismath=False)[0]
        for text in texts
        for line in text.split("\n")
    ]
    return max(widths, default=0.0) / 72.0


def new_figure(width: float, height: float, left: float, bottom: float, legend: Sequence[str]):
    """A figure with margins in inches, measured rather than found by a layout engine (which
    draws each figure twice): `left` and `bottom` for the tick labels, the right margin
    for a legend of the labels `legend` beside the axes."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height))
    right = text_width(legend, LEGEND_SIZE) + 0.75
    fig.subplots_adjust(
        left=left / width, right=1 - right / width, bottom=bottom / height, top=1 - 0.35 / height
    )
    return fig


def stacked_bars(ax, parts: Sequence[tuple[str, str, Sequence[float]]], width: float) -> list[int]:
    """One bar per position, stacked from `parts` (label, colour, a height per bar) in
    order; the bars' x positions are returned for the ticks."""
    xs = list(range(len(parts[0][2]))) if parts else []
    bottom = [0.0] * len(xs)
    for label, colour, heights in parts:
        ax.bar(xs, heights, bottom=bottom, width=width, color=colour, label=label)
        bottom = [a + b for a, b in zip(bottom, heights, strict=True)]
    return xs


def legend(ax) -> None:
    ax.legend(
        loc="upper left",
        bbox_to_anchor=(1.02, 1.0),
        borderaxespad=0,
        frameon=False,
        fontsize=LEGEND_SIZE,
    )
