"""bench/published.py's table: every published run that ran fits its plan, with memory
within 10 % where the run published it, and the plan's tokens/s within 10 % of the
published on average (issue 24, Checks). Each row's error is the bench's to print."""

from __future__ import annotations

import importlib.util
import statistics
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "published.py"


def load_bench():
    spec = importlib.util.spec_from_file_location("published", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules["published"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


bench = load_bench()


@pytest.mark.parametrize("run", bench.RUNS, ids=[r.name for r in bench.RUNS])
def test_every_published_run_fits_its_plan(run):
    plan = bench.plan_run(run)
    assert plan.fits, f"{run.name}: {plan.memory.total / 1e9:.1f} GB planned"
    if run.memory_gib:
        assert plan.memory.total / bench.GIB == pytest.approx(run.memory_gib, rel=0.10)


def test_every_run_names_its_source():
    assert all(r.source and r.tokens_per_s_per_gpu > 0 for r in bench.RUNS)


def test_the_planned_tokens_per_second_are_within_10_percent_on_average():
    errors = [
        abs(bench.plan_run(r).tokens_per_s / r.gpus / r.tokens_per_s_per_gpu - 1)
        for r in bench.RUNS
    ]
    assert statistics.mean(errors) <= 0.10, [f"{e:.1%}" for e in errors]


def test_the_llama3_405b_run_fits_its_published_layout():
    # Meta ran it (arXiv 2407.21783, Table 4): the plan of its layout must fit.
    plan, published = bench.plan_llama3_405b()
    assert plan.fits, f"{plan.memory.total / bench.GIB:.1f} GiB planned"
    assert published > 0
