"""The doctor's pure parts: bus bandwidth factors, message sizes, version differences, the
data-wait share, the worker counts, the schema and the renderings."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest

from trainwise.config.schema import CHECK_NAMES
from trainwise.doctor.bandwidth import bus_factor, message_sizes
from trainwise.doctor.data_check import wait_share
from trainwise.doctor.result import CheckResult, DoctorRecord, schema
from trainwise.doctor.scaling import worker_counts
from trainwise.errors import ConfigError
from trainwise.faults import Faults, SlowDataset, parse_faults
from trainwise.run.job.versions import differences, mismatch_lines

DOCS_SCHEMA = Path(__file__).parents[2] / "docs" / "doctor.schema.json"


@pytest.mark.parametrize("n", [2, 3, 4, 8, 64])
def test_bus_factors_are_nccl_tests_definitions(n: int):
    assert bus_factor("all_reduce", n) == pytest.approx(2 * (n - 1) / n)
    assert bus_factor("all_gather", n) == pytest.approx((n - 1) / n)
    assert bus_factor("reduce_scatter", n) == pytest.approx((n - 1) / n)
    assert bus_factor("broadcast", n) == 1.0
    # alltoall: each rank sends (n - 1) / n of its buffer to the others (src/alltoall.cu).
    assert bus_factor("all_to_all", n) == pytest.approx((n - 1) / n)
    with pytest.raises(ValueError):
        bus_factor("scatter", n)


def test_message_sizes_run_from_1k_to_the_bound_in_whole_elements_per_rank():
    sizes = message_sizes(64 * 2**20, world=3)
    assert sizes[0] <= 1024 and sizes[-1] <= 64 * 2**20
    assert sizes[-1] > 16 * 2**20  # reaches the last step under the bound
    assert all(s % (4 * 3) == 0 for s in sizes)
    assert sizes == sorted(sizes) and len(set(sizes)) == len(sizes)


def test_differences_name_the_field_the_values_and_the_ranks():
    same = {"python": "3.11", "torch": "2.13.0", "code": "abc", "host": "a"}
    ranks = [same, {**same, "host": "b"}, {**same, "torch": "2.12.1"}, dict(same)]
    diffs = differences(ranks)
    assert diffs == {"torch": {"2.13.0": [0, 1, 3], "2.12.1": [2]}}  # host is not compared
    assert mismatch_lines(diffs) == ["torch: 2.13.0 on ranks 0,1,3; 2.12.1 on rank 2"]
    assert differences([same, dict(same)]) == {}


def test_wait_share_adds_in_line_and_overlaps_with_workers():
    assert wait_share(0.1, 0.3, workers=0) == pytest.approx(0.25)  # the loader runs in the step
    assert wait_share(0.1, 0.3, workers=2) == 0.0  # prefetched beside a slower step
    assert wait_share(0.4, 0.1, workers=1) == pytest.approx(0.75)  # the step waits 0.3 of 0.4
    assert wait_share(0.0, 0.0, workers=0) == 0.0


def test_worker_counts_double_up_to_the_world():
    assert worker_counts(1) == [1]
    assert worker_counts(2) == [1, 2]
    assert worker_counts(6) == [1, 2, 4, 6]
    assert worker_counts(8) == [1, 2, 4, 8]


def test_only_accepts_check_names_and_says_which_one_is_not():
    from trainwise.cli.doctor import parse_only

    assert parse_only(None) is None
    assert parse_only("versions, bandwidth") == ["versions", "bandwidth"]
    with pytest.raises(ConfigError) as err:
        parse_only("versions,speed")
    assert "speed" in str(err.value) and "bandwidth" in str(err.value)


def test_the_checklist_runs_every_named_check_in_order():
    from trainwise.doctor.checklist import CHECKS

    assert tuple(CHECKS) == CHECK_NAMES


def test_documented_schema_is_the_records_schema():
    """docs/doctor.schema.json is what DoctorRecord validates; regenerate it on change:
    python -c "import json; from trainwise.doctor.result import schema; ..."."""
    assert json.loads(DOCS_SCHEMA.read_text()) == json.loads(json.dumps(schema()))


def _record(*statuses: str) -> DoctorRecord:
    checks = [
        CheckResult(
            name=f"c{i}",
            title=f"check {i}",
            status=s,
            measured="1 GB/s",
            expected="2 GB/s",
            detail="why",
            fix="do this" if s in ("warn", "fail") else None,
        )
        for i, s in enumerate(statuses)
    ]
    return DoctorRecord(
        created=0.0, run_dir="runs/x", world=2, device="cpu", strategy="ddp", elapsed_s=3.0,
        checks=checks,
    )


def test_failed_means_a_check_failed():
    assert _record("pass", "warn", "skip").failed is False
    assert _record("pass", "fail").failed is True


def test_text_rendering_numbers_the_checks_and_shows_fixes_on_warn_or_fail_only():
    from trainwise.report.doctor_view import render_text

    text = render_text(_record("pass", "warn", "fail", "skip"))
    lines = text.splitlines()
    assert lines[0].startswith("trainwise doctor: 1 passed, 1 warnings, 1 failed, 1 skipped")
    assert " 1. ✓ check 0: 1 GB/s  (expected 2 GB/s)" in lines
    assert " 3. ✗ check 2: 1 GB/s  (expected 2 GB/s)" in lines
    assert text.count("fix: do this") == 2
    assert "\x1b[" not in text


def test_terminal_rendering_has_colour_only_in_a_terminal():
    import io

    from rich.console import Console

    from trainwise.report.doctor_view import render_terminal

    record = _record("pass", "fail")
    plain, tty = io.StringIO(), io.StringIO()
    render_terminal(record, Console(file=plain, force_terminal=False, width=200))
    render_terminal(record, Console(file=tty, force_terminal=True, width=200))
    assert "\x1b[" not in plain.getvalue() and "✗ check 1" in plain.getvalue()
    assert "\x1b[" in tty.getvalue()


def test_a_slowed_dataset_sleeps_per_sample_and_keeps_its_items(monkeypatch):
    faults = parse_faults("slow_data@seconds=0.02;slow_network@gbps=0.5")
    assert [(f.kind, f.seconds, f.gbps) for f in faults] == [
        ("slow_data", 0.02, None),
        ("slow_network", None, 0.5),
    ]
    data = [10, 20, 30]
    assert Faults.from_env(0, Path("unused"), 0, {}).data(data) is data
    fault = {"TRAINWISE_FAULTS": "slow_data@seconds=0.02"}
    slow = Faults.from_env(0, Path("unused"), 0, fault).data(data)
    assert isinstance(slow, SlowDataset) and len(slow) == 3
    slept: list[float] = []
    monkeypatch.setattr("trainwise.faults.time", SimpleNamespace(sleep=slept.append))
    assert [slow[i] for i in range(3)] == data
    assert slept == [0.02] * 3  # each sample's load waits the fault's seconds


def test_the_fsdp_verdict_is_finite_for_the_default_job():
    """The bandwidth check's verdict comes from the planner: a measured link in, a share out."""
    from dataclasses import replace

    from trainwise.config import load_config
    from trainwise.plan.estimate import evaluate
    from trainwise.plan.inputs import resolve_inputs

    inputs = resolve_inputs(load_config(None, {"cluster.gpu": "cpu", "plan.gpus": 2}))
    slow = replace(inputs, hardware=replace(inputs.hardware, intra_bps=1e6))
    fast = replace(inputs, hardware=replace(inputs.hardware, intra_bps=1e12))
    s, f = evaluate(slow, "fsdp-full").step, evaluate(fast, "fsdp-full").step
    assert math.isfinite(s.exposed_comm / s.total)
    assert s.exposed_comm / s.total > f.exposed_comm / f.total


def test_a_version_mismatch_renders_as_a_table_of_field_value_and_ranks():
    from trainwise.report.doctor_view import render_text

    record = _record("fail")
    record.checks[0] = record.checks[0].model_copy(
        update={
            "name": "versions",
            "data": {
                "differences": {
                    "torch": {"2.13.0": [0, 2], "2.12.1": [1]},
                    "nccl": {"2.21": [0, 1], "2.20": [2]},
                }
            },
        }
    )
    rows = [line.split() for line in render_text(record).splitlines()[2:6]]
    assert rows == [
        ["field", "value", "ranks"],
        ["torch", "2.13.0", "0,2"],
        ["torch", "2.12.1", "1"],
        ["nccl", "2.21", "0,1"],
    ]


def test_collective_checks_are_skipped_after_a_version_mismatch_and_a_raising_check_fails(
    monkeypatch: pytest.MonkeyPatch,
):
    from types import SimpleNamespace

    from trainwise.doctor import checklist

    def result(name: str, status: str):
        return lambda ctx: CheckResult(name=name, title=name, status=status)

    def broken(ctx):
        raise RuntimeError("first line\nthe disk went away")

    fakes = {name: result(name, "pass") for name in CHECK_NAMES}
    fakes["versions"] = result("versions", "fail")
    fakes["disk"] = broken
    monkeypatch.setattr(checklist, "CHECKS", fakes)
    ctx = SimpleNamespace(env=SimpleNamespace(rank=0), gather=lambda obj: [obj])
    out = {r.name: r for r in checklist.run_checks(ctx)}
    assert list(out) == list(CHECK_NAMES)
    assert [out[n].status for n in ("bandwidth", "data", "scaling", "smoke")] == ["skip"] * 4
    assert out["memory"].status == "pass"
    assert out["disk"].status == "fail" and "the disk went away" in out["disk"].measured
    assert "RuntimeError" in out["disk"].data["traceback"]
    only = checklist.run_checks(ctx, ["memory"])
    assert [r.name for r in only] == ["memory"]


def test_links_are_timed_within_each_node_and_across_nodes_on_rails():
    from trainwise.doctor.bandwidth import link_groups

    assert link_groups(["a", "a", "a", "a"]) == {"intra_node": [[0, 1, 2, 3]], "inter_node": []}
    assert link_groups(["a", "a", "b", "b"]) == {
        "intra_node": [[0, 1], [2, 3]],
        "inter_node": [[0, 2], [1, 3]],
    }
    # One worker per node: nothing within a node to time.
    assert link_groups(["a", "b", "c"]) == {"intra_node": [], "inter_node": [[0, 1, 2]]}


def test_the_cuda_memory_check_holds_allocated_bytes_against_the_plans_tensors():
    """torch.cuda.max_memory_allocated counts tensors, not the CUDA context the plan adds
    (on a GPU the check once called a plan of 10 MB of tensors plus 1 GB of context 92 %
    over); the context still counts for the fit."""
    from types import SimpleNamespace

    import torch

    from trainwise.doctor.checks import check_memory
    from trainwise.plan.model.memory import MemoryEstimate

    plan = MemoryEstimate(params=1e6, grads=1e6, optimizer=2e6, activations=6e6, buffers=0.0,
                          overhead=1e9)

    def ran(peak: float, budget: float = 80e9) -> CheckResult:
        decision = SimpleNamespace(estimate=plan, budget_bytes=budget)
        return check_memory(SimpleNamespace(
            device=torch.device("cuda"), measured={"smoke_peak_bytes": peak},
            slowest=lambda value: value, job=SimpleNamespace(decision=decision),
        ))

    near = ran(10.5e6)
    assert near.status == "pass" and near.data["plan_bytes"] == 10e6, near
    assert ran(30e6).status == "warn"  # 200 % over the plan's tensors
    assert ran(10e6, budget=1.005e9).status == "fail"  # fits only without the context


def test_a_scaling_efficiency_far_below_the_plans_warns_with_what_it_costs():
    """59 % measured against 99 % planned once passed with a tick: beyond the tolerance it
    warns, and says the cost: each step 99/59 as long, charged to the planned job."""
    from trainwise.doctor.gap import JobTerms
    from trainwise.doctor.scaling import judge_scaling

    def rows(two_workers_tokens_per_s: float) -> list[dict]:
        return [
            {"workers": 1, "step_s": 1.0, "tokens_per_s": 1000.0, "plan_tokens_per_s": 500.0},
            {"workers": 2, "step_s": 1.0, "tokens_per_s": two_workers_tokens_per_s,
             "plan_tokens_per_s": 990.0},
        ]

    terms = JobTerms(step_s=2.0, steps=10_000, gpus=2, price_per_gpu_hour=3.6)
    far = judge_scaling(rows(1180.0), terms)  # 59 % on 2 workers, the plan 99 %
    assert far.status == "warn", far
    assert far.measured.startswith("59% efficiency") and "99% (plan" in far.expected
    assert "passes at >= 74%" in far.expected
    # 2 s x 99/59 = 3.356 s a step: +68 %, 1356 s more per 1000 steps on 2 workers at
    # $3.6 an hour = $2.71; 10,000 steps: 3.77 h more than the planned 5.56 h.
    assert far.fix.startswith("+68% step time = $2.71 per 1000 steps on 2 workers"), far.fix
    assert "3.8 h more on the planned 5.6 h of 10000 steps" in far.fix, far.fix
    near = judge_scaling(rows(1700.0), terms)  # 85 %: within 25 % of 99 %
    assert near.status == "pass" and near.fix is None, near


def test_a_gap_on_a_machine_without_a_price_is_told_in_time():
    from trainwise.doctor.gap import JobTerms, short_of

    terms = JobTerms(step_s=0.1, steps=200, gpus=2, price_per_gpu_hour=0.0)
    assert terms.cost_of(0.15) == "+50% step time = 50 s more per 1000 steps (10 s more on " \
        "the planned 20 s of 200 steps)"
    assert short_of(0.7, 1.0) and not short_of(0.8, 1.0) and not short_of(2.0, 1.0)
    assert terms.cost_of(0.1000016).startswith("+0.0016% step time"), terms.cost_of(0.1000016)
