"""examples/finetune/run.py as a user runs it (fewer steps): a tiny Llama directory and
tokenizer built here, pretrained by trainwise on corpus.txt (1 worker) and exported ->
prepare -> train (2 workers, FSDP) every parameter and with LoRA from that base -> export
--format hf / --format peft -> transformers' and PEFT's from_pretrained, whose logits
equal the trained checkpoints', and both runs' answers (trainwise generate)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from helpers import hang_limit, run_limited

pytest.importorskip("transformers")

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "finetune" / "run.py"
STEPS = 50  # of each fine-tune: LoRA's loss halves with a margin (7.8 -> 2.5 here)
PRETRAIN_STEPS = 100


# Three trains (a one-process pretraining, two fine-tunes), the rest in the script's process.
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(
    hang_limit(launches=4, steps=PRETRAIN_STEPS + 2 * STEPS))]


def test_the_finetune_example_runs_end_to_end(tmp_path: Path):
    out = tmp_path / "example"
    proc = run_limited(
        [sys.executable, str(SCRIPT), "--out", str(out), "--steps", str(STEPS),
         "--pretrain-steps", str(PRETRAIN_STEPS)],
        cwd=tmp_path, what="examples/finetune/run.py",
        limit=hang_limit(launches=4, steps=PRETRAIN_STEPS + 2 * STEPS),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["max_abs_diff"] < 1e-4 and result["peft_max_abs_diff"] < 1e-4
    exported = Path(result["export"])
    assert (exported / "config.json").is_file() and list(exported.glob("*.safetensors"))
    assert (Path(result["adapter"]) / "adapter_config.json").is_file()
    pretrain = losses(out / "run-pretrain")
    assert len(pretrain) == PRETRAIN_STEPS and pretrain[-1] < pretrain[0] / 3
    for run in ("full", "lora"):
        loss = losses(out / f"run-{run}")
        assert len(loss) == STEPS and [result[run]["first_loss"], result[run]["last_loss"]] \
            == [loss[0], loss[-1]]
        # Both learn: LoRA on the pretrained base too (on a random one it stays near its
        # first loss). The last 3 steps' mean: one packed batch's loss is noisy.
        assert sum(loss[-3:]) / 3 < loss[0] / 2, (run, loss)
        assert isinstance(result[run]["answer"], str) and result[run]["peak_mem_bytes"] > 0
        assert f"{run} fine-tune (" in proc.stdout
    # The full fine-tune trains every parameter; LoRA only the adapters it added.
    full, lora = result["full"], result["lora"]
    assert full["trainable"] == full["parameters"]
    assert 0 < lora["trainable"] == lora["parameters"] - full["parameters"] < full["parameters"] / 5
    index = json.loads((out / "qa" / "index.json").read_text())
    assert index["kind"] == "prompt_response"  # only the answers were learned


def losses(run: Path) -> list[float]:
    """The training loss of each step of a run (its metrics.jsonl)."""
    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_the_example_never_deletes_a_folder_it_did_not_write(tmp_path: Path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    proc = run_limited([sys.executable, str(SCRIPT), "--out", str(mine)], cwd=tmp_path,
                       what="examples/finetune/run.py onto a folder of its own",
                       limit=hang_limit(procs=0))
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "was not written by this example" in lines[0], proc.stderr
    assert [p.name for p in mine.iterdir()] == ["notes.txt"]
