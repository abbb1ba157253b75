"""What identifies a LoRA run's frozen base, and what it costs: the Hugging Face hub cache's
blob names (nothing read), else one read of every weight by the launcher, which hands the
id to its workers (they read nothing). Reads are counted at the file reader."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import pytest

from helpers import tiny_llama
from trainwise.config import dump_toml, load_config
from trainwise.hardware import GB, DeviceInfo
from trainwise.models import hf_weights
from trainwise.models.hf_weights import weights_digest
from trainwise.run.job.lifeline import end_launch, start_launch, this_launch
from trainwise.run.job.resolve import prepare_job

CPU = DeviceInfo("cpu", "cpu", 1, 64 * GB, bf16=True, fp16=False, gpu=None)
WEIGHTS = hf_weights.SINGLE


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """The weight files read, one entry per read, in a process with nothing cached yet."""
    read: list[Path] = []
    real = hf_weights.digest_file

    def counted(path: Path, *args: object, **kwargs: object) -> str:
        read.append(Path(path))
        return real(path, *args, **kwargs)

    hf_weights._file_digest.cache_clear()
    monkeypatch.setattr(hf_weights, "digest_file", counted)
    yield read
    hf_weights._file_digest.cache_clear()


def hub_snapshot(cache: Path, revision: str, content: bytes) -> Path:
    """A snapshot as huggingface_hub lays it out: the file a symlink to blobs/<sha256>."""
    blobs = cache / "models--org--base" / "blobs"
    blobs.mkdir(parents=True, exist_ok=True)
    blob = blobs / hashlib.sha256(content).hexdigest()
    blob.write_bytes(content)
    snapshot = cache / "models--org--base" / "snapshots" / revision
    snapshot.mkdir(parents=True)
    (snapshot / WEIGHTS).symlink_to(os.path.relpath(blob, snapshot))
    return snapshot


def test_hub_snapshots_are_identified_by_their_blob_names_without_a_read(
    tmp_path: Path, reads: list[Path]
):
    first = hub_snapshot(tmp_path, "a" * 40, b"weights one")
    same = hub_snapshot(tmp_path, "b" * 40, b"weights one")  # another revision, same blob
    other = hub_snapshot(tmp_path, "c" * 40, b"weights two")
    assert weights_digest(first).startswith("sha256:")
    assert weights_digest(first) == weights_digest(same)
    assert weights_digest(other) != weights_digest(first)
    assert reads == []


def test_files_outside_the_hub_layout_are_read_once_per_process(
    tmp_path: Path, reads: list[Path]
):
    snapshot = hub_snapshot(tmp_path / "cache", "a" * 40, b"weights one")
    copied = tmp_path / "copied"
    copied.mkdir()
    shutil.copy(snapshot / WEIGHTS, copied / WEIGHTS)  # a plain file now
    linked = tmp_path / "linked"  # a symlink, but not to a blob named by its sha256
    linked.mkdir()
    (linked / WEIGHTS).symlink_to(copied / WEIGHTS)
    assert weights_digest(copied).startswith("xxh3:")
    assert weights_digest(copied) == weights_digest(copied)
    assert reads == [copied / WEIGHTS]
    assert weights_digest(linked).startswith("xxh3:")
    assert len(reads) == 2


def lora_config(folder: Path, *more: str):
    return load_config(overrides=[
        f"model.name='hf:{folder}'", "data.vocab_size=97", "lora.rank=2", "data.seq_len=16",
        "data.synthetic_tokens=4000", "data.micro_batch=2", "checkpoint.enabled=false",
        "parallel.strategy='single'", *more,
    ])


def test_the_launcher_reads_the_base_once_and_its_workers_read_nothing(
    tmp_path: Path, reads: list[Path], monkeypatch: pytest.MonkeyPatch
):
    from trainwise.run.engine.worker import join_job

    folder = tiny_llama(tmp_path / "llama", safe_serialization=True)
    cfg = lora_config(folder)
    launcher = prepare_job(cfg, 1, CPU)
    assert launcher.base_weights.startswith("xxh3:")
    assert reads == [folder / WEIGHTS]
    monkeypatch.setenv("TRAINWISE_LAUNCH", "")  # restored after the test, as is the config
    monkeypatch.setenv("TRAINWISE_CONFIG", "")
    launch = start_launch(dump_toml(cfg), launcher.base_weights)
    try:
        assert this_launch().base_weights == launcher.base_weights
        hf_weights._file_digest.cache_clear()  # a worker is a fresh process: nothing cached
        *_, worker = join_job(cfg)
    finally:
        end_launch(launch)
    assert worker.base_weights == launcher.base_weights
    assert reads == [folder / WEIGHTS]


def test_a_worker_without_a_launcher_reads_the_base_itself(
    tmp_path: Path, reads: list[Path], monkeypatch: pytest.MonkeyPatch
):
    """Started by torchrun or srun by hand: rank 0 (here the only one) reads."""
    from trainwise.run.engine.worker import join_job

    folder = tiny_llama(tmp_path / "llama", safe_serialization=True)
    monkeypatch.delenv("TRAINWISE_LAUNCH", raising=False)
    *_, worker = join_job(lora_config(folder))
    assert worker.base_weights == weights_digest(folder)
    assert reads == [folder / WEIGHTS]


def test_start_job_hands_its_one_read_to_the_workers_it_launches(
    tmp_path: Path, reads: list[Path], monkeypatch: pytest.MonkeyPatch
):
    """The launcher's side, up to where torchrun's agent would start the workers (faked
    here: no process starts): one read, and the launch record the workers inherit holds it."""
    from trainwise.run.launch import torchrun
    from trainwise.run.launch.start import start_job

    folder = tiny_llama(tmp_path / "llama", safe_serialization=True)
    cfg = lora_config(
        folder, "parallel.strategy='ddp'", "cluster.nproc=2", "cluster.oversubscribe=true",
        f"logging.run_dir='{tmp_path / 'run'}'",
    )
    handed: list[str | None] = []
    monkeypatch.setattr(
        torchrun, "launch_workers", lambda *a, **k: handed.append(this_launch().base_weights)
    )
    start_job(cfg, lambda *_: None, "trainwise.run.engine.worker")
    assert reads == [folder / WEIGHTS]
    assert handed == [weights_digest(folder)]
