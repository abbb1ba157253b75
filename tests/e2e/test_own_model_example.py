"""examples/own_model as a user runs it, each script once (both at a time, two workers
each), checked by what they print and write:

- run.py: the plan from Python answers (fits, layout, step time); trainwise.train() on 2
  workers lowers the loss; a second call with more steps resumes at the first's last
  checkpoint and continues; `trainwise export` writes one safetensors file, which loads
  into the user's TinyLM with strict names and gives the run's held-out loss;
- notebook.py, run top to bottom as a script: its class, defined in the notebook, went
  to the workers by value; it learns, and its export loads back likewise.

Beside them, what `trainwise export` makes of a module of the user's own: torch's format
too, and one line for the Hugging Face formats (no config.json can build it)."""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from helpers import cli_env, hang_limit, read_records, run_main

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "own_model"
STEPS, NOTEBOOK_STEPS = 40, 30  # run.py's default (half, then all); the notebook's
RUN_PY = hang_limit(launches=3, steps=STEPS)  # two calls of train(), one export
NOTEBOOK = hang_limit(launches=2, steps=NOTEBOOK_STEPS)  # train(), export
# The examples at once (the first test waits for both), then two exports of one test.
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(RUN_PY + NOTEBOOK + hang_limit(launches=2))]


@dataclass(frozen=True)
class Ran:
    """An example's run: what it printed (its last line, JSON, read) and its folder."""

    stdout: str
    result: dict
    out: Path


def _run(script: str, out: Path, args: list[str], env: dict[str, str], timeout: float) -> Ran:
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE / script), *args], cwd=out.parent,
        env={**cli_env(), **env}, capture_output=True, text=True, timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return Ran(proc.stdout, json.loads(proc.stdout.strip().splitlines()[-1]), out)


@pytest.fixture(scope="module")
def ran(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Ran]:
    """Both examples, at the same time; each its own Hugging Face cache (nothing
    downloaded: the JSONL files are read by the "json" builder)."""
    root = tmp_path_factory.mktemp("own-model-example")

    def env(name: str) -> dict[str, str]:
        return {"HF_DATASETS_CACHE": str(root / f"hf-{name}"), "HF_HUB_OFFLINE": "1",
                "HF_DATASETS_OFFLINE": "1", "OWN_MODEL_NOTEBOOK_OUT": str(root / "notebook")}

    with ThreadPoolExecutor(max_workers=2) as pool:
        script = pool.submit(_run, "run.py", root / "script", ["--out", str(root / "script")],
                             env("script"), RUN_PY)
        notebook = pool.submit(_run, "notebook.py", root / "notebook", [], env("notebook"),
                               NOTEBOOK)
        return {"script": script.result(), "notebook": notebook.result()}


def _learned(losses: list[float]) -> bool:
    """The last 3 steps' mean under half the first step's loss (one batch is noisy)."""
    return sum(losses[-3:]) / 3 < losses[0] / 2


def _exported(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(path)


# --- run.py --------------------------------------------------------------------------------


def test_the_plan_from_python_answers_before_training(ran):
    plan = ran["script"].result["plan"]
    assert plan["fits"] is True and "(ddp)" in plan["configuration"] and plan["step_ms"] > 0
    assert f"plan: fits True; {plan['configuration']}; step" in ran["script"].stdout


def test_two_workers_lower_the_loss_and_the_second_call_resumes(ran):
    out, result = ran["script"].out, ran["script"].result
    first, second = result["first"], result["second"]
    assert (first["last_step"], second["resumed_from"], second["last_step"]) == (20, 20, STEPS)
    records = read_records(out / "run")
    # Every step once: the second call continued at step 21, it did not start over.
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in records] == result["losses"]
    assert records[19]["loss"] == first["final_loss"] and _learned(result["losses"])
    events = [json.loads(x) for x in (out / "run" / "events.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events if e["kind"] == "resume"] == [20]
    assert "resumed from step 20, trained to step 40" in ran["script"].stdout


def test_the_export_loads_into_the_users_module_and_evaluates_as_the_run_did(ran):
    sys.path.insert(0, str(EXAMPLE))
    try:
        from my_model import TinyLM
    finally:
        sys.path.remove(str(EXAMPLE))
    result = ran["script"].result
    weights = _exported(ran["script"].out / "tinylm.safetensors")
    assert weights.keys() == TinyLM().state_dict().keys()
    # The run evaluates the same split in other batches over 2 ranks: close, not equal.
    trained = result["second"]["final_eval_loss"]
    assert result["exported_eval_loss"] == pytest.approx(trained, rel=0.02)
    assert result["exported_eval_loss"] < result["losses"][0] / 2


def test_export_of_your_own_module_torch_format_and_one_line_for_hf(ran, tmp_path: Path):
    run_dir = ran["script"].out / "run"
    # Through the CLI's main in this process: an export starts no worker.
    done = run_main("export", str(run_dir), "-o", str(tmp_path / "w.pt"), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    saved = torch.load(tmp_path / "w.pt", weights_only=True)
    theirs = _exported(ran["script"].out / "tinylm.safetensors")
    assert saved.keys() == theirs.keys()
    assert all(torch.equal(saved[k], theirs[k]) for k in saved)
    hf = run_main("export", str(run_dir), "--format", "hf", "-o", str(tmp_path / "hf"),
                  cwd=tmp_path)
    assert hf.returncode == 2
    (line,) = hf.stderr.strip().splitlines()
    assert "model.name = 'my_model:TinyLM' is a module of your own" in line
    assert "use --format safetensors" in line and not (tmp_path / "hf").exists()


# --- notebook.py ---------------------------------------------------------------------------


def test_the_notebook_trains_its_own_class_by_value_and_loads_the_export(ran):
    out, result = ran["notebook"].out, ran["notebook"].result
    assert result["status"] == "finished" and result["model"].startswith("pickled:")
    losses = result["losses"]
    assert len(losses) == NOTEBOOK_STEPS and _learned(losses)
    assert [r["loss"] for r in read_records(out / "run")] == losses
    weights = _exported(out / "convlm.safetensors")
    assert any(k.startswith("blocks.3.") for k in weights)  # the notebook's 4 blocks
    assert result["exported_eval_loss"] == pytest.approx(result["final_eval_loss"], rel=0.02)
    assert "plan: fits True" in ran["notebook"].stdout
