"""Packed supervised fine-tuning in real jobs: a packed prompt/response corpus trains a
transformers Llama under 2-way FSDP (with evaluation), the built-in GPT under 2-way TP with
the losses of one process (the example ids reach every TP rank's attention), and the
settings it cannot run are one line."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from helpers import (
    QUIET,
    SFT_SEQ,
    hang_limit,
    read_records,
    run_cli,
    run_main,
    sft_corpus,
    tiny_llama,
)
from trainwise.data.prepare import load_tokenizer, prepare

# A test's runs: two launches, or one and two refused before any worker.
pytestmark = [pytest.mark.dist, pytest.mark.timeout(hang_limit(launches=3, steps=8))]

@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return sft_corpus(tmp_path_factory.mktemp("packing"))


def test_packed_corpus_trains_under_fsdp_and_bad_settings_are_one_line(corpus: Path, tmp_path: Path):
    common = ("--set", "data.dataset=tokens", "--set", f"data.path={corpus}", "--set",
              f"data.seq_len={SFT_SEQ}", "--set", "data.micro_batch=2", "--set", "data.val_fraction=0.2",
              "--set", "checkpoint.enabled=false", "--set", "train.eval_every=3")
    # A transformers Llama: the example ids reach its attention as a 4-D mask under FSDP
    # (the built-in GPT trains packed in the TP test below).
    llama = tiny_llama(tmp_path / "llama", vocab=257, positions=SFT_SEQ)
    proc = run_cli("train", *QUIET, "--nproc", "2", "--strategy", "fsdp", "--steps", "3",
                   "--run-dir", "run", *common, "--set", f"model.name=hf:{llama}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    records = read_records(tmp_path / "run")
    assert len(records) == 3 and all(np.isfinite(r["loss"]) for r in records)
    assert records[-1]["eval_loss"] is not None
    # A model that cannot keep packed examples apart, and a format the data is not.
    neo = tmp_path / "neo"  # a transformers model that builds its own mask: no example ids
    neo.mkdir()
    (neo / "config.json").write_text(json.dumps({
        "model_type": "gpt_neo", "hidden_size": 32, "num_layers": 2, "num_heads": 4,
        "attention_types": [[["global"], 2]], "vocab_size": 257,
    }))
    bad = [
        (("--set", f"model.name=hf:{neo}"), "data.packing = true packs several examples"),
        (("--set", "data.format=prompt_response", "--set", "data.path=text"),
         "data.format = 'prompt_response' but data.path 'text'"),
    ]
    prepare([corpus.parent / "sft.jsonl"], tmp_path / "text", load_tokenizer("bytes"),
            field="prompt")
    for extra, message in bad:  # through the CLI's main here: refused before any worker
        proc = run_main("train", *QUIET, "--steps", "1", *common, *extra, cwd=tmp_path)
        assert proc.returncode == 2, proc.stderr
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        assert any(message in line for line in lines), proc.stderr


def test_packed_examples_under_tensor_parallelism_train_as_one_process(corpus: Path, tmp_path: Path):
    """The example ids reach every TP rank's attention (keyword arguments pass TP's input
    layouts untouched): 2-way TP trains the losses of one process."""
    losses = {}
    for name, layout in (("single", ("--nproc", "1", "--strategy", "single")),
                         ("tp2", ("--nproc", "2", "--set", "parallel.tp=2"))):
        proc = run_cli(
            "train", *QUIET, *layout, "--steps", "4", "--run-dir", name, "--set", "model.name=small",
            "--set", "model.vocab_size=258", "--set", "data.dataset=tokens", "--set",
            f"data.path={corpus}", "--set", f"data.seq_len={SFT_SEQ}", "--set", "data.micro_batch=4",
            "--set", "data.val_fraction=0.2", "--set", "checkpoint.enabled=false", cwd=tmp_path,
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        losses[name] = [r["loss"] for r in read_records(tmp_path / name)]
    assert losses["tp2"] == pytest.approx(losses["single"], rel=1e-5)
