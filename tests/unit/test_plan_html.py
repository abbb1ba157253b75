"""Unit tests of trainwise.report.plan_html: the plan as one self-contained HTML page.

The page is parsed with html.parser, which checks that every element is closed in order
and collects what the page would fetch (src/href attributes, url(...) references)."""

from __future__ import annotations

import html
import re
from dataclasses import replace
from html.parser import HTMLParser

import pytest

from trainwise.config import load_config
from trainwise.plan.inputs import PLAN_DEFAULTS, resolve_inputs
from trainwise.plan.planner import make_plan
from trainwise.plan.search import describe_setup
from trainwise.plan.units import fmt_usd
from trainwise.report.plan_html import render_html
from trainwise.report.plan_view import config_lines, is_chosen, table_plans

SWEEP = [1, 2, 4, 8, 16]
# The only absolute URLs allowed on the page: the SVG and XLink namespaces of inline <svg>.
NAMESPACES = {"http://www.w3.org/2000/svg", "http://www.w3.org/1999/xlink"}
VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source"}
VOID |= {"track", "wbr"}


class PageChecker(HTMLParser):
    """Records the structural errors (an end tag that does not close the innermost open
    element, elements left open), the <svg> elements' attributes, every reference the page
    could follow, every id, and the text outside tags."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.stack: list[str] = []
        self.errors: list[str] = []
        self.tags: list[str] = []
        self.svgs: list[dict[str, str | None]] = []
        self.refs: list[str] = []
        self.ids: list[str] = []
        self.text: list[str] = []

    def handle_starttag(self, tag, attrs):
        self._record(tag, attrs)
        if tag not in VOID:
            self.stack.append(tag)

    def handle_startendtag(self, tag, attrs):
        self._record(tag, attrs)

    def handle_endtag(self, tag):
        if not self.stack or self.stack[-1] != tag:
            self.errors.append(f"</{tag}> closes {self.stack[-1:] or 'nothing'}")
        else:
            self.stack.pop()

    def handle_data(self, data):
        self.text.append(data)

    def _record(self, tag, attrs):
        self.tags.append(tag)
        values = dict(attrs)
        if tag == "svg":
            self.svgs.append(values)
        for name, value in attrs:
            if name in ("src", "href", "action", "srcset") or name.endswith(":href"):
                self.refs.append(value or "")
            if name == "id":
                self.ids.append(value or "")

    def close(self):
        super().close()
        if self.stack:
            self.errors.append(f"left open: {self.stack}")


def check(page: str) -> PageChecker:
    parser = PageChecker()
    parser.feed(page)
    parser.close()
    return parser


@pytest.fixture(scope="module")
def inputs():
    return resolve_inputs(load_config(None, base=PLAN_DEFAULTS))


@pytest.fixture(scope="module")
def plan(inputs):
    return make_plan(inputs, SWEEP)


@pytest.fixture(scope="module")
def page(plan) -> str:
    return render_html(plan)


@pytest.fixture(scope="module")
def parsed(page) -> PageChecker:
    return check(page)


def test_page_parses_with_every_element_closed(page, parsed):
    assert page.startswith("<!DOCTYPE html>")
    assert parsed.errors == []
    for tag in ("html", "head", "body", "style", "table", "figure"):
        assert tag in parsed.tags
    assert "<?xml" not in page and "<!DOCTYPE svg" not in page  # the SVG prolog is stripped


def test_three_pictures_with_a_sweep_each_labelled(page, parsed):
    assert page.count("<svg") == 3
    assert len(parsed.svgs) == 3
    labels = [svg.get("aria-label") for svg in parsed.svgs]
    assert all(svg.get("role") == "img" for svg in parsed.svgs)
    assert labels[0] == "memory per GPU"
    assert "cost" in labels[1] and "scaling" in labels[2]


def test_two_pictures_without_a_sweep(inputs):
    plan = make_plan(inputs)
    page = render_html(plan)
    parsed = check(page)
    assert parsed.errors == []
    assert page.count("<svg") == 2
    assert [svg.get("aria-label") for svg in parsed.svgs][0] == "memory per GPU"
    assert "Scaling sweep" not in page


def test_nothing_is_fetched(page, parsed):
    urls = set(re.findall(r"[a-z][a-z0-9+.-]*://[^\s\"'<>)]+", page, flags=re.IGNORECASE))
    assert urls <= NAMESPACES
    assert parsed.refs, "the SVG markers are referenced by fragment: the check sees them"
    for ref in parsed.refs:
        assert ref.startswith("#"), ref  # a fragment inside the page, never a URL
    for ref in re.findall(r"url\(([^)]*)\)", page):
        assert ref.startswith("#"), ref
    assert "script" not in parsed.tags and "link" not in parsed.tags and "img" not in parsed.tags
    assert "@import" not in page and "@font-face" not in page


def test_ids_are_unique_and_every_fragment_resolves(parsed):
    # Three matplotlib pictures number their ids alike (figure_1, patch_1, ...) unless
    # prefixed per picture.
    assert len(parsed.ids) == len(set(parsed.ids))
    targets = {ref[1:] for ref in parsed.refs}
    assert targets <= set(parsed.ids)


def test_shows_the_recommendation_its_cost_and_every_strategy(plan, page, parsed):
    text = "".join(parsed.text)
    rec = plan.recommendation
    assert f"Recommendation: {describe_setup(rec.choice.setup)}" in text
    assert fmt_usd(plan.best.cost.total_usd) in text
    for s in plan.strategies:
        assert s.name in text
    for reason in rec.reasons:
        assert reason in text
    for line in config_lines(plan):  # the job file's keys
        assert html.escape(line) in page
    for question, answer in plan.questions:
        assert question in text and answer in text
    # The recommended configuration's row is the highlighted one, in both strategy tables.
    rec_rows = re.findall(r'<tr class="rec"><td class="l">([^<]*)</td>', page)
    label = next(label for label, s in table_plans(plan) if is_chosen(plan, s))
    assert rec_rows == [label + "*", label + "*"]


def test_sections_in_order(page):
    marks = [
        "<h1>",
        'id="recommendation"',
        'aria-label="memory per GPU"',
        'aria-label="cost',
        'aria-label="scaling',
        "<caption>Memory per GPU",
        "<caption>Step in seconds",
        "<caption>Scaling sweep",
        'id="questions"',
        'id="warnings"',
    ]
    at = [page.index(mark) for mark in marks]
    assert at == sorted(at)


def test_text_is_escaped(plan):
    hostile = "<script>alert('x')</script> & <b>"
    page = render_html(replace(plan, warnings=[hostile], questions=[(hostile, hostile)]))
    parsed = check(page)
    assert parsed.errors == []
    assert "<script>" not in page and "<b>" not in page
    assert "&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt; &amp; &lt;b&gt;" in page
    assert "script" not in parsed.tags
    assert hostile in "".join(parsed.text)


def test_knee_is_marked(plan):
    name = next(r.strategy for r in plan.sweep if r.gpus == 8)  # a strategy the sweep drew
    page = render_html(replace(plan, knees={**plan.knees, name: 8}))
    assert f"knee of {name}" in page
    assert f"{name} (knee)" in page  # the sweep table marks the same row
    assert "knee of" not in render_html(replace(plan, knees={}))


def test_same_plan_same_page(plan, page):
    assert render_html(plan) == page


def test_bare_parameter_count_without_activations():
    cfg = load_config(None, flags={"plan.params": 1_000_000_000}, base=PLAN_DEFAULTS)
    plan = make_plan(resolve_inputs(cfg))
    assert all(s.memory.activations is None for s in plan.strategies)
    page = render_html(plan)
    assert check(page).errors == []
    assert page.count("<svg") == 2
    assert "activations (not modelled)" in page


def _drawn(fig):
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    return canvas.get_renderer()


def test_a_layout_100x_larger_does_not_squash_the_ones_that_fit(plan):
    from trainwise.report.plan_html import _memory_figure, memory_cut

    assert memory_cut(plan) is None  # nothing out of scale here: the axis is whole
    huge = [
        replace(s, memory=replace(s.memory, overhead=100 * s.memory.total), fits=False)
        if s.name == "single"
        else s
        for s in plan.strategies
    ]
    fitting = max(s.memory.total for s in huge if s.fits) / 1e9
    wide = replace(plan, strategies=huge)
    ax = _memory_figure(wide).axes[0]
    # The widest fitting bar keeps a tenth of the axis or more (uncut: under a 150th).
    assert fitting / ax.get_xlim()[1] > 0.1
    assert max(p.get_width() + p.get_x() for p in ax.patches) <= memory_cut(wide) + 1e-9
    page = render_html(wide)
    assert "does not fit (bar cut)" in page
    assert check(page).errors == []


def test_knee_labels_do_not_overlap(plan):
    from matplotlib.text import Text

    from trainwise.report.plan_html import _scaling_figure

    names = sorted({r.strategy for r in plan.sweep})
    at_once = replace(plan, knees=dict.fromkeys(names, 8))  # every knee at one point
    fig = _scaling_figure(at_once)
    renderer = _drawn(fig)
    labels = [t for t in fig.axes[0].texts if t.get_text().startswith("knee of")]
    assert len(labels) >= 3
    # The labels' text (an Annotation's own extent includes its line to the ring).
    boxes = [Text.get_window_extent(t, renderer) for t in labels]
    for i, a in enumerate(boxes):
        for b in boxes[i + 1 :]:
            assert not a.overlaps(b), "two knee labels overlap"
