"""The tokenizers `trainwise data prepare` uses: a Hugging Face `tokenizers` tokenizer.json
(or a model directory's), or the built-in `bytes` (UTF-8 bytes, EOS 256), with the EOS id
that separates documents."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainwise.errors import DataError

BYTES = "bytes"  # the built-in tokenizer: UTF-8 bytes 0..255, EOS = 256
_EOS_NAMES = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "<|eos|>", "[SEP]")


@dataclass
class Tokenizer:
    """What prepare needs of a tokenizer: encode a batch, its vocabulary and EOS id."""

    spec: str
    vocab_size: int
    eos_id: int
    sha256: str
    _tok: Any = None  # a tokenizers.Tokenizer; None for bytes

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        if self._tok is None:
            return [list(t.encode("utf-8")) for t in texts]
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        if self._tok is None:
            return bytes(ids).decode("utf-8")
        return self._tok.decode(list(ids), skip_special_tokens=False)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _eos_from_config(folder: Path) -> str | None:
    """The eos_token of a tokenizer_config.json beside tokenizer.json, when there is one."""
    cfg = folder / "tokenizer_config.json"
    try:
        eos = json.loads(cfg.read_text(encoding="utf-8")).get("eos_token")
    except (OSError, ValueError, AttributeError):
        return None
    return eos.get("content") if isinstance(eos, dict) else eos


def load_tokenizer(spec: str, eos: str | None = None) -> Tokenizer:
    """`spec` is "bytes", a tokenizer.json, or "hf:DIR" (DIR/tokenizer.json). The EOS token is
    `eos`, else the eos_token of tokenizer_config.json beside it, else a common name."""
    if spec == BYTES:
        return Tokenizer(BYTES, 257, 256, hashlib.sha256(b"bytes").hexdigest())
    path = Path(spec[3:] if spec.startswith("hf:") else spec).expanduser()
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise DataError(
            f"--tokenizer {spec}: no tokenizer file at {str(path)!r}; give a tokenizer.json, "
            "hf:MODEL_DIR (holding tokenizer.json) or 'bytes'"
        )
    try:
        from tokenizers import Tokenizer as HFTokenizer
    except ImportError:
        raise DataError(
            f"--tokenizer {spec} needs Hugging Face tokenizers: pip install 'trainwise[hf]' "
            "(or use --tokenizer bytes)"
        ) from None

    try:
        tok = HFTokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises a bare Exception on bad JSON
        why = " ".join(str(exc).split())[:160]
        raise DataError(
            f"--tokenizer {spec}: {str(path)!r} is not a Hugging Face tokenizer.json ({why})"
        ) from None
    names = [eos] if eos else [n for n in (_eos_from_config(path.parent), *_EOS_NAMES) if n]
    eos_id = next((i for i in map(tok.token_to_id, names) if i is not None), None)
    if eos_id is None:
        raise DataError(
            f"--tokenizer {spec}: no end-of-document token found (tried {', '.join(names)}); "
            "name the tokenizer's EOS token with --eos"
        )
    vocab = tok.get_vocab_size(with_added_tokens=True)
    return Tokenizer(spec, vocab, eos_id, _sha256(path), tok)
