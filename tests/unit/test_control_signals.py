"""A worker in a Slurm job step gets each scheduler signal twice: Slurm signals every
process of the step, and the launcher forwards the same signal moments later. That is
one request to save and stop, not the second signal that exits at once."""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest

from helpers import hang_limit, run_limited
from trainwise.run.engine.control import SLURM_REPEAT_S, is_repeat


@pytest.fixture
def in_slurm_step(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURM_STEP_ID", "0")


def test_the_same_signal_again_soon_in_a_slurm_step_is_a_repeat(in_slurm_step):
    now = time.monotonic()
    assert is_repeat(signal.SIGUSR1, (signal.SIGUSR1, now))
    assert not is_repeat(signal.SIGINT, (signal.SIGUSR1, now))  # another signal
    assert not is_repeat(signal.SIGUSR1, (signal.SIGUSR1, now - SLURM_REPEAT_S - 1))
    assert not is_repeat(signal.SIGUSR1, None)  # no first one


def test_outside_slurm_every_signal_counts(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("SLURM_STEP_ID", raising=False)
    assert not is_repeat(signal.SIGUSR1, (signal.SIGUSR1, time.monotonic()))


# A worker's Control, signalled twice by "Slurm" and "the launcher"; in a child process,
# since a second signal ends the process that gets it.
DOUBLE_DELIVERY = """
import os, signal
from trainwise.run.engine.control import Control
control = Control(distributed=False, announce_second=False)
control.install()
os.kill(os.getpid(), signal.SIGUSR1)
os.kill(os.getpid(), signal.SIGUSR1)
print(control.signal_name, control.exchange())
"""


@pytest.mark.parametrize(("step", "survives"), [("0", True), (None, False)])
def test_a_worker_survives_the_double_delivery_only_in_a_slurm_step(step, survives):
    env = {k: v for k, v in os.environ.items() if k != "SLURM_STEP_ID"}
    env.update({"SLURM_STEP_ID": step} if step else {})
    done = run_limited([sys.executable, "-c", DOUBLE_DELIVERY], env=env,
                       what="a worker signalled twice", limit=hang_limit(procs=0))
    if survives:
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == "SIGUSR1 (True, False)"  # one stop, at the next step
    else:
        assert done.returncode == 128 + signal.SIGUSR1 and done.stdout == ""


def test_a_stop_exits_with_128_plus_its_signal_never_0():
    from trainwise.run.engine.control import stop_status

    assert [stop_status(name) for name in ("SIGINT", "SIGTERM", "SIGUSR1", "SIGHUP")] == [
        130, 143, 138, 129
    ]
    assert stop_status("launcher exit") == 128 + signal.SIGUSR2  # lifeline.LAUNCHER_GONE
    assert stop_status(None) == 143  # a stop of unknown cause is still not a success
