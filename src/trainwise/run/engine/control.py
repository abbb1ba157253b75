"""Decisions every rank must take at the same step: stop for preemption, save now.

Slurm and Kubernetes send SIGTERM (or SIGUSR1 with `--signal`) before they kill a job; a
user presses Ctrl-C or closes the terminal. The first signal asks the run to finish its
step, save and exit 128 + the signal (stop_status); a second one exits at once (in a
Slurm job step, the same signal again within seconds is the first one delivered twice:
see SLURM_REPEAT_S).
A signal reaches the ranks at slightly different moments, and time-based save decisions
are taken on rank 0's clock, so the flags are agreed with a MAX all-reduce on the job's
host group (run.job.distributed.host_group: the job's own group under gloo, a gloo side
group under NCCL): issued after a step, waited for after the next one, so it overlaps a
whole step and adds no synchronisation to the loop. Every rank acts on the same step. The
exchange is not made after every step, only at steps every rank knows (`Cadence`): after
every logging.flush_every steps, and in between about once a second of training, at
every step when steps are slower than that. A stop or save request waits for the next
one: at most about a second (or flush_every steps) and a step more than before.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import torch
import torch.distributed as dist

from trainwise.run.job.lifeline import LAUNCHER_GONE

# Every way a run is asked to stop saves first: the scheduler's SIGTERM / SIGUSR1, Ctrl-C
# (SIGINT), a closed terminal (SIGHUP), and the launcher's death (see lifeline). A second
# signal exits at once, except repeats of the launcher's death (one event, several signals).
PREEMPT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT, signal.SIGHUP, LAUNCHER_GONE)
# The exchanged flags: stop, save now, and minus the steps each rank wishes to the next
# exchange (a MAX all-reduce of them agrees on the smallest wish).
STOP, SAVE, GAP = 0, 1, 2
# Exchanges about this far apart, in seconds of training, when steps are shorter: the cost
# of a collective is not paid every millisecond step, and a stop still comes promptly.
AGREE_EVERY_S = 1.0
# Slurm signals every process of a job step at once, and the launcher then forwards the
# same signal to its workers: under Slurm a worker gets each signal twice, moments apart.
# A repeat this soon is that same request, not a second one.
SLURM_REPEAT_S = 5.0
_early: list[tuple[int, float]] = []  # a stop asked for while the worker was still starting


def is_repeat(signum: int, first: tuple[int, float] | None) -> bool:
    """Whether `signum` is the first signal (signal, monotonic time) delivered again by
    Slurm's step and the launcher both (in a Slurm job step only)."""
    return (
        first is not None
        and signum == first[0]
        and "SLURM_STEP_ID" in os.environ
        and time.monotonic() - first[1] < SLURM_REPEAT_S
    )


def catch_early_signals() -> None:
    """From a worker's first moment: a stop asked for during start-up is kept for the
    loop (which saves and exits) instead of a traceback; a second one exits at once."""
    for sig in PREEMPT_SIGNALS:
        signal.signal(sig, _on_early_signal)


def _on_early_signal(signum: int, frame: object) -> None:
    if _early and (signum == LAUNCHER_GONE or is_repeat(signum, _early[0])):
        return
    if _early:
        os._exit(128 + signum)
    _early.append((signum, time.monotonic()))


def signal_name(signum: int) -> str:
    """How a stop's cause reads in events and summaries."""
    return "launcher exit" if signum == LAUNCHER_GONE else signal.Signals(signum).name


def stop_status(name: str | None) -> int:
    """The exit status of a run that saved and stopped before its last step, from the
    signal's name (signal_name): 128 + the signal, as a shell reports a job a signal ended
    (130 SIGINT, 143 SIGTERM, 138 SIGUSR1, 129 SIGHUP), so that `train && export` never
    goes on and a scheduler keyed on exit codes retries it. 0 is a finished run only."""
    if name == "launcher exit":
        return 128 + LAUNCHER_GONE
    try:
        return 128 + signal.Signals[name or ""]
    except KeyError:
        return 128 + signal.SIGTERM  # a stop of unknown cause is still not a success


class Cadence:
    """The steps after which the ranks exchange their flags, the same on every rank: every
    multiple of `every` (logging.flush_every: the ranks meet for the metrics then anyway)
    and, in between, as the last exchange agreed: the steps that take about AGREE_EVERY_S,
    one when steps are slower than that."""

    def __init__(self, every: int):
        self.every = every
        self.next = 0  # the first exchange follows the first step
        self._last: tuple[int, float] | None = None  # this rank's last proposal: step, time

    def due(self, step: int) -> bool:
        return step >= self.next or step % self.every == 0

    def proposal(self, step: int, now: float) -> int:
        """This rank's wish for the gap after `step`'s exchange, from its clock `now`:
        the steps that take about AGREE_EVERY_S, measured since its previous proposal
        (1 before there is one, or after the step went back: a rollback)."""
        last, self._last = self._last, (step, now)
        if last is None or step <= last[0]:
            return 1
        step_s = (now - last[1]) / (step - last[0])
        wish = int(AGREE_EVERY_S / step_s) if step_s > 0 else self.every
        return max(1, min(self.every, wish))

    def agreed(self, issued: int, gap: int) -> None:
        """The exchange issued after step `issued` agreed on `gap`."""
        self.next = issued + max(1, gap)


class Control:
    """The run's stop and save flags, agreed over `group` (None: a process alone, whose
    own flags apply at once). The group is the job's: Control does not destroy it."""

    def __init__(
        self, group: dist.ProcessGroup | None, announce_second: bool = True, every: int = 1,
    ):
        self.announce_second = announce_second
        self.group = group
        self.cadence = Cadence(every)
        self.signal: int | None = None
        self._first: tuple[int, float] | None = None  # the first signal and when it came
        self._local = torch.zeros(3, dtype=torch.int32)
        self._pending: tuple[object, torch.Tensor, int] | None = None
        self._previous: dict[int, object] = {}

    # -- signals ----------------------------------------------------------------------

    def install(self) -> None:
        for sig in PREEMPT_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._on_signal)
        if _early:
            self._on_signal(_early[0][0], None)
            self._first = _early[0]

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _on_signal(self, signum: int, frame: object) -> None:
        if self.signal is not None and signum == LAUNCHER_GONE:
            return  # the kernel's repeat of the launcher's death, or a death after a stop
        if is_repeat(signum, self._first):
            return
        if self.signal is not None:
            # Second signal: no more grace. The last committed checkpoint stays valid.
            if self.announce_second:
                print(f"trainwise: second {signal_name(signum)}: exiting now", file=sys.stderr)
            os._exit(128 + signum)
        self.signal = signum
        self._first = (signum, time.monotonic())
        self._local[STOP] = 1

    @property
    def signal_name(self) -> str | None:
        return signal_name(self.signal) if self.signal else None

    # -- agreement --------------------------------------------------------------------

    def request_save(self) -> None:
        self._local[SAVE] = 1

    def exchange(self, step: int) -> tuple[bool, bool]:
        """Call after every step on every rank, with the step: returns (stop, save) as
        agreed for this step (by the exchange issued after the previous step, if one
        was) and issues the next exchange when the cadence says so. Without a process
        group the local flags apply at once."""
        if self.group is None:
            stop, save = bool(self._local[STOP]), bool(self._local[SAVE])
            self._local[SAVE] = 0
            return stop, save
        agreed = (False, False)
        if self._pending is not None:
            work, flags, issued = self._pending
            self._pending = None
            work.wait()
            values = flags.tolist()  # one read, not one per flag
            agreed = (bool(values[STOP]), bool(values[SAVE]))
            self.cadence.agreed(issued, -values[GAP])
        if self.cadence.due(step):
            flags = self._local.clone()
            self._local[SAVE] = 0
            flags[GAP] = -self.cadence.proposal(step, time.monotonic())
            work = dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
            self._pending = (work, flags, step)
        return agreed

    def drain(self) -> None:
        """Wait for the exchange in flight (before the group goes away)."""
        if self._pending is not None:
            self._pending[0].wait()
            self._pending = None

    def close(self) -> None:
        self.drain()
        self.uninstall()
        self.group = None
