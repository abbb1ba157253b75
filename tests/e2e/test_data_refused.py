"""Wrong data as a user meets it at the command line: one line, exit status 2, and no
worker started (so nothing to restart). The commands run through the CLI's main in the
test's process: every refusal here comes before any worker, so a process of its own would
prove no more (test_cli's bad-input tests run `trainwise train` as a process)."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from helpers import QUIET, tiny_llama
from trainwise.cli.main import main

Cli = Callable[..., subprocess.CompletedProcess]


@pytest.fixture
def cli(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> Cli:
    """`trainwise ARGS` through main in this process, in the test's folder."""
    monkeypatch.chdir(tmp_path)

    def run(*args: str) -> subprocess.CompletedProcess:
        capsys.readouterr()
        rc = main(list(args))
        out = capsys.readouterr()
        return subprocess.CompletedProcess(args, rc, out.out, out.err)

    return run


def _train(cli: Cli, *keys: str, nproc: int = 1):
    sets = [arg for key in keys for arg in ("--set", key)]
    return cli(
        "train", "--nproc", str(nproc), "--steps", "2", "--run-dir", "run", *QUIET,
        "--set", "data.micro_batch=2", "--set", "checkpoint.enabled=false", *sets,
    )


def _one_error_line(proc) -> str:
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("trainwise: error: "), proc.stderr
    return lines[0]


def _prepare(cli: Cli, *args: str):
    return cli("data", "prepare", *args)


def test_a_random_byte_shard_stops_before_any_worker(tmp_path: Path, cli: Cli):
    (tmp_path / "a.txt").write_text("Some text to train on, again and again.\n" * 200)
    assert _prepare(cli, "a.txt", "--out", "corpus", "--tokenizer", "bytes",
                    "--shard-tokens", "4096").returncode == 0
    shard = tmp_path / "corpus" / "tokens-00001.bin"
    noise = np.random.default_rng(1).integers(0, 256, shard.stat().st_size, dtype=np.uint8)
    shard.write_bytes(noise.tobytes())  # the right size, random ids
    proc = _train(cli, "data.dataset=tokens", "data.path=corpus", "data.seq_len=32",
                  "parallel.strategy=ddp", "checkpoint.max_restarts=3", nproc=2)
    line = _one_error_line(proc)
    assert "tokens-00001.bin" in line and "checksum" in line
    assert not (tmp_path / "run").exists()  # no run files, no event: nothing started


def test_a_foreign_tokenizer_and_a_long_sequence_are_one_line_each(tmp_path: Path, cli: Cli):
    # max_position_embeddings = 64; a vocabulary that holds the byte tokenizer's ids, so
    # that only the tokenizer's identity tells the corpus is foreign.
    model = tiny_llama(tmp_path / "llama", vocab=300)
    (model / "tokenizer.json").write_text(json.dumps({"not": "the bytes tokenizer"}))
    (tmp_path / "a.txt").write_text("Some text to train on.\n" * 200)
    assert _prepare(cli, "a.txt", "--out", "corpus", "--tokenizer", "bytes").returncode == 0
    proc = _train(cli, f"model.name=hf:{model}", "data.dataset=tokens",
                  "data.path=corpus", "data.seq_len=128")
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 2, proc.stderr  # every problem of the job, one line each
    assert "data.seq_len = 128 is longer than the 64 positions" in lines[0]
    assert "tokenized with 'bytes', not with the tokenizer of" in lines[1]


def test_a_bare_number_for_eos_is_refused(tmp_path: Path, cli: Cli):
    (tmp_path / "a.txt").write_text("text\n")
    tokenizer = tmp_path / "tok.json"
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "0": 1, "</s>": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(tokenizer))
    line = _one_error_line(_prepare(cli, "a.txt", "--out", "o", "--tokenizer",
                                    str(tokenizer), "--eos", "0"))
    assert "--eos id:0 or --eos token:0" in line
    done = _prepare(cli, "a.txt", "--out", "o", "--tokenizer", str(tokenizer), "--eos", "id:0")
    assert done.returncode == 0, done.stderr
    assert json.loads((tmp_path / "o" / "index.json").read_text())["eos_id"] == 0


def test_prepare_of_text_that_is_not_utf8(tmp_path: Path, cli: Cli):
    (tmp_path / "a.txt").write_bytes(b"na\xefve text\n" * 3)
    line = _one_error_line(_prepare(cli, "a.txt", "--out", "o", "--tokenizer", "bytes"))
    assert "a.txt: not UTF-8 at byte 2" in line and "--errors replace" in line
    done = _prepare(cli, "a.txt", "--out", "o", "--tokenizer", "bytes", "--errors", "replace")
    assert done.returncode == 0, done.stderr
