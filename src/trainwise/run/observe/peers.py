"""When a collective fails: say where (the stage of the step) and who (the ranks that did not
answer), in one line, instead of a C++ traceback from inside gloo.

A rank that hangs (a stuck kernel, a dead NIC, a deadlocked data worker) makes its peers
wait in their next collective until `parallel.timeout_s` passes; gloo then raises "Timed
out waiting ...". A rank that died makes its peers fail at once ("Connection reset by
peer"). After a timeout the peers ask who is still there with torch elastic's store
barrier, whose missing-rank trace names on rank 0 every rank that did not check in; it
runs on the job's rendezvous store, so no process group (and no gloo event-loop thread
waking every 10 ms for the whole run) is kept for a diagnosis that may never come, and a
training group whose timed-out operation closed its connections does not matter. Then
they exit with status 1 so that torchrun's elastic agent restarts the group from the
last checkpoint."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed import DistStoreError
from torch.distributed.elastic.utils.store import barrier as store_barrier

# The backends' own wording (gloo; NCCL's watchdog), matched on RuntimeErrors only: a path
# or a DataLoader message that merely contains "timeout" is not a peer failure.
TIMEOUT_MARKERS = ("timed out waiting", "collective operation timeout")
LOST_MARKERS = (
    "connection closed by peer",
    "connection reset by peer",
    "remote worker crashing",
    "nccl communicator was aborted",
)
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
            whom = (
                f"rank{'s' if len(self.absent) > 1 else ''} {who} did not respond (stuck or dead)"
            )
        elif self.cause == "lost":
            whom = "a peer process exited (the launcher's failure event names it)"
        else:
            whom = "the other ranks could not tell which rank is missing"
        return (
            f"step {self.step}: rank {self.rank} {what}; {whom}; the elastic "
            f"agent restarts the group from the last checkpoint [{self.detail}]"
        )


class PeerError(RuntimeError):
    """A collective failed because of another rank (raised where the backend's own error
    was wrapped, e.g. inside a checkpoint save)."""

    def __init__(self, cause: str, message: str):
        super().__init__(message)
        self.cause = cause  # "timeout" | "lost"


def classify(err: BaseException) -> str | None:
    """'timeout' or 'lost' for a collective that failed because of a peer; None for any
    other error."""
    if isinstance(err, PeerError):
        return err.cause
    if not isinstance(err, RuntimeError):
        return None
    text = str(err).lower()
    if any(m in text for m in TIMEOUT_MARKERS):
        return "timeout"
    if any(m in text for m in LOST_MARKERS):
        return "lost"
    return None


def nested_errors(err: BaseException, limit: int = 64) -> Iterator[BaseException]:
    """`err` and every error inside it: its cause chain, and the per-rank failures that
    DCP's CheckpointException gathers (each under ``.exc``)."""
    todo, seen = [err], 0
    while todo and seen < limit:
        e = todo.pop()
        seen += 1
        yield e
        todo += [x for x in (e.__cause__, e.__context__) if x is not None]
        for wrapped in getattr(e, "failures", {}).values():
            inner = getattr(wrapped, "exc", wrapped)
            if isinstance(inner, BaseException):
                todo.append(inner)


def find_peer_error(err: BaseException) -> PeerError | None:
    """A peer failure anywhere inside `err` (see nested_errors)."""
    for e in nested_errors(err):
        cause = classify(e)
        if cause:
            return e if isinstance(e, PeerError) else PeerError(cause, last_line(e))
    return None


def absent_ranks(
    store: dist.Store | None, rank: int, world: int, key: str, seconds: float = BARRIER_S
) -> list[int] | None:
    """The ranks that do not check in at `key` (one name per diagnosis: the attempt and
    step) within `seconds`, by torch elastic's store barrier. Rank 0 learns the list (its
    trace waits up to `seconds` more for the first absent rank's check-in); another rank
    learns nothing (None) when anyone is missing, and so does every rank when the store
    itself is gone."""
    if store is None:
        return None
    try:
        store_barrier(store, world, f"trainwise/absent/{key}", barrier_timeout=seconds,
                      rank=rank, trace_timeout=seconds)
    except DistStoreError as err:
        found = re.search(r"missing_ranks=\[([\d, ]+)\]", str(err))
        if found is None:  # another rank than 0 (rank 0's own line names them)
            return None
        return sorted(int(r) for r in found.group(1).replace(" ", "").split(",") if r)
    except (RuntimeError, OSError):  # the store's host went away too
        return None
    return []  # everyone answered: the failed collective's peer has recovered or restarted


def last_line(err: BaseException) -> str:
    """The backend's message: its last line, without gloo's "[path/file.cc:78] " prefix."""
    text = str(err).strip().splitlines()
    line = text[-1] if text else type(err).__name__
    return re.sub(r"^\[[^\]]*\] ", "", line)
