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
from trainwise.run.engine.control import AGREE_EVERY_S, SLURM_REPEAT_S, Cadence, is_repeat


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
control = Control(None, announce_second=False)
control.install()
os.kill(os.getpid(), signal.SIGUSR1)
os.kill(os.getpid(), signal.SIGUSR1)
print(control.signal_name, control.exchange(1))
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


# The cadence of the flag exchange: every rank decides from agreed values alone.


def exchanges(cadence: Cadence, steps: list[int] | range, gaps: dict[int, int]) -> list[int]:
    """The steps after which `cadence` exchanges, each exchange agreeing on the gap
    `gaps[step]` (1 when not given) one step later, as Control.exchange does."""
    made, pending = [], None
    for step in steps:
        if pending is not None:
            cadence.agreed(pending, gaps.get(pending, 1))
            pending = None
        if cadence.due(step):
            made.append(step)
            pending = step
    return made


def test_an_exchange_follows_every_step_until_a_longer_gap_is_agreed():
    assert exchanges(Cadence(every=10), range(1, 8), {}) == [1, 2, 3, 4, 5, 6, 7]
    # A gap of 4 agreed after step 2's exchange: the next ones after steps 6 and 10.
    assert exchanges(Cadence(every=10), range(1, 12), {2: 4, 6: 4}) == [1, 2, 6, 10, 11]


def test_every_multiple_of_flush_every_exchanges_whatever_the_gap():
    """A stop requested after step 6 is agreed by step 10's exchange at the latest, also
    when the agreed gap is longer or the step went back (a rollback)."""
    cadence = Cadence(every=10)
    assert exchanges(cadence, range(1, 31), {1: 50, 10: 50, 20: 50}) == [1, 10, 20, 30]
    rollback = [*range(1, 9), *range(3, 12)]  # back to step 3 after step 8
    assert exchanges(Cadence(every=10), rollback, {1: 7, 8: 7}) == [1, 8, 10, 11]


def test_a_rank_proposes_the_steps_that_take_about_a_second():
    cadence = Cadence(every=100)
    assert cadence.proposal(1, now=10.0) == 1  # nothing measured yet
    assert cadence.proposal(5, now=10.0 + 4 * 0.05) == round(AGREE_EVERY_S / 0.05)
    assert cadence.proposal(6, now=20.0) == 1  # slower steps than a second: every step
    assert cadence.proposal(4, now=20.1) == 1  # the step went back: measure again
    assert Cadence(every=10).proposal(1, 0.0) == 1
    fast = Cadence(every=10)
    fast.proposal(1, now=0.0)
    assert fast.proposal(2, now=0.001) == 10  # never past a multiple of flush_every
