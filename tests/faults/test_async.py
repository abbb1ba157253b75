"""Async save: the loop stalls only while the state is staged; writing, hashing and the
commit happen in the background (the save returns with the write in flight, and its
record counts a stall shorter than the whole save). How much shorter is a performance
figure: bench/checkpoint.py measures it against the sync save, side by side."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from torch import nn

from trainwise.config.schema import CheckpointConfig
from trainwise.run.checkpoint.dcp import Checkpointer, Place, SaveSchedule
from trainwise.run.checkpoint.states import training_states
from trainwise.run.checkpoint.store import list_checkpoints


def trained_state() -> tuple[
    nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler
]:
    """About 8 M parameters (and Adam's two states): large enough that writing and
    hashing the files dominates copying them to host memory."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(8)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    model(torch.randn(4, 1024)).square().mean().backward()
    optimizer.step()
    return model, optimizer, scheduler


def checkpointer(run_dir: Path, async_save: bool, parts: tuple) -> Checkpointer:
    model, optimizer, scheduler = parts
    cpu = torch.device("cpu")
    return Checkpointer(
        CheckpointConfig(interval=1, async_save=async_save),
        Place(run_dir / "checkpoints", run_dir, 0, 1, cpu),
        training_states([model], optimizer, 0, cpu),
        {"scheduler": scheduler, "scaler": None},
        meta={"strategy": "single", "dp_size": 1, "config_hash": "test", "lineage": {}},
        schedule=SaveSchedule(total_steps=10),
        log=logging.getLogger("test"),
    )


def saved(run_dir: Path) -> dict:
    lines = (run_dir / "events.jsonl").read_text().splitlines()
    return next(e for e in map(json.loads, lines) if e["kind"] == "checkpoint")


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_async_saves_return_with_the_write_in_flight_and_commit_valid_checkpoints(
    tmp_path: Path,
):
    """Three saves each way. (Comparing the two stalls here was a wall-clock assertion,
    which a loaded machine can reverse: the comparison lives in the bench.)"""
    parts = trained_state()
    sync_dir, async_dir = tmp_path / "sync", tmp_path / "async"

    sync = checkpointer(sync_dir, False, parts)
    sync_stalls = [sync.save(step, 0, 0.0, {}) for step in (1, 2, 3)]
    sync.close()

    later = checkpointer(async_dir, True, parts)
    async_stalls = []
    for step in (1, 2, 3):
        async_stalls.append(later.save(step, 0, 0.0, {}))
        assert later.inflight is not None  # returned before the write finished
        later.wait()  # so the next save's stall is its own, not the wait for this one
    later.close()

    print(f"stalls: async {async_stalls}, sync {sync_stalls}")
    event = saved(async_dir)
    assert event["async_save"] and event["stall_s"] < event["save_s"]
    assert saved(sync_dir)["stall_s"] == saved(sync_dir)["save_s"]  # sync: all of it stalls
    for run_dir in (sync_dir, async_dir):
        infos = list_checkpoints(run_dir / "checkpoints", "full")
        assert infos and all(info.valid for info in infos), [i.problems for i in infos]


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_missing_items_finds_what_a_failed_writer_thread_left_out(tmp_path: Path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    from trainwise.run.checkpoint.dcp import missing_items

    state = {"a": torch.ones(64), "b": torch.zeros(8, 8), "note": {"text": "bytes item"}}
    metadata = dcp.save(state, storage_writer=FileSystemWriter(str(tmp_path), thread_count=2))
    assert missing_items(metadata) == 0
    dropped = next(iter(metadata.storage_data))
    del metadata.storage_data[dropped]  # what a writer thread dying mid-file leaves
    assert missing_items(metadata) == 1


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_without_storage_records_returned_the_written_file_is_counted(tmp_path: Path):
    """torch 2.11 returns the metadata without storage records (seen on a GPU machine):
    the check reads the .metadata file DCP wrote instead of calling every item missing."""
    import pickle

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    from trainwise.run.checkpoint.dcp import missing_items, written_metadata

    state = {"a": torch.ones(64), "b": torch.zeros(8, 8), "note": {"text": "bytes item"}}
    returned = dcp.save(state, storage_writer=FileSystemWriter(str(tmp_path), thread_count=2))
    returned.storage_data = None  # as 2.11 returns it
    assert missing_items(returned) == 3  # every item: what the check said of each save there
    assert missing_items(written_metadata(returned, tmp_path)) == 0
    on_disk = pickle.loads((tmp_path / ".metadata").read_bytes())
    del on_disk.storage_data[next(iter(on_disk.storage_data))]  # a writer thread's loss
    (tmp_path / ".metadata").write_bytes(pickle.dumps(on_disk))
    assert missing_items(written_metadata(returned, tmp_path)) == 1
    assert written_metadata(returned, tmp_path / "elsewhere") is None  # not this rank's to read


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_rank_0_that_cannot_read_back_its_metadata_fails_the_save(tmp_path: Path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    written = tmp_path / "written"
    returned = dcp.save({"a": torch.ones(4)}, storage_writer=FileSystemWriter(str(written)))
    returned.storage_data = None  # as torch 2.11 returns it
    ckpt = checkpointer(tmp_path / "run", False, trained_state())
    try:
        assert ckpt._write_failure(returned, written) is None
        (written / ".metadata").write_bytes(b"")  # cut short
        assert "cannot be read back" in ckpt._write_failure(returned, written)
    finally:
        ckpt.close()
