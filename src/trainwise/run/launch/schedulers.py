"""Scheduler files for a job on several machines: a Slurm batch script and a Kubeflow
PyTorchJob manifest, each running one trainwise launcher per node (torchrun's elastic
agent, c10d rendezvous on the first node), which starts that node's workers itself.

Pure functions of a `ClusterJob`: the same job gives the same bytes (no timestamps, no
paths of this machine, a fixed order), so the files can be reviewed, diffed and tested
against golden copies. Bad generator input raises one ConfigError listing every problem.
"""

from __future__ import annotations

import re
import shlex
import signal
from dataclasses import dataclass
from typing import TYPE_CHECKING

import yaml

from trainwise.errors import ConfigError

if TYPE_CHECKING:
    from trainwise.config import JobConfig

# Slurm warns the batch shell this long before the time limit (--signal=B:USR1@...). It
# must cover a synchronous save: the launcher gives its workers 120 s after the signal
# (trainwise.run.launch.torchrun.SHUTDOWN_GRACE_S) before it kills them.
SIGNAL_LEAD_S = 180
# Kubernetes waits this long between SIGTERM and SIGKILL when it deletes a pod (the
# default, 30 s, is too short for a save).
TERMINATION_GRACE_S = 180
# GPUs per machine when neither the job file (cluster.nproc) nor --gpus-per-node says.
DEFAULT_GPUS_PER_NODE = 8
# A pod's memory request per worker when --memory-per-node does not say: an assumption
# (the data loader's processes and pinned batches, a checkpoint's staging copy on async
# saves), not a measurement; the request is also the limit, so a pod over it is OOM-killed.
DEFAULT_MEMORY_PER_WORKER_GI = 8
DEFAULT_STORAGE = "100Gi"  # the run claim trainwise writes when --pvc names none
# The exit statuses of a run that saved and stopped before its last step: 128 + each
# stop signal a launcher gets (trainwise.run.engine.control.stop_status; a test keeps the two
# in step). The batch script requeues the job on them; a PyTorchJob's ExitCode policy
# retries them too.
STOP_STATUSES = tuple(
    sorted(128 + s for s in (signal.SIGHUP, signal.SIGINT, signal.SIGUSR1, signal.SIGTERM))
)

CONFIG_MOUNT = "/etc/trainwise"  # the ConfigMap's job.toml, in every pod
RUNS_MOUNT = "/runs"  # the shared volume that holds the run directories
HEREDOC_END = "TRAINWISE_JOB_TOML"

_DNS_1035 = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
_SLURM_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
# The log %x-%j.out and the run directory runs/NAME are file names: at most 255 bytes on
# Linux (NAME_MAX, <linux/limits.h>), less "-" + a 32-bit job id (10 digits) + ".out".
SLURM_NAME_MAX = 255 - len("-4294967295.out")
# A Kubernetes quantity as a size: 100Gi, 512Mi, 1.5T (binary or decimal suffixes).
_QUANTITY = re.compile(r"\d+(\.\d+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?")
# minutes, minutes:seconds, hours:minutes:seconds, days-hours[:minutes[:seconds]]
_SLURM_TIME = re.compile(r"(\d+-)?\d+(:\d{1,2}){0,2}")


@dataclass(frozen=True)
class ClusterJob:
    """One job on a cluster, as the scheduler files need it."""

    name: str  # Slurm job name / PyTorchJob name; also the run directory's name
    config_text: str  # the job's TOML, embedded verbatim
    nodes: int  # machines (the most, with min_nodes)
    nproc: int  # workers per machine (trainwise train --nproc)
    gpus_per_node: int = 0  # GPUs asked for per machine, one per worker; 0: a CPU job
    cpus_per_node: int | None = None  # CPUs asked for per machine; None: the scheduler's default
    min_nodes: int | None = None  # elastic: the fewest machines to train on
    port: int = 29400  # c10d rendezvous port on the first node
    run_dir: str | None = None  # Slurm: default runs/<name>; Kubernetes: always /runs/<name>
    sets: tuple[str, ...] = ()  # --set KEY=VALUE overrides, passed to every launcher
    partition: str | None = None  # Slurm only
    time: str | None = None  # Slurm only: the time limit
    account: str | None = None  # Slurm only
    image: str | None = None  # Kubernetes only: a container image with trainwise installed
    max_restarts: int = 3  # Kubernetes only: elasticPolicy.maxRestarts
    pvc: str | None = None  # Kubernetes only: an existing claim for /runs; None: write one
    storage: str = DEFAULT_STORAGE  # Kubernetes only: the size of the claim trainwise writes
    memory_per_node: str | None = None  # Kubernetes only: a quantity; None: by the workers
    python: str = "python3"  # Slurm only: the interpreter with trainwise on every node


def default_job_name(stem: str) -> str:
    """A config file's stem as a job name that Slurm and Kubernetes (a DNS-1035 label:
    lowercase letters, digits, '-', starting with a letter) both accept."""
    name = re.sub(r"[^a-z0-9]+", "-", stem.lower()).strip("-")
    if not name:
        return "job"
    if not name[0].isalpha():
        name = "job-" + name
    return name[:40].rstrip("-")


def check_cluster_job(job: ClusterJob, scheduler: str) -> None:
    """Raise one ConfigError naming every bad generator input (`scheduler`: slurm, k8s)."""
    problems = []
    if job.nodes < 1:
        problems.append(f"--nodes {job.nodes}: give at least 1 machine")
    if job.nproc < 1:
        problems.append(f"{job.nproc} workers per node: give at least 1")
    if job.gpus_per_node not in (0, job.nproc):
        problems.append(
            f"--gpus-per-node {job.gpus_per_node} with {job.nproc} workers per node: "
            "one worker per GPU needs them equal"
        )
    if job.min_nodes is not None and not 1 <= job.min_nodes <= job.nodes:
        problems.append(
            f"--min-nodes {job.min_nodes} with --nodes {job.nodes}: "
            "need 1 <= --min-nodes <= --nodes"
        )
    if not 1 <= job.port <= 65535:
        problems.append(f"--port {job.port}: give a TCP port, 1 to 65535")
    if scheduler == "slurm":
        if not _SLURM_NAME.fullmatch(job.name) or len(job.name) > SLURM_NAME_MAX:
            shown = job.name if len(job.name) <= 60 else job.name[:40] + "..."
            problems.append(
                f"--name {shown!r} ({len(job.name)} characters): use at most "
                f"{SLURM_NAME_MAX} letters, digits, '.', '_' and '-', starting with a letter "
                "or digit (it names the run directory and the log file too)"
            )
        if job.time is not None and not _SLURM_TIME.fullmatch(job.time):
            problems.append(
                f"--time {job.time!r}: use Slurm's format, e.g. 90 (minutes), 24:00:00 "
                "or 2-00:00:00 (days-hours:minutes:seconds)"
            )
        if any(line == HEREDOC_END for line in job.config_text.splitlines()):
            problems.append(f"the config has a line {HEREDOC_END!r}: remove it")
    else:
        longest = len(f"-worker-{max(job.nodes, 1) - 1}")
        if not _DNS_1035.fullmatch(job.name) or len(job.name) + longest > 63:
            problems.append(
                f"--name {job.name!r}: a PyTorchJob name must be a DNS-1035 label "
                "(lowercase letters, digits and '-', starting with a letter, not ending "
                f"with '-'), at most {63 - longest} characters here (pods are NAME-worker-N)"
            )
        if not job.image:
            problems.append("--image: give a container image with trainwise installed")
        if job.max_restarts < 0:
            problems.append(f"--max-restarts {job.max_restarts}: give 0 or more")
        for flag, size in (("--storage", job.storage), ("--memory-per-node", job.memory_per_node)):
            if size is not None and not _QUANTITY.fullmatch(size):
                problems.append(f"{flag} {size!r}: give a Kubernetes quantity, e.g. 100Gi")
    if problems:
        raise ConfigError(problems)


def node_resources(
    cfg: JobConfig, gpus_flag: int | None, cpus_flag: int | None, source: str
) -> tuple[int, int, int | None]:
    """Workers, GPUs and CPUs per machine, from the job file `cfg` (read from `source`)
    and the generator's --gpus-per-node / --cpus-per-node. A CPU job (cluster.device =
    "cpu") asks for CPUs only, by default one per worker; any other job asks for one GPU
    per worker (cluster.nproc, else the flag, else 8). A flag that contradicts the job
    file raises ConfigError: a script the scheduler would refuse, or run wrong, is not
    written."""
    from trainwise.hardware import DeviceInfo
    from trainwise.run.job.resolve import resolve_nproc

    for flag, value in (("--gpus-per-node", gpus_flag), ("--cpus-per-node", cpus_flag)):
        if value is not None and value < 1:
            raise ConfigError(f"{flag} {value}: give at least 1")
    if cfg.cluster.device == "cpu":
        if gpus_flag is not None:
            raise ConfigError(
                f'--gpus-per-node {gpus_flag}: {source} trains on CPUs (cluster.device = "cpu"); '
                "drop the flag (cluster.nproc sets the workers, --cpus-per-node the CPUs)"
            )
        cpu = DeviceInfo(kind="cpu", name="cpu", count=1, memory_bytes=0.0, bf16=False,
                         fp16=False, gpu=None)
        workers = resolve_nproc(cfg, cpu)
        return workers, 0, cpus_flag or workers
    nproc = cfg.cluster.nproc
    if gpus_flag is not None and nproc is not None and gpus_flag != nproc:
        raise ConfigError(
            f"--gpus-per-node {gpus_flag} with cluster.nproc = {nproc} in {source}: one "
            "worker per GPU needs them equal; drop one of the two or make them agree"
        )
    gpus = gpus_flag or nproc or DEFAULT_GPUS_PER_NODE
    return gpus, gpus, cpus_flag


def describe_shape(job: ClusterJob) -> str:
    """The job's machines for the files' headers, e.g. '4 nodes x 8 GPUs'."""
    machines = _count(job.nodes, "node")
    if job.gpus_per_node:
        shape = f"{machines} x {job.gpus_per_node} GPUs"
    else:
        shape = f"{machines} x {job.nproc} CPU workers ({job.cpus_per_node} CPUs)"
    if job.min_nodes is not None:
        shape += f", elastic down to {_count(job.min_nodes, 'node')}"
    return shape


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def nnodes_arg(job: ClusterJob) -> str:
    """trainwise train's --nnodes: N, or MIN:MAX for an elastic range."""
    if job.min_nodes is None:
        return str(job.nodes)
    return f"{job.min_nodes}:{job.nodes}"


def train_command(
    job: ClusterJob, config: str, rdzv_endpoint: str, rdzv_id: str, run_dir: str
) -> list[str]:
    """The launcher's command on every node, the same on each."""
    command = [
        "trainwise", "train",  # Slurm runs it with "$PYTHON" -m (srun_line)
        "--config", config,
        "--nnodes", nnodes_arg(job),
        "--nproc", str(job.nproc),
        "--rdzv-endpoint", rdzv_endpoint,
        "--rdzv-id", rdzv_id,
        "--run-dir", run_dir,
    ]
    for item in job.sets:
        command += ["--set", item]
    return command


def job_run_dir(job: ClusterJob, scheduler: str) -> str:
    """The run directory every node writes to: on Slurm --run-dir or runs/<name> (relative
    to the submit directory); on Kubernetes /runs/<name> on the shared claim."""
    if scheduler == "k8s":
        return f"{RUNS_MOUNT}/{job.name}"
    return job.run_dir or f"runs/{job.name}"


# --- Slurm ---------------------------------------------------------------------------


def srun_line(job: ClusterJob) -> str:
    """The batch script's one srun line (the README quotes it for its example). Each task
    is a node's launcher: under srun with a rendezvous endpoint, `trainwise train` starts
    the elastic agent instead of training as one of srun's ranks (run.start.is_worker)."""
    command = ["$PYTHON", "-m"] + train_command(
        job,
        config="$RUN_DIR/job.toml",
        rdzv_endpoint=f"$HEAD_ADDR:{job.port}",
        rdzv_id="$SLURM_JOB_ID",
        run_dir="$RUN_DIR",
    )
    # srun is given the CPUs itself: from Slurm 22.05 to 23.02 it does not take
    # --cpus-per-task from the batch script's allocation, and would pin a launcher and its
    # workers to one CPU.
    cpus = [f"--cpus-per-task={job.cpus_per_node}"] if job.cpus_per_node else []
    prefix = ["srun", "--ntasks-per-node=1", *cpus, "--kill-on-bad-exit=0"]
    return " ".join(prefix + [_shell_word(word) for word in command])


def _shell_word(word: str) -> str:
    """Our own `$VAR` placeholders in double quotes (expanded by the shell); anything
    else quoted so that the shell passes it through as is."""
    if word.startswith("$"):
        return f'"{word}"'
    return shlex.quote(word)


def slurm_script(job: ClusterJob) -> str:
    """An sbatch script: one trainwise launcher per node, rendezvous on the first node,
    a checkpoint and a requeue when the time limit comes near."""
    check_cluster_job(job, "slurm")
    # An elastic job may start on fewer machines than it asks for (Slurm's --nodes=MIN-MAX):
    # the launchers' --nnodes MIN:MAX train on whatever count Slurm gives.
    nodes = f"{job.min_nodes}-{job.nodes}" if job.min_nodes is not None else str(job.nodes)
    directives = [
        f"--job-name={job.name}",
        f"--nodes={nodes}",
        "--ntasks-per-node=1",
    ]
    directives += [f"--gpus-per-node={job.gpus_per_node}"] if job.gpus_per_node else []
    directives += [f"--cpus-per-task={job.cpus_per_node}"] if job.cpus_per_node else []
    directives += [f"--partition={job.partition}"] if job.partition else []
    directives += [f"--time={job.time}"] if job.time else []
    directives += [f"--account={job.account}"] if job.account else []
    directives += [
        "--requeue",
        f"--signal=B:USR1@{SIGNAL_LEAD_S}",
        "--output=%x-%j.out",
        "--open-mode=append",
    ]
    config = job.config_text if job.config_text.endswith("\n") else job.config_text + "\n"
    stops = "|".join(str(code) for code in STOP_STATUSES)
    lines = [
        "#!/bin/bash",
        *(f"#SBATCH {d}" for d in directives),
        f"# trainwise job '{job.name}', {describe_shape(job)}.",
        "# Written by `trainwise launch slurm`; submit with `sbatch FILE`. The log is",
        "# %x-%j.out in the submit directory, appended to when the job is requeued.",
        "",
        "set -euo pipefail",
        "",
        "# The interpreter the script was written from, with trainwise installed; every node",
        "# must see it at this path (TRAINWISE_PYTHON=/path/to/python sbatch FILE overrides).",
        f"PYTHON=${{TRAINWISE_PYTHON:-{shlex.quote(job.python)}}}",
        "",
        "# The run directory must be on storage that every node sees: each rank writes its",
        "# checkpoint shards there, and a requeued job resumes from the newest checkpoint.",
        f"RUN_DIR={shlex.quote(job_run_dir(job, 'slurm'))}",
        'mkdir -p "$RUN_DIR"',
        "",
        "# The job's keys as `trainwise launch` read them (a quoted heredoc: nothing in it is",
        "# expanded); the machine counts and --set come from the srun line below.",
        f"cat > \"$RUN_DIR/job.toml\" <<'{HEREDOC_END}'",
        config + HEREDOC_END,
        "",
        "# The first node hosts the c10d rendezvous; every node's launcher meets it at that",
        "# node's address, as torchtitan's multinode_trainer.slurm finds it (pytorch/torchtitan).",
        "# Where the first address is not one the others reach (127.0.1.1 in /etc/hosts), set",
        "# TRAINWISE_HEAD_ADDR.",
        "# (awk, not head: head's early exit would fail the pipe under pipefail, SIGPIPE).",
        'HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | awk \'NR == 1\')',
        'HEAD_ADDR=${TRAINWISE_HEAD_ADDR:-$(srun --nodes=1 --ntasks=1 -w "$HEAD_NODE" '
        "hostname --ip-address | awk 'NR == 1 {print $1}')}",
        "",
        f"# Slurm sends USR1 to this shell {SIGNAL_LEAD_S} s before the time limit (and scancel",
        "# --signal=USR1 --batch does, to preempt). srun passes it to the launchers, whose",
        "# workers save a checkpoint and exit; then the job is requeued and resumes from that",
        "# checkpoint. The trap is set before srun starts, so that an early signal requeues too.",
        'SRUN_PID=""',
        "requeue() {",
        '    echo "trainwise: got USR1; checkpointing, then requeueing job $SLURM_JOB_ID"',
        '    kill -USR1 "$SRUN_PID" 2>/dev/null || true',
        '    wait "$SRUN_PID" 2>/dev/null || true',
        '    scontrol requeue "$SLURM_JOB_ID"',
        "    exit 0",
        "}",
        "trap requeue USR1",
        "",
        f"# One launcher per node starts that node's {job.nproc} workers itself.",
        "# --kill-on-bad-exit=0: a failing node does not take the others down at once; the",
        "# elastic agents decide. The rendezvous id is the Slurm job id, which a requeued",
        "# job keeps.",
        srun_line(job) + " &",
        "SRUN_PID=$!",
        "",
        "# 0: finished. 128 + a signal: stopped by it after a checkpoint (SIGTERM from a",
        "# preemption, SIGINT, ...): requeued, to resume. Anything else: failed, not requeued.",
        'STATUS=0',
        'wait "$SRUN_PID" || STATUS=$?',
        'case "$STATUS" in',
        f'    {stops})',
        '        echo "trainwise: stopped after a checkpoint (exit $STATUS);" \\',
        '            "requeueing job $SLURM_JOB_ID"',
        '        scontrol requeue "$SLURM_JOB_ID"',
        "        exit 0 ;;",
        "esac",
        'exit "$STATUS"',
    ]
    return "\n".join(lines) + "\n"


# --- Kubernetes ------------------------------------------------------------------------


class _Dumper(yaml.SafeDumper):
    """yaml.SafeDumper that writes multi-line strings (the job file) as literal blocks."""


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def pod_resources(job: ClusterJob) -> dict[str, dict[str, int | str]]:
    """A pod's requests and limits: its CPUs (one per worker unless --cpus-per-node says)
    and memory are requested, so that the scheduler places it where they are free; memory
    and GPUs are limits too. No CPU limit: a throttled data loader would slow every step."""
    memory = job.memory_per_node or f"{DEFAULT_MEMORY_PER_WORKER_GI * job.nproc}Gi"
    requests: dict[str, int | str] = {"cpu": job.cpus_per_node or job.nproc, "memory": memory}
    limits: dict[str, int | str] = {"memory": memory}
    if job.gpus_per_node:
        limits["nvidia.com/gpu"] = job.gpus_per_node
    return {"requests": requests, "limits": limits}


def run_claim(job: ClusterJob) -> dict:
    """The ReadWriteMany claim the run directories live on, when --pvc names none."""
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": claim_name(job)},
        "spec": {
            "accessModes": ["ReadWriteMany"],  # every pod writes its shards there
            "resources": {"requests": {"storage": job.storage}},
        },
    }


def claim_name(job: ClusterJob) -> str:
    return job.pvc or f"{job.name}-runs"


def pytorchjob_manifest(job: ClusterJob) -> str:
    """A ConfigMap with the job file and a kubeflow.org/v1 PyTorchJob whose Worker pods
    each run one trainwise launcher; the operator's elastic policy sets the range."""
    check_cluster_job(job, "k8s")
    config_map_name = f"{job.name}-config"
    claim = claim_name(job)
    command = train_command(
        job,
        config=f"{CONFIG_MOUNT}/job.toml",
        rdzv_endpoint=f"{job.name}-worker-0:{job.port}",  # the operator's per-pod service
        rdzv_id=job.name,
        run_dir=job_run_dir(job, "k8s"),
    )
    config_map = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": config_map_name},
        "data": {"job.toml": job.config_text},
    }
    container = {
        "name": "pytorch",  # the operator looks for this name
        "image": job.image,
        "command": command,
        # Named so that the operator's per-pod service uses it (else it adds port 23456).
        "ports": [{"name": "pytorchjob-port", "containerPort": job.port}],
        "resources": pod_resources(job),
        "volumeMounts": [
            {"name": "config", "mountPath": CONFIG_MOUNT, "readOnly": True},
            {"name": "runs", "mountPath": RUNS_MOUNT},
            {"name": "dshm", "mountPath": "/dev/shm"},
        ],
    }
    pytorch_job = {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": {"name": job.name},
        "spec": {
            "elasticPolicy": {
                "rdzvBackend": "c10d",
                "minReplicas": job.min_nodes or job.nodes,
                "maxReplicas": job.nodes,
                "maxRestarts": job.max_restarts,
                "nProcPerNode": job.nproc,
            },
            "pytorchReplicaSpecs": {
                "Worker": {
                    "replicas": job.nodes,
                    # 0 succeeded; 1-127 (2: bad input, 1: a failure past its restarts) are
                    # permanent; 128 + a signal (a stop after a checkpoint, a kill) is
                    # retried (kubeflow/training-operator pkg/util/train IsRetryableExitCode).
                    "restartPolicy": "ExitCode",
                    "template": {
                        "spec": {
                            "terminationGracePeriodSeconds": TERMINATION_GRACE_S,
                            "containers": [container],
                            "volumes": [
                                {"name": "config", "configMap": {"name": config_map_name}},
                                {"name": "runs", "persistentVolumeClaim": {"claimName": claim}},
                                # DataLoader worker processes share batches through /dev/shm,
                                # which a container's default (64 MB) is too small for.
                                {"name": "dshm", "emptyDir": {"medium": "Memory"}},
                            ],
                        }
                    },
                }
            },
        },
    }
    header = [
        f"# trainwise job '{job.name}', {describe_shape(job)}.",
        "# Written by `trainwise launch k8s`; apply with `kubectl apply -f FILE` (needs the",
        "# Kubeflow training operator).",
        f"# Runs go to {RUNS_MOUNT}/{job.name} on the ReadWriteMany claim {claim}: every pod",
        "# writes its checkpoint shards there, and a restarted pod resumes from them.",
        "# The claim must exist (--pvc)." if job.pvc else "# The claim is written below: the "
        "cluster's default storage class must offer\n# ReadWriteMany (else pass --pvc CLAIM).",
    ]
    documents = ([] if job.pvc else [run_claim(job)]) + [config_map, pytorch_job]
    body = yaml.dump_all(
        documents,
        Dumper=_Dumper,
        sort_keys=False,
        default_flow_style=False,
        allow_unicode=True,
        explicit_start=True,
    )
    return "\n".join(header) + "\n" + body
