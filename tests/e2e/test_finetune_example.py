"""examples/finetune/run.py as a user runs it (fewer steps): a tiny Llama directory and
tokenizer built here, prepare -> train (2 workers, FSDP) every parameter and with LoRA ->
export --format hf / --format peft -> transformers' and PEFT's from_pretrained, whose
logits equal the trained checkpoints', and both runs' answers (trainwise generate)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import cli_env

pytest.importorskip("transformers")
pytestmark = pytest.mark.e2e

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "finetune" / "run.py"


def test_the_finetune_example_runs_end_to_end(tmp_path: Path):
    out = tmp_path / "example"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(out), "--steps", "20"],
        cwd=tmp_path, env=cli_env(), capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["max_abs_diff"] < 1e-4 and result["peft_max_abs_diff"] < 1e-4
    exported = Path(result["export"])
    assert (exported / "config.json").is_file() and list(exported.glob("*.safetensors"))
    assert (Path(result["adapter"]) / "adapter_config.json").is_file()
    for run in ("full", "lora"):
        records = [json.loads(line)
                   for line in (out / f"run-{run}" / "metrics.jsonl").read_text().splitlines()]
        assert len(records) == 20 and records[-1]["loss"] < records[0]["loss"]
        assert isinstance(result[run]["answer"], str) and result[run]["peak_mem_bytes"] > 0
        assert f"{run} fine-tune (" in proc.stdout
    # The full fine-tune trains every parameter; LoRA only the adapters it added.
    full, lora = result["full"], result["lora"]
    assert full["trainable"] == full["parameters"]
    assert 0 < lora["trainable"] == lora["parameters"] - full["parameters"] < full["parameters"] / 5
    index = json.loads((out / "qa" / "index.json").read_text())
    assert index["kind"] == "prompt_response"  # only the answers were learned


def test_the_example_never_deletes_a_folder_it_did_not_write(tmp_path: Path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(mine)],
        cwd=tmp_path, env=cli_env(), capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "was not written by this example" in lines[0], proc.stderr
    assert [p.name for p in mine.iterdir()] == ["notes.txt"]
