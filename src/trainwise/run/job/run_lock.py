"""One live job per run directory.

A launcher holds a `flock` on `RUN/.lock` from before it writes the run files until it
returns; the file names the holder (host, pid, start and, for a job on several machines,
the job). The kernel drops the lock when its holder dies however it dies, so a lock left by
a dead process is simply taken over (with a line saying whose it was). Each worker holds a
shared lock on `RUN/.lock.workers` for its whole life: a new job waits for the workers of
an earlier one (they stop within seconds of their launcher's death, see
`die_with_launcher`) and refuses to start beside them.

A job on one machine holds the lock alone. The launchers of a job on several machines
(one per machine, possibly several on one host) share it: the first takes it exclusively,
writes the job's identity (its rendezvous endpoint and id) and turns its hold into a shared
one; the others join only a holder of the same identity.
"""

from __future__ import annotations

import contextlib
import errno
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


@contextmanager
def hold_run_dir(run_dir: Path, job_id: str | None = None) -> Iterator[None]:
    """Hold the run directory for this launch (raises RunDirBusy when another job has it).
    `job_id` names a job on several machines, whose launchers share the hold."""
    path = Path(run_dir) / LOCK_FILE
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as err:
        raise unusable_run_dir(run_dir, err) from None
    try:
        try:
            if _try_lock(fd, fcntl.LOCK_EX):
                _first_holder(fd, path, run_dir, job_id)
            elif job_id is None:
                raise _busy(run_dir, path)
            else:
                _join(fd, path, run_dir, job_id)
        except OSError as err:  # a full disk: the holder's name cannot be written
            raise unusable_run_dir(run_dir, err) from None
        yield
    finally:
        if _try_lock(fd, fcntl.LOCK_EX):  # the last holder out: an empty file is no stale lock
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)
        os.close(fd)


def unusable_run_dir(run_dir: Path, err: OSError) -> ConfigError:
    """One line for a run directory that cannot be written (full, read-only, no rights)."""
    full = err.errno in (errno.ENOSPC, errno.EDQUOT)
    fix = "free space on it" if full else "make it writable"
    return ConfigError(
        f"logging.run_dir = '{run_dir}' cannot be used ({err.strerror or err}): {fix}, or "
        "choose another directory with --run-dir"
    )


def _first_holder(fd: int, path: Path, run_dir: Path, job_id: str | None) -> None:
    stale = _holder(path)
    if stale:  # written by a launcher that never released it
        print(f"trainwise: taking over the lock of {run_dir} from {_describe(stale)}, "
              "which is no longer running", file=sys.stderr)
    _write_holder(fd, job_id)  # before the wait, so that the job's other launchers can join
    _wait_for_workers(run_dir)
    if job_id is not None:
        fcntl.flock(fd, fcntl.LOCK_SH)  # let the job's other launchers in


def _join(fd: int, path: Path, run_dir: Path, job_id: str) -> None:
    """Join the hold of this job's first launcher (which may still wait for old workers)."""
    deadline = time.monotonic() + WORKERS_GONE_S + 5
    while True:
        held = _holder(path)
        if held and held.get("job") != job_id:
            raise _busy(run_dir, path)
        if _try_lock(fd, fcntl.LOCK_SH):
            held = _holder(path)
            if held and held.get("job") == job_id:
                return
            fcntl.flock(fd, fcntl.LOCK_UN)
            if held:
                raise _busy(run_dir, path)
            # Nobody named: the last holder has just left (it empties the file on its way
            # out). Hold it as the first of this job's launchers.
            if _try_lock(fd, fcntl.LOCK_EX):
                _first_holder(fd, path, run_dir, job_id)
                return
        if time.monotonic() > deadline:
            raise _busy(run_dir, path)
        time.sleep(POLL_S)


def _try_lock(fd: int, kind: int) -> bool:
    try:
        fcntl.flock(fd, kind | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def _busy(run_dir: Path, path: Path) -> RunDirBusy:
    return RunDirBusy(
        f"{run_dir} is in use by another trainwise job ({_describe(_holder(path))}): wait "
        "for it to finish, stop it, or choose another --run-dir"
    )


def _wait_for_workers(run_dir: Path) -> None:
    """Wait until no worker of an earlier launch holds the workers' lock."""
    path = Path(run_dir) / WORKERS_FILE
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
                          f"{run_dir} to stop", file=sys.stderr)
                    told = True
                time.sleep(POLL_S)
    finally:
        os.close(fd)


def hold_as_worker(run_dir: Path) -> int:
    """A worker's shared hold, kept until the process exits (returns the descriptor)."""
    fd = os.open(Path(run_dir) / WORKERS_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_SH)
    return fd


def _write_holder(fd: int, job_id: str | None) -> None:
    held = {"host": socket.gethostname(), "pid": os.getpid(), "since": time.time()}
    if job_id is not None:
        held["job"] = job_id
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(held).encode(), 0)


def _holder(path: Path) -> dict | None:
    try:
        held = json.loads(path.read_text() or "null")
    except (OSError, ValueError):
        return None
    return held if isinstance(held, dict) else None


def _describe(held: dict | None) -> str:
    if not held:
        return "holder unknown"
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(held.get("since", 0)))
    job = f", job {held['job']}" if held.get("job") else ""
    return f"pid {held.get('pid')} on host {held.get('host')}, since {since}{job}"


def job_identity(cfg: JobConfig) -> str | None:
    """The identity that a job's launchers on several machines share (None on one machine)."""
    c = cfg.cluster
    if c.nodes == 1 and c.min_nodes is None:
        return None
    return f"{c.rdzv_id}@{c.rdzv_endpoint}"
