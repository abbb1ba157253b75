"""The drill-down's parts on their own: the trackers' guard (one warning, the tracker
dropped, the others go on; the run ids kept for a resume), the profiler summary's groups,
the hangs read from events, and the report's section in every format, from a synthetic run
directory with a traced window and a hang."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from pydantic import ValidationError
from test_report import make_run

from trainwise.config.schema import LoggingConfig
from trainwise.report.analysis import analyse
from trainwise.report.drilldown import hangs
from trainwise.report.run_html import render_html
from trainwise.report.run_view import render_markdown, render_text, to_json
from trainwise.report.rundir import load_run
from trainwise.run.observe.profiling import STEP_SPAN, group_of, summarise
from trainwise.run.observe.trackers import IDS_FILE, Trackers, numeric


class Recording:
    """A tracker that keeps what it is given; `fail` names the call that raises."""

    def __init__(self, name: str, fail: str = "", new_id: str = "id-1"):
        self.name, self.fail, self.new_id = name, fail, new_id
        self.opened_with: str | None = None
        self.rows: list[dict] = []
        self.closed: bool | None = None

    def _maybe_fail(self, call: str) -> None:
        if call == self.fail:
            raise ImportError("no module", name="mlflow") if call == "import" else OSError(call)

    def open(self, run_id):
        self._maybe_fail("open")
        self._maybe_fail("import")
        self.opened_with = run_id
        return self.new_id

    def records(self, rows):
        self._maybe_fail("records")
        self.rows += rows

    def events(self, events):
        self._maybe_fail("events")

    def artifacts(self, paths):
        self._maybe_fail("artifacts")

    def close(self, finished):
        self.closed = finished


def test_a_failing_tracker_is_one_warning_and_the_others_go_on(tmp_path, caplog):
    good, bad = Recording("tensorboard"), Recording("mlflow", fail="records")
    trackers = Trackers(tmp_path, [good, bad])
    with caplog.at_level(logging.WARNING, logger="trainwise"):
        trackers.open()
        for step in (1, 2, 3):
            trackers.records([{"step": step, "loss": 1.0 / step}])
        trackers.finish([], finished=True)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "the mlflow tracker failed to log metrics" in lines[0]
    assert "training goes on" in lines[0]
    assert [r["step"] for r in good.rows] == [1, 2, 3] and good.closed is True
    assert bad.closed is None  # dropped at its first failure


def test_a_missing_package_names_the_extra(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="trainwise"):
        Trackers(tmp_path, [Recording("mlflow", fail="import")]).open()
    assert "pip install 'trainwise[mlflow]'" in caplog.records[0].getMessage()


def test_a_resumed_run_reopens_the_stored_run_ids(tmp_path):
    first = Recording("mlflow", new_id="abc")
    Trackers(tmp_path, [first]).open()
    assert first.opened_with is None
    assert json.loads((tmp_path / IDS_FILE).read_text()) == {"mlflow": "abc"}
    again = Recording("mlflow", new_id="abc")
    Trackers(tmp_path, [again]).open()
    assert again.opened_with == "abc"


def test_trackers_get_the_numbers_of_a_record():
    row = {"step": 3, "loss": 2.5, "eval_loss": None, "mem_kind": "rss_peak",
           "profiled": True, "tokens": 96}
    assert numeric(row) == {"loss": 2.5, "profiled": 1.0, "tokens": 96.0}


def test_profile_steps_is_a_window():
    assert LoggingConfig(profile_steps=[2, 4]).profile_steps == [2, 4]
    for bad in ([3], [4, 2], [0, 1], [1, 2, 3]):
        with pytest.raises(ValidationError, match="first, last"):
            LoggingConfig(profile_steps=bad)
    assert LoggingConfig(tensorboard=False, trackers=["tensorboard", "mlflow"]).trackers == [
        "mlflow"
    ]


@pytest.mark.parametrize(
    ("name", "group"),
    [("aten::mm", "compute"), ("c10d::allreduce_", "communication"),
     ("gloo:all_reduce", "communication"), ("nccl:all_gather", "communication"),
     ("aten::copy_", "copies"), ("Memcpy HtoD", "copies"),
     ("enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__", "data"),
     ("Optimizer.step#AdamW.step", "compute")],
)
def test_operators_fall_in_groups(name, group):
    assert group_of(name) == group


def _event(name: str, start: float, end: float, self_us: float, thread: int = 1):
    return SimpleNamespace(name=name, thread=thread, self_cpu_time_total=self_us,
                           time_range=SimpleNamespace(start=start, end=end))


def test_the_summary_splits_the_steps_spans_by_group_and_stage():
    # Step 1 (0-1000 us): a matmul, the loader, an all-reduce launch, then this thread
    # idles 650-850 while gloo's thread reduces (600-850), then the optimizer. Step 2
    # (2000-3000) runs nothing the profiler sees. Outside the steps or on another thread,
    # operators count in no group.
    events = [
        _event(f"{STEP_SPAN}1", 0, 1000, 250), _event("aten::mm", 50, 500, 450),
        _event("enumerate(DataLoader)#x", 500, 600, 100),
        _event("c10d::allreduce_", 600, 650, 50),
        _event("Optimizer.step#AdamW.step", 850, 1000, 150),
        _event("gloo:all_reduce", 600, 850, 250, thread=2), _event("aten::mul", 10, 20, 10, 2),
        _event("aten::add", 1200, 1300, 100), _event(f"{STEP_SPAN}2", 2000, 3000, 1000),
    ]
    s = summarise(events, wall_s=0.5, window=[1, 2], cuda=False)
    assert s["window_s"] == pytest.approx(0.002)
    assert s["groups_s"] == pytest.approx(
        {"compute": 600e-6, "communication": 50e-6, "copies": 0.0, "data": 100e-6,
         "other": 1250e-6}
    )
    assert sum(s["groups_s"].values()) == pytest.approx(s["window_s"])
    # Per step: the 200 us this thread waited for gloo count as exposed communication.
    assert s["stages_s"] == pytest.approx(
        {"data": 50e-6, "optimizer": 75e-6, "exposed_comm": 125e-6, "compute": 750e-6}
    )
    assert [op["name"] for op in s["top"]][:2] == ["aten::mm", "Optimizer.step#AdamW.step"]
    assert {op["name"] for op in s["top"]}.isdisjoint({"aten::add", "aten::mul"})


def test_hangs_name_who_did_not_arrive():
    events = [
        {"kind": "peer_failure", "step": 6, "rank": 0, "cause": "timeout", "absent": [1],
         "stage": "forward/backward", "message": "step 6: rank 0 waited"},
        {"kind": "peer_failure", "step": 6, "rank": 1, "cause": "lost", "absent": None,
         "stage": "forward/backward", "message": "step 6: rank 1 lost"},
        {"kind": "finish", "step": 12},
    ]
    (h,) = hangs(events)
    assert (h.step, h.cause, h.absent, h.seen_by) == (6, "timeout", [1], [0, 1])


def _traced_run(root: Path) -> Path:
    run = make_run(root, failure=False)
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    for r in recs:
        r["profiled"] = r["step"] in (3, 4, 5)
        if r["profiled"]:
            r["tokens_per_s"] = 10.0  # the profiler's slowdown: no median may see it
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    profile = run / "profile"
    profile.mkdir()
    for rank in (0, 1):
        summary = {"rank": rank, "steps": [3, 5], "window_s": 2.0, "trace": "x",
                   "groups_s": {"compute": 1.0, "communication": 0.5, "copies": 0.2,
                                "data": 0.1, "other": 0.2},
                   "stages_s": {"data": 0.01, "compute": 0.4, "exposed_comm": 0.3,
                                "optimizer": 0.02},
                   "top": [{"name": "aten::mm", "group": "compute", "calls": 8,
                            "self_s": 0.8}]}
        (profile / f"summary-rank-{rank}.json").write_text(json.dumps(summary))
        (profile / f"trace-rank-{rank}.json").write_text('{"traceEvents": []}')
    (profile / "summary-rank-2.json").write_text("{half")  # damaged: passed over
    (run / "hang").mkdir()
    (run / "hang" / "rank-0.txt").write_text("step 6: rank 0 waited <here>\nThread 0x1")
    with (run / "events.jsonl").open("a") as f:
        f.write(json.dumps({"time": 105.5, "kind": "peer_failure", "step": 5, "rank": 0,
                            "cause": "timeout", "absent": [1], "stage": "the step",
                            "message": "m", "dump": "hang/rank-0.txt"}) + "\n")
    return run


def test_the_report_shows_where_to_look_next(tmp_path):
    r = analyse(load_run(_traced_run(tmp_path)))
    d = r.drill
    assert [p.rank for p in d.profiles] == [0, 1]
    assert d.top[0].name == "aten::mm" and d.top[0].share == pytest.approx(0.4)
    assert d.traces == ["profile/trace-rank-0.json", "profile/trace-rank-1.json"]
    assert "needs CUDA" in d.memory
    # A traced step three ways: the plan, the loop's timers over steps 3-5, rank 0's trace.
    sync = next(a for a in d.attributed if a.stage == "exposed sync")
    assert (sync.plan, sync.loop, sync.trace) == pytest.approx((0.05, 0.1, 0.3))
    optim = next(a for a in d.attributed if a.stage == "optimizer")
    assert (optim.plan, optim.loop, optim.trace) == (None, pytest.approx(0.2), 0.02)
    assert d.hangs[0].absent == [1] and "rank 0 waited" in d.dumps[0]
    assert r.headline.tokens_per_s == pytest.approx(1000.0)  # profiled steps left out
    assert any("steps 3-5 ran under the profiler" in n for n in r.notes)
    text = render_text(r)
    assert "Where to look next" in text and "aten::mm" in text and "50%" in text
    assert "trace: profile/trace-rank-1.json" in text and "stacks of rank 0" in text
    assert "exposed sync       50.00 ms    100.00 ms  300.00 ms" in text
    md = render_markdown(r)
    assert "## Where to look next" in md and "| 5 | the step | timeout | 1 | 0 |" in md
    page = render_html([r])
    assert page.count("<svg") == 5 and 'href="profile/trace-rank-0.json"' in page
    assert "rank 0 waited &lt;here&gt;" in page  # the stacks, escaped
    assert json.loads(to_json([r]))["runs"][0]["drill"]["hangs"][0]["absent"] == [1]


def test_a_run_without_drill_down_files_says_how_to_get_them(tmp_path):
    r = analyse(load_run(make_run(tmp_path, failure=False)))
    assert r.drill.empty and "profile_steps" in r.drill.memory
    assert "Where to look next" in render_text(r)


def test_a_profile_window_past_the_run_is_bad_input():
    from trainwise.config import JobConfig
    from trainwise.config.load import check_consistency

    cfg = JobConfig.model_validate({"train": {"steps": 4}, "logging": {"profile_steps": [3, 9]}})
    (line,) = check_consistency(cfg)
    assert "logging.profile_steps = [3, 9]" in line and "train.steps = 4" in line


@pytest.fixture
def mlflow_env(monkeypatch):
    pytest.importorskip("mlflow", reason="pip install 'trainwise[mlflow]'")
    for var, value in (("MLFLOW_ALLOW_FILE_STORE", "true"),
                       ("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0"),
                       ("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")):
        monkeypatch.setenv(var, value)


def test_an_mlflow_server_that_is_down_is_one_warning(tmp_path, caplog, mlflow_env):
    from trainwise.run.observe.trackers import MLflow

    trackers = Trackers(tmp_path, [MLflow(tmp_path, "http://127.0.0.1:9", {"a": "1"})])
    with caplog.at_level(logging.WARNING, logger="trainwise"):
        trackers.open()
        trackers.records([{"step": 1, "loss": 2.0}])
        trackers.finish([], finished=True)
    mine = [r.getMessage() for r in caplog.records if r.name == "trainwise"]
    assert len(mine) == 1 and "the mlflow tracker failed to start" in mine[0]
    assert trackers.live == []


def test_mlflow_continues_its_run_after_a_restart(tmp_path, mlflow_env, monkeypatch):
    """In its default store: SQLite in the run directory (MLflow's recommended local
    backend), with the artifacts beside it, not in the current directory."""
    from mlflow.tracking import MlflowClient

    from trainwise.run.observe.trackers import MLflow, default_mlflow_uri

    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE")  # the default must not need it
    monkeypatch.chdir(tmp_path.parent)
    uri = default_mlflow_uri(tmp_path)
    assert uri == f"sqlite:///{tmp_path.resolve() / 'mlflow.db'}"
    (tmp_path / "summary.json").write_text("{}")
    for attempt, steps in enumerate(([1, 2, 3], [3, 4])):  # the second redoes step 3
        trackers = Trackers(tmp_path, [MLflow(tmp_path, uri, {"train.steps": "4"})])
        trackers.open()
        trackers.records([{"step": s, "loss": 10.0 * attempt + s, "time": 1.0} for s in steps])
        trackers.finish([{"kind": "resume"}] * attempt, finished=attempt == 1)
    assert trackers.live  # no tracker was dropped
    assert (tmp_path / "mlflow.db").is_file() and not (tmp_path.parent / "mlruns").exists()
    assert len(list((tmp_path / "mlartifacts").rglob("summary.json"))) == 1
    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("trainwise").experiment_id])
    history = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, "loss"))
    assert history == [(1, 1.0), (2, 2.0), (3, 3.0), (3, 13.0), (4, 14.0)]
    assert run.info.status == "FINISHED" and run.data.params == {"train.steps": "4"}
    assert run.data.tags["trainwise.events.resume"] == "1"


def test_the_default_store_without_sqlalchemy_says_what_to_install(tmp_path, caplog, monkeypatch):
    from trainwise.run.observe.trackers import MLflow, default_mlflow_uri

    monkeypatch.setitem(sys.modules, "sqlalchemy", None)  # `import sqlalchemy` fails
    trackers = Trackers(tmp_path, [MLflow(tmp_path, default_mlflow_uri(tmp_path), {})])
    with caplog.at_level(logging.WARNING, logger="trainwise"):
        trackers.open()
    (line,) = [r.getMessage() for r in caplog.records if r.name == "trainwise"]
    assert "needs sqlalchemy: pip install 'trainwise[mlflow]'" in line and trackers.live == []
