"""The one-line diagnosis of a failed collective."""

from __future__ import annotations

from trainwise.run.peers import PeerFailure, absent_ranks, classify, classify_text, first_line

GLOO_TIMEOUT = (
    "[/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] "
    "Timed out waiting 5000ms for recv operation to complete"
)


def test_classify():
    assert classify(RuntimeError(GLOO_TIMEOUT)) == "timeout"
    assert classify(RuntimeError("Connection reset by peer")) == "lost"
    assert classify(RuntimeError("CUDA out of memory")) is None
    assert classify(ValueError(GLOO_TIMEOUT)) is None  # not from the backend
    assert classify_text(BaseException("rank 1: Connection closed by peer")) == "lost"


def test_first_line_drops_the_source_location():
    assert first_line(RuntimeError(GLOO_TIMEOUT)) == (
        "Timed out waiting 5000ms for recv operation to complete"
    )


def test_line_names_stage_and_ranks():
    failure = PeerFailure(6, "the optimizer step", 0, "timeout", [1, 3], "Timed out")
    line = failure.line(5.0)
    assert line.startswith("step 6: rank 0 waited more than 5 s (parallel.timeout_s) in the ")
    assert "ranks 1, 3 did not respond" in line and "restarts the group" in line
    lost = PeerFailure(2, "evaluation", 1, "lost", None, "reset").line(600)
    assert "lost its connection to a peer in evaluation" in lost
    assert "could not tell which rank" in lost


def test_absent_ranks_without_a_group_is_unknown():
    assert absent_ranks(None) is None
