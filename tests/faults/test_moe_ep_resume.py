"""Expert parallelism through faults and across layouts, on the shared job_args (12 steps,
a checkpoint every 4, global batch 16) with the tiny MoE, its balancing loss and bias
update on: a worker SIGKILLed under FSDP 2 x ep 2 resumes to weights bit-identical to the
run left alone; that run's checkpoint (experts sharded over ep) resumes on one process
(ep 1: every expert whole on the rank, the dense layout of the same model) and one
written there resumes under ep 2 again, each continuing the uninterrupted run's losses
(1e-6). The uninterrupted run's own records show the experts' telemetry: the all-to-all
time, the tokens per expert and the imbalance, in metrics.jsonl, summary.json and the
report, beside the plan's; and a calibration from the run takes its imbalance."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from faulty import assert_identical, final_weights, finish, job_args, kill, start, wait_for_pid

from helpers import hang_limit, read_records, run_cli, run_main

pytestmark = pytest.mark.dist

MOE = ("--set", "model.name='moe-tiny'", "--set", "data.seq_len=32",
       "--set", "moe.aux_loss_coef=0.05", "--set", "moe.bias_update_rate=0.01")
EP2 = ("--set", "parallel.ep=2")
LIMIT = hang_limit(launches=2, steps=24)
RTOL = 1e-6


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_records(run_dir)}


@pytest.fixture(scope="module")
def ep_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted FSDP 2 x ep 2 run the others must match."""
    root = tmp_path_factory.mktemp("moe_ep")
    run_dir = root / "ep2"
    done = run_cli(*job_args(run_dir, 2, "fsdp", *MOE, *EP2), cwd=root, timeout=LIMIT)
    assert done.returncode == 0, done.stderr
    return run_dir


def resume(workdir: Path, checkpoint: Path, name: str, nproc: int, strategy: str,
           *extra: str) -> Path:
    run_dir = workdir / name
    args = job_args(run_dir, nproc, strategy, *MOE, *extra,
                    "--set", f"checkpoint.resume={checkpoint}")
    done = run_cli(*args, cwd=workdir, timeout=LIMIT)
    assert done.returncode == 0, done.stderr
    return run_dir


def assert_continues(written: Path, resumed: Path, after: int) -> None:
    before, got = losses(written), losses(resumed)
    assert sorted(got) == list(range(after + 1, max(before) + 1))
    for step, loss in got.items():
        assert loss == pytest.approx(before[step], rel=RTOL), f"step {step}"


@pytest.mark.timeout(hang_limit(launches=6, steps=72))
def test_sigkill_under_ep_resumes_exactly(workdir: Path, ep_run: Path):
    broken = workdir / "broken"
    proc = start(job_args(broken, 2, "fsdp", *MOE, *EP2), workdir, faults="pause@step=10,rank=1")
    pid = wait_for_pid(proc, broken / "faults" / "pause-step-10.pid", LIMIT)
    kill(pid)  # after step 10; the last checkpoint is step 8
    rc, _, err = finish(proc, LIMIT)
    assert rc == 0, err
    assert "resuming from step 8" in err
    assert_identical(final_weights(ep_run), final_weights(broken))


@pytest.mark.timeout(hang_limit(launches=6, steps=72))
def test_ep_checkpoints_load_into_the_dense_layout_and_back(workdir: Path, ep_run: Path):
    dense = resume(workdir, ep_run / "checkpoints" / "step-00000004", "ep1", 1, "single")
    assert_continues(ep_run, dense, 4)
    again = resume(workdir, dense / "checkpoints" / "step-00000008", "ep2-again", 2, "fsdp",
                   *EP2)
    assert_continues(ep_run, again, 8)


def test_the_run_records_its_experts(workdir: Path, ep_run: Path):
    records = read_records(ep_run)
    assert all(r["a2a_s"] > 0 and r["sync_s"] >= r["a2a_s"] for r in records)
    # 16 samples x 32 tokens x top-2, in each of the 2 MoE layers, over 8 experts.
    assert all(len(r["expert_tokens"]) == 8 and sum(r["expert_tokens"]) == 16 * 32 * 2 * 2
               for r in records)
    assert all(r["expert_imbalance"] >= r["ep_imbalance"] >= 1.0 for r in records)
    summary = json.loads((ep_run / "summary.json").read_text())
    assert 0 < summary["a2a_share"] < 1 and summary["ep_imbalance"] >= 1.0
    made = run_main("report", str(ep_run), "--format", "json", cwd=workdir)
    assert made.returncode == 0, made.stderr
    checks = {c["name"]: c for c in json.loads(made.stdout)["runs"][0]["plan_vs_actual"]}
    assert checks["expert load imbalance"]["actual"] == pytest.approx(summary["ep_imbalance"])
    # plan.json priced the job as the planner's MoE model does: the imbalance and the
    # all-to-alls' seconds, which the report sets the measured share beside.
    plan = json.loads((ep_run / "plan.json").read_text())
    assert plan["name"] == "ep2 + fsdp-full" and plan["moe_imbalance"] == 1.25
    assert checks["expert load imbalance"]["planned"] == 1.25
    share = checks["all-to-all share"]
    assert share["planned"] == pytest.approx(plan["all_to_all_s"] / plan["step"]["total"])
    assert 0 < share["actual"] < 1


def test_a_calibration_takes_the_runs_expert_imbalance(workdir: Path, ep_run: Path):
    """`trainwise plan --calibrate RUN` of this MoE run: its measured ep_imbalance becomes
    the plan's moe.imbalance (the plan says where it came from)."""
    summary = json.loads((ep_run / "summary.json").read_text())
    made = run_main("plan", "--config", str(ep_run / "config.toml"), "--calibrate", str(ep_run),
                    "--json", cwd=workdir)
    assert made.returncode == 0, made.stderr
    plan = json.loads(made.stdout)
    assert plan["inputs"]["moe"]["imbalance"] == pytest.approx(summary["ep_imbalance"])
    assert any("expert load imbalance" in n and "over 2 expert-parallel ranks" in n
               for n in plan["inputs"]["calibration"])
