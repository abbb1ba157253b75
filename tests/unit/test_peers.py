"""The one-line diagnosis of a failed collective, and the disk-full judgement of a failed
save: what counts and what does not."""

from __future__ import annotations

import errno
import threading
from pathlib import Path

import torch.distributed as dist

from helpers import hang_limit
from trainwise.run.checkpoint.dcp import disk_full
from trainwise.run.observe.peers import (
    PeerError,
    PeerFailure,
    absent_ranks,
    classify,
    find_peer_error,
    last_line,
)

GLOO_TIMEOUT = (
    "[/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] "
    "Timed out waiting 5000ms for recv operation to complete"
)


class Wrapped:  # DCP's _WrappedException: the rank's exception under .exc
    def __init__(self, exc: BaseException):
        self.exc = exc


class CheckpointException(BaseException):  # DCP's: failures by rank, text with tracebacks
    def __init__(self, failures: dict[int, Wrapped], text: str):
        super().__init__(text)
        self.failures = failures


def test_classify_matches_the_backends_wording_only():
    assert classify(RuntimeError(GLOO_TIMEOUT)) == "timeout"
    assert classify(RuntimeError("Connection closed by peer [127.0.0.1]:8595")) == "lost"
    assert classify(RuntimeError("Read error: Connection reset by peer")) == "lost"
    assert classify(RuntimeError("CUDA out of memory")) is None
    assert classify(RuntimeError("DataLoader timed out after 5 seconds")) is None
    assert classify(RuntimeError("cannot open /scratch/timeout_exp/x")) is None
    assert classify(ValueError(GLOO_TIMEOUT)) is None  # not from the backend
    assert classify(PeerError("lost", "anything")) == "lost"


def test_find_peer_error_looks_inside_dcp_failures_not_at_their_text():
    lost = RuntimeError("Connection closed by peer [10.0.0.2]:29500")
    found = find_peer_error(CheckpointException({1: Wrapped(lost)}, "rank 1 failed"))
    assert found is not None and found.cause == "lost"
    # A disk error under a path that happens to contain "timeout": not a peer failure.
    denied = PermissionError(13, "Permission denied", "/scratch/timeout_exp/__0_0.distcp")
    assert find_peer_error(CheckpointException({0: Wrapped(denied)}, str(denied))) is None
    chained = RuntimeError("save failed")
    chained.__cause__ = RuntimeError(GLOO_TIMEOUT)
    assert find_peer_error(chained).cause == "timeout"


def test_last_line_drops_the_source_location():
    assert last_line(RuntimeError(GLOO_TIMEOUT)) == (
        "Timed out waiting 5000ms for recv operation to complete"
    )


def test_line_names_stage_and_ranks():
    failure = PeerFailure(6, "the optimizer step", 0, "timeout", [1, 3], "Timed out")
    line = failure.line(5.0)
    assert line.startswith("step 6: rank 0 waited more than 5 s (parallel.timeout_s) in the ")
    assert "ranks 1, 3 did not respond" in line and "restarts the group" in line
    lost = PeerFailure(2, "evaluation", 1, "lost", None, "reset").line(600)
    assert "lost its connection to a peer in evaluation" in lost
    assert "a peer process exited" in lost
    unknown = PeerFailure(2, "evaluation", 1, "timeout", None, "t").line(600)
    assert "could not tell which rank is missing" in unknown


def test_absent_ranks_without_a_store_is_unknown():
    assert absent_ranks(None, 0, 2, "0/1") is None


def _check_in(ranks: list[int], world: int, key: str) -> dict[int, list[int] | None]:
    """Each of `ranks` asks absent_ranks at `key` from a thread of its own, on its own
    client of one real TCPStore (the job's rendezvous store), as the survivors of a
    timed-out collective do; the ranks of `world` not in `ranks` never come."""
    server = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False)
    found: dict[int, list[int] | None] = {}

    def ask(rank: int) -> None:
        client = dist.TCPStore("127.0.0.1", server.port, world, is_master=False)
        found[rank] = absent_ranks(client, rank, world, key, seconds=1.0)

    threads = [threading.Thread(target=ask, args=(r,)) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=hang_limit())
    return found


def test_absent_ranks_names_the_ranks_that_never_check_in_on_rank_0():
    found = _check_in([0, 2], world=4, key="0/6")
    assert found == {0: [1, 3], 2: None}  # rank 2 only learns that someone is missing
    assert _check_in([0, 1], world=2, key="0/7") == {0: [], 1: []}  # all there: none absent


def test_disk_full_needs_the_errno_or_a_short_write_on_a_full_disk(tmp_path: Path):
    assert disk_full(OSError(errno.ENOSPC, "No space left on device"), tmp_path)
    assert disk_full(OSError(errno.EDQUOT, "Disk quota exceeded"), tmp_path)
    nested = CheckpointException({1: Wrapped(OSError(errno.ENOSPC, "x"))}, "rank 1 failed")
    assert disk_full(nested, tmp_path)
    # This test's folder has room: a short write here is not a full disk, and neither is
    # any other error.
    assert not disk_full(RuntimeError("unexpected pos 704 vs 598"), tmp_path)
    assert not disk_full(PermissionError(13, "Permission denied"), tmp_path)


def test_a_failed_dcp_writer_thread_is_collected_and_other_threads_are_not():
    import threading

    from trainwise.run.checkpoint.dcp import WRITER_ERRORS, WRITER_THREAD

    def fail(message: str) -> None:
        raise OSError(message)

    WRITER_ERRORS.install()
    WRITER_ERRORS.install()  # idempotent: the hook does not wrap itself
    seen: list[str] = []
    previous, WRITER_ERRORS._previous = (
        WRITER_ERRORS._previous,
        lambda a: seen.append(str(a.exc_value)),
    )
    try:
        for name, message in ((f"Thread-1 ({WRITER_THREAD})", "disk"), ("other", "elsewhere")):
            t = threading.Thread(target=fail, args=(message,), name=name)
            t.start()
            t.join()
    finally:
        WRITER_ERRORS._previous = previous
    assert [str(e) for e in WRITER_ERRORS.take()] == ["disk"]
    assert WRITER_ERRORS.take() == []
    assert seen == ["elsewhere"]  # any other thread's error goes to the previous hook
    # The hook must not keep a Checkpointer (and its tensors) alive in every later thread.
    assert "Checkpointer" not in repr(threading.excepthook)
