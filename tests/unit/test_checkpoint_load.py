"""A checkpoint that does not fit the job's model is an error no restart can fix: one line,
exit status 2 (the worker records it as fatal, so the elastic agent does not restart)."""

from __future__ import annotations

import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed.checkpoint as dcp

from trainwise.run.checkpoint.dcp import Checkpointer
from trainwise.run.checkpoint.store import CheckpointError


def test_a_shape_mismatch_in_dcp_load_is_one_line_exit_2(tmp_path: Path):
    """DCP reports it as a CheckpointException, a BaseException: it must still become the
    one-line CheckpointError, not escape as a traceback that the agent restarts."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled ..." (on purpose)
        dcp.save({"model": {"w": torch.zeros(4, 8)}}, checkpoint_id=tmp_path)
        with pytest.raises(CheckpointError) as err:
            Checkpointer._read(SimpleNamespace(group=None), {"model": {"w": torch.zeros(4, 4)}},
                               tmp_path)
    line = str(err.value)
    assert err.value.exit_status == 2 and "\n" not in line
    assert "does not load into this job's model" in line and "Size mismatch" in line


def test_a_failed_save_says_whether_an_earlier_checkpoint_is_intact(tmp_path: Path):
    import errno

    from trainwise.run.checkpoint.dcp import _save_error
    from trainwise.run.checkpoint.store import commit, final_dir, tmp_dir

    root = tmp_path / "checkpoints"
    full = OSError(errno.ENOSPC, "No space left on device")
    first = str(_save_error(4, tmp_dir(root, 4), full))
    assert "no space left" in first and "no earlier checkpoint exists" in first
    assert "intact" not in first

    tmp = tmp_dir(root, 4)
    tmp.mkdir(parents=True)
    (tmp / "w.bin").write_bytes(b"w" * 64)
    fields = {
        "step": 4, "tokens": 64, "world_size": 1, "dp_size": 1, "strategy": "single",
        "config_hash": "x", "trainwise_version": "0", "torch_version": "0", "step_time": 0.0,
    }
    commit(tmp, final_dir(root, 4), fields)
    later = str(_save_error(8, tmp_dir(root, 8), full))
    assert "the previous checkpoint is intact (step-00000004)" in later


class TwoLayers(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.first = torch.nn.Linear(3, 3)
        self.second = torch.nn.Linear(3, 2)


def test_the_model_state_of_parts_keeps_the_whole_models_names():
    """As pipeline stages split a model: each part keeps the whole model's names, and the
    checkpoint's keys are those of the whole model however it is split."""
    from trainwise.run.checkpoint.states import ModelState

    torch.manual_seed(0)
    whole = TwoLayers()
    one = ModelState([whole]).state_dict()
    assert sorted(one) == sorted(whole.state_dict())
    front, back = TwoLayers(), TwoLayers()
    front.second, back.first = None, None  # each stage drops the other's layers
    ModelState([front, back]).load_state_dict(one)
    split = ModelState([front, back]).state_dict()
    assert sorted(split) == sorted(one)
    assert all(torch.equal(split[k], one[k]) for k in one)
