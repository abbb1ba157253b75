"""A model and a dataset of your own, as examples/own_model/run.py trains them: nothing in
this file is trainwise's.

TinyLM is a byte-level language model (token and position embeddings, causal attention
blocks, a final norm and a head), written as torchtitan writes its models so that
trainwise can also cut it into pipeline stages (docs/parallelism.md): the blocks in one
`layers` container, the modules before them and after them called only when they are
there (a stage holds None in their place).

load_data() reads the JSONL files beside this one with Hugging Face datasets' "json"
builder (nothing is downloaded) and turns each line's text into bytes: `input_ids` and,
one byte later, the `labels` the model learns to predict (-100 where the text has ended,
which cross entropy skips).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

DATA = Path(__file__).resolve().parent / "data"  # train.jsonl, validation.jsonl
VOCAB = 128  # ASCII
SEQ = 40  # bytes a sample; the longest line has 37
PAD, IGNORE = 0, -100


class Block(nn.Module):
    """Pre-norm causal self-attention and an MLP, each added to the residual stream."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, t, d = h.shape
        q, k, v = self.qkv(self.norm1(h)).view(b, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = h + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return h + self.mlp(self.norm2(h))


class TinyLM(nn.Module):
    """tokens [B, T] -> logits [B, T, VOCAB]."""

    def __init__(self, dim: int = 64, n_layers: int = 2, heads: int = 4):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, dim)  # before the blocks: the first stage's
        self.pos = nn.Embedding(SEQ, dim)
        self.layers = nn.ModuleList(Block(dim, heads) for _ in range(n_layers))
        self.norm = nn.LayerNorm(dim)  # after them: the last stage's
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = tokens
        if self.tok is not None:
            where = torch.arange(tokens.shape[1], device=tokens.device)
            h = self.tok(tokens) + self.pos(where)
        for block in self.layers:
            h = block(h)
        h = self.norm(h) if self.norm is not None else h
        return self.head(h) if self.head is not None else h


def encode(row: dict[str, Any]) -> dict[str, list[int]]:
    """A line of text as the model's input bytes and the next byte of each."""
    ids = list(row["text"].encode("ascii"))[: SEQ + 1]
    labels = ids[1:] + [IGNORE] * (SEQ + 1 - len(ids))
    return {"input_ids": ids[:-1] + [PAD] * (SEQ + 1 - len(ids)), "labels": labels}


def load_data() -> Any:
    """The JSONL files as a Hugging Face DatasetDict (train, validation) of byte ids.
    trainwise reads the `validation` split for the held-out loss, reads each batch's
    `labels` as the target and gives the model the other tensor column, `input_ids`."""
    import datasets

    datasets.disable_progress_bars()
    files = {split: str(DATA / f"{split}.jsonl") for split in ("train", "validation")}
    return datasets.load_dataset("json", data_files=files).map(encode, remove_columns="text")


@torch.no_grad()
def held_out_loss(model: nn.Module, batch_size: int = 16) -> float:
    """The model's mean loss a batch over the validation split (as trainwise evaluates)."""
    val = load_data()["validation"].with_format("torch")
    model.eval()
    losses = []
    for start in range(0, len(val), batch_size):
        rows = val[start : start + batch_size]
        logits = model(rows["input_ids"])
        losses.append(F.cross_entropy(logits.flatten(0, 1), rows["labels"].flatten()))
    return float(torch.stack(losses).mean())


@torch.no_grad()
def complete(model: nn.Module, prompt: str, length: int = 24) -> str:
    """The prompt continued byte by byte, each the model's likeliest."""
    model.eval()
    ids = list(prompt.encode("ascii"))
    while len(ids) < min(SEQ, len(prompt) + length):
        nxt = int(model(torch.tensor([ids]))[0, -1].argmax())
        if nxt == PAD:
            break
        ids.append(nxt)
        if nxt == ord("."):
            break
    return bytes(ids).decode("ascii", errors="replace")
