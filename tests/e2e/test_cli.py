"""The CLI as a user types it: the demo job, bad input, --print-config, the examples."""

from __future__ import annotations

import json
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import tomllib

from helpers import QUIET, hang_limit, read_records, run_cli
from trainwise.cli.main import main
from trainwise.config import load_config
from trainwise.run.observe.telemetry import RECORD_FIELDS

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((REPO / "examples").glob("*.toml"))


def test_demo_job_learns_and_records_every_step(workdir: Path, capsys):
    """`make demo` runs `trainwise train` with no arguments: this is that job."""
    steps = load_config().train.steps
    res = run_cli("train", cwd=workdir, timeout=hang_limit(steps=steps))
    assert res.returncode == 0, res.stderr[-3000:]
    (run_dir,) = list((workdir / "runs").iterdir())
    records = read_records(run_dir)
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    for r in records:
        assert tuple(r) == RECORD_FIELDS
        assert r["loss"] > 0 and r["step_s"] > 0 and r["tokens_per_s"] > 0
    assert records[-1]["loss"] <= records[0]["loss"] / 2
    assert records[-1]["eval_loss"] is not None

    job = json.loads((run_dir / "job.json").read_text())
    assert (job["strategy"], job["world"], job["backend"]) == ("ddp", 2, "gloo")
    out = res.stdout
    assert "training finished" in out
    assert "ddp: one replica needs" in out and "MB" in out  # the reason, with its figures
    assert "tokens/s" in out and "exposed sync" in out and "data wait" in out
    assert f"run dir    runs/{run_dir.name}" in out
    assert (run_dir / "config.toml").is_file() and (run_dir / "summary.json").is_file()
    assert any((run_dir / "tensorboard").iterdir())

    # The finished run calibrates the planner: the efficiency it achieved replaces the
    # assumed one (`trainwise plan --config ... --calibrate RUN`).
    capsys.readouterr()
    args = ["plan", "--config", str(run_dir / "config.toml"), "--calibrate", str(run_dir)]
    assert main([*args, "--gpu", "cpu", "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)
    assert 0 < planned["inputs"]["efficiency"] <= 1
    assert planned["inputs"]["efficiency"] != load_config().plan.efficiency
    assert "measured in" in planned["inputs"]["calibration"][0]


BAD_INPUTS = {
    "unknown strategy": (["--strategy", "fdsp"], "parallel.strategy"),
    "unknown key": (["--set", "optim.lrr=0.1"], "optim.lrr"),
    "batch does not divide": (["--set", "data.global_batch=30"], "data.global_batch"),
    "model import fails": (["--model", "no_such_module_xyz:build"], "no_such_module_xyz"),
    "precision the device cannot run": (["--precision", "fp16"], "precision.dtype"),
    "zero steps": (["--steps", "0"], "train.steps"),
    "negative steps": (["--steps", "-5"], "train.steps"),
    "toml syntax error": (["--config", "bad.toml"], "bad.toml:3"),
    "run dir is a file": (["--run-dir", "bad.toml"], "logging.run_dir"),
    "config is a directory": (["--config", "."], "is a directory: --config takes a TOML"),
    "unsupported precision": (["--precision", "fp8"], "(from --precision): Input should be"),
    "absurd steps": (["--set", "train.steps=1e23"], "train.steps = 1e+23 (from --set): is beyond"),
    "fractional steps": (["--set", "train.steps=2.5"], "must be a whole number"),
    "empty run dir": (["--run-dir", ""], "logging.run_dir = '' (from --run-dir)"),
    "more CPU workers than cores": (["--nproc", "4096", "--set", "cluster.device='cpu'"],
                                    "--oversubscribe"),
}


# The first test of each fixture carries it: every example's run, every bad input's refusal.
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(hang_limit(launches=len(EXAMPLES) + len(BAD_INPUTS),
                                                              steps=6 * len(EXAMPLES)))]


def _bad_input(root: Path, case: str) -> tuple[Path, object]:
    workdir = root / case.replace(" ", "_")
    workdir.mkdir()
    (workdir / "bad.toml").write_text('[optim]\nlr = 3e-4\nname = "adamw\n')
    return workdir, run_cli("train", *BAD_INPUTS[case][0], cwd=workdir)


@pytest.fixture(scope="module")
def bad_input_runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Each case in its own directory, two processes at a time (they share nothing)."""
    root = tmp_path_factory.mktemp("bad-inputs")
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {case: pool.submit(_bad_input, root, case) for case in BAD_INPUTS}
        return {case: future.result() for case, future in futures.items()}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_is_one_line_exit_2_and_no_worker(bad_input_runs, case: str):
    workdir, res = bad_input_runs[case]
    must_name = BAD_INPUTS[case][1]
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith("trainwise: error: ") and must_name in lines[0]
    assert not (workdir / "runs").exists(), "a run directory means the job started"
    assert res.stdout == ""


def test_print_config_loads_back_to_the_same_config(workdir: Path):
    args = [
        "--config",
        str(REPO / "examples" / "mlp_digits.toml"),
        "--set",
        "optim.lr=0.05",
        "--steps",
        "7",
        "--set",
        "model.kwargs={a = 1}",
    ]
    res = run_cli("train", *args, "--print-config", cwd=workdir)
    assert res.returncode == 0, res.stderr
    dumped = workdir / "resolved.toml"
    dumped.write_text(res.stdout)
    again = load_config(dumped)
    assert again.optim.lr == 0.05 and again.train.steps == 7 and again.model.name == "mlp"
    assert again == load_config(
        REPO / "examples" / "mlp_digits.toml",
        {"train.steps": 7},
        ["optim.lr=0.05", "model.kwargs={a = 1}"],
    )
    assert (
        run_cli("train", "--config", str(dumped), "--print-config", cwd=workdir).stdout
        == res.stdout
    )


def _example(root: Path, example: Path) -> tuple[Path, object]:
    workdir = root / example.stem
    shutil.copytree(REPO / "examples", workdir / "examples")
    res = run_cli(
        "train", "--config", f"examples/{example.name}", "--steps", "6", "--run-dir", "run",
        *QUIET, cwd=workdir,
    )
    return workdir, res


@pytest.fixture(scope="module")
def example_runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("examples")
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {ex.stem: pool.submit(_example, root, ex) for ex in EXAMPLES}
        return {name: future.result() for name, future in futures.items()}


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_every_example_runs(example_runs, example: Path):
    assert tomllib.loads(example.read_text())  # plain TOML
    workdir, res = example_runs[example.stem]
    assert res.returncode == 0, res.stderr[-3000:]
    records = read_records(workdir / "run")
    assert len(records) == 6 and records[-1]["loss"] < records[0]["loss"]
