"""Several machines through torchrun's c10d rendezvous.

- Two hosts made of network namespaces joined by a veth pair, each with its own hostname
  (needs root; skipped with the reason elsewhere): 2 nodes x 1 worker train the same model
  as 1 node x 2 workers, and the doctor sees both hosts' versions and the link between.
- Two launchers on this host (each its own elastic agent): an elastic job (--nnodes 1:2)
  whose second node is killed carries on alone from the last checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from helpers import (
    QUIET,
    cli_env,
    communicate,
    hang_limit,
    read_records,
    run_cli,
    run_main,
    wait_until,
)
from trainwise.run.job.distributed import free_port
from trainwise.run.observe.events import read_events

STEPS = 10
JOB = ["--steps", str(STEPS), "--strategy", "ddp", *QUIET,
       "--set", "checkpoint.interval=4", "--set", "checkpoint.async_save=false"]
# The reference run beside a test's own launches (two hosts: a train and a doctor).
pytestmark = [pytest.mark.dist, pytest.mark.timeout(hang_limit(launches=4, steps=2 * STEPS))]


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
    )


def _rel_diff(a: list[dict], b: list[dict], steps: range) -> float:
    loss = {r["step"]: r["loss"] for r in a}
    ref = {r["step"]: r["loss"] for r in b}
    return max(abs(loss[s] - ref[s]) / ref[s] for s in steps)


@dataclass(frozen=True)
class Host:
    netns: str
    hostname: str
    address: str
    interface: str

    def command(self, *args: str) -> list[str]:
        """`trainwise ARGS` on this host: in its network namespace, under its hostname."""
        inner = 'hostname "$1" && shift && exec "$@"'
        return ["ip", "netns", "exec", self.netns, "unshare", "--uts", "sh", "-c", inner,
                "sh", self.hostname, sys.executable, "-m", "trainwise", *args]


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True,
                   timeout=hang_limit(procs=0))


@pytest.fixture(scope="module")
def hosts():
    """Two hosts: namespaces `twNa`, `twNb` joined by a veth pair, 10.213.0.1 and .2."""
    tag = f"tw{os.getpid() % 100000}"
    made = [Host(f"{tag}{x}", f"tw-node-{x}", f"10.213.0.{i}", f"{tag}v{x}")
            for i, x in ((1, "a"), (2, "b"))]
    try:
        if shutil.which("ip") is None or shutil.which("unshare") is None:
            raise OSError("the ip and unshare commands are missing (iproute2, util-linux)")
        for h in made:
            _ip("netns", "add", h.netns)
        _ip("link", "add", made[0].interface, "type", "veth", "peer", "name", made[1].interface)
        for h in made:
            _ip("link", "set", h.interface, "netns", h.netns)
            _ip("-n", h.netns, "addr", "add", f"{h.address}/24", "dev", h.interface)
            _ip("-n", h.netns, "link", "set", h.interface, "up")
            _ip("-n", h.netns, "link", "set", "lo", "up")
        subprocess.run(made[0].command("--version"), check=True, capture_output=True,
                       timeout=hang_limit(procs=0))
    except (OSError, subprocess.SubprocessError) as err:
        reason = getattr(err, "stderr", None) or err
        _remove(made)
        pytest.skip(f"cannot make network namespaces here (needs root): {str(reason).strip()}")
    yield made
    _remove(made)


def _remove(hosts: list[Host]) -> None:
    for h in hosts:  # deleting a namespace deletes its end of the veth pair, then the pair
        subprocess.run(["ip", "netns", "del", h.netns], capture_output=True,
                       timeout=hang_limit(procs=0))


def _on_hosts(root: Path, hosts: list[Host], run: str, *args: str) -> list[tuple[str, str]]:
    """The same `trainwise` command on both hosts, the first hosting the rendezvous. Each
    host works in its own folder `root/HOSTNAME`: the run directory is per machine."""
    endpoint = f"{hosts[0].address}:{free_port()}"
    procs = []
    for i, h in enumerate(hosts):
        cwd = root / h.hostname
        cwd.mkdir(exist_ok=True)
        where = ["--nnodes", "2", "--nproc", "1", "--rdzv-endpoint", endpoint, "--rdzv-id", run,
                 "--run-dir", run, "--node-rank", str(i), "--local-addr", h.address,
                 "--set", f"cluster.socket_ifname={h.interface}"]
        procs.append(
            subprocess.Popen(
                h.command(*args, *where),
                cwd=cwd,
                env=cli_env(),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    outputs = [communicate(p, limit=hang_limit(steps=STEPS), what=f"`trainwise {args[0]}` on "
                           f"{h.hostname}") for p, h in zip(procs, hosts, strict=True)]
    for p, (_, err) in zip(procs, outputs, strict=True):
        assert p.returncode in (0, 1), err[-3000:]  # the doctor exits 1 on a failed check
    return outputs


def test_two_hosts_train_the_same_model_as_one_node_with_two_workers(
    tmp_path: Path, hosts: list[Host], one_node
):
    # Run directories per machine; the checkpoints on storage both see.
    shared = tmp_path / "shared-checkpoints"
    outputs = _on_hosts(tmp_path, hosts, "two", "train", *JOB, "--set", f"checkpoint.dir={shared}")
    a, b = (tmp_path / h.hostname / "two" for h in hosts)
    # Rank 0 (the first address) is on the first host: its machine has the summary.
    assert "run dir    two" in outputs[0][0] and "2 x cpu" in outputs[0][0]
    assert "rank 0's machine has two/summary.json" in outputs[1][0]
    assert (b / "config.toml").is_file() and not (b / "metrics.jsonl").exists()
    committed = sorted(p.parent.name for p in shared.glob("*/manifest.json"))
    assert committed == ["step-00000008", "step-00000010"]  # keep_last = 2
    # The start-up log names the interface the collectives use: the veth pair.
    assert f"2 machine(s) x 1 workers, interface {hosts[0].interface}" in outputs[0][1]
    two = read_records(a)
    assert len(two) == STEPS
    assert _rel_diff(two, _reference(one_node), range(1, STEPS + 1)) < 1e-5

    _on_hosts(tmp_path, hosts, "doc", "doctor", "--only", "versions,bandwidth", *QUIET,
              "--set", "doctor.max_message_mb=1")
    record = json.loads((tmp_path / hosts[0].hostname / "doc" / "doctor.json").read_text())
    checks = {c["name"]: c for c in record["checks"]}
    assert checks["versions"]["status"] == "pass"
    ranks = checks["versions"]["data"]["ranks"]
    assert sorted(r["host"] for r in ranks) == ["tw-node-a", "tw-node-b"]
    assert ranks[0]["torch"] == ranks[1]["torch"]
    # One worker per host: only the link between them to time.
    assert record["bandwidth"]["inter_node_busbw_bytes_per_s"] > 0
    assert record["bandwidth"]["intra_node_busbw_bytes_per_s"] is None


def _wait_for(path: Path, procs: list[subprocess.Popen]) -> int:
    wait_until(path.is_file, limit=hang_limit(steps=STEPS), what=path.name, procs=procs)
    return int(path.read_text())


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


# Its two agents must meet within the rendezvous's last call: under other tests' load the
# second can arrive after the first has started (and finished) alone.
@pytest.mark.serial
def test_losing_a_node_of_an_elastic_job_the_other_resumes_alone(tmp_path: Path, one_node):
    endpoint = f"127.0.0.1:{free_port()}"
    # Quick to give up on the dead node and to start without it (defaults: 15 s, 30 s), yet
    # a launch's expected time here (hang_limit's without its margin): a live agent misses
    # no heartbeat for that long, and two agents started together meet within it.
    quick = round(hang_limit(factor=1))
    args = [
        "--nnodes", "1:2", "--nproc", "1", "--rdzv-endpoint", endpoint, "--rdzv-id", "elastic",
        "--run-dir", "elastic", "--set", "checkpoint.max_restarts=2",
        "--set", "logging.flush_every=1",  # a record per step, so that steps 1-6 outlive the kill
        "--set", f"cluster.node_timeout_s={quick}", "--set", f"cluster.rdzv_last_call_s={quick}",
    ]
    fault = {"TRAINWISE_FAULTS": "pause@step=6,rank=1"}  # after step 6; last checkpoint 4
    # Both at once, so that the second joins well within the last call that starts
    # when the first reaches the rendezvous; it retries until the first's store is up.
    first = _agent(tmp_path, [*args, "--node-rank", "0"], fault)
    second = _agent(tmp_path, [*args, "--node-rank", "1"], fault)
    pid = _wait_for(tmp_path / "elastic" / "faults" / "pause-step-6.pid", [first, second])
    # The rendezvous ranks machines by (host, launcher pid): rank 1 is the second machine.
    assert _parent(pid) == second.pid
    os.kill(pid, signal.SIGKILL)  # the whole machine: its worker (in its own session)
    os.killpg(second.pid, signal.SIGKILL)  # and its agent
    second.wait(timeout=hang_limit(procs=0))
    limit = hang_limit(launches=2, steps=STEPS, waits=2 * quick)  # the restart, the last call
    out, err = communicate(first, limit=limit, what="the surviving elastic agent")
    assert first.returncode == 0, err[-3000:]

    events = read_events(tmp_path / "elastic")
    change = [e for e in events if e["kind"] == "membership"]
    assert [(e["from_world"], e["world"], e["from_nodes"], e["nodes"]) for e in change] == [
        (2, 1, 2, 1)
    ]
    resume = next(e for e in events if e["kind"] == "resume")
    assert (resume["step"], resume["from_world"]) == (4, 2)
    assert events[-1]["kind"] == "finish"
    # Two machines of one worker, then one worker accumulating both workers' micro-batches
    # (the same global batch): the losses of the uninterrupted one-machine run throughout.
    records = read_records(tmp_path / "elastic")
    assert max(r["step"] for r in records) == STEPS
    assert _rel_diff(records, _reference(one_node), range(1, STEPS + 1)) < 1e-5
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
)
def test_several_machines_need_their_rendezvous_in_one_line(tmp_path: Path, args, words):
    res = run_main("train", *args, *QUIET, cwd=tmp_path)  # refused before any worker
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and all(w in lines[0] for w in words), res.stderr
    assert not (tmp_path / "runs").exists() and not (tmp_path / "r").exists()
