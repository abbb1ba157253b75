"""Slurm itself runs what `trainwise launch slurm` writes.

A private one-node cluster in a temporary folder (Debian's slurm-wlm and munge, which
.ci/run installs where it can): munged with its own key and socket, slurmctld and slurmd
with their own slurm.conf (this machine's CPUs and memory, one partition, free ports,
state and spool in the folder). On it the script for the tiny CPU job
(examples/tiny_gpt_cpu.toml)
- trains to the end with the losses of a plain `trainwise train` of the same job;
- preempted with `scancel --signal=USR1 --batch`, saves a checkpoint, requeues itself
  and resumes, every step's loss equal to the uninterrupted run's;
- with a short `--time`, gets USR1 from Slurm's own `--signal=B:USR1@N` and takes the
  same path by itself;
- elastic (`--min-nodes`), is accepted by `sbatch --test-only`.
A requeued job waits for its old credential to expire before it starts again: two
minutes by default, CRED_EXPIRE_S here.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
from pathlib import Path

import pytest

from helpers import QUIET, Hung, cli_env, hang_limit, read_records, run_cli, run_limited, wait_until
from trainwise.run.job.distributed import free_port

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "examples" / "tiny_gpt_cpu.toml"  # 2 CPU workers, ddp
STEPS = 20
PAUSE = 8  # the step after which rank 0 waits for the preemption (a fault point)
# The job of every run here, the Slurm ones and the plain reference alike.
SETS = [*QUIET, "--set", f"train.steps={STEPS}", "--set", f"train.eval_every={STEPS}",
        "--set", "checkpoint.interval=5"]
COMMANDS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "squeue", "scancel", "sinfo")
CRED_EXPIRE_S = 5  # a requeued job starts again after this (and 1 s)
REQUEUE_S = CRED_EXPIRE_S + 1
# test_time_limit_signal_requeues_by_itself: USR1 comes 15 to 45 s after the job starts (a
# 1-minute limit, its warning 15 s before, checked every 30 s), whatever the machine.
TIME_LIMIT_S = 45
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL"}


def _find(name: str) -> str | None:
    """A command on PATH or in the sbin folders (where Debian puts the daemons)."""
    extra = os.pathsep.join(("/usr/sbin", "/usr/local/sbin", "/sbin"))
    return shutil.which(name, path=os.environ.get("PATH", "") + os.pathsep + extra)


def _skip_reason() -> str | None:
    missing = [name for name in COMMANDS if _find(name) is None]
    if missing:
        return (
            f"Slurm is not installed ({', '.join(missing)} missing; Debian: apt-get install "
            "slurm-wlm munge; .ci/run installs them where it can)"
        )
    if os.geteuid() != 0:
        return "slurmd must run as root to start jobs; run the tests as root"
    return None


SKIP = _skip_reason()
# serial: a private Slurm cluster's daemons and jobs keep Slurm's own clock (a 1-minute time
# limit, credentials that expire); run alone, after the parallel pass.
pytestmark = [
    pytest.mark.dist,
    pytest.mark.serial,
    pytest.mark.skipif(SKIP is not None, reason=SKIP or ""),
]


class Cluster:
    """One node of Slurm in `root`: its daemons are this object's child processes,
    stopped by pid in `stop`, and `root` removed."""

    def __init__(self, root: Path):
        self.root = root
        self.conf = root / "slurm.conf"
        self.daemons: list[subprocess.Popen] = []
        self.env = {**cli_env(), "SLURM_CONF": str(self.conf)}
        # No `trainwise` on PATH: the script runs the interpreter it was written from.
        for var in [v for v in self.env if v.startswith(("SLURM_", "SBATCH_", "SRUN_"))]:
            if var != "SLURM_CONF":
                del self.env[var]  # an outer Slurm job's settings are not ours

    # -- daemons ------------------------------------------------------------------------

    def start(self) -> None:
        munge_dir = self.root / "munge"
        munge_dir.mkdir(mode=0o700)
        key = munge_dir / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        self.socket = munge_dir / "munge.socket"
        # -F: in the foreground, our child; -f: a temporary folder is not the 0755 one
        # munged wants for its socket.
        self._daemon("munged", "-F", "-f", f"--socket={self.socket}", f"--key-file={key}",
                     f"--pid-file={munge_dir / 'munged.pid'}",
                     f"--seed-file={munge_dir / 'munged.seed'}")
        self._until(self.socket.exists, "munged's socket")
        self.node = self._write_conf()
        self._daemon("slurmctld", "-D", "-f", str(self.conf))
        self._daemon("slurmd", "-D", "-f", str(self.conf))
        self._until(lambda: self.slurm("sinfo", "-h", "-o", "%t", check=False).stdout.strip()
                    == "idle", "the node to be idle")

    def _write_conf(self) -> str:
        """slurm.conf for this machine; returns the node's name (its hostname)."""
        probe = subprocess.run([_find("slurmd"), "-C"], capture_output=True, text=True)
        assert probe.returncode == 0, f"slurmd -C: {probe.stderr}"
        node_line = probe.stdout.splitlines()[0]  # NodeName=... CPUs=... RealMemory=...
        node = re.search(r"NodeName=(\S+)", node_line).group(1)
        try:  # the script's rendezvous endpoint is the node's name
            socket.gethostbyname(node)
        except OSError:
            pytest.skip(f"this machine's name {node!r} does not resolve (add it to /etc/hosts)")
        state, spool = self.root / "state", self.root / "spool"
        state.mkdir()
        spool.mkdir()
        ctld_port = free_port()
        while (slurmd_port := free_port()) == ctld_port:
            pass
        settings = {
            "ClusterName": "trainwise",
            "SlurmctldHost": f"{node}(127.0.0.1)",
            "SlurmctldPort": ctld_port,
            "SlurmdPort": slurmd_port,
            "SlurmUser": "root",
            "AuthType": "auth/munge",
            "CredType": "cred/munge",
            # cred_expire also sets how long a requeued job waits before it starts again
            # (120 s by default): Slurm cannot start it sooner, since slurmd refuses the
            # job until the old attempt's revoked credential is stale.
            "AuthInfo": f"socket={self.socket},cred_expire={CRED_EXPIRE_S}",
            "StateSaveLocation": state,
            "SlurmdSpoolDir": spool,
            "SlurmctldPidFile": self.root / "slurmctld.pid",
            "SlurmdPidFile": self.root / "slurmd.pid",
            "SlurmctldLogFile": self.root / "slurmctld.log",
            "SlurmdLogFile": self.root / "slurmd.log",
            "ProctrackType": "proctrack/linuxproc",
            "TaskPlugin": "task/none",
            "SelectType": "select/cons_tres",
            "SelectTypeParameters": "CR_Core",
            "MpiDefault": "none",
            "SwitchType": "switch/none",
            "JobCompType": "jobcomp/none",
            "AccountingStorageType": "accounting_storage/none",
            "JobAcctGatherType": "jobacct_gather/none",
            # Try pending jobs every second, not every minute: a requeued job starts as
            # soon as its wait is over.
            "SchedulerParameters": "sched_interval=1",
            "ReturnToService": 2,
            "KillWait": 5,
        }
        lines = [f"{key}={value}" for key, value in settings.items()]
        lines += [
            f"{node_line} NodeAddr=127.0.0.1 State=UNKNOWN",
            "PartitionName=main Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
        ]
        self.conf.write_text("\n".join(lines) + "\n")
        return node

    def _daemon(self, name: str, *args: str) -> None:
        log = open(self.root / f"{name}.out", "w")  # noqa: SIM115 (the daemon's, until stop)
        self.daemons.append(
            subprocess.Popen([_find(name), *args], env=self.env, stdout=log,
                             stderr=subprocess.STDOUT, start_new_session=True)
        )
        log.close()  # the child has its own copy

    def _until(self, ready, what: str) -> None:
        """Wait for `ready()` (a daemon's start-up, a lone process's hang limit); fails with
        the daemons' logs when one has ended or the limit passed."""
        def check() -> bool:
            dead = [d.args[0] for d in self.daemons if d.poll() is not None]
            assert not dead, f"waiting for {what}: {dead} ended\n{self.logs()}"
            return ready()

        try:
            wait_until(check, limit=hang_limit(procs=0), what=what)
        except Hung as hung:
            raise Hung(f"{hung}\n{self.logs()}") from None

    def logs(self) -> str:
        tails = []
        for path in sorted(self.root.glob("*.out")) + sorted(self.root.glob("*.log")):
            tails.append(f"--- {path.name}\n" + "\n".join(path.read_text().splitlines()[-15:]))
        return "\n".join(tails)

    def stop(self) -> None:
        """Cancel every job, let slurmd's step daemons finish, stop the daemons (newest
        first) by pid, and remove the folder."""
        try:
            if self.daemons and self.daemons[-1].poll() is None:
                self.slurm("scancel", "--user", "root", check=False)
                spool = self.root / "spool"
                with contextlib.suppress(Hung):  # then the daemons are stopped all the same
                    wait_until(lambda: not (
                        self.slurm("squeue", "-h", check=False).stdout.strip()
                        or any(spool.glob("*.[0-9]*"))  # a step daemon's socket
                    ), limit=hang_limit(procs=0), what="the cancelled jobs' end")
        finally:
            for daemon in reversed(self.daemons):
                if daemon.poll() is None:
                    daemon.send_signal(signal.SIGTERM)
                    try:
                        daemon.wait(timeout=hang_limit(procs=0))
                    except subprocess.TimeoutExpired:
                        daemon.kill()
                        daemon.wait()
            shutil.rmtree(self.root, ignore_errors=True)

    # -- clients ------------------------------------------------------------------------

    def slurm(self, *args: str, check: bool = True, cwd: Path | None = None,
              env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        done = run_limited([_find(args[0]), *args[1:]], env={**self.env, **(env or {})},
                           cwd=cwd, what=" ".join(args), limit=hang_limit(procs=0))
        if check:
            assert done.returncode == 0, f"{' '.join(args)}: {done.stderr}"
        return done

    def job(self, job_id: str) -> dict[str, str]:
        line = self.slurm("scontrol", "-o", "show", "job", job_id).stdout
        return dict(re.findall(r"(\w+)=(\S*)", line))

    def wait_end(self, job_id: str, workdir: Path, limit: float) -> dict[str, str]:
        """Poll the job (submitted from `workdir`) until it ends (`limit`: hang_limit's)."""
        try:
            return wait_until(lambda: (job := self.job(job_id))["JobState"] in ENDED and job,
                              limit=limit, what=f"the end of job {job_id}")
        except Hung as hung:
            # The job's output, and the run's events: which worker ended how, when.
            found = [*workdir.glob("*.out"), *workdir.glob("runs/*/events.jsonl")]
            outputs = "\n".join(f"--- {p.name}\n{p.read_text()}" for p in found)
            raise Hung(f"{hung}: {self.job(job_id)}\n{outputs}\n{self.logs()}") from None


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Cluster:
    running = Cluster(tmp_path_factory.mktemp("slurm"))
    request.addfinalizer(running.stop)  # even when start fails half-way
    running.start()
    return running


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[int, float]:
    """Each step's loss in a plain, uninterrupted `trainwise train` of the job."""
    root = tmp_path_factory.mktemp("plain")
    done = run_cli("train", "--config", str(TINY), "--run-dir", "run", *SETS, cwd=root)
    assert done.returncode == 0, done.stderr
    return {r["step"]: r["loss"] for r in read_records(root / "run")}


def submit(cluster: Cluster, workdir: Path, flags: list[str], sbatch: tuple[str, ...] = (),
           faults: str = "") -> tuple[str, Path]:
    """Write the job's script with `trainwise launch slurm FLAGS` and sbatch it from
    `workdir`; the job id and its run directory."""
    launch = ["launch", "slurm", "--config", str(TINY), "--nodes", "1", "--name", "tiny",
              "--port", str(free_port()), *SETS, *flags, "-o", "job.sbatch"]
    made = run_cli(*launch, cwd=workdir)
    assert made.returncode == 0, made.stderr
    env = {"TRAINWISE_FAULTS": faults} if faults else {}
    done = cluster.slurm("sbatch", "--parsable", *sbatch, "job.sbatch", cwd=workdir, env=env)
    return done.stdout.strip().split(";")[0], workdir / "runs" / "tiny"


def job_log(workdir: Path, job_id: str) -> str:
    return (workdir / f"tiny-{job_id}.out").read_text()


def assert_same_losses(run_dir: Path, reference: dict[int, float]) -> None:
    """Every step trained, and every loss recorded (a step trained twice, too) equal to
    the uninterrupted run's."""
    records = read_records(run_dir)
    assert {r["step"] for r in records} == set(reference)
    for r in records:
        assert r["loss"] == reference[r["step"]], f"step {r['step']}: {r['loss']}"


def assert_preempted_and_resumed(workdir: Path, job_id: str, job: dict[str, str]) -> None:
    """USR1 made the workers save, the script requeued the job, and a requeued attempt
    resumed from that checkpoint and finished."""
    log = job_log(workdir, job_id)
    assert job["JobState"] == "COMPLETED" and job["ExitCode"] == "0:0", log
    assert int(job["Restarts"]) >= 1, log
    events = [json.loads(x) for x in (workdir / "runs/tiny/events.jsonl").read_text().splitlines()]
    stops = [e for e in events if e["kind"] == "preempted"]
    assert stops and all(e["signal"] == "SIGUSR1" for e in stops), log
    saved = {e["step"] for e in events if e["kind"] == "checkpoint"}
    resumed = {e["step"] for e in events if e["kind"] == "resume"}
    assert stops[-1]["step"] in saved and stops[-1]["step"] in resumed, log
    assert f"resuming from step {stops[-1]['step']}" in log
    assert "got USR1; checkpointing, then requeueing" in log
    assert events[-1]["kind"] == "finish" and events[-1]["step"] == STEPS


def wait_for_pause(cluster: Cluster, job_id: str, run_dir: Path) -> None:
    """Rank 0 has trained step PAUSE and waits (TRAINWISE_FAULTS) for the signal."""
    marker = run_dir / "faults" / f"pause-step-{PAUSE}.pid"

    def paused() -> bool:
        state = cluster.job(job_id)["JobState"]
        assert state in ("PENDING", "RUNNING"), f"job {job_id} {state} before step {PAUSE}"
        return marker.exists()

    wait_until(paused, limit=hang_limit(steps=PAUSE), what=f"{marker.name} of job {job_id}")


# Every test's limit counts the module's fixtures (pytest-timeout charges them to the first
# test): the cluster's start-up, a few lone processes, and the reference launch.
FIXTURES_S = hang_limit(launches=3, procs=0) + hang_limit(steps=STEPS)


@pytest.mark.timeout(FIXTURES_S + hang_limit(procs=0) + hang_limit(steps=STEPS))
def test_job_trains_like_plain_train(cluster: Cluster, reference, tmp_path: Path):
    job_id, run_dir = submit(cluster, tmp_path, [])
    job = cluster.wait_end(job_id, tmp_path, hang_limit(steps=STEPS))
    log = job_log(tmp_path, job_id)
    assert job["JobState"] == "COMPLETED" and job["ExitCode"] == "0:0", log
    assert job["Restarts"] == "0" and "training finished" in log
    assert_same_losses(run_dir, reference)


# Their limits: the wait for the pause, then the requeued job's end (one launch's limit,
# the default, is less than Slurm's own clock: the requeue, the time limit's signal).
@pytest.mark.timeout(FIXTURES_S + hang_limit(steps=PAUSE)
                     + hang_limit(launches=2, steps=STEPS, waits=REQUEUE_S))
def test_usr1_checkpoints_requeues_and_resumes_exactly(cluster: Cluster, reference, tmp_path):
    job_id, run_dir = submit(cluster, tmp_path, [], faults=f"pause@step={PAUSE},rank=0")
    wait_for_pause(cluster, job_id, run_dir)
    cluster.slurm("scancel", "--signal=USR1", "--batch", job_id)  # as a preempting admin
    job = cluster.wait_end(job_id, tmp_path, hang_limit(launches=2, steps=STEPS, waits=REQUEUE_S))
    assert_preempted_and_resumed(tmp_path, job_id, job)
    assert_same_losses(run_dir, reference)


@pytest.mark.timeout(
    FIXTURES_S + hang_limit() + hang_limit(launches=2, steps=STEPS, waits=TIME_LIMIT_S + REQUEUE_S)
)
def test_time_limit_signal_requeues_by_itself(cluster: Cluster, reference, tmp_path: Path):
    """A 1-minute limit with the warning 15 s before it (on the sbatch command line, over
    the script's 180 s). Slurm checks time limits every 30 s, so USR1 comes 15 to 45 s
    after the start, while rank 0 waits after step PAUSE; nothing here signals the job.
    (Should it come before step PAUSE, the requeued attempt waits there for its own.)"""
    job_id, run_dir = submit(cluster, tmp_path, ["--time", "1"], sbatch=("--signal=B:USR1@15",),
                             faults=f"pause@step={PAUSE},rank=0")
    assert cluster.job(job_id)["TimeLimit"] == "00:01:00"
    waits = TIME_LIMIT_S + REQUEUE_S
    job = cluster.wait_end(job_id, tmp_path, hang_limit(launches=2, steps=STEPS, waits=waits))
    assert_preempted_and_resumed(tmp_path, job_id, job)
    assert_same_losses(run_dir, reference)


@pytest.mark.timeout(FIXTURES_S + hang_limit(launches=2, procs=0))
def test_elastic_script_is_accepted(cluster: Cluster, tmp_path: Path):
    """--min-nodes 1 --nodes 2 on a one-node cluster: Slurm may start it on one node."""
    made = run_cli("launch", "slurm", "--config", str(TINY), "--nodes", "2", "--min-nodes",
                   "1", "-o", "job.sbatch", cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    done = cluster.slurm("sbatch", "--test-only", "job.sbatch", cwd=tmp_path, check=False)
    assert done.returncode == 0, done.stderr
    assert f"on nodes {cluster.node}" in done.stderr
