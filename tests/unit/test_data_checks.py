"""Data checked before training: shard checksums and ids, the model's tokenizer and
positions, an unambiguous --eos, and text that is not UTF-8."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from helpers import tiny_llama
from trainwise.config import load_config
from trainwise.data.prepare import load_tokenizer, prepare
from trainwise.data.shards import verify_shards
from trainwise.data.tokenizer import parse_eos
from trainwise.errors import ConfigError, DataError
from trainwise.run.launch.data_checks import check_data

TEXT = "The quick brown fox jumps over the lazy dog.\n" * 40


def _corpus(tmp_path: Path, shard_tokens: int = 512) -> Path:
    src = tmp_path / "a.txt"
    src.write_text(TEXT)
    prepare([src], tmp_path / "corpus", load_tokenizer("bytes"), shard_tokens=shard_tokens)
    return tmp_path / "corpus"


def _randomize(shard: Path) -> None:
    """The shard's bytes replaced by random ones, its size kept (a foreign or damaged file)."""
    noise = np.random.default_rng(0).integers(0, 256, shard.stat().st_size, dtype=np.uint8)
    shard.write_bytes(noise.tobytes())


def test_prepare_records_each_shards_checksum_and_largest_id(tmp_path: Path):
    corpus = _corpus(tmp_path)
    shards = json.loads((corpus / "index.json").read_text())["shards"]
    assert len(shards) > 1
    assert all(len(s["xxh3"]) == 32 for s in shards)
    assert {s["max_id"] for s in shards} <= set(range(257)) and max(s["max_id"] for s in shards) == 256
    verify_shards(corpus)  # as written: passes


def test_a_random_byte_shard_fails_its_checksum(tmp_path: Path):
    corpus = _corpus(tmp_path)
    _randomize(corpus / "tokens-00001.bin")
    with pytest.raises(DataError, match=r"tokens-00001.bin.*checksum"):
        verify_shards(corpus)


def test_ids_outside_the_vocabulary_are_found_without_a_checksum(tmp_path: Path):
    corpus = _corpus(tmp_path)
    index = json.loads((corpus / "index.json").read_text())
    for shard in index["shards"]:
        del shard["xxh3"]  # an index written before checksums
    (corpus / "index.json").write_text(json.dumps(index))
    _randomize(corpus / "tokens-00000.bin")
    with pytest.raises(DataError, match=r"tokens-00000.bin' holds token id \d+, outside the "
                       r"vocabulary of 257"):
        verify_shards(corpus)


def _job(**keys: object):
    return load_config(overrides=[f"{k.replace('__', '.')}={v}" for k, v in keys.items()])


def test_seq_len_beyond_the_models_positions_is_one_line(tmp_path: Path):
    model = tiny_llama(tmp_path / "llama")  # max_position_embeddings = 64
    cfg = _job(model__name=f"hf:{model}", data__seq_len=128)
    with pytest.raises(ConfigError, match=r"data.seq_len = 128 is longer than the 64 positions"):
        check_data(cfg)
    check_data(_job(model__name=f"hf:{model}", data__seq_len=64))


def test_a_corpus_of_another_tokenizer_is_refused(tmp_path: Path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    model = tiny_llama(tmp_path / "llama")
    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "</s>": 1, "a": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(model / "tokenizer.json"))
    corpus = _corpus(tmp_path)  # the byte tokenizer's
    cfg = _job(model__name=f"hf:{model}", data__dataset="tokens", data__path=str(corpus),
               data__seq_len=32)
    with pytest.raises(ConfigError, match=r"tokenized with 'bytes', not with the tokenizer of"):
        check_data(cfg)
    src = tmp_path / "w.txt"
    src.write_text("a a a a\n" * 200)
    prepare([src], tmp_path / "own", load_tokenizer(f"hf:{model}"))
    check_data(_job(model__name=f"hf:{model}", data__dataset="tokens",
                    data__path=str(tmp_path / "own"), data__seq_len=32))


@pytest.mark.parametrize(
    "given, meant", [("id:0", 0), ("token:0", "0"), ("</s>", "</s>"), ("token:id:3", "id:3")]
)
def test_eos_says_whether_it_is_an_id_or_a_token(given: str, meant: object):
    assert parse_eos(given, 100) == meant


@pytest.mark.parametrize(
    "given, words", [("0", "--eos id:0 or --eos token:0"), ("id:100", "0..99"), ("id:x", "0..99")]
)
def test_an_ambiguous_or_impossible_eos_is_refused(given: str, words: str):
    with pytest.raises(DataError, match=words):
        parse_eos(given, 100)


def test_the_bytes_tokenizer_takes_no_other_eos():
    assert load_tokenizer("bytes", "id:256").eos_id == 256
    for given in ("0", "id:0", "</s>"):
        with pytest.raises(DataError, match="--eos"):
            load_tokenizer("bytes", given)


def test_text_that_is_not_utf8_names_the_file_and_byte(tmp_path: Path):
    src = tmp_path / "latin1.txt"
    src.write_bytes("café au lait".encode("latin-1"))  # é is byte 3, 0xe9
    tok = load_tokenizer("bytes")
    with pytest.raises(DataError, match=r"latin1.txt: not UTF-8 at byte 3 .*--errors replace"):
        prepare([src], tmp_path / "out", tok)
    index = prepare([src], tmp_path / "out", tok, errors="replace")
    assert index["tokens"] == len("caf\ufffd au lait".encode()) + 1  # the byte replaced, EOS


def test_jsonl_that_is_not_utf8_names_the_line_and_file_offset(tmp_path: Path):
    src = tmp_path / "a.jsonl"
    src.write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(DataError, match=r"a.jsonl:2: not UTF-8 at byte 28"):
        prepare([src], tmp_path / "out", load_tokenizer("bytes"))
    index = prepare([src], tmp_path / "out", load_tokenizer("bytes"), errors="ignore")
    assert index["documents"] == 2
