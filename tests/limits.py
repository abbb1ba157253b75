"""How the tests start processes and how long they let them run: the environment of a
launched process, the time limits (a limit only catches a hang: hang_limit sizes it from
the work and this machine's measured speed), a launch under a limit that says which launch
hung and how long it had, a polling wait for a condition, and the folder the session's
processes share. helpers re-exports these."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


def cli_env() -> dict[str, str]:
    """The environment of a process a test starts: this one's, one thread per process, gloo
    on the loopback, unbuffered output, and no variable of an outer job's."""
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", PYTHONUNBUFFERED="1")
    outer = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_STEP_ID")
    for var in outer:
        env.pop(var, None)  # a test must not think it is a worker of an outer job
    return env


# Time limits. A limit only catches a hang: it is the work's expected time on this machine,
# here and now (a standard tiny launch timed once per test session), times HANG_FACTOR, times
# the test processes sharing the machine, times how much more crowded the machine is than
# when the launch was timed (its load now). A slow or busy machine raises every limit with it.
SHARED_DIR_ENV = "TRAINWISE_TEST_SHARED_DIR"  # the session's folder (tests/conftest.py)
SPEED_FILE_ENV = "TRAINWISE_TEST_SPEED_FILE"  # a measurement to keep (default: the folder's)
SPEED_WORKER = Path(__file__).with_name("speed_worker.py")
HANG_FACTOR = 4.0
# The calibration launch's own limit, the one fixed figure: 20x its time on a loaded 2-core
# machine (about 40 s at a load of 12), so that only a broken torch install reaches it.
CALIBRATION_LIMIT_S = 900.0
POLL_S = 0.05  # wait_until's polling interval


class Hung(AssertionError):
    """Work that outlasted its hang limit (killed, with everything it started)."""


@dataclass(frozen=True)
class Speed:
    """This machine, measured by the standard tiny launch (tests/speed_worker.py: torchrun,
    2 gloo workers, a few DDP steps of a tiny-GPT-sized model): its wall time and median
    step, and how many test processes share the machine (pytest-xdist's workers)."""

    launch_s: float
    step_s: float
    sharers: int
    load: float = 0.0  # the machine's 1-minute load average when the launch was timed

    def __str__(self) -> str:
        return (f"a standard tiny launch took {self.launch_s:.1f} s here this session (load "
                f"{self.load:.1f}), a step {self.step_s:.3f} s, with {self.sharers} test "
                f"process(es) at once; the machine is {crowding():.1f}x as crowded now")


_speed: Speed | None = None


def machine_speed() -> Speed:
    """The session's Speed: measured by the first caller, read by every other (the file that
    SPEED_FILE_ENV names, under a lock, shared by the pytest-xdist workers); without the
    variable (outside pytest) measured once per process."""
    global _speed
    if _speed is None:
        sharers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
        _speed = Speed(**_session_measurement(), sharers=max(1, sharers))
    return _speed


def _session_measurement() -> dict[str, float]:
    import tempfile

    where = os.environ.get(SPEED_FILE_ENV) or (
        os.environ.get(SHARED_DIR_ENV) and str(Path(os.environ[SHARED_DIR_ENV]) / "speed.json"))
    if not where:
        with tempfile.TemporaryDirectory(prefix="trainwise-speed-") as folder:
            return _measure(Path(folder))
    path = Path(where)
    with locked(path):  # the others wait here for the first's measurement
        if not path.exists():
            measured = _measure(path.parent)
            path.with_suffix(".partial").write_text(json.dumps(measured))
            path.with_suffix(".partial").rename(path)
        return json.loads(path.read_text())


def shared_dir() -> Path:
    """The folder this test session's processes share (the pytest-xdist workers': made by
    tests/conftest.py, removed at the session's end)."""
    return Path(os.environ[SHARED_DIR_ENV])


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """Hold the session-wide lock of `path` (a file beside it): one process at a time."""
    import fcntl

    with open(path.with_name(path.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _measure(folder: Path) -> dict[str, float]:
    """Time the standard tiny launch in `folder`. A failed launch is tried once more (a
    port taken between its choice and its use, say), then stops the session: no limit can
    be sized without it."""
    out = folder / "speed-step.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", str(SPEED_WORKER), str(out)]
    for _ in range(2):
        start = time.monotonic()
        done = run_limited(cmd, what="the calibration launch (tests/speed_worker.py)",
                           limit=CALIBRATION_LIMIT_S, cwd=folder, basis="its fixed ceiling")
        if done.returncode == 0:
            return {"launch_s": time.monotonic() - start, "load": load_average(),
                    **json.loads(out.read_text())}
    raise RuntimeError(
        "the calibration launch that sizes the tests' time limits failed twice (torch's own "
        f"launcher and gloo, no trainwise):\n{worker_failure(done.stderr)}"
    )


def hang_limit(
    *, launches: int = 1, steps: int = 0, procs: int = 2, waits: float = 0.0,
    factor: float = HANG_FACTOR,
) -> float:
    """Seconds after which a test's work counts as hung, not slow: `launches` process
    launches of `procs` workers each (0: a lone process such as `trainwise plan`) training
    `steps` steps in all, never less than one launch's worth (a unit test's limit); `factor`
    times its expected time on this machine now, times the test processes sharing the
    machine. `waits`: seconds of fixed waiting the work includes (a timeout it runs into on
    purpose, a scheduler's clock), added as they are. Every time limit in tests/ comes
    from here (tests/unit/test_limits.py holds it)."""
    global _first_crowding
    speed, now = machine_speed(), crowding()
    if _first_crowding is None:  # this process's collection: where the marks are sized
        _first_crowding = now
    crowd = max(1.0, (1 + procs) / 3)  # its processes against the standard launch's three
    expected = (max(1, launches) * speed.launch_s * crowd
                + steps * speed.step_s * max(1.0, procs / 2))
    return round(factor * speed.sharers * expected * now + waits, 1)


_first_crowding: float | None = None  # crowding() at this process's first hang_limit


def load_average() -> float:
    """The machine's 1-minute load average: the processes running or waiting for a core."""
    return os.getloadavg()[0]


def crowding() -> float:
    """How many times more crowded the machine is now than when the standard launch was
    timed: its load per core now over then, each at least 1 (below one load a core, a
    process has a core to itself). A session is long and other work comes and goes: a
    limit sized while the load was low grows when it rises."""
    cores = len(os.sched_getaffinity(0))

    def per_core(load: float) -> float:
        return max(1.0, load / cores)

    return max(1.0, per_core(load_average()) / per_core(machine_speed().load))


def grown(limit: float) -> float:
    """`limit`, sized earlier in this process by hang_limit (a pytest-timeout mark, at
    collection), grown with the crowding since (tests/conftest.py applies it as a test
    starts)."""
    return round(limit * max(1.0, crowding() / (_first_crowding or 1.0)), 1)


def wait_until(
    condition: Callable[[], T], *, limit: float, what: str, procs: Sequence[subprocess.Popen] = ()
) -> T:
    """Poll `condition` until it returns something true, and return that. Fails (Hung) after
    `limit` seconds (hang_limit's), and at once with its output when a process of `procs`
    (the work that should bring the condition about) has ended first."""
    deadline = time.monotonic() + limit
    while not (found := condition()):
        for proc in procs:
            if proc.poll() is not None:
                out, err = proc.communicate()
                raise AssertionError(f"ended (exit {proc.returncode}) before {what}:\n"
                                     f"{out[-2000:] if out else ''}\n{err[-3000:] if err else ''}")
        if time.monotonic() > deadline:
            for proc in procs:
                _kill_tree(proc.pid)
            raise Hung(f"{what}: not after its hang limit of {limit:.0f} s ({machine_speed()})")
        time.sleep(POLL_S)
    return found


def communicate(
    proc: subprocess.Popen, *, limit: float, what: str, basis: str | None = None
) -> tuple[str, str]:
    """proc.communicate() within `limit` seconds; past it, `proc` and every process it
    started are killed and Hung names `what`, the limit and where it came from, with the
    output so far."""
    try:
        return proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        killed = _kill_tree(proc.pid)
        out, err = proc.communicate()
        raise Hung(
            f"{what}: still running after its hang limit of {limit:.0f} s "
            f"({basis or machine_speed()}); killed it and {killed} process(es) it started. "
            f"Its output so far:\n{(out or '')[-2000:]}\n{(err or '')[-3000:]}"
        ) from None


def run_limited(
    cmd: Sequence[str], *, what: str, limit: float, cwd: Path | None = None,
    env: dict[str, str] | None = None, basis: str | None = None,
) -> subprocess.CompletedProcess:
    """subprocess.run(cmd, capture_output=True, text=True) under a hang limit (communicate's)."""
    proc = subprocess.Popen(list(cmd), cwd=cwd, env=env if env is not None else cli_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = communicate(proc, limit=limit, what=what, basis=basis)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _kill_tree(pid: int) -> int:
    """SIGKILL `pid` and its descendants (torchrun's workers run in sessions of their own, so
    a process group would miss them); the number of descendants."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
        children.setdefault(ppid, []).append(int(stat.parent.name))
    tree, todo = [], [pid]
    while todo:
        tree.append(todo.pop())
        todo += children.get(tree[-1], [])
    for p in tree:  # all found before any is killed: an orphan's parent becomes init
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)
    return len(tree) - 1


def worker_failure(stderr: str) -> str:
    """A failed launch's stderr for an assertion message: from the first worker's traceback
    (or faulthandler's dump), where the cause is, then the launcher's summary at the end."""
    starts = [i for i in (stderr.find("Traceback"), stderr.find("Fatal Python error")) if i >= 0]
    head = stderr[min(starts):][:3000] if starts else ""
    return f"{head}\n...\n{stderr[-1500:]}"
