"""Hang dumps: when a collective times out or loses its peer, each rank that can still run
writes RUN/hang/rank-N.txt: what it saw (the step, the stage, the ranks that did not reach
the monitored barrier), the failed collective's traceback, and the Python stacks of all
its threads (faulthandler). With NCCL, the flight recorder's record of the last
collectives goes beside it (nccl-trace-rank-N): enabled by the launcher for a CUDA job
(before the process group starts), dumped by NCCL's watchdog on a timeout and by this rank
when it gets the error."""

from __future__ import annotations

import faulthandler
import logging
import os
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path

import torch

HANG_DIR = "hang"
NCCL_TRACE_ENTRIES = "2000"  # collectives the flight recorder keeps per rank
NCCL_TRACE_PREFIX = "nccl-trace-rank-"  # NCCL appends the rank
# PyTorch's flight recorder settings (docs: torch_nccl_environment_variables), each under
# its documented name first, then the other spelling PyTorch reads for it: a user who set
# either keeps theirs.
_FLIGHT_RECORDER = (
    (("TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_FR_BUFFER_SIZE"), NCCL_TRACE_ENTRIES),
    (("TORCH_NCCL_DUMP_ON_TIMEOUT",), "1"),  # needs the buffer above
    (("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"), None),  # the prefix
)


def flight_recorder_env(run_dir: Path, environ: Mapping[str, str]) -> dict[str, str]:
    """The variables that turn NCCL's flight recorder on for the workers: it keeps the last
    collectives and dumps them into RUN/hang/ on a timeout. Only those the environment
    `environ` does not set already (a user's own settings win). Read by NCCL only."""
    prefix = str(Path(run_dir) / HANG_DIR / NCCL_TRACE_PREFIX)
    return {
        names[0]: value or prefix
        for names, value in _FLIGHT_RECORDER
        if not any(name in environ for name in names)
    }


def enable_flight_recorder(run_dir: Path) -> None:
    """Before the process group starts, in this process and so in the workers it starts:
    the flight recorder's variables, and the folder NCCL writes into (it does not make
    it). For a CUDA job."""
    os.environ.update(flight_recorder_env(run_dir, os.environ))
    (Path(run_dir) / HANG_DIR).mkdir(parents=True, exist_ok=True)


# The watchdog is re-armed once this share of its timeout has passed since it was armed,
# not at every step: arming joins faulthandler's thread and starts another (tens of
# microseconds on a quiet machine, milliseconds on a loaded one), a cost a short step
# should not pay. A stuck step's stacks are then taken between (1 - REARM_SHARE) x the
# timeout and the timeout after it began: still before its collective gives up.
REARM_SHARE = 0.25


class StepWatchdog:
    """faulthandler's watchdog: a C thread that, when a step runs long (between
    (1 - REARM_SHARE) x `seconds` and `seconds`), writes every thread's stack into an
    unnamed file, GIL or not. That is where this rank was while stuck (or while waiting
    for a stuck peer); a failure puts it in the dump."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        # Unnamed, gone with the process: read back at a failure. Open for its lifetime.
        self.file = tempfile.TemporaryFile()  # noqa: SIM115
        self.armed_at: float | None = None  # monotonic time of the last arming
        self.step_began = 0.0

    def arm(self) -> None:
        """At the start of every step: note when it began; re-arm when due."""
        now = self.step_began = time.monotonic()
        if self.armed_at is not None and now - self.armed_at < REARM_SHARE * self.seconds:
            return
        if os.fstat(self.file.fileno()).st_size:  # a slow step's stacks: not this one's
            self.file.truncate(0)
            self.file.seek(0)
        faulthandler.dump_traceback_later(self.seconds, file=self.file)
        self.armed_at = now

    def disarm(self) -> None:
        faulthandler.cancel_dump_traceback_later()
        self.armed_at = None

    def taken_after(self) -> float:
        """How long the current step had run when the stacks are (or were) taken."""
        armed = self.step_began if self.armed_at is None else self.armed_at
        return armed + self.seconds - self.step_began

    def stacks(self) -> str:
        self.file.seek(0)
        return self.file.read().decode(errors="replace")


def write_hang_dump(
    run_dir: Path, rank: int, header: str, trace: str, stuck: str = "", after_s: float = 0.0
) -> Path:
    """RUN/hang/rank-N.txt: `header` (what this rank saw), the stacks the watchdog took
    when the step had run `after_s` seconds (`stuck`), the failed collective's traceback,
    then every thread's stack now."""
    folder = Path(run_dir) / HANG_DIR
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"rank-{rank}.txt"
    with path.open("w") as out:
        out.write(f"{header}\n\n")
        if stuck:
            out.write(f"Every thread when the step had run {after_s:.0f} s:\n{stuck}\n")
        out.write(f"The failed collective:\n{trace}\nEvery thread now:\n")
        out.flush()  # faulthandler writes to the descriptor, after what is buffered
        faulthandler.dump_traceback(out, all_threads=True)
    _dump_nccl_trace(folder, rank)
    return path


def _dump_nccl_trace(folder: Path, rank: int) -> None:
    """NCCL's flight recorder of this rank, when the job runs on NCCL."""
    if not torch.cuda.is_available():
        return
    try:
        from torch.distributed import distributed_c10d as c10d

        if c10d.get_backend() != "nccl":
            return
        record = torch._C._distributed_c10d._dump_nccl_trace()
        (folder / f"{NCCL_TRACE_PREFIX}{rank}.pickle").write_bytes(record)
    except Exception as err:  # a dump is a help, never a second failure
        logging.getLogger("trainwise").warning("trainwise: no NCCL flight record: %s", err)
