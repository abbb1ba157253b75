"""The drill-down on real runs: MLflow (its default store, SQLite in the run directory, read
back through MlflowClient)
and W&B (offline, read back by wandb's own reader) hold what metrics.jsonl holds, and a
killed and restarted run goes on in the same tracker runs; a tracker that raises on every
call is one warning and changes no loss; the profiler's window leaves a Chrome trace per
rank with the model's matmuls and the gradient all-reduce, a summary whose groups add up
to the window, and a report section that links them.

Two launches of two workers, shared by the tests of this module."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from faulty import fault_limit, finish, job_args, kill, start, wait_for_pid

from helpers import hang_limit, run_limited, run_main, wait_until

# Each test's limit: its runs and the references it may wait for, and for the first, the module fixture's runs.
pytestmark = [pytest.mark.dist, pytest.mark.timeout(fault_limit(launches=3))]
mlflow = pytest.importorskip("mlflow", reason="pip install 'trainwise[mlflow]'")

STEPS = 8
TRACKED = ("--set", 'logging.trackers=["tensorboard", "mlflow", "wandb"]',
           "--set", "logging.flush_every=1", "--set", "logging.profile_steps=[2, 3]",
           "--set", "logging.report=true")


def records(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def mlflow_run(run_dir: Path):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{(run_dir / 'mlflow.db').resolve()}")
    run_id = json.loads((run_dir / "trackers.json").read_text())["mlflow"]
    return client, run_id


def wait_for_mlflow_step(run_dir: Path, step: int, proc: subprocess.Popen) -> None:
    """The tracker logs on the metrics thread, after metrics.jsonl: wait until it has."""

    def logged() -> bool:
        if not (run_dir / "trackers.json").is_file():
            return False
        client, run_id = mlflow_run(run_dir)
        return any(m.step == step for m in client.get_metric_history(run_id, "loss"))

    wait_until(logged, limit=hang_limit(), what=f"MLflow's loss of step {step}", procs=[proc])


@pytest.fixture(scope="module")
def tracked(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, str]:
    """Two workers with every tracker and a traced window; rank 0 killed after step 6 (the
    last checkpoint is step 4): the agent restarts the group, which resumes."""
    root = tmp_path_factory.mktemp("tracked")
    run_dir = root / "run"
    args = job_args(run_dir, 2, "ddp", *TRACKED, steps=STEPS)
    proc = start(args, root, faults="pause@step=6,rank=0")
    pid = wait_for_pid(proc, run_dir / "faults" / "pause-step-6.pid")
    wait_for_mlflow_step(run_dir, 6, proc)
    kill(pid)
    rc, out, err = finish(proc)
    assert rc == 0, err
    return run_dir, out, err


@pytest.fixture(scope="module")
def broken(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """The same job with W&B and an MLflow tracker whose every call raises."""
    root = tmp_path_factory.mktemp("broken")
    run_dir = root / "run"
    trackers = 'logging.trackers=["mlflow", "wandb"]'
    args = job_args(run_dir, 2, "ddp", "--set", trackers, steps=STEPS)
    rc, _, err = finish(start(args, root, faults="tracker_raises@tracker=mlflow"))
    assert rc == 0, err
    return run_dir, err


def test_mlflow_holds_every_record_and_a_restart_continues_its_run(tracked):
    run_dir, _, _ = tracked
    client, run_id = mlflow_run(run_dir)
    written = records(run_dir)
    assert [r["attempt"] for r in written].count(1) == 4  # steps 5-8 again after the kill
    for key in ("loss", "lr", "grad_norm", "step_s", "tokens", "mem_bytes", "profiled"):
        history = sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))
        assert history == sorted((r["step"], float(r[key])) for r in written), key
    # One run, continued: the experiment holds no other, and it finished.
    exp = client.get_experiment_by_name("trainwise")
    assert [r.info.run_id for r in client.search_runs([exp.experiment_id])] == [run_id]
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["train.steps"] == str(STEPS)
    assert run.data.tags["trainwise.events.resume"] == "1"
    artifacts = {a.path for a in client.list_artifacts(run_id)}
    assert {"report.html", "plan.json", "summary.json", "events.jsonl"} <= artifacts
    # MLflow's recommended local store, all of it in the run directory.
    assert run.info.artifact_uri.startswith((run_dir / "mlartifacts").resolve().as_uri())
    assert not (run_dir / "mlruns").exists()


def wandb_history(run_dir: Path) -> tuple[dict[int, float], int]:
    """Loss by step as W&B's own reader shows the offline runs of the run's id (a restart
    continues the id in a new offline folder), and how many folders."""
    run_id = json.loads((run_dir / "trackers.json").read_text())["wandb"]
    logs = sorted((run_dir / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb"))
    history: dict[int, float] = {}
    for log in logs:
        shown = run_limited(
            [sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(log)],
            what=f"wandb's reader of {log.name}", limit=hang_limit(),
        )
        assert shown.returncode == 0, shown.stderr
        for line in shown.stdout.splitlines():
            rec = json.loads(line)
            item = rec.get("history", {}).get("item", {})
            if rec.get("type") == "history" and "loss" in item:
                history[item["_step"]] = item["loss"]
    return history, len(logs)


def test_wandb_offline_holds_the_history(broken):
    run_dir, _ = broken
    history, _ = wandb_history(run_dir)
    assert history == pytest.approx({r["step"]: r["loss"] for r in records(run_dir)})
    assert len(history) == STEPS


def test_a_restart_continues_the_wandb_run(tracked):
    """The restarted attempt logs under the same id. (The killed process's records that
    W&B had not yet written are lost with it: metrics.jsonl keeps every step.)"""
    run_dir, _, _ = tracked
    history, folders = wandb_history(run_dir)
    assert folders >= 2
    last = {r["step"]: r["loss"] for r in records(run_dir) if r["attempt"] == 1}
    assert {s: history.get(s) for s in last} == pytest.approx(last)


def test_a_tracker_that_raises_is_one_warning_and_changes_no_loss(tracked, broken):
    run_dir, err = broken
    warnings = [x for x in err.splitlines() if "tracker" in x and "training goes on" in x]
    assert len(warnings) == 1, err
    assert "the mlflow tracker failed to start" in warnings[0]
    assert "mlflow" not in json.loads((run_dir / "trackers.json").read_text())  # never started
    losses = {r["step"]: r["loss"] for r in records(run_dir)}
    tracked_losses = {r["step"]: r["loss"] for r in records(tracked[0])}
    assert losses == tracked_losses and len(losses) == STEPS


def test_the_profiler_traces_matmuls_and_the_all_reduce(tracked):
    run_dir, _, _ = tracked
    for rank in (0, 1):
        trace = json.loads((run_dir / "profile" / f"trace-rank-{rank}.json").read_text())
        names = {e.get("name", "") for e in trace["traceEvents"]}
        assert names & {"aten::mm", "aten::addmm", "aten::matmul"}, rank
        assert any("allreduce" in n.lower() or "all_reduce" in n.lower() for n in names)
        summary = json.loads((run_dir / "profile" / f"summary-rank-{rank}.json").read_text())
        assert summary["steps"] == [2, 3] and summary["window_s"] > 0
        groups = summary["groups_s"]
        assert sum(groups.values()) == pytest.approx(summary["window_s"], rel=0.05)
        assert groups["compute"] > 0 and groups["communication"] > 0
        stages = summary["stages_s"]  # a traced step by the plan's stages, as long as a step
        assert sum(stages.values()) * 2 == pytest.approx(summary["window_s"], rel=0.05)
        assert stages["exposed_comm"] > 0 and stages["compute"] > 0
    profiled = [r["step"] for r in records(run_dir) if r["profiled"]]
    assert profiled == [2, 3, 4]  # and the step that waited for the traces


def test_the_report_shows_where_to_look_next(tracked):
    run_dir, _, _ = tracked
    made = run_main("report", str(run_dir), "--format", "json", cwd=run_dir.parent)
    assert made.returncode == 0, made.stderr
    run = json.loads(made.stdout)["runs"][0]
    drill = run["drill"]
    assert [p["rank"] for p in drill["profiles"]] == [0, 1]
    assert {"profile/trace-rank-0.json", "profile/trace-rank-1.json"} <= set(drill["traces"])
    assert "needs CUDA" in drill["memory"]
    assert any("profiler" in n for n in run["notes"])
    page = (run_dir / "report.html").read_text()
    assert "Where to look next" in page and 'href="profile/trace-rank-1.json"' in page
