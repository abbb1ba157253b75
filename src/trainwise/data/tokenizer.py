"""The tokenizers `trainwise data prepare` uses: a Hugging Face `tokenizers` tokenizer.json
(or a model directory's), or the built-in `bytes` (UTF-8 bytes, EOS 256), with the EOS id
that separates documents."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainwise.data.sources import source_sha256
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


def _spec_path(spec: str) -> Path:
    """The file or folder a --tokenizer names (tokenizer.json, or hf:MODEL_DIR)."""
    return Path(spec[3:] if spec.startswith("hf:") else spec).expanduser()


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
        if eos and parse_eos(eos, 257) != 256:
            raise DataError(f"--eos {eos}: the bytes tokenizer's EOS is id 256; drop --eos")
        return Tokenizer(BYTES, 257, 256, hashlib.sha256(b"bytes").hexdigest())
    path = _spec_path(spec)
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
    vocab = tok.get_vocab_size(with_added_tokens=True)
    given = parse_eos(eos, vocab) if eos else None
    if isinstance(given, int):
        return Tokenizer(spec, vocab, given, source_sha256(path), tok)
    names = [given] if given else [n for n in (_eos_from_config(path.parent), *_EOS_NAMES) if n]
    eos_id = next((i for i in map(tok.token_to_id, names) if i is not None), None)
    if eos_id is None:
        raise DataError(
            f"--tokenizer {spec}: no end-of-document token found (tried {', '.join(names)}); "
            "name the tokenizer's EOS token with --eos"
        )
    return Tokenizer(spec, vocab, eos_id, source_sha256(path), tok)


def parse_eos(eos: str, vocab: int) -> int | str:
    """--eos: `id:N` (an id), `token:TEXT` or TEXT (a token's text). A bare number could be
    either, so it is refused."""
    kind, _, value = eos.partition(":")
    if kind == "id" and value.isdigit() and int(value) < vocab:
        return int(value)
    if kind == "id":
        raise DataError(f"--eos {eos}: give an id in 0..{vocab - 1} (the tokenizer's vocabulary)")
    if kind == "token" and value:
        return value
    if eos.isdigit():
        raise DataError(
            f"--eos {eos} could be the id {eos} or the token text {eos!r}: write --eos id:{eos} "
            f"or --eos token:{eos}"
        )
    return eos


Segments = list[tuple[str, bool]]  # an example's text in order, each part counted or not


def chat_renderer(spec: str) -> Callable[[Any, str], Segments]:
    """For `--messages-field`: a function from one conversation (a list of {role, content})
    to its text as the model's chat template renders it (transformers' apply_chat_template),
    cut so that the assistant turns are counted in the loss and the rest not. DataError when
    the tokenizer has no chat template."""
    if spec == BYTES:
        raise DataError(
            "--messages-field needs a tokenizer with a chat template (hf:MODEL_DIR); 'bytes' "
            "has none: give --field and --response-field instead"
        )
    folder = _spec_path(spec)
    folder = folder if folder.is_dir() else folder.parent
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise DataError("--messages-field needs transformers: pip install 'trainwise[hf]'") from None
    try:
        hf = AutoTokenizer.from_pretrained(str(folder))
    except (OSError, ValueError) as exc:
        raise DataError(f"--tokenizer {spec}: transformers cannot load it ({exc})") from None
    if not getattr(hf, "chat_template", None):
        raise DataError(
            f"--tokenizer {spec} has no chat template (tokenizer_config.json 'chat_template' or "
            "chat_template.jinja): render the conversations into --field / --response-field"
        )

    def render(messages: list[dict[str, str]], **kw: Any) -> str:
        return hf.apply_chat_template(messages, tokenize=False, **kw)

    def segments(messages: Any, where: str) -> Segments:
        _check_messages(messages, where)
        full, out, pos = render(messages), [], 0
        for k, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before = render(messages[:k], add_generation_prompt=True) if k else ""
            upto = render(messages[: k + 1])
            if not (full.startswith(upto) and upto.startswith(before) and len(before) >= pos):
                raise DataError(
                    f"{where}: the chat template does not render a conversation as the "
                    "rendering of its first turns followed by the rest, so the assistant's "
                    "tokens cannot be told apart; render it into --field / --response-field"
                )
            out += [(full[pos : len(before)], False), (full[len(before) : len(upto)], True)]
            pos = len(upto)
        return [part for part in [*out, (full[pos:], False)] if part[0]]

    return segments


def _check_messages(messages: Any, where: str) -> None:
    ok = isinstance(messages, list) and messages and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in messages
    )
    if not ok:
        raise DataError(
            f"{where}: messages must be a non-empty list of {{'role': ..., 'content': ...}} "
            "with text values"
        )
