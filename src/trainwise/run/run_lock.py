"""One live job per run directory.

The launcher holds an exclusive `flock` on `RUN/.lock` from before it writes the run files
until it returns; the file names the holder (host, pid, start). The kernel drops the lock
when its holder dies however it dies, so a lock left by a dead process is simply taken
over (with a line saying whose it was). Each worker holds a shared lock on
`RUN/.lock.workers` for its whole life: a new launch waits for the workers of an earlier
one (they stop within seconds of their launcher's death, see `die_with_launcher`) and
refuses to start beside them.

On several machines sharing one run directory every machine's launcher belongs to the
job, so each locks a file of its own host (`RUN/.lock-HOST`): two jobs on one machine are
kept apart, two jobs on different machines in one shared directory are not.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from trainwise.config import JobConfig
from trainwise.errors import ConfigError

LOCK_FILE = ".lock"
WORKERS_FILE = ".lock.workers"
WORKERS_GONE_S = 30.0  # how long a new launch waits for an earlier launch's workers to stop
POLL_S = 0.2


class RunDirBusy(ConfigError):
    """The run directory belongs to another live job."""


def lock_path(run_dir: Path, per_host: bool) -> Path:
    return Path(run_dir) / (f"{LOCK_FILE}-{socket.gethostname()}" if per_host else LOCK_FILE)


def workers_path(run_dir: Path, per_host: bool) -> Path:
    suffix = f"-{socket.gethostname()}" if per_host else ""
    return Path(run_dir) / (WORKERS_FILE + suffix)


@contextmanager
def hold_run_dir(run_dir: Path, per_host: bool = False) -> Iterator[None]:
    """Hold the run directory for this launch (raises RunDirBusy when another job has it)."""
    path = lock_path(run_dir, per_host)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as err:
        raise ConfigError(
            f"logging.run_dir = '{run_dir}' cannot be used ({err.strerror or err}): "
            "choose a writable directory"
        ) from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RunDirBusy(
                f"{run_dir} is in use by another trainwise job ({_holder(path)}): wait for "
                "it to finish, stop it, or choose another --run-dir"
            ) from None
        stale = _holder(path)
        if stale != "holder unknown":  # written by a launcher that never released it
            print(f"trainwise: taking over the lock of {run_dir} from {stale}, which is no "
                  "longer running", file=sys.stderr)  # fmt: skip
        _wait_for_workers(run_dir, per_host)
        _write_holder(fd)
        yield
    finally:
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)  # released cleanly: an empty file is no stale lock
        os.close(fd)


def _wait_for_workers(run_dir: Path, per_host: bool) -> None:
    """Wait until no worker of an earlier launch holds the workers' lock."""
    path = workers_path(run_dir, per_host)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline = time.monotonic() + WORKERS_GONE_S
        told = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                fcntl.flock(fd, fcntl.LOCK_UN)
                return
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise RunDirBusy(
                        f"workers of an earlier launch still run in {run_dir} after "
                        f"{WORKERS_GONE_S:.0f} s: stop them (see `ps`), then run again"
                    ) from None
                if not told:
                    print("trainwise: waiting for the workers of an earlier launch in "
                          f"{run_dir} to stop", file=sys.stderr)  # fmt: skip
                    told = True
                time.sleep(POLL_S)
    finally:
        os.close(fd)


def hold_as_worker(run_dir: Path, per_host: bool = False) -> int:
    """A worker's shared hold, kept until the process exits (returns the descriptor)."""
    fd = os.open(workers_path(run_dir, per_host), os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_SH)
    return fd


def _write_holder(fd: int) -> None:
    text = json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "since": time.time()})
    os.ftruncate(fd, 0)
    os.pwrite(fd, text.encode(), 0)


def _holder(path: Path) -> str:
    try:
        held = json.loads(path.read_text() or "null")
    except (OSError, ValueError):
        held = None
    if not isinstance(held, dict):
        return "holder unknown"
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(held.get("since", 0)))
    return f"pid {held.get('pid')} on host {held.get('host')}, since {since}"


def machines_share(cfg: JobConfig) -> bool:
    """Whether several machines' launchers may share the run directory (one lock each)."""
    return cfg.cluster.nodes > 1 or cfg.cluster.min_nodes is not None
