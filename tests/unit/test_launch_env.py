"""The environment the launcher gives its workers: on CUDA, NCCL's flight recorder on and
dumping into RUN/hang/ (docs/drill-down.md); a user's own settings kept. No GPU needed: the
device is faked and the elastic agent's launch caught as it starts the workers."""

from __future__ import annotations

import os
from pathlib import Path
from unittest import mock

import pytest

from trainwise.config import load_config
from trainwise.config.schema import ClusterConfig
from trainwise.hardware import GB, DeviceInfo
from trainwise.run.launch.torchrun import worker_environment

GPU4 = DeviceInfo("cuda", "FakeGPU", 4, 16 * GB, bf16=True, fp16=True, gpu=None)
RECORDER = ("TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_NCCL_DUMP_ON_TIMEOUT", "TORCH_FR_DUMP_TEMP_FILE")
ALIASES = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")


@pytest.fixture
def clean_env():
    """The test process's environment as it was afterwards (the launcher adds to it), with
    none of the flight recorder's variables during the test."""
    with mock.patch.dict(os.environ):
        for name in RECORDER + ALIASES:
            os.environ.pop(name, None)
        yield os.environ


def _start(tmp_path: Path, monkeypatch, nproc: int) -> tuple[Path, dict[str, str]]:
    """A CUDA job started through `start_job`; the environment its workers get."""
    from trainwise.hardware import detect
    from trainwise.run.launch import torchrun
    from trainwise.run.launch.start import start_job

    monkeypatch.setattr(detect, "detect_device", lambda kind="auto": GPU4)
    monkeypatch.setattr(detect, "usable_cores", lambda: 2)
    seen: dict[str, str] = {}

    def agent(config, entrypoint):  # elastic_launch: its workers would inherit os.environ
        return lambda *args: seen.update(os.environ)

    monkeypatch.setattr(torchrun, "elastic_launch", agent)
    run = tmp_path / f"run-{nproc}"
    config = load_config(overrides=[
        "data.synthetic_tokens=20000", f"cluster.nproc={nproc}", f"logging.run_dir='{run}'"
    ])
    start_job(config, lambda *_: seen.update(os.environ), "trainwise.run.engine.worker")
    return run, seen


@pytest.mark.parametrize("nproc", [2, 1])  # the agent's workers; the one in-process worker
def test_a_cuda_job_starts_its_workers_with_the_flight_recorder(
    tmp_path, monkeypatch, clean_env, nproc
):
    clean_env["TORCH_NCCL_DUMP_ON_TIMEOUT"] = "0"  # the user's own: kept
    run, seen = _start(tmp_path, monkeypatch, nproc)
    assert seen["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "2000"
    assert seen["TORCH_FR_DUMP_TEMP_FILE"] == str(run / "hang" / "nccl-trace-rank-")
    assert seen["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "0"
    assert (run / "hang").is_dir()  # NCCL writes there; it does not make the folder


def test_the_recorder_is_for_cuda_jobs_and_yields_to_the_users_settings(tmp_path, clean_env):
    cluster, run = ClusterConfig(), tmp_path / "run"
    cpu = worker_environment(run, 2, cluster, "cpu", {})
    assert not set(cpu) & set(RECORDER + ALIASES)
    assert cpu["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    cuda = worker_environment(run, 2, cluster, "cuda", {})
    assert {k: cuda[k] for k in RECORDER} == {
        "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_FR_DUMP_TEMP_FILE": str(run / "hang" / "nccl-trace-rank-"),
    }
    # The other spelling PyTorch reads counts as the user's setting too.
    own = {"TORCH_FR_BUFFER_SIZE": "50", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "/x/fr-"}
    assert set(worker_environment(run, 2, cluster, "cuda", own)) & set(RECORDER) == {
        "TORCH_NCCL_DUMP_ON_TIMEOUT"
    }
    assert "OMP_NUM_THREADS" not in worker_environment(run, 2, cluster, "cpu",
                                                       {"OMP_NUM_THREADS": "3"})
