"""`trainwise data prepare` and prepared directories: round trip, determinism, dtypes,
shards read as one stream, bad inputs (one line, exit 2, nothing that looks complete)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from helpers import CUT_PROMPT_JOB, QUIET, cut_prompt_corpus, read_records, run_cli, run_main
from trainwise.data import TokenShards, build_datasets
from trainwise.data.prepare import load_tokenizer, prepare
from trainwise.errors import DataError

DOCS = [
    "The quick brown fox jumps over the lazy dog.",
    "Sharded checkpoints are written by every rank.",
    "Ünïcödé text, emoji 🙂 and\nnew lines survive.",
    "Tokens are stored as uint16 when the vocabulary fits.",
] * 5


def _bpe_tokenizer(path: Path, texts: list[str], vocab: int = 300) -> Path:
    """A byte-level BPE trained on `texts` (no download), saved as tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer)
    tok.save(str(path))
    return path


def _wordlevel_tokenizer(path: Path, n_words: int) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"</s>": 0, "[UNK]": 1} | {f"w{i}": i + 2 for i in range(n_words)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path))
    return path


def _jsonl(path: Path, docs: list[str], field: str = "text") -> Path:
    path.write_text("".join(json.dumps({field: d, "id": i}) + "\n" for i, d in enumerate(docs)))
    return path


def _documents(out: Path) -> list[np.ndarray]:
    shards = TokenShards(out)
    stream = np.asarray(shards)
    cuts = np.flatnonzero(stream == shards.index["eos_id"])
    assert cuts[-1] == len(stream) - 1  # the stream ends with a separator
    return np.split(stream, cuts + 1)[:-1]


def test_round_trip_per_document(tmp_path: Path):
    tok = load_tokenizer(str(_bpe_tokenizer(tmp_path / "tokenizer.json", DOCS)))
    a, b = _jsonl(tmp_path / "a.jsonl", DOCS[:7]), tmp_path / "b.txt"
    b.write_text(DOCS[7], encoding="utf-8")
    index = prepare([a, b], tmp_path / "out", tok, shard_tokens=50)
    assert index["dtype"] == "uint16" and len(index["shards"]) > 2
    docs = _documents(tmp_path / "out")
    assert [tok.decode(d[:-1].tolist()) for d in docs] == DOCS[:8]
    assert index["documents"] == 8 and index["tokens"] == sum(map(len, docs))


def test_same_inputs_same_bytes(tmp_path: Path):
    tok = load_tokenizer(str(_bpe_tokenizer(tmp_path / "tokenizer.json", DOCS)))
    src = _jsonl(tmp_path / "c.jsonl", DOCS)
    for name in ("x", "y"):
        prepare([src], tmp_path / name, tok, shard_tokens=64)
    files = sorted(p.name for p in (tmp_path / "x").iterdir())
    assert files == sorted(p.name for p in (tmp_path / "y").iterdir())
    for f in files:
        assert (tmp_path / "x" / f).read_bytes() == (tmp_path / "y" / f).read_bytes(), f


def test_large_vocabulary_is_uint32(tmp_path: Path):
    tok = load_tokenizer(str(_wordlevel_tokenizer(tmp_path / "tokenizer.json", 70_000)))
    assert tok.vocab_size == 70_002
    src = _jsonl(tmp_path / "d.jsonl", ["w0 w69999 w65540", "w12 w70001"])
    index = prepare([src], tmp_path / "out", tok)
    assert index["dtype"] == "uint32"
    ids = np.asarray(TokenShards(tmp_path / "out")).tolist()
    assert ids == [2, 70_001, 65_542, 0, 14, 1, 0]  # w70001 is unknown: [UNK] = 1


def test_shards_read_as_one_stream(tmp_path: Path):
    src = _jsonl(tmp_path / "e.jsonl", DOCS)
    prepare([src], tmp_path / "out", load_tokenizer("bytes"), shard_tokens=37)
    shards = TokenShards(tmp_path / "out")
    files = sorted((tmp_path / "out").glob("*.bin"))
    whole = np.concatenate([np.fromfile(f, dtype="<u2") for f in files])
    assert len(shards) == len(whole)
    tail = shards[10:]  # a view of a view, as the train/val split makes
    for lo, hi in ((10, 15), (30, 80), (36, 38), (len(whole) - 3, len(whole))):
        assert np.array_equal(np.asarray(shards[lo:hi]), whole[lo:hi])
        assert np.array_equal(np.asarray(tail[lo - 10 : hi - 10]), whole[lo:hi])
    train, val, info = build_datasets(
        "tokens", seq_len=16, val_fraction=0.2, seed=0, path=str(tmp_path / "out")
    )
    assert info.vocab_size == 257  # the tokenizer's vocabulary, not the largest id seen
    x, y = train[3]
    assert x.tolist() == whole[48:64].tolist() and y.tolist() == whole[49:65].tolist()
    assert len(train) + len(val) >= len(whole) // 16 - 2


def test_failed_prepare_leaves_nothing_complete(tmp_path: Path):
    good = _jsonl(tmp_path / "good.jsonl", DOCS)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": broken\n')
    with pytest.raises(DataError, match=r"bad.jsonl:2 is not JSON"):
        prepare([good, bad], tmp_path / "out", load_tokenizer("bytes"))
    assert not (tmp_path / "out").exists()
    partial = tmp_path / "out.partial"  # what was written so far has no index
    assert partial.is_dir() and not (partial / "index.json").exists()
    with pytest.raises(DataError, match="without index.json"):
        TokenShards(partial)
    # Run again with good inputs: the leftover is replaced, the output is complete.
    prepare([good], tmp_path / "out", load_tokenizer("bytes"))
    assert not partial.exists() and len(TokenShards(tmp_path / "out")) > 0


@pytest.mark.parametrize(
    ("files", "args", "message"),
    [
        ({"a.jsonl": '{"text": "x"}\n'}, ["--tokenizer", "missing.json"], "no tokenizer file"),
        ({"a.jsonl": '{"text": "x"}\n', "tokenizer.json": "{not json"}, ["--tokenizer", "tokenizer.json"], "not a Hugging Face tokenizer.json"),
        ({"a.jsonl": '{"text": "x"}\nnope\n'}, ["--tokenizer", "bytes"], "a.jsonl:2 is not JSON"),
        ({"a.jsonl": '{"body": "x"}\n'}, ["--tokenizer", "bytes"], "a.jsonl:1 has no field 'text' (it has: body)"),
        ({"a.jsonl": "\n\n"}, ["--tokenizer", "bytes"], "hold no text"),
        ({"a.jsonl": '{"text": ""}\n'}, ["--tokenizer", "bytes"], "hold no text"),
    ],
)
def test_bad_inputs_one_line_exit_2(tmp_path: Path, files, args, message):
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    proc = run_main("data", "prepare", "a.jsonl", "--out", "out", *args, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], proc.stderr
    assert not (tmp_path / "out").exists()


def test_prepare_then_train(tmp_path: Path):
    _jsonl(tmp_path / "corpus.jsonl", DOCS * 10)
    proc = run_cli(
        "data", "prepare", "corpus.jsonl", "--out", "corpus", "--tokenizer", "bytes",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert "documents" in proc.stdout
    index = json.loads((tmp_path / "corpus" / "index.json").read_text())
    assert index["command"][:4] == ["trainwise", "data", "prepare", "corpus.jsonl"]
    proc = run_cli(
        "train", *QUIET, "--set", "data.dataset=tokens", "--set", "data.path=corpus",
        "--set", "parallel.strategy=single", "--set", "train.steps=2", "--set", "data.seq_len=32",
        "--set", "data.micro_batch=4", "--set", "logging.run_dir=run", "--set",
        "checkpoint.enabled=false", cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    steps = [r for r in read_records(tmp_path / "run") if "loss" in r]
    assert steps and np.isfinite(steps[-1]["loss"])


# -- prompt / response examples (supervised fine-tuning) --------------------------------

EXAMPLES = [{"prompt": f"Q{i}: what is {i} + {i}? A:", "response": f" {2 * i}."} for i in range(30)]


@pytest.fixture
def sft_corpus(tmp_path: Path) -> Path:
    src = tmp_path / "sft.jsonl"
    src.write_text("".join(json.dumps(e) + "\n" for e in EXAMPLES))
    tok = load_tokenizer("bytes")
    index = prepare(
        [src], tmp_path / "sft", tok, field="prompt", response_field="response", shard_tokens=100
    )
    assert index["kind"] == "prompt_response" and len(index["shards"]) > 1
    return tmp_path / "sft"


def test_examples_mask_the_prompt(sft_corpus: Path):
    train, val, info = build_datasets(
        "tokens", seq_len=40, val_fraction=0.2, seed=0, path=str(sft_corpus), packing=False
    )
    assert (len(train), len(val), info.vocab_size) == (24, 6, 257)
    for i, example in ((0, EXAMPLES[0]), (5, EXAMPLES[5]), (-1, EXAMPLES[-1])):
        ds, j = (val, len(val) - 1) if i == -1 else (train, i)
        x, y = ds[j]
        prompt, response = example["prompt"].encode(), example["response"].encode()
        n = len(prompt) + len(response)  # inputs: prompt + response; then EOS as a target
        assert bytes(x[:n].tolist()) == prompt + response
        assert (x[n:] == 256).all()  # padded with EOS
        # Targets: nothing for the prompt (the first response token is predicted from the
        # last prompt token), the response and the EOS, nothing for the padding.
        assert (y[: len(prompt) - 1] == -100).all()
        assert bytes(y[len(prompt) - 1 : n - 1].tolist()) == response
        assert y[n - 1] == 256 and (y[n:] == -100).all()


def test_prompt_tokens_add_nothing_to_loss_or_gradients(sft_corpus: Path):
    import torch

    from trainwise.models import ModelSpec, build_model

    train, _, _ = build_datasets(
        "tokens", seq_len=40, val_fraction=0.2, seed=0, path=str(sft_corpus), packing=False
    )
    x, y = (torch.stack(t) for t in zip(*(train[i] for i in range(4)), strict=True))
    torch.manual_seed(0)
    bundle = build_model(ModelSpec(name="small", vocab_size=257, seq_len=40))
    logits = bundle.module(x).detach().requires_grad_()
    loss = bundle.loss_fn(logits, y)
    loss.backward()
    counted = y != -100
    # The loss is the mean over response targets alone ...
    alone = torch.nn.functional.cross_entropy(logits[counted], y[counted])
    assert torch.allclose(loss, alone, rtol=0, atol=1e-6)
    # ... and no gradient flows from a prompt or padding position.
    assert (logits.grad[~counted] == 0).all() and (logits.grad[counted] != 0).any()


def test_sft_corpus_trains(sft_corpus: Path, tmp_path: Path):
    proc = run_cli(
        "train", *QUIET, "--set", "data.dataset=tokens", "--set", f"data.path={sft_corpus}",
        "--set", "parallel.strategy=single", "--set", "train.steps=2", "--set", "data.seq_len=40",
        "--set", "data.micro_batch=4", "--set", "data.val_fraction=0.2", "--set",
        "logging.run_dir=run", "--set", "checkpoint.enabled=false", cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    steps = [r for r in read_records(tmp_path / "run") if "loss" in r]
    assert steps and all(np.isfinite(r["loss"]) for r in steps)


def test_examples_whose_prompt_fills_the_sequence_record_no_nan(tmp_path: Path):
    """Every third prompt is longer than the sequence: its sample has no counted target,
    whose cross entropy is NaN with a gradient of 0. One sample a step: such a step
    records the 0 its gradient optimised (not NaN), and the held-out mean leaves such
    batches out; the other steps train as before (their gradients are untouched)."""
    proc = run_cli(
        "train", *QUIET, *CUT_PROMPT_JOB, "--set", f"data.path={cut_prompt_corpus(tmp_path)}",
        "--set", "parallel.strategy=single", "--set", "train.steps=8", "--set",
        "train.eval_every=8", "--set", "logging.run_dir=run", cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    steps = read_records(tmp_path / "run")
    assert len(steps) == 8 and all(np.isfinite(r["loss"]) for r in steps)
    empty = [r for r in steps if r["grad_norm"] == 0.0]
    assert empty and all(r["loss"] == 0.0 for r in empty)  # a step of a prompt only ran
    assert all(r["loss"] > 0 for r in steps if r["grad_norm"] > 0)
    assert np.isfinite(steps[-1]["eval_loss"]) and steps[-1]["eval_loss"] > 0


def test_hf_model_dir_tokenizer_and_its_eos(tmp_path: Path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    folder = tmp_path / "model"
    folder.mkdir()
    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "<end>": 1, "a": 2, "b": 3}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(folder / "tokenizer.json"))
    with pytest.raises(DataError, match="no end-of-document token found.*--eos"):
        load_tokenizer(f"hf:{folder}")
    assert load_tokenizer(f"hf:{folder}", eos="<end>").eos_id == 1
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<end>"}}))
    loaded = load_tokenizer(f"hf:{folder}")
    assert (loaded.eos_id, loaded.vocab_size) == (1, 4)
    assert loaded.encode_batch(["a b a", "b"]) == [[2, 3, 2], [3]]
