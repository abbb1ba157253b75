"""Packed supervised fine-tuning: several whole examples a sequence (data.packing), and
none sees another. The built-in GPT (learned positions and rope) gives an example inside a
packed sequence the logits it gives the example alone; the packed loss is the loss of the
examples' responses alone; every example is packed once, in order. (Training with it
under FSDP and TP: tests/dist/test_sft_packing.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import SFT_EXAMPLES, SFT_SEQ, sft_corpus, tiny_llama
from trainwise.data import (
    PackedExamples,
    PromptResponseExamples,
    build_datasets,
    build_loader,
    write_token_file,
)
from trainwise.errors import DataError
from trainwise.models import ModelSpec, build_model, takes_example_ids
from trainwise.models.gpt import packed_layout


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return sft_corpus(tmp_path_factory.mktemp("packing"))


def test_positions_restart_and_attention_stays_inside_an_example():
    positions, mask = packed_layout(torch.tensor([[0, 0, 1, 1, 1, -1, -1]]))
    assert positions.tolist() == [[0, 1, 0, 1, 2, 0, 1]]
    allowed = mask[0, 0].nonzero().tolist()
    assert [2, 0] not in allowed and [2, 1] not in allowed and [4, 2] in allowed
    assert [3, 4] not in allowed  # causal
    assert all(mask[0, 0, i, i] for i in range(7))  # no row is empty


def test_every_example_is_packed_once_in_order(corpus: Path):
    packed = PackedExamples(corpus, SFT_SEQ)
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
    assert seen == list(range(len(SFT_EXAMPLES)))
    assert len(packed) < len(SFT_EXAMPLES) / 2  # packing is worth it here


@pytest.mark.parametrize("preset", ["tiny", "small"])  # learned positions, rope
def test_a_packed_example_has_its_logits_alone(corpus: Path, preset: str):
    torch.manual_seed(0)
    model = build_model(ModelSpec(name=preset, vocab_size=257, seq_len=SFT_SEQ)).module.eval()
    packed = PackedExamples(corpus, SFT_SEQ)
    x, y, doc = (t[None] for t in packed[1])
    with torch.no_grad():
        logits = model(x, doc)
        other = x.clone()
        other[doc == 0] = (other[doc == 0] + 7) % 256  # another example's tokens change
        changed = model(other, doc)
        for k in range(int(doc.max()) + 1):
            at = (doc[0] == k).nonzero().flatten()
            alone = model(x[:, at])
            torch.testing.assert_close(logits[:, at], alone, rtol=0, atol=1e-6)
            if k > 0:
                torch.testing.assert_close(changed[:, at], logits[:, at], rtol=0, atol=0)


def test_the_packed_loss_is_the_responses_alone(corpus: Path):
    torch.manual_seed(0)
    bundle = build_model(ModelSpec(name="small", vocab_size=257, seq_len=SFT_SEQ))
    packed = PackedExamples(corpus, SFT_SEQ)
    x, y, doc = (torch.stack(t) for t in zip(*(packed[j] for j in range(2)), strict=True))
    loss = bundle.loss_fn(bundle.module(x, doc), y)
    total, count = torch.zeros(()), 0
    for b in range(2):
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
    # The same holds for the gradients: prompt and padding positions add exactly nothing.
    params = [p for p in bundle.module.parameters() if p.requires_grad]
    packed_grads = torch.autograd.grad(loss, params, retain_graph=True)
    alone_grads = torch.autograd.grad(total / count, params)
    for got, want in zip(packed_grads, alone_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


def _rows(batches) -> list[tuple]:
    """The samples of some (x, y, doc) batches, each as one hashable row."""
    return sorted(
        (tuple(x.tolist()), tuple(y.tolist()), tuple(d.tolist()))
        for xb, yb, db in batches
        for x, y, d in zip(xb, yb, db, strict=True)
    )


def test_the_loader_packs_the_same_samples_on_one_and_two_ranks(corpus: Path):
    packed = PackedExamples(corpus, SFT_SEQ)
    common = dict(grad_accum=1, seed=3, num_steps=3)
    one = list(build_loader(packed, micro_batch=4, dp_rank=0, dp_size=1, **common))
    two = [
        list(build_loader(packed, micro_batch=2, dp_rank=r, dp_size=2, **common)) for r in (0, 1)
    ]
    assert all(len(b) == 3 for b in one), "batches are (x, y, doc)"
    for step in range(3):
        assert _rows([one[step]]) == _rows([two[0][step], two[1][step]])
    # Resuming at step 2 on two ranks yields what the uninterrupted run saw at step 2.
    resumed = [
        next(iter(build_loader(packed, micro_batch=2, dp_rank=r, dp_size=2, grad_accum=1,
                               seed=3, start_step=2, num_steps=1)))
        for r in (0, 1)
    ]
    assert _rows(resumed) == _rows([one[2]])


def test_the_format_follows_the_index_and_a_wrong_one_is_one_line(corpus: Path, tmp_path: Path):
    common = dict(seq_len=SFT_SEQ, val_fraction=0.2, seed=0, path=str(corpus))
    train, _, info = build_datasets("tokens", **common)  # auto: the index says prompt_response
    assert isinstance(train, PackedExamples) and info.packed
    train, _, info = build_datasets("tokens", **common, packing=False)
    assert not isinstance(train, PackedExamples) and len(train[0]) == 2 and not info.packed
    train, _, info = build_datasets("tokens", **common, format="text")  # a plain token stream
    assert not isinstance(train, PromptResponseExamples) and not info.packed
    token_file = tmp_path / "tokens.bin"
    write_token_file(token_file, np.arange(4096) % 256)
    for path in (token_file, tmp_path / "missing"):
        with pytest.raises(DataError) as err:
            build_datasets("tokens", **{**common, "path": str(path)}, format="prompt_response")
        message = str(err.value)
        assert "\n" not in message and "data.format = 'prompt_response'" in message
        assert str(path) in message and "--response-field" in message


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_a_transformers_model_keeps_packed_examples_apart(
    corpus: Path, tmp_path: Path, attention: str
):
    """A transformers Llama gets the examples' 4-D mask and restarting positions."""
    spec = ModelSpec(name=f"hf:{tiny_llama(tmp_path / 'llama', vocab=257)}", vocab_size=257,
                     seq_len=SFT_SEQ)
    assert takes_example_ids(spec)
    model = build_model(spec).module.eval()
    model.model.set_attn_implementation(attention)
    x, _, doc = (t[None] for t in PackedExamples(corpus, SFT_SEQ)[1])
    with torch.no_grad():
        logits = model(x, doc)
        other = x.clone()
        other[doc == 0] = (other[doc == 0] + 7) % 256
        changed = model(other, doc)
        for k in range(int(doc.max()) + 1):
            at = (doc[0] == k).nonzero().flatten()
            torch.testing.assert_close(logits[:, at], model(x[:, at]), rtol=0, atol=1e-6)
            if k > 0:
                torch.testing.assert_close(changed[:, at], logits[:, at], rtol=0, atol=1e-6)


def test_a_transformers_model_with_its_own_mask_cannot_pack(tmp_path: Path):
    config = {"model_type": "gpt_neo", "hidden_size": 32, "num_layers": 2, "num_heads": 4,
              "attention_types": [[["global"], 2]], "vocab_size": 257}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert not takes_example_ids(ModelSpec(name=f"hf:{tmp_path}", vocab_size=257))


def test_a_transformers_model_on_flash_or_flex_attention_cannot_pack(tmp_path: Path):
    """config.json's attn_implementation reaches the built model; flash and flex attention
    take no custom 4-D mask, so packing is refused before any worker starts."""
    folder = tiny_llama(tmp_path / "llama", vocab=257)
    config = json.loads((folder / "config.json").read_text())
    spec = ModelSpec(name=f"hf:{folder}", vocab_size=257)
    for impl, packs in (("sdpa", True), ("flex_attention", False)):
        (folder / "config.json").write_text(json.dumps({**config, "attn_implementation": impl}))
        assert takes_example_ids(spec) == packs, impl
