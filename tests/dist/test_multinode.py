"""Several machines through torchrun's c10d rendezvous: two launchers on this host stand
for two nodes (each its own elastic agent, meeting at one endpoint). The job must train
the same model as one node with the same number of workers, and an elastic job
(--nnodes 1:2) must carry on alone when the other node dies.

Nodes in separate network namespaces are in test_netns.py."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

from helpers import QUIET, cli_env, read_records, run_cli
from trainwise.run.distributed import free_port
from trainwise.run.events import read_events

pytestmark = pytest.mark.dist

STEPS = 10
JOB = ["--steps", str(STEPS), "--strategy", "ddp", *QUIET,
       "--set", "checkpoint.interval=4", "--set", "checkpoint.async_save=false"]  # fmt: skip


@pytest.fixture(scope="module")
def one_node(tmp_path_factory: pytest.TempPathFactory):
    """The reference, 1 node x 2 workers, started in the background so that the tests'
    own launchers run beside it."""
    root = tmp_path_factory.mktemp("one-node")
    with ThreadPoolExecutor(max_workers=1) as pool:
        yield (
            root / "one",
            pool.submit(run_cli, "train", "--nproc", "2", "--run-dir", "one", *JOB, cwd=root),
        )


def _reference(one_node: tuple[Path, Future]) -> list[dict]:
    run_dir, future = one_node
    res = future.result()
    assert res.returncode == 0, res.stderr[-2000:]
    return read_records(run_dir)


def _agent(root: Path, args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
    """One machine's launcher, in its own process group (so that a test can kill the
    whole machine: its agent and its workers)."""
    return subprocess.Popen(
        [sys.executable, "-m", "trainwise", "train", *args, *JOB], cwd=root,
        env={**cli_env(), **(env or {})}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, start_new_session=True,
    )  # fmt: skip


def _rel_diff(a: list[dict], b: list[dict], steps: range) -> float:
    loss = {r["step"]: r["loss"] for r in a}
    ref = {r["step"]: r["loss"] for r in b}
    return max(abs(loss[s] - ref[s]) / ref[s] for s in steps)


def test_two_nodes_train_the_same_model_as_one_node_with_two_workers(tmp_path: Path, one_node):
    endpoint = f"127.0.0.1:{free_port()}"
    args = ["--nnodes", "2", "--nproc", "1", "--rdzv-endpoint", endpoint,
            "--rdzv-id", "two-nodes", "--run-dir", "two"]  # fmt: skip
    agents = [_agent(tmp_path, args) for _ in range(2)]
    outputs = [a.communicate(timeout=300) for a in agents]
    for a, (out, err) in zip(agents, outputs, strict=True):
        assert a.returncode == 0, err[-3000:]
        assert "run dir    two" in out  # each machine reports the shared run
    assert "strategy   ddp" in outputs[0][0] and "2 x cpu" in outputs[0][0]
    two = read_records(tmp_path / "two")
    assert len(two) == STEPS
    assert _rel_diff(two, _reference(one_node), range(1, STEPS + 1)) < 1e-5
    # The start-up log names the interface the collectives use (the tests pin loopback).
    assert "2 machine(s) x 1 workers, interface lo" in outputs[0][1] + outputs[1][1]


def _listening(endpoint: str) -> bool:
    host, port = endpoint.split(":")
    with socket.socket() as s:
        return s.connect_ex((host, int(port))) == 0


def _wait_for(path: Path, procs: list[subprocess.Popen], timeout: float = 120) -> int:
    deadline = time.monotonic() + timeout
    while not path.is_file():
        dead = [p for p in procs if p.poll() is not None]
        assert not dead, dead[0].communicate()[1][-3000:]
        assert time.monotonic() < deadline, f"no {path.name} after {timeout} s"
        time.sleep(0.05)
    return int(path.read_text())


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def test_losing_a_node_of_an_elastic_job_the_other_resumes_alone(tmp_path: Path, one_node):
    endpoint = f"127.0.0.1:{free_port()}"
    args = [
        "--nnodes", "1:2", "--nproc", "1", "--rdzv-endpoint", endpoint, "--rdzv-id", "elastic",
        "--run-dir", "elastic", "--set", "checkpoint.max_restarts=2",
        # Quick to give up on the dead node and to start without it (defaults: 15 s, 30 s).
        "--set", "cluster.node_timeout_s=3", "--set", "cluster.rdzv_last_call_s=4",
    ]  # fmt: skip
    fault = {"TRAINWISE_FAULTS": "pause@step=6,rank=1"}  # after step 6; last checkpoint 4
    first = _agent(tmp_path, [*args, "--node-rank", "0"], fault)
    deadline = time.monotonic() + 60
    while not _listening(endpoint):  # the first machine hosts the rendezvous store
        assert first.poll() is None and time.monotonic() < deadline, first.communicate()[1]
        time.sleep(0.05)
    second = _agent(tmp_path, [*args, "--node-rank", "1"], fault)
    pid = _wait_for(tmp_path / "elastic" / "faults" / "pause-step-6.pid", [first, second])
    # The rendezvous ranks machines by (host, launcher pid): rank 1 is the second machine.
    assert _parent(pid) == second.pid
    os.kill(pid, signal.SIGKILL)  # the whole machine: its worker (in its own session)
    os.killpg(second.pid, signal.SIGKILL)  # and its agent
    second.wait(timeout=30)
    out, err = first.communicate(timeout=300)
    assert first.returncode == 0, err[-3000:]

    events = read_events(tmp_path / "elastic")
    change = [e for e in events if e["kind"] == "membership"]
    assert [(e["from_world"], e["world"], e["from_nodes"], e["nodes"]) for e in change] == [
        (2, 1, 2, 1)
    ]
    resume = next(e for e in events if e["kind"] == "resume")
    assert (resume["step"], resume["from_world"]) == (4, 2)
    assert events[-1]["kind"] == "finish"
    # One worker accumulates the two workers' micro-batches: the same global batch, so the
    # same losses as the uninterrupted two-worker run.
    records = read_records(tmp_path / "elastic")
    assert max(r["step"] for r in records) == STEPS
    assert _rel_diff(records, _reference(one_node), range(5, STEPS + 1)) < 1e-5
    assert "run dir    elastic" in out


@pytest.mark.parametrize(
    "args, words",
    [
        (["--nnodes", "2"], ["--rdzv-endpoint", "--rdzv-id", "--run-dir"]),
        (["--nnodes", "3:2"], ["MIN <= MAX"]),
        (["--nnodes", "two"], ["machine count"]),
        (["--nnodes", "2:3", "--rdzv-endpoint", "h:1", "--rdzv-id", "j", "--run-dir", "r"],
         ["data.grad_accum = 1", "--nnodes 2:3", "multiple of 2"]),
        (["--nnodes", "2", "--node-rank", "2"], ["cluster.node_rank = 2"]),
    ],
)  # fmt: skip
def test_several_machines_need_their_rendezvous_in_one_line(tmp_path: Path, args, words):
    res = run_cli("train", *args, *QUIET, cwd=tmp_path)
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and all(w in lines[0] for w in words), res.stderr
    assert not (tmp_path / "runs").exists() and not (tmp_path / "r").exists()
