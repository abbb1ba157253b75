"""A rank that hangs: its peers wait in the step's collective until parallel.timeout_s, say
in one line which stage they were in and which rank did not answer, and exit; the elastic
agent restarts the group, which resumes from the last checkpoint and ends bit-identical
to the run that never hung."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from faulty import (
    STEPS,
    References,
    assert_identical,
    fault_limit,
    final_weights,
    finish,
    job_args,
    start,
)

from helpers import hang_limit, run_main
from trainwise.run.observe.hang import REARM_SHARE

# Each test's limit: its runs and the references it may wait for.
pytestmark = [pytest.mark.dist, pytest.mark.timeout(fault_limit())]

# The job's collective timeout, which the hang is detected by. It also bounds how far apart
# the two workers may reach their first collectives (gloo's connect at start-up gives up
# after it), so it is a whole launch's expected time on this machine now (hang_limit's
# without its safety factor): one worker's start-up lagging the other's by more than the
# whole launch takes is a hang. The price is that much waiting for the hung rank.
TIMEOUT_S = round(hang_limit(factor=1))


def test_a_hung_rank_is_named_and_the_group_restarts(workdir: Path, reference: References):
    run_dir = workdir / "run"
    args = job_args(run_dir, 2, "ddp", "--set", f"parallel.timeout_s={TIMEOUT_S}")
    hang = f"hang@step=6,rank=1,seconds={10 * TIMEOUT_S}"  # far past the timeout
    limit = hang_limit(launches=2, steps=2 * STEPS, waits=TIMEOUT_S)  # with a restart
    rc, _, err = finish(start(args, workdir, faults=hang), limit)
    assert rc == 0, err

    line = next(x for x in err.splitlines() if "step 6: rank 0 waited" in x)
    assert f"more than {TIMEOUT_S} s (parallel.timeout_s) in forward/backward" in line
    assert "(gradient sync)" in line and "rank 1 did not respond" in line
    assert "Traceback" not in err

    log = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]
    seen = next(e for e in log if e["kind"] == "peer_failure" and e["rank"] == 0)
    assert (seen["step"], seen["cause"], seen["absent"]) == (6, "timeout", [1])
    assert any(e["kind"] == "failure" for e in log)
    resume = next(e for e in log if e["kind"] == "resume")
    assert resume["step"] == 4 and resume["attempt"] == 1
    assert_identical(reference.weights(2, "ddp"), final_weights(run_dir))

    # The waiting rank's stacks, named in its event and shown by the report.
    assert seen["dump"] == "hang/rank-0.txt"
    dump = (run_dir / "hang" / "rank-0.txt").read_text()
    assert "rank 1 did not respond" in dump and "Timed out" in dump
    assert "Current thread" in dump and "training.py" in dump  # faulthandler's stacks
    # The hung rank, stopped by the agent, wrote where its watchdog found it stuck: in the
    # fault's sleep before the step's collectives.
    # The watchdog is re-armed every REARM_SHARE of the timeout, not every step: it took
    # them between (1 - REARM_SHARE) x the timeout and the timeout into the step.
    stuck = (run_dir / "hang" / "rank-1.txt").read_text()
    taken = re.search(r"Every thread when the step had run (\d+) s:\n(.*)The failed", stuck, re.S)
    assert taken is not None, stuck
    assert round((1 - REARM_SHARE) * TIMEOUT_S) <= int(taken[1]) <= TIMEOUT_S
    assert "in _wait" in taken[2] and "in before_step" in taken[2]
    made = run_main("report", str(run_dir), "--format", "json", cwd=workdir)
    assert made.returncode == 0, made.stderr
    drill = json.loads(made.stdout)["runs"][0]["drill"]
    hang = next(h for h in drill["hangs"] if h["step"] == 6)
    assert hang["absent"] == [1] and 0 in hang["seen_by"]
    assert "rank 1 did not respond" in drill["dumps"]["0"] and "in _wait" in drill["dumps"]["1"]
    page = run_main("report", str(run_dir), "--format", "md", cwd=workdir).stdout
    assert "did not arrive" in page and "stacks of rank 0: hang/rank-0.txt" in page
