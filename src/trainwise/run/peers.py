"""When a collective fails: say where (the stage of the step) and who (the ranks that did not
answer), in one line, instead of a C++ traceback from inside gloo.

A rank that hangs (a stuck kernel, a dead NIC, a deadlocked data worker) makes its peers
wait in their next collective until `parallel.timeout_s` passes; gloo then raises "Timed
out waiting ...". A rank that died makes its peers fail at once ("Connection reset by
peer"). Either way the peers ask who is still there with `monitored_barrier` (gloo's own
diagnosis: rank 0 reports every rank that did not reach it) on a group kept for this, then
exit with status 1 so that torchrun's elastic agent restarts the group from the last
checkpoint."""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

TIMEOUT_MARKERS = ("timed out", "timeout")
LOST_MARKERS = ("connection reset", "connection closed", "broken pipe", "connection refused")
BARRIER_S = 10.0  # how long the survivors wait for each other while finding the absent


@dataclass(frozen=True)
class PeerFailure:
    step: int
    stage: str
    rank: int
    cause: str  # "timeout" | "lost"
    absent: list[int] | None  # ranks that did not reach the barrier; None: unknown
    detail: str

    def line(self, timeout_s: float) -> str:
        if self.cause == "timeout":
            what = f"waited more than {timeout_s:g} s (parallel.timeout_s) in {self.stage}"
        else:
            what = f"lost its connection to a peer in {self.stage}"
        if self.absent:
            who = ", ".join(map(str, self.absent))
            whom = f"rank{'s' if len(self.absent) > 1 else ''} {who} did not respond"
        else:
            whom = "the other ranks could not tell which rank is missing"
        return (
            f"step {self.step}: rank {self.rank} {what}; {whom} (stuck or dead); the elastic "
            f"agent restarts the group from the last checkpoint [{self.detail}]"
        )


def classify(err: BaseException) -> str | None:
    """'timeout' or 'lost' for a failed collective (a RuntimeError from the backend);
    None for any other error."""
    return classify_text(err) if isinstance(err, RuntimeError) else None


def classify_text(err: BaseException) -> str | None:
    """The same judgement from the text alone, for errors that wrap the backend's (DCP's
    CheckpointException gathers every rank's failure)."""
    text = str(err).lower()
    if any(m in text for m in TIMEOUT_MARKERS):
        return "timeout"
    if any(m in text for m in LOST_MARKERS):
        return "lost"
    return None


def absent_ranks(group: dist.ProcessGroup | None, seconds: float = BARRIER_S) -> list[int] | None:
    """The ranks that do not reach a monitored barrier within `seconds` (gloo only). Rank 0
    learns the full list; another rank learns only whether rank 0 answered."""
    if group is None:
        return None
    try:
        dist.monitored_barrier(group, timeout=timedelta(seconds=seconds), wait_all_ranks=True)
    except RuntimeError as err:
        text = str(err)
        found = re.search(r"Ranks? ([\d, ]+) failed to pass monitoredBarrier", text)
        if found:
            return [int(r) for r in found.group(1).replace(" ", "").split(",") if r]
        if "rank 0" in text.lower():
            return [0]
        return None
    return []  # everyone answered: the failed collective's peer has recovered or restarted


def first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    line = text[-1] if text else type(err).__name__
    return re.sub(r"^\[[^\]]*\] ", "", line)  # drop gloo's "[path/file.cc:78] " prefix
