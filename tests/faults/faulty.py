"""Helpers for fault tests: start `trainwise train` in the background, wait for a fault
point to be reached (a file the worker writes), and read a run's final weights."""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import load_file

from helpers import QUIET, cli_env, run_cli

# A short job with a checkpoint every 4 steps and a held-out loss at the end; global batch
# 16 whatever the world size.
STEPS = 12


def job_args(
    run_dir: Path, nproc: int, strategy: str, *extra: str, steps: int = STEPS
) -> list[str]:
    micro = 16 // nproc
    return [
        "train", "--nproc", str(nproc), "--strategy", strategy, "--steps", str(steps),
        "--run-dir", str(run_dir), *QUIET,
        "--set", f"data.micro_batch={micro}", "--set", f"train.eval_every={steps}",
        "--set", "checkpoint.interval=4", "--set", "checkpoint.keep_last=3",
        "--set", "parallel.timeout_s=60", *extra,
    ]


def start(args: list[str], cwd: Path, faults: str = "") -> subprocess.Popen:
    env = cli_env()
    env["TRAINWISE_FAULTS"] = faults
    return subprocess.Popen(
        [sys.executable, "-m", "trainwise", *args],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_for_pid(proc: subprocess.Popen, marker: Path, timeout: float = 120) -> int:
    """The pid a paused worker wrote; fails at once if the run ended before pausing."""
    deadline = time.monotonic() + timeout
    while not marker.exists():
        if proc.poll() is not None:
            out, err = proc.communicate()
            raise AssertionError(f"run ended before {marker.name}:\n{out}\n{err}")
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"{marker} did not appear within {timeout} s")
        time.sleep(0.05)
    return int(marker.read_text())


def kill(pid: int, sig: int = signal.SIGKILL) -> None:
    os.kill(pid, sig)


def finish(proc: subprocess.Popen, timeout: float = 240) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def final_weights(run_dir: Path, cwd: Path) -> dict[str, torch.Tensor]:
    """The run's newest checkpoint, exported through the CLI and loaded back."""
    out = run_dir / "final.safetensors"
    done = run_cli("export", str(run_dir), "-o", str(out), "--force", cwd=cwd)
    assert done.returncode == 0, done.stderr
    return load_file(out)


def assert_identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), f"{name} differs"


class References:
    """Uninterrupted runs of job_args, each made once per test session on first use and
    shared (read-only) by the tests that compare against them."""

    def __init__(self, root: Path):
        self.root = root
        self.runs: dict[tuple[int, str], Path] = {}
        self.exported: dict[tuple[int, str], dict[str, torch.Tensor]] = {}

    def run(self, nproc: int, strategy: str) -> Path:
        key = (nproc, strategy)
        if key not in self.runs:
            run_dir = self.root / f"{strategy}-x{nproc}"
            done = run_cli(*job_args(run_dir, nproc, strategy), cwd=self.root)
            assert done.returncode == 0, done.stderr
            self.runs[key] = run_dir
        return self.runs[key]

    def weights(self, nproc: int, strategy: str) -> dict[str, torch.Tensor]:
        key = (nproc, strategy)
        if key not in self.exported:
            self.exported[key] = final_weights(self.run(nproc, strategy), self.root)
        return self.exported[key]


@contextlib.contextmanager
def tmpfs(mount: Path, size: int) -> Iterator[Path]:
    """A tmpfs of `size` bytes at `mount` (a small disk to fill); the test is skipped where
    mounting needs rights this process lacks."""
    import pytest

    mount.mkdir(parents=True, exist_ok=True)
    try:
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)],
            check=True, capture_output=True, text=True,
        )
    except (OSError, subprocess.CalledProcessError) as err:
        reason = getattr(err, "stderr", "") or err
        pytest.skip(f"cannot mount a tmpfs here (needs root / CAP_SYS_ADMIN): {reason}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "--lazy", str(mount)], check=False)


def fill_disk(folder: Path) -> Path:
    """A file that takes every free block of `folder`'s file system (written until ENOSPC)."""
    filler = folder / "filler"
    with filler.open("wb", buffering=0) as f:
        for chunk in (1 << 16, 1 << 12):
            try:
                while True:
                    f.write(b"\0" * chunk)
            except OSError as err:
                if err.errno != errno.ENOSPC:
                    raise
    return filler
