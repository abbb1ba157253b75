"""Several machines through torchrun's c10d rendezvous: two launchers on this host stand
for two nodes (each its own elastic agent, meeting at one endpoint). The job must train
the same model as one node with the same number of workers.

What this does not cover yet: nodes in separate network namespaces, a node lost under an
elastic range, the Slurm and Kubernetes launch files."""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from helpers import QUIET, cli_env, read_records, run_cli
from trainwise.run.distributed import free_port

pytestmark = pytest.mark.dist

JOB = ["--steps", "8", "--strategy", "ddp", "--set", "checkpoint.enabled=false", *QUIET]


def _two_nodes(root: Path) -> list[subprocess.CompletedProcess]:
    endpoint = f"127.0.0.1:{free_port()}"
    cmd = [
        sys.executable, "-m", "trainwise", "train", "--nnodes", "2", "--nproc", "1",
        "--rdzv-endpoint", endpoint, "--rdzv-id", "two-nodes", "--run-dir", "two", *JOB,
    ]  # fmt: skip
    agents = [
        subprocess.Popen(cmd, cwd=root, env=cli_env(), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)  # fmt: skip
        for _ in range(2)
    ]
    outputs = [a.communicate(timeout=300) for a in agents]
    return [
        subprocess.CompletedProcess(cmd, a.returncode, out, err)
        for a, (out, err) in zip(agents, outputs, strict=True)
    ]


def test_two_nodes_train_the_same_model_as_one_node_with_two_workers(tmp_path: Path):
    with ThreadPoolExecutor(max_workers=2) as pool:
        two = pool.submit(_two_nodes, tmp_path)
        one = pool.submit(
            run_cli, "train", "--nproc", "2", "--run-dir", "one", *JOB, cwd=tmp_path
        )
        agents, single = two.result(), one.result()
    assert single.returncode == 0, single.stderr[-2000:]
    for a in agents:
        assert a.returncode == 0, a.stderr[-3000:]
        assert "run dir    two" in a.stdout  # each machine reports the shared run
    a, b = read_records(tmp_path / "two"), read_records(tmp_path / "one")
    assert len(a) == len(b) == 8
    assert max(abs(x["loss"] - y["loss"]) / y["loss"] for x, y in zip(a, b, strict=True)) < 1e-5
    assert "strategy   ddp" in agents[0].stdout and "2 x cpu" in agents[0].stdout


@pytest.mark.parametrize(
    "args, words",
    [
        (["--nnodes", "2"], ["--rdzv-endpoint", "--rdzv-id", "--run-dir"]),
        (["--nnodes", "3:2"], ["MIN <= MAX"]),
        (["--nnodes", "two"], ["machine count"]),
    ],
)
def test_several_machines_need_their_rendezvous_in_one_line(tmp_path: Path, args, words):
    res = run_cli("train", *args, *QUIET, cwd=tmp_path)
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and all(w in lines[0] for w in words), res.stderr
    assert not (tmp_path / "runs").exists()
