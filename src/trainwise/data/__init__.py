"""trainwise.data: built-in and user datasets, splits, and the sharded batch sampler.

This package sits on the lowest floor: it imports nothing from trainwise but the
top-level modules (errors, checksum, objects), and takes plain arguments rather than config
objects.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from torch.utils.data import DataLoader, Dataset

from trainwise.data.datasets import ArrayDataset, TokenWindows, split_arrays, split_tokens
from trainwise.data.digits import load_digits_arrays
from trainwise.data.sampler import ShardedBatchSampler
from trainwise.data.shards import (
    PackedExamples,
    PromptResponseExamples,
    TokenShards,
    is_prepared_dir,
    read_index,
)
from trainwise.data.stream import Stream, StreamBatches, stream_eval_batches
from trainwise.data.synthetic import build_synthetic_corpus, synthetic_entropy_rate
from trainwise.data.tokens import open_token_file, token_vocab_size, write_token_file
from trainwise.data.user import UserData, first_batch, user_data_problems
from trainwise.errors import DataError
from trainwise.objects import is_object_reference

__all__ = [
    "DATASET_NAMES",
    "ArrayDataset",
    "DataInfo",
    "ShardedBatchSampler",
    "Stream",
    "StreamBatches",
    "PackedExamples",
    "PromptResponseExamples",
    "TokenShards",
    "TokenWindows",
    "build_datasets",
    "build_eval_loader",
    "build_loader",
    "build_synthetic_corpus",
    "load_digits_arrays",
    "open_token_file",
    "split_arrays",
    "split_tokens",
    "synthetic_entropy_rate",
    "token_vocab_size",
    "first_batch",
    "user_data_problems",
    "write_token_file",
]

DATASET_NAMES = ("synthetic", "digits", "tokens")


@dataclass
class DataInfo:
    """What a model and the throughput meter need to know about the built datasets."""

    task: Literal["lm", "classify", "custom"]  # custom: your own dataset (data/user.py)
    vocab_size: int | None  # lm: max token id + 1 as used by the corpus
    in_features: int | None  # classify
    num_classes: int | None  # classify
    train_samples: int | None  # None: an iterable (its length is not known)
    val_samples: int | None  # None: an iterable, or no validation split
    tokens_per_sample: int  # seq_len for lm, 1 for classify and custom (used for tokens/s)
    packed: bool = False  # samples are (x, y, doc): packed examples the model keeps apart
    notes: tuple[str, ...] = ()  # said once before training (how an iterable is read, ...)


def _lm_datasets(
    tokens, seq_len: int, val_fraction: float, vocab_size: int, what: str
) -> tuple[Dataset, Dataset, DataInfo]:
    train, val = split_tokens(tokens, val_fraction)
    train_ds = TokenWindows(train, seq_len, source=f"the training split of {what}")
    val_ds = TokenWindows(
        val, seq_len, source=f"the validation split (data.val_fraction={val_fraction}) of {what}"
    )
    info = DataInfo("lm", vocab_size, None, None, len(train_ds), len(val_ds), seq_len)
    return train_ds, val_ds, info


def _examples(
    path: str | Path, seq_len: int, packing: bool, first: int = 0, last: int | None = None
) -> PromptResponseExamples:
    cls = PackedExamples if packing else PromptResponseExamples
    return cls(path, seq_len, first, last)


def _example_datasets(
    path: str, seq_len: int, val_fraction: float, packing: bool
) -> tuple[Dataset, Dataset, DataInfo]:
    """A prompt/response corpus: the last val_fraction of the examples held out."""
    index = read_index(path)
    n = int(index["documents"])
    n_val = int(round(n * val_fraction))
    if not 0 < n_val < n:
        raise DataError(
            f"data.val_fraction={val_fraction} of the {n} examples in {str(path)!r} leaves an "
            "empty split; use more examples or a val_fraction nearer 0.5"
        )
    train = _examples(path, seq_len, packing, 0, n - n_val)
    val = _examples(path, seq_len, packing, n - n_val, n)
    vocab = int(index["vocab_size"])
    return train, val, DataInfo("lm", vocab, None, None, len(train), len(val), seq_len, packing)


def _held_out_datasets(
    path: str, seq_len: int, examples: bool, packing: bool
) -> tuple[Dataset, Dataset, DataInfo]:
    """A prepared corpus with the documents `data prepare --val-fraction` held out in
    PATH/val: training reads PATH, evaluation PATH/val (data.val_fraction is not applied)."""
    held = Path(path) / "val"
    if examples:
        train: Dataset = _examples(path, seq_len, packing)
        val: Dataset = _examples(held, seq_len, packing)
    else:
        train = TokenWindows(TokenShards(path), seq_len, source=f"prepared corpus {path!r}")
        val = TokenWindows(TokenShards(held), seq_len, source=f"its held-out part {str(held)!r}")
    vocab = int(read_index(path)["vocab_size"])
    packed = examples and packing
    return train, val, DataInfo("lm", vocab, None, None, len(train), len(val), seq_len, packed)


def example_format(path: str, format: str) -> bool:
    """Whether the corpus at `path` is read as examples (prompt/response: masked labels) or
    as a plain token stream: data.format, or for auto the prepared index's kind."""
    kind = read_index(path).get("kind") if Path(path).is_dir() else None
    if format == "prompt_response" and kind != "prompt_response":
        raise DataError(
            f"data.format = 'prompt_response' but data.path {path!r} is not a prepared "
            "prompt/response corpus: prepare it with --response-field or --messages-field, "
            "or set data.format = 'auto'"
        )
    return kind == "prompt_response" and format != "text"


def _user_datasets(
    path: str, collate: str | None, val_fraction: float, num_workers: int
) -> tuple[Any, Any, DataInfo]:
    user = UserData(path, collate, val_fraction, num_workers)
    train, val = user.train, user.val
    n_train = None if isinstance(train, Stream) else len(train)
    n_val = None if val is None or isinstance(val, Stream) else len(val)
    info = DataInfo("custom", None, None, None, n_train, n_val, 1, notes=tuple(user.notes))
    return train, val, info


def build_datasets(
    name: str,
    *,
    seq_len: int,
    val_fraction: float,
    seed: int,
    path: str | None = None,
    vocab_size: int = 256,
    synthetic_tokens: int = 1_000_000,
    format: str = "auto",
    packing: bool = True,
    collate: str | None = None,
    num_workers: int = 0,
) -> tuple[Any, Any, DataInfo]:
    """Build (train, val, info) for a dataset name, or your own dataset's import path
    (data/user.py: val is None for an iterable without a validation split).

    synthetic: a generated corpus of synthetic_tokens ids over vocab_size, the same on every
    rank (it depends on seed only). tokens: the uint16 file at path, or a directory
    `trainwise data prepare` wrote (its vocabulary is the tokenizer's). digits: sklearn's
    digits, split with a seeded shuffle; seq_len is unused.
    """
    if is_object_reference(name):  # an import path, or an object by value
        return _user_datasets(name, collate, val_fraction, num_workers)
    if name == "synthetic":
        corpus = build_synthetic_corpus(synthetic_tokens, vocab_size, seed)
        what = f"the synthetic corpus ({synthetic_tokens} tokens)"
        return _lm_datasets(corpus, seq_len, val_fraction, vocab_size, what)
    if name == "tokens":
        if path is None:
            raise DataError(
                "data.path is not set but data.name='tokens' needs it; set data.path to a uint16 "
                "token file or a directory written by `trainwise data prepare`"
            )
        examples = example_format(path, format)
        if Path(path).is_dir() and is_prepared_dir(Path(path) / "val"):
            return _held_out_datasets(path, seq_len, examples, packing)
        if examples:
            return _example_datasets(path, seq_len, val_fraction, packing)
        if Path(path).is_dir():
            shards = TokenShards(path)
            what = f"prepared corpus {str(path)!r} ({len(shards)} tokens)"
            return _lm_datasets(shards, seq_len, val_fraction, shards.vocab_size, what)
        tokens = open_token_file(path)
        what = f"token file {str(path)!r} ({len(tokens)} tokens)"
        return _lm_datasets(tokens, seq_len, val_fraction, token_vocab_size(tokens), what)
    if name == "digits":
        X, y = load_digits_arrays()
        (x_tr, y_tr), (x_va, y_va) = split_arrays(X, y, val_fraction, seed)
        info = DataInfo("classify", None, X.shape[1], int(y.max()) + 1, len(x_tr), len(x_va), 1)
        return ArrayDataset(x_tr, y_tr), ArrayDataset(x_va, y_va), info
    raise DataError(f"data.name={name!r} is unknown; choose one of {', '.join(DATASET_NAMES)}")


def build_loader(
    dataset: Any,
    *,
    micro_batch: int,
    grad_accum: int,
    dp_rank: int,
    dp_size: int,
    seed: int,
    start_step: int = 0,
    num_steps: int | None = None,
    shuffle: bool = True,
    num_workers: int = 0,
    pin_memory: bool = False,
    prefetch_factor: int = 2,
    position: dict[str, Any] | None = None,
) -> DataLoader | StreamBatches:
    """This rank's (x, y, ...) micro-batches: a DataLoader over ShardedBatchSampler for a
    map-style dataset, StreamBatches for an iterable one (`position`: a checkpoint's data
    position at start_step, which restores the stream's own state)."""
    if not isinstance(num_workers, int) or isinstance(num_workers, bool) or num_workers < 0:
        raise DataError(f"data.num_workers={num_workers!r} must be an integer >= 0")
    if isinstance(dataset, Stream):
        return StreamBatches(
            dataset, micro_batch=micro_batch, grad_accum=grad_accum, dp_rank=dp_rank,
            dp_size=dp_size, start_step=start_step, num_steps=num_steps, position=position,
        )
    sampler = ShardedBatchSampler(
        len(dataset),
        micro_batch,
        grad_accum,
        dp_rank,
        dp_size,
        seed=seed,
        start_step=start_step,
        num_steps=num_steps,
        shuffle=shuffle,
    )
    return DataLoader(
        dataset,
        batch_sampler=sampler,
        collate_fn=getattr(dataset, "batch_of", None),  # your data.collate (data/user.py)
        num_workers=num_workers,
        pin_memory=pin_memory,
        persistent_workers=num_workers > 0,
        prefetch_factor=prefetch_factor if num_workers > 0 else None,
    )


def build_eval_loader(
    dataset: Any, *, micro_batch: int, max_batches: int, dp_rank: int, dp_size: int, seed: int
) -> Any:
    """Held-out batches, in order: every rank gets the same number of distinct samples and
    none repeats (a small split gets smaller batches, then fewer of them)."""
    if isinstance(dataset, Stream):
        return stream_eval_batches(
            dataset, micro_batch=micro_batch, max_batches=max_batches, dp_rank=dp_rank,
            dp_size=dp_size,
        )
    mb = min(micro_batch, max(1, len(dataset) // (dp_size * max_batches)))
    steps = max(1, min(max_batches, len(dataset) // (dp_size * mb)))
    return build_loader(
        dataset, micro_batch=mb, grad_accum=1, dp_rank=dp_rank, dp_size=dp_size, seed=seed,
        num_steps=steps, shuffle=False,
    )
