"""Unit tests of trainwise.data: synthetic corpus, token files, datasets, sharded sampler."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from trainwise.data import (
    ArrayDataset,
    DataInfo,
    ShardedBatchSampler,
    TokenWindows,
    build_datasets,
    build_loader,
    build_synthetic_corpus,
    load_digits_arrays,
    open_token_file,
    split_arrays,
    split_tokens,
    synthetic_entropy_rate,
    token_vocab_size,
    write_token_file,
)
from trainwise.errors import DataError


def _cond_entropy(context: np.ndarray, nxt: np.ndarray) -> float:
    """Plug-in estimate of H(next | context) in nats."""
    _, pair_counts = np.unique(context * 65536 + nxt, return_counts=True)
    _, ctx_counts = np.unique(context, return_counts=True)
    n = len(nxt)
    return float(
        (-(pair_counts * np.log(pair_counts)).sum() + (ctx_counts * np.log(ctx_counts)).sum()) / n
    )


# -- synthetic corpus ------------------------------------------------------------------


def test_corpus_deterministic_dtype_range():
    a = build_synthetic_corpus(50_000, vocab_size=256, seed=0)
    b = build_synthetic_corpus(50_000, vocab_size=256, seed=0)
    assert a.dtype == np.uint16
    assert a.shape == (50_000,)
    assert np.array_equal(a, b)
    assert a.max() < 256
    # Every id is used (slot 0 follows a cycle through the whole vocabulary).
    assert len(np.unique(a)) == 256


def test_corpus_small_vocab_range_and_prefix():
    c = build_synthetic_corpus(3000, vocab_size=17, seed=3)
    assert c.max() < 17
    assert np.array_equal(build_synthetic_corpus(1500, vocab_size=17, seed=3), c[:1500])


def test_corpus_seeds_differ():
    a = build_synthetic_corpus(10_000, seed=0)
    b = build_synthetic_corpus(10_000, seed=1)
    assert np.mean(a != b) > 0.5


def test_entropy_rate_low_and_matches_corpus():
    h = synthetic_entropy_rate(256, 0)
    assert h < 0.5 * math.log(256)
    assert 0.8 < h < 1.5
    c = build_synthetic_corpus(1_000_000, 256, 0).astype(np.int64)
    # Second-order plug-in estimate matches the exact rate ...
    h2 = _cond_entropy(c[:-2] * 256 + c[1:-1], c[2:])
    assert abs(h2 - h) < 0.05
    # ... and the previous token matters: first order alone is clearly worse.
    h1 = _cond_entropy(c[1:-1], c[2:])
    assert h1 > h + 0.15


@pytest.mark.parametrize(
    "kwargs",
    [{"n_tokens": 0}, {"n_tokens": 10, "vocab_size": 3}, {"n_tokens": 10, "vocab_size": 70_000}],
)
def test_corpus_bad_args(kwargs):
    with pytest.raises(DataError):
        build_synthetic_corpus(**kwargs)


# -- sampler ---------------------------------------------------------------------------


def _step_shards(n, mb, accum, dp, step, seed=0):
    """{rank: [micro-batch index lists]} for one step."""
    out = {}
    for r in range(dp):
        s = ShardedBatchSampler(n, mb, accum, r, dp, seed=seed)
        out[r] = [s.indices(step, a) for a in range(accum)]
    return out


def test_sampler_ranks_disjoint_within_step():
    shards = _step_shards(100, 3, 2, 4, step=5)
    flat = [i for r in shards.values() for mb in r for i in mb]
    assert len(flat) == 3 * 2 * 4
    assert len(set(flat)) == len(flat)
    for r in range(4):
        for b in range(r + 1, 4):
            ra = {i for mb in shards[r] for i in mb}
            rb = {i for mb in shards[b] for i in mb}
            assert not ra & rb


def test_sampler_union_same_for_same_global_batch():
    layouts = [(4, 1, 1), (2, 1, 2), (1, 2, 2), (2, 2, 1)]
    for step in (0, 3, 7):
        unions = []
        for mb, accum, dp in layouts:
            shards = _step_shards(37, mb, accum, dp, step=step, seed=11)
            unions.append(sorted(i for r in shards.values() for b in r for i in b))
        assert all(u == unions[0] for u in unions), (step, unions)


def test_sampler_every_sample_once_per_epoch():
    n, mb, accum, dp = 24, 2, 3, 2  # G = 12, two steps per epoch
    for epoch in range(3):
        seen = []
        for step in (2 * epoch, 2 * epoch + 1):
            for r in range(dp):
                s = ShardedBatchSampler(n, mb, accum, r, dp, seed=5)
                for a in range(accum):
                    seen += s.indices(step, a)
        assert sorted(seen) == list(range(n))


def test_sampler_epochs_use_different_permutations():
    s = ShardedBatchSampler(50, 50, 1, 0, 1, seed=0)
    assert s.indices(0, 0) != s.indices(1, 0)
    assert sorted(s.indices(0, 0)) == sorted(s.indices(1, 0)) == list(range(50))
    flat = ShardedBatchSampler(50, 50, 1, 0, 1, shuffle=False)
    assert flat.indices(0, 0) == flat.indices(1, 0) == list(range(50))


def test_sampler_crosses_epoch_boundary():
    n, g = 10, 4  # step 2 covers positions 8..11: two of epoch 0, two of epoch 1
    s = ShardedBatchSampler(n, g, 1, 0, 1, seed=9)
    p0 = np.random.default_rng([9, 0]).permutation(n)
    p1 = np.random.default_rng([9, 1]).permutation(n)
    assert s.indices(2, 0) == [*p0[8:10], *p1[0:2]]
    # The stream stays a concatenation of permutations across many boundaries.
    stream = [i for step in range(10) for i in s.indices(step, 0)]
    for e in range(4):
        assert sorted(stream[e * n : (e + 1) * n]) == list(range(n))
    ordered = ShardedBatchSampler(n, g, 1, 0, 1, shuffle=False)
    assert ordered.indices(2, 0) == [8, 9, 0, 1]


def test_sampler_iter_order_and_len():
    s = ShardedBatchSampler(40, 2, 3, 1, 2, seed=1, num_steps=4)
    assert len(s) == 12
    batches = list(s)
    assert len(batches) == 12
    assert batches == [s.indices(st, a) for st in range(4) for a in range(3)]
    assert all(len(b) == 2 for b in batches)
    assert s.state_dict()["step"] == 4
    # A finite sampler is re-iterable: each pass covers the same window.
    assert list(s) == batches and len(s) == 12


def test_sampler_infinite_has_no_len():
    s = ShardedBatchSampler(40, 2, 1, 0, 1)
    with pytest.raises(TypeError):
        len(s)
    it = iter(s)
    assert len([next(it) for _ in range(100)]) == 100


def test_sampler_resume_equals_tail():
    full = list(ShardedBatchSampler(30, 2, 2, 1, 3, seed=4, num_steps=10))
    tail = list(ShardedBatchSampler(30, 2, 2, 1, 3, seed=4, start_step=6, num_steps=4))
    assert tail == full[6 * 2 :]


def test_sampler_tracks_position_and_state_round_trip():
    s = ShardedBatchSampler(30, 2, 2, 0, 1, seed=4, num_steps=10)
    it = iter(s)
    for _ in range(5):  # steps 0, 1 and the first micro-batch of step 2
        next(it)
    state = s.state_dict()
    assert state["step"] == 2
    s2 = ShardedBatchSampler(30, 2, 2, 0, 1, seed=4, num_steps=10)
    s2.load_state_dict(state)
    assert len(s2) == 8 * 2
    rest = list(s2)
    assert rest == [s.indices(st, a) for st in range(2, 10) for a in range(2)]
    assert s2.state_dict()["step"] == 10
    # Another split of the same global batch may resume it.
    s3 = ShardedBatchSampler(30, 1, 2, 1, 2, seed=4)
    s3.load_state_dict(state)
    assert s3.state_dict()["step"] == 2


@pytest.mark.parametrize(
    ("field", "kwargs"),
    [
        ("global_batch", {"micro_batch": 4}),
        ("seed", {"seed": 5}),
        ("num_samples", {"num_samples": 31}),
        ("shuffle", {"shuffle": False}),
    ],
)
def test_sampler_load_state_mismatch(field, kwargs):
    base = {"num_samples": 30, "micro_batch": 2, "grad_accum": 2, "dp_rank": 0, "dp_size": 1}
    state = ShardedBatchSampler(**base, seed=4).state_dict()
    other = ShardedBatchSampler(**{**base, "seed": 4, **kwargs})
    with pytest.raises(DataError, match=field):
        other.load_state_dict(state)
    with pytest.raises(DataError, match="missing"):
        other.load_state_dict({"step": 3})


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((10, 0, 1, 0, 1), "micro_batch"),
        ((10, 1, 0, 0, 1), "grad_accum"),
        ((10, 1, 1, 0, 0), "dp_size"),
        ((10, 1, 1, 2, 2), "dp_rank"),
        ((10, 1, 1, -1, 2), "dp_rank"),
        ((10, 3, 2, 0, 2), "exceeds the 10 samples"),
    ],
)
def test_sampler_bad_args(args, match):
    with pytest.raises(DataError, match=match):
        ShardedBatchSampler(*args)


# -- token files and datasets ----------------------------------------------------------


def test_token_windows_shifted_by_one():
    tokens = np.arange(23, dtype=np.uint16)
    ds = TokenWindows(tokens, 5)
    assert len(ds) == 4  # (23 - 1) // 5
    for i in range(len(ds)):
        x, y = ds[i]
        assert x.dtype == y.dtype == torch.int64
        assert x.tolist() == list(range(5 * i, 5 * i + 5))
        assert y.tolist() == list(range(5 * i + 1, 5 * i + 6))
    with pytest.raises(IndexError):
        ds[4]
    with pytest.raises(DataError, match="too few"):
        TokenWindows(np.arange(5, dtype=np.uint16), 5)


def test_token_file_round_trip(tmp_path):
    tokens = build_synthetic_corpus(1000, vocab_size=300, seed=2)
    path = write_token_file(tmp_path / "sub" / "train.bin", tokens)
    assert path.stat().st_size == 2000
    mm = open_token_file(path)
    assert isinstance(mm, np.memmap)
    assert np.array_equal(np.asarray(mm), tokens)
    with pytest.raises(ValueError):
        mm[0] = 1  # read-only
    assert token_vocab_size(mm, chunk=7) == int(tokens.max()) + 1


def test_write_token_file_rejects_out_of_range(tmp_path):
    with pytest.raises(DataError, match="uint16"):
        write_token_file(tmp_path / "x.bin", np.array([0, 70_000]))


def test_bad_token_files(tmp_path):
    missing = tmp_path / "nope.bin"
    with pytest.raises(DataError, match="nope.bin.*does not exist"):
        open_token_file(missing)
    empty = tmp_path / "empty.bin"
    empty.write_bytes(b"")
    with pytest.raises(DataError, match="empty.bin.*is empty"):
        open_token_file(empty)
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\x01\x00\x02")
    with pytest.raises(DataError, match="odd.bin.*not a multiple of 2"):
        open_token_file(odd)


def test_digits_shapes_and_ranges():
    X, y = load_digits_arrays()
    assert X.shape == (1797, 64) and X.dtype == np.float32
    assert y.shape == (1797,) and y.dtype == np.int64
    assert X.min() == 0.0 and X.max() == 1.0
    assert set(np.unique(y).tolist()) == set(range(10))


def test_splits():
    tokens = np.arange(1000)
    train, val = split_tokens(tokens, 0.1)
    assert len(train) == 900 and len(val) == 100
    assert np.array_equal(val, np.arange(900, 1000))  # the last fraction is held out

    X = np.arange(200, dtype=np.float32).reshape(100, 2)
    y = np.arange(100)
    (xt, yt), (xv, yv) = split_arrays(X, y, 0.25, seed=3)
    assert len(xt) == 75 and len(xv) == 25
    assert sorted([*yt.tolist(), *yv.tolist()]) == list(range(100))
    assert np.array_equal(xt[:, 0], yt * 2)  # rows stay paired with labels
    (_, yt2), _ = split_arrays(X, y, 0.25, seed=3)
    (_, yt3), _ = split_arrays(X, y, 0.25, seed=4)
    assert np.array_equal(yt, yt2) and not np.array_equal(yt, yt3)
    for bad in (0.0, 1.0, -0.1):
        with pytest.raises(DataError, match="val_fraction"):
            split_tokens(tokens, bad)


def test_array_dataset():
    ds = ArrayDataset(np.zeros((4, 3), np.float32), np.arange(4))
    x, y = ds[2]
    assert x.shape == (3,) and int(y) == 2 and len(ds) == 4
    with pytest.raises(DataError):
        ArrayDataset(np.zeros((4, 3)), np.arange(3))


# -- build_datasets / build_loader -----------------------------------------------------


def test_build_datasets_synthetic():
    train, val, info = build_datasets(
        "synthetic", seq_len=16, val_fraction=0.1, seed=0, vocab_size=64, synthetic_tokens=10_000
    )
    assert info == DataInfo("lm", 64, None, None, len(train), len(val), 16)
    assert len(train) == (9000 - 1) // 16 and len(val) == (1000 - 1) // 16
    x, y = train[0]
    assert x.shape == (16,) and torch.equal(x[1:], y[:-1])


def test_build_datasets_tokens(tmp_path):
    path = write_token_file(tmp_path / "c.bin", np.arange(2000) % 500)
    train, val, info = build_datasets("tokens", seq_len=8, val_fraction=0.2, seed=0, path=str(path))
    assert info.task == "lm" and info.vocab_size == 500 and info.tokens_per_sample == 8
    assert info.train_samples == len(train) == (1600 - 1) // 8
    with pytest.raises(DataError, match="data.path"):
        build_datasets("tokens", seq_len=8, val_fraction=0.2, seed=0)
    with pytest.raises(DataError, match="validation split"):
        build_datasets("tokens", seq_len=500, val_fraction=0.2, seed=0, path=str(path))


def test_build_datasets_digits():
    train, val, info = build_datasets("digits", seq_len=64, val_fraction=0.2, seed=0)
    assert info.task == "classify" and info.in_features == 64 and info.num_classes == 10
    assert info.train_samples + info.val_samples == 1797 and info.val_samples == 359
    assert info.vocab_size is None and info.tokens_per_sample == 1


def test_build_datasets_unknown_name():
    with pytest.raises(DataError, match="synthetic, digits, tokens"):
        build_datasets("mnist", seq_len=8, val_fraction=0.1, seed=0)  # type: ignore[arg-type]


def test_build_loader_lm():
    train, _, _ = build_datasets(
        "synthetic", seq_len=16, val_fraction=0.1, seed=0, synthetic_tokens=5_000
    )
    loader = build_loader(
        train, micro_batch=4, grad_accum=2, dp_rank=1, dp_size=2, seed=0, num_steps=3
    )
    batches = list(loader)
    assert len(loader) == len(batches) == 6
    for x, y in batches:
        assert x.shape == y.shape == (4, 16) and x.dtype == torch.int64
    again = list(loader)
    assert len(again) == 6 and all(
        torch.equal(a[0], b[0]) for a, b in zip(again, batches, strict=True)
    )


def test_build_loader_digits_and_bad_workers():
    train, _, _ = build_datasets("digits", seq_len=1, val_fraction=0.2, seed=0)
    loader = build_loader(
        train, micro_batch=32, grad_accum=1, dp_rank=0, dp_size=1, seed=0, num_steps=2
    )
    batches = list(loader)
    assert len(batches) == 2
    x, y = batches[0]
    assert x.shape == (32, 64) and x.dtype == torch.float32
    assert y.shape == (32,) and y.dtype == torch.int64
    with pytest.raises(DataError, match="num_workers"):
        build_loader(
            train, micro_batch=1, grad_accum=1, dp_rank=0, dp_size=1, seed=0, num_workers=-1
        )


def test_sampler_rank_micro_layout_within_global_batch():
    n, mb, accum, dp = 50, 3, 2, 4
    whole = ShardedBatchSampler(n, mb * accum * dp, 1, 0, 1, seed=8)
    for step in (0, 1, 2):
        g = whole.indices(step, 0)
        for r in range(dp):
            s = ShardedBatchSampler(n, mb, accum, r, dp, seed=8)
            for a in range(accum):
                start = (r * accum + a) * mb
                assert s.indices(step, a) == g[start : start + mb]
