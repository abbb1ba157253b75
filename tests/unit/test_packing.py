"""Packed supervised fine-tuning: several whole examples a sequence (data.packing), and
none sees another. The built-in GPT (learned positions and rope) gives an example inside a
packed sequence the logits it gives the example alone; the packed loss is the loss of the
examples' responses alone; every example is packed once, in order. (Training with it
under FSDP and TP: tests/dist/test_sft_packing.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from trainwise.data import PackedExamples
from trainwise.data.prepare import load_tokenizer, prepare
from trainwise.models import ModelSpec, build_model
from trainwise.models.gpt import packed_layout

EXAMPLES = [
    {"prompt": f"Q{i}: {'what is ' * (i % 4)}{i} + {i}?", "response": f" {2 * i}." * (1 + i % 3)}
    for i in range(40)
]
SEQ = 128


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("packing")
    src = root / "sft.jsonl"
    src.write_text("".join(json.dumps(e) + "\n" for e in EXAMPLES))
    prepare([src], root / "sft", load_tokenizer("bytes"), field="prompt", response_field="response")
    return root / "sft"


def test_positions_restart_and_attention_stays_inside_an_example():
    positions, mask = packed_layout(torch.tensor([[0, 0, 1, 1, 1, -1, -1]]))
    assert positions.tolist() == [[0, 1, 0, 1, 2, 0, 1]]
    allowed = mask[0, 0].nonzero().tolist()
    assert [2, 0] not in allowed and [2, 1] not in allowed and [4, 2] in allowed
    assert [3, 4] not in allowed  # causal
    assert all(mask[0, 0, i, i] for i in range(7))  # no row is empty


def test_every_example_is_packed_once_in_order(corpus: Path):
    packed = PackedExamples(corpus, SEQ)
    plain = packed.example  # the same corpus read one example at a time
    seen = []
    for j in range(len(packed)):
        x, y, doc = packed[j]
        for k in range(int(doc.max()) + 1):
            i = len(seen)
            inputs, targets = plain(i)
            at = (doc == k).nonzero().flatten()
            assert x[at].tolist() == inputs.tolist() and y[at].tolist() == targets.tolist()
            seen.append(i)
        pad = doc == -1
        assert (y[pad] == -100).all()
    assert seen == list(range(len(EXAMPLES)))
    assert len(packed) < len(EXAMPLES) / 2  # packing is worth it here


@pytest.mark.parametrize("preset", ["tiny", "small"])  # learned positions, rope
def test_a_packed_example_has_its_logits_alone(corpus: Path, preset: str):
    torch.manual_seed(0)
    model = build_model(ModelSpec(name=preset, vocab_size=257, seq_len=SEQ)).module.eval()
    packed = PackedExamples(corpus, SEQ)
    x, y, doc = (t[None] for t in packed[1])
    with torch.no_grad():
        logits = model(x, doc)
        other = x.clone()
        other[doc == 0] = (other[doc == 0] + 7) % 256  # another example's tokens change
        changed = model(other, doc)
        for k in range(int(doc.max()) + 1):
            at = (doc[0] == k).nonzero().flatten()
            alone = model(x[:, at])
            torch.testing.assert_close(logits[:, at], alone, rtol=0, atol=1e-5)
            if k > 0:
                torch.testing.assert_close(changed[:, at], logits[:, at], rtol=0, atol=0)


def test_the_packed_loss_is_the_responses_alone(corpus: Path):
    torch.manual_seed(0)
    bundle = build_model(ModelSpec(name="small", vocab_size=257, seq_len=SEQ))
    packed = PackedExamples(corpus, SEQ)
    x, y, doc = (torch.stack(t) for t in zip(*(packed[j] for j in range(3)), strict=True))
    loss = bundle.loss_fn(bundle.module(x, doc), y)
    total, count = torch.zeros(()), 0
    for b in range(3):
        for k in range(int(doc[b].max()) + 1):
            at = (doc[b] == k).nonzero().flatten()
            targets = y[b, at]
            counted = targets != -100
            logits = bundle.module(x[b : b + 1, at])[0]
            total += torch.nn.functional.cross_entropy(
                logits[counted], targets[counted], reduction="sum"
            )
            count += int(counted.sum())
    torch.testing.assert_close(loss, total / count, rtol=1e-5, atol=1e-6)
