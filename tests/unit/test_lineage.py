"""The lineage of a run: what a resume may change (the layout, the length, how a run
starts) and what it may not (what training computes)."""

from __future__ import annotations

import pytest

from trainwise.config import load_config
from trainwise.config.lineage import lineage_differences, lineage_hash, lineage_keys


def lineage(*overrides: str, global_batch: int = 32) -> dict:
    return lineage_keys(load_config(overrides=list(overrides)), global_batch)


@pytest.mark.parametrize(
    "change",
    ["parallel.strategy='fsdp'", "cluster.nproc=4", "train.steps=999", "model.init='random'",
     "checkpoint.interval=7", "data.micro_batch=4", "model.norm_impl='composite'",
     "optim.foreach=false", "optim.implementation='foreach'"],
)
def test_what_a_resume_may_change_keeps_the_lineage(change: str):
    assert lineage_hash(lineage(change)) == lineage_hash(lineage())


@pytest.mark.parametrize(
    "change, key",
    [("optim.lr=1e-3", "optim.lr"), ("model.name='small'", "model.name"),
     ("train.seed=7", "train.seed"), ("precision.dtype='bf16'", "precision.dtype"),
     ("data.seq_len=32", "data.seq_len")],
)
def test_what_training_computes_is_the_lineage(change: str, key: str):
    ours, theirs = lineage(change), lineage()
    assert lineage_hash(ours) != lineage_hash(theirs)
    assert [line.split(" = ")[0] for line in lineage_differences(theirs, ours)] == [key]


def test_the_global_batch_is_the_lineage_not_how_it_is_split():
    assert lineage_hash(lineage(global_batch=32)) != lineage_hash(lineage(global_batch=64))
