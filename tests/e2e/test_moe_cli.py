"""A Mixture-of-Experts model through the CLI: a Hugging Face Qwen3-MoE directory trained
by trainwise's own MoE model (`model.impl = "trainwise"`) under FSDP on 2 gloo workers at
lr 1e-12 (0 in effect: an update below the weights' last bit; the schema wants lr > 0),
exported with `--format hf`: transformers loads the export with the logits it gave
for the source (1e-4), each expert its own tensors on disk again. Bad MoE input stops
before any worker with one line and exit status 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import QUIET, hang_limit, read_records, run_cli, run_main, tiny_moe

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.e2e
LIMIT = hang_limit(launches=2, steps=2)


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("moe_cli")
    source = tiny_moe(root / "qwen3moe", vocab=97)
    res = run_cli(
        "train", "--nproc", "2", "--strategy", "fsdp", "--steps", "2", "--run-dir", "run",
        "--set", f"model.name='hf:{source}'", "--set", "model.impl='trainwise'",
        "--set", "data.vocab_size=97", "--set", "data.seq_len=16", "--set", "optim.lr=1e-12",
        "--set", "moe.aux_loss_coef=0.01", *QUIET, cwd=root, timeout=LIMIT,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    res = run_main("export", "run", "--format", "hf", "-o", "out", cwd=root)
    assert res.returncode == 0, res.stderr[-3000:]
    return source, root


def test_export_gives_transformers_logits_of_the_source(exported):
    import torch

    source, root = exported
    out = root / "out"
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "qwen3_moe" and config["num_experts_per_tok"] == 2
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in names
    assert not any("expert_bias" in n for n in names)  # trainwise's own state stays home
    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        got = model(input_ids=torch.load(source / "idx.pt")).logits
    want = torch.load(source / "logits.pt")
    assert torch.allclose(got, want, atol=1e-4, rtol=0), (got - want).abs().max()


def test_the_loss_logs_its_balancing_part(exported):
    _, root = exported
    records = read_records(root / "run")
    assert len(records) == 2
    assert all(0.005 < r["aux_loss"] < 0.05 for r in records)  # 0.01 x about 1 a layer
    job = json.loads((root / "run" / "job.json").read_text())
    assert job["layout_name"] == "fsdp" and job["flops_per_token"] > 0


def _refused(root: Path, *sets: str, nproc: str = "1") -> str:
    args = [a for kv in sets for a in ("--set", kv)]
    # Through the CLI's main in this process: the refusal comes before any worker.
    res = run_main("train", "--nproc", nproc, "--steps", "1", "--run-dir", "run", *QUIET, *args,
                   cwd=root)
    assert res.returncode == 2, res.stderr[-2000:]
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert not (root / "run" / "metrics.jsonl").exists()
    return lines[0]


def test_top_k_above_the_experts_is_one_line(tmp_path):
    # transformers' config checks nothing of it: written as a user could.
    source = tiny_moe(tmp_path / "bad", vocab=97)
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, "num_experts_per_tok": 9}))
    line = _refused(tmp_path, f"model.name='hf:{source}'", "model.impl='trainwise'",
                    "data.vocab_size=97")
    assert "moe.top_k = 9 exceeds the moe.experts = 4" in line


def test_ep_that_does_not_divide_the_experts_is_one_line(tmp_path):
    line = _refused(tmp_path, "model.name='moe-tiny'", "parallel.ep=3", "parallel.strategy='fsdp'",
                    nproc="3")
    assert "parallel.ep = 3 does not divide the 8 experts" in line


def test_ep_with_a_dense_model_is_one_line(tmp_path):
    line = _refused(tmp_path, "parallel.ep=2", "parallel.strategy='fsdp'", nproc="2")
    assert "has none: use parallel.ep = 1" in line


def test_balancing_keys_for_a_dense_model_are_one_line(tmp_path):
    line = _refused(tmp_path, "moe.bias_update_rate=0.001")
    assert "moe.bias_update_rate set, but model.name = 'tiny' has no experts" in line
