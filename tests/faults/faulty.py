"""Helpers for fault tests: start `trainwise train` in the background, wait for a fault
point to be reached (a file the worker writes), and read a run's final weights."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import load_file

from helpers import QUIET, cli_env, communicate, hang_limit, locked, run_cli, wait_until

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
        # A collective waits a launch's hang limit: a peer this late is hung, not slow.
        "--set", f"parallel.timeout_s={hang_limit():g}", *extra,
    ]


def fault_limit(launches: int = 0) -> float:
    """A fault test's hang limit: its own run with a restart and a run after it (3 launches),
    the references it may make or wait for (2), and `launches` more: its module fixture's,
    which pytest-timeout counts against the first test that uses it."""
    work = 5 + launches
    return hang_limit(launches=work, procs=4, steps=work * STEPS)


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


def wait_for_pid(proc: subprocess.Popen, marker: Path, limit: float | None = None) -> int:
    """The pid a paused worker wrote; fails at once if the run ended before pausing.
    `limit`: hang_limit's (default: one launch's)."""
    limit = hang_limit() if limit is None else limit
    wait_until(marker.exists, limit=limit, what=f"{marker.name} of {what(proc)}", procs=[proc])
    return int(marker.read_text())


def what(proc: subprocess.Popen) -> str:
    """The run `start` began, as a hang's message names it."""
    return f"`trainwise {' '.join(proc.args[3:11])} ...`"


def kill(pid: int, sig: int = signal.SIGKILL) -> None:
    os.kill(pid, sig)


def thread_names(pid: int) -> list[str]:
    """The names of a live process's threads (Linux /proc). A paused worker's threads all
    started long before, so each bears the name it gave itself."""
    names = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(FileNotFoundError):  # a thread that ended meanwhile
            names.append((task / "comm").read_text().strip())
    return sorted(names)


def finish(proc: subprocess.Popen, limit: float | None = None) -> tuple[int, str, str]:
    """The run's exit status and output. `limit`: hang_limit's for what is left of it
    (default: two launches of STEPS steps: a fault's restart is a second launch)."""
    limit = hang_limit(launches=2, steps=2 * STEPS) if limit is None else limit
    out, err = communicate(proc, limit=limit, what=what(proc))
    return proc.returncode, out, err


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    """The model weights of the run's newest valid checkpoint, read in this process the way
    `trainwise export` reads them (export.weights: the newest checkpoint whose every file
    verifies, its model part whole). The export command itself: exported_weights."""
    from trainwise.export.weights import load_model_state, resolve_checkpoint

    return load_model_state(resolve_checkpoint(run_dir))


def exported_weights(run_dir: Path, cwd: Path) -> dict[str, torch.Tensor]:
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
    """Uninterrupted runs of job_args, each made once per test session on first use, by
    whichever pytest-xdist worker asks first (the others wait for it, then read it), and
    shared read-only by the tests that compare against them."""

    def __init__(self, root: Path):
        self.root = root
        self.exported: dict[tuple[int, str], dict[str, torch.Tensor]] = {}

    def run(self, nproc: int, strategy: str) -> Path:
        run_dir = self.root / f"{strategy}-x{nproc}"
        whole = run_dir.with_name(run_dir.name + ".done")
        self.root.mkdir(parents=True, exist_ok=True)
        with locked(run_dir):
            if not whole.exists():
                shutil.rmtree(run_dir, ignore_errors=True)  # a failed attempt's
                done = run_cli(*job_args(run_dir, nproc, strategy), cwd=self.root)
                assert done.returncode == 0, done.stderr
                whole.touch()
        return run_dir

    def weights(self, nproc: int, strategy: str) -> dict[str, torch.Tensor]:
        key = (nproc, strategy)
        if key not in self.exported:
            self.exported[key] = final_weights(self.run(nproc, strategy))
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
