"""A checkpoint that does not fit the job's model is an error no restart can fix: one line,
exit status 2 (the worker records it as fatal, so the elastic agent does not restart)."""

from __future__ import annotations

import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed.checkpoint as dcp

from trainwise.run.checkpoint import Checkpointer
from trainwise.run.checkpoint_store import CheckpointError


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
