"""`trainwise data prepare` beyond text and JSONL: Parquet and saved Hugging Face datasets,
a pool of tokenizer processes, held-out documents, and a prepare killed with SIGKILL that
resumes to the same bytes as one never killed."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from test_prepare import DOCS, _bpe_tokenizer, _documents, _jsonl

from helpers import cli_env, communicate, hang_limit, run_limited, run_main, wait_until
from trainwise.data import build_datasets
from trainwise.data.prepare import BATCH, COMMIT_BATCHES, load_tokenizer, prepare
from trainwise.data.progress_line import ProgressLine
from trainwise.errors import DataError
from trainwise.faults import ENV

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
datasets = pytest.importorskip("datasets")

MANY = [f"document {i}: " + DOCS[i % len(DOCS)] for i in range(3 * BATCH * COMMIT_BATCHES)]


def _parquet(path: Path, columns: dict[str, list], row_group: int = 3) -> Path:
    pq.write_table(pa.table(columns), path, row_group_size=row_group)
    return path


def _same_output(a: Path, b: Path) -> None:
    """Every file byte for byte; index.json alike but for the command (its --out)."""
    files = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file())
    for f in files:
        if f.name == "index.json":
            one, two = (json.loads((d / f).read_text()) for d in (a, b))
            one.pop("command"), two.pop("command")
            assert one == two, f
        else:
            assert (a / f).read_bytes() == (b / f).read_bytes(), f


def _decoded(out: Path, tok) -> list[str]:
    return [tok.decode(d[:-1].tolist()) for d in _documents(out)]


def test_parquet_and_saved_datasets_round_trip(tmp_path: Path):
    tok = load_tokenizer("bytes")
    table = _parquet(tmp_path / "a.parquet", {"id": list(range(7)), "body": DOCS[:7]})
    saved = tmp_path / "saved"
    datasets.Dataset.from_dict({"body": DOCS[7:12], "n": list(range(5))}).save_to_disk(saved)
    splits = tmp_path / "splits"
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_dict({"body": DOCS[12:14]}),
         "test": datasets.Dataset.from_dict({"body": ["not read"]})}
    ).save_to_disk(splits)
    index = prepare([table, saved, splits], tmp_path / "out", tok, field="body")
    assert _decoded(tmp_path / "out", tok) == DOCS[:14]
    assert [s["path"] for s in index["sources"]] == [str(table), str(saved), str(splits)]


def test_examples_read_alike_from_jsonl_and_parquet(tmp_path: Path):
    tok = load_tokenizer("bytes")
    prompts, responses = DOCS[:6], [d.upper() for d in DOCS[:6]]
    rows = tmp_path / "ex.jsonl"
    rows.write_text("".join(json.dumps({"q": p, "a": r}) + "\n" for p, r in zip(prompts, responses, strict=True)))
    table = _parquet(tmp_path / "ex.parquet", {"q": prompts, "a": responses})
    for name, src in (("j", rows), ("p", table)):
        prepare([src], tmp_path / name, tok, field="q", response_field="a")
    for f in ("tokens-00000.bin", "mask-00000.bin", "documents.bin"):
        assert (tmp_path / "j" / f).read_bytes() == (tmp_path / "p" / f).read_bytes(), f


def test_a_pool_of_tokenizers_writes_the_same_bytes(tmp_path: Path):
    tok = load_tokenizer(str(_bpe_tokenizer(tmp_path / "tokenizer.json", DOCS)))
    src = _jsonl(tmp_path / "many.jsonl", MANY[: 3 * BATCH])  # three batches: two in the pool
    for name, workers in (("one", 1), ("two", 2)):
        prepare([src], tmp_path / name, tok, shard_tokens=4096, workers=workers)
    _same_output(tmp_path / "one", tmp_path / "two")


def test_held_out_documents_are_whole_and_evaluated(tmp_path: Path):
    tok = load_tokenizer("bytes")
    src = _jsonl(tmp_path / "c.jsonl", MANY[:400])
    index = prepare([src], tmp_path / "out", tok, val_fraction=0.1)
    train, val = _decoded(tmp_path / "out", tok), _decoded(tmp_path / "out" / "val", tok)
    assert sorted(train + val) == sorted(MANY[:400])  # every document once, whole
    assert index["val"]["documents"] == len(val) and 20 <= len(val) <= 60
    prepare([src], tmp_path / "again", tok, val_fraction=0.1)
    _same_output(tmp_path / "out", tmp_path / "again")
    train_ds, val_ds, info = build_datasets(
        "tokens", seq_len=32, val_fraction=0.3, seed=0, path=str(tmp_path / "out")
    )
    held = np.asarray(val_ds.tokens)  # the held-out directory, not a cut of the stream
    assert held.tolist() == np.fromfile(tmp_path / "out" / "val" / "tokens-00000.bin", "<u2").tolist()
    assert info.val_samples == len(val_ds) == (index["val"]["tokens"] - 1) // 32


def _prepare_cmd(src: Path, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "trainwise", "data", "prepare", str(src), "--out", str(out),
            "--tokenizer", "bytes", "--shard-tokens", "20000", "--val-fraction", "0.05",
            "--workers", "1", "--quiet", *extra]


def _killed_after_first_commit(src: Path, out: Path, *extra: str) -> None:
    proc = subprocess.Popen(_prepare_cmd(src, out, *extra), env={**cli_env(), ENV: "pause_in_prepare@commit=1"},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    marker = out.with_name(out.name + ".partial.pid")
    # The prepare pauses at its first commit until killed.
    wait_until(marker.exists, limit=hang_limit(procs=0), what="the prepare's first commit",
               procs=[proc])
    os.kill(int(marker.read_text()), signal.SIGKILL)
    communicate(proc, limit=hang_limit(procs=0), what="the killed prepare's end")
    marker.unlink()


def test_a_killed_prepare_resumes_to_the_same_bytes(tmp_path: Path):
    src = _jsonl(tmp_path / "many.jsonl", MANY)
    _killed_after_first_commit(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()  # nothing looks complete
    partial = tmp_path / "out.partial"
    assert json.loads((partial / "progress.json").read_text())["items"] == BATCH * COMMIT_BATCHES
    resumed = run_limited(_prepare_cmd(src, tmp_path / "out"), what="the resumed prepare",
                          limit=hang_limit(procs=0))
    assert resumed.returncode == 0, resumed.stderr
    assert f"after {BATCH * COMMIT_BATCHES} records" in resumed.stderr
    whole = run_limited(_prepare_cmd(src, tmp_path / "whole"), what="a whole prepare",
                        limit=hang_limit(procs=0))
    assert whole.returncode == 0, whole.stderr
    _same_output(tmp_path / "out", tmp_path / "whole")
    assert not partial.exists()


def test_another_command_over_a_partial_output_starts_over(tmp_path: Path):
    src = _jsonl(tmp_path / "many.jsonl", MANY)
    _killed_after_first_commit(src, tmp_path / "out", "--field", "text")
    other = run_main("data", "prepare", str(src), "--out", "out", "--tokenizer", "bytes",
                     "--shard-tokens", "30000", "--quiet", cwd=tmp_path)
    assert other.returncode == 0, other.stderr
    assert "removing another command's partial output" in other.stderr
    tok = load_tokenizer("bytes")
    assert _decoded(tmp_path / "out", tok) == MANY


@pytest.mark.parametrize(
    ("make", "args", "message"),
    [
        (lambda d: _parquet(d / "a.parquet", {"body": ["x"]}), ["--column", "text"],
         "a.parquet has no column 'text' (it has: body)"),
        (lambda d: (d / "a.parquet").mkdir(), [], "is a folder but not a saved Hugging Face dataset"),
        (lambda d: datasets.DatasetDict({"test": datasets.Dataset.from_dict({"text": ["x"]})})
         .save_to_disk(d / "a.parquet"), [], "splits test and no 'train'"),
        (lambda d: _parquet(d / "a.parquet", {"text": ["x y"]}), ["--val-fraction", "0.7"],
         "--val-fraction 0.7"),
        (lambda d: None, [], "'a.parquet' does not exist"),
        (lambda d: _parquet(d / "a.parquet", {"text": ["x y"]}), ["--workers", "0"],
         "--workers 0: give at least 1"),
    ],
)
def test_bad_inputs_are_one_line(tmp_path: Path, make, args, message):
    make(tmp_path)
    proc = run_main("data", "prepare", "a.parquet", "--out", "out", "--tokenizer", "bytes",
                    *args, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], proc.stderr
    assert not (tmp_path / "out").exists()


def test_library_errors_name_the_row(tmp_path: Path):
    table = _parquet(tmp_path / "n.parquet", {"text": ["fine", None, "x"]})
    with pytest.raises(DataError, match=r"n.parquet row 2: field 'text' is NoneType"):
        prepare([table], tmp_path / "out", load_tokenizer("bytes"))


CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CHATS = [
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Two plus two?"},
     {"role": "assistant", "content": "Four."}, {"role": "user", "content": "And three?"},
     {"role": "assistant", "content": "Five... no, six."}],
    [{"role": "user", "content": "Name a prime."}, {"role": "assistant", "content": "Seven."}],
]


def _chat_model_dir(folder: Path, template: str | None) -> Path:
    """A model folder's tokenizer files: a BPE with ChatML's special tokens, and
    tokenizer_config.json with the EOS and (when given) the chat template."""
    from tokenizers import AddedToken

    folder.mkdir()
    texts = [m["content"] for chat in CHATS for m in chat] + DOCS
    path = _bpe_tokenizer(folder / "tokenizer.json", texts)
    from tokenizers import Tokenizer as HFTokenizer

    tok = HFTokenizer.from_file(str(path))
    tok.add_special_tokens([AddedToken(t, special=True) for t in ("<|im_start|>", "<|im_end|>")])
    tok.save(str(path))
    config = {"eos_token": "<|endoftext|>", "tokenizer_class": "PreTrainedTokenizerFast"}
    if template:
        config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def test_chat_messages_count_the_assistant_turns_only(tmp_path: Path):
    model = _chat_model_dir(tmp_path / "model", CHATML)
    src = tmp_path / "chats.jsonl"
    src.write_text("".join(json.dumps({"messages": c}) + "\n" for c in CHATS))
    tok = load_tokenizer(f"hf:{model}")
    index = prepare([src], tmp_path / "out", tok, messages_field="messages")
    assert index["kind"] == "prompt_response" and index["documents"] == 2
    out = tmp_path / "out"
    ids = np.fromfile(out / "tokens-00000.bin", "<u2")
    mask = np.fromfile(out / "mask-00000.bin", "u1").astype(bool)
    starts = np.fromfile(out / "documents.bin", "<u8")
    for chat, lo, hi in zip(CHATS, starts[:-1], starts[1:], strict=True):
        counted = tok.decode(ids[lo:hi][mask[lo:hi]].tolist())
        answers = "".join(m["content"] + "<|im_end|>\n" for m in chat if m["role"] == "assistant")
        assert counted == answers + "<|endoftext|>"
        whole = tok.decode(ids[lo : hi - 1].tolist())  # the conversation as the template renders it
        assert whole.startswith("<|im_start|>") and chat[-1]["content"] in whole


def test_chat_without_a_template_is_one_line(tmp_path: Path):
    model = _chat_model_dir(tmp_path / "model", None)
    (tmp_path / "c.jsonl").write_text(json.dumps({"messages": CHATS[1]}) + "\n")
    proc = run_main("data", "prepare", "c.jsonl", "--out", "out", "--tokenizer", f"hf:{model}",
                    "--messages-field", "messages", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "has no chat template" in lines[0], proc.stderr


def test_chat_records_read_alike_from_jsonl_and_parquet(tmp_path: Path):
    tok = load_tokenizer(f"hf:{_chat_model_dir(tmp_path / 'model', CHATML)}")
    rows = tmp_path / "chats.jsonl"
    rows.write_text("".join(json.dumps({"messages": c, "id": i}) + "\n" for i, c in enumerate(CHATS)))
    table = _parquet(tmp_path / "chats.parquet", {"messages": CHATS, "id": [0, 1]})
    for name, src in (("j", rows), ("p", table)):
        prepare([src], tmp_path / name, tok, messages_field="messages")
    for f in ("tokens-00000.bin", "mask-00000.bin", "documents.bin"):
        assert (tmp_path / "j" / f).read_bytes() == (tmp_path / "p" / f).read_bytes(), f


class _Terminal(io.StringIO):
    def __init__(self, tty: bool):
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


def test_progress_line_on_a_terminal_only():
    now = [0.0]
    for tty, quiet in ((True, False), (False, False), (True, True)):
        stream = _Terminal(tty)
        line = ProgressLine(not quiet, stream, clock=lambda: now[0])
        for doc in ("é" * 500_000, "x" * 1_000_000):  # 2 MB of UTF-8 in all
            line.add(len(line.read(doc)) + 1)
            now[0] += 1.0  # one second a document
        line.close()
        if tty and not quiet:
            assert stream.getvalue().endswith("\rprepare: 2 records, 1,500,002 tokens, 1.0 MB/s\n")
        else:
            assert stream.getvalue() == ""


class _Crash(Exception):
    pass


def test_examples_resume_cut_back_to_the_commit(tmp_path: Path, monkeypatch):
    """A prepare of examples that dies after its first commit, having written more (mask
    shards, example offsets, held-out part): run again, it cuts every file back to the commit
    and ends with the bytes of a run never stopped."""
    from trainwise.data import prepare as prepare_module

    src = tmp_path / "ex.jsonl"
    src.write_text("".join(json.dumps({"q": d, "a": d[::-1]}) + "\n" for d in MANY[: 2 * BATCH * COMMIT_BATCHES]))
    tok = load_tokenizer("bytes")
    args = dict(field="q", response_field="a", shard_tokens=50_000, val_fraction=0.05)
    real_held_out = prepare_module._held_out
    committed = BATCH * COMMIT_BATCHES

    def crash_past_the_commit(position: int, fraction: float) -> bool:
        if position == committed + 100:  # 100 records written after the first commit
            raise _Crash
        return real_held_out(position, fraction)

    monkeypatch.setattr(prepare_module, "_held_out", crash_past_the_commit)
    with pytest.raises(_Crash):
        prepare([src], tmp_path / "out", tok, **args)
    monkeypatch.setattr(prepare_module, "_held_out", real_held_out)
    partial = tmp_path / "out.partial"
    progress = json.loads((partial / "progress.json").read_text())
    assert progress["items"] == committed
    # more than the commit is on disk, for the resume to cut back
    assert (partial / "documents.bin").stat().st_size > 8 * (progress["train"]["documents"] + 1)
    messages = []
    prepare([src], tmp_path / "out", tok, say=messages.append, **args)
    assert messages == [f"trainwise: resuming the prepare in {partial} after {committed} records"]
    prepare([src], tmp_path / "whole", tok, **args)
    _same_output(tmp_path / "out", tmp_path / "whole")
    assert len(list((tmp_path / "out").glob("mask-*.bin"))) > 1
