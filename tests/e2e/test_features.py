"""Features through the CLI: your own token file, torch.compile with activation
checkpointing, selective-op checkpointing's exact losses, a Hugging Face model sharded
with FSDP2."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from helpers import QUIET, hang_limit, read_records, run_cli
from trainwise.data import build_synthetic_corpus, write_token_file

# The compile test's three runs: one compiles (about a launch's work).
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(hang_limit(launches=4, steps=30))]


def test_training_on_a_token_file(workdir: Path):
    tokens = build_synthetic_corpus(60_000, vocab_size=300, seed=3)
    assert tokens.max() >= 256  # ids past one byte: the file really is uint16
    write_token_file(workdir / "corpus.bin", tokens)
    res = run_cli(
        "train",
        "--nproc",
        "1",
        "--steps",
        "30",
        "--run-dir",
        "run",
        *QUIET,
        "--set",
        "data.dataset='tokens'",
        "--set",
        "data.path='corpus.bin'",
        "--set",
        "data.seq_len=32",
        "--set",
        "data.num_workers=1",  # batches from a DataLoader worker process
        cwd=workdir,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    records = read_records(workdir / "run")
    assert records[-1]["loss"] < records[0]["loss"] - 0.5
    # The model's vocabulary follows the file's largest id.
    assert records[0]["loss"] == pytest.approx(np.log(int(tokens.max()) + 1), rel=0.05)


def test_compile_and_activation_checkpointing_match_eager(workdir: Path):
    common = ["train", "--nproc", "1", "--steps", "4", *QUIET]
    eager = run_cli(*common, "--run-dir", "eager", cwd=workdir)
    fast = run_cli(
        *common,
        "--run-dir",
        "compiled",
        "--set",
        "train.compile=true",
        "--set",
        "parallel.ac='full'",
        cwd=workdir,
        timeout=hang_limit(launches=2, procs=1),  # compiling is about a launch's work
    )
    assert eager.returncode == 0 and fast.returncode == 0, fast.stderr[-3000:]
    a = [r["loss"] for r in read_records(workdir / "eager")]
    b = [r["loss"] for r in read_records(workdir / "compiled")]
    assert b == pytest.approx(a, rel=1e-4)
    # Selective-op (every block under the per-operation policy), eager: the kept outputs
    # and the recomputed ones are the same numbers, so the losses are no-AC's.
    op = run_cli(*common, "--run-dir", "selective-op", "--set", "parallel.ac='selective-op'",
                 cwd=workdir)
    assert op.returncode == 0, op.stderr[-3000:]
    c = [r["loss"] for r in read_records(workdir / "selective-op")]
    assert len(c) == len(a) == 4
    assert c == pytest.approx(a, abs=1e-6, rel=0)


def test_a_hugging_face_config_trains_sharded(workdir: Path):
    pytest.importorskip("transformers")
    config = {
        "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": 256, "max_position_embeddings": 128,
    }
    (workdir / "config.json").write_text(json.dumps(config))
    res = run_cli(
        "train", "--model", "hf:config.json", "--strategy", "fsdp", "--nproc", "2",
        "--steps", "10", "--run-dir", "run", *QUIET, cwd=workdir,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert json.loads((workdir / "run" / "job.json").read_text())["strategy"] == "fsdp"
    records = read_records(workdir / "run")
    assert len(records) == 10 and records[-1]["loss"] < records[0]["loss"] - 0.5
