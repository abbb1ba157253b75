"""Unit tests of `trainwise launch slurm|k8s` (trainwise.run.launch.schedulers): the generated
files equal the golden copies byte for byte and are stable; the sbatch script is valid
bash with the documented srun line; the manifest is a valid PyTorchJob; the launcher
command in both parses with trainwise's own argparse into a valid multi-node job; bad
input is one line and exit status 2.

The golden files are tests/golden/job.sbatch and tests/golden/job.yaml, generated from
tests/golden/job.toml. After an intended change, regenerate them and review the diff:

    TRAINWISE_UPDATE_GOLDEN=1 .venv/bin/pytest -q tests/unit/test_schedulers.py
"""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path

import pytest
import tomli_w
import yaml

from helpers import hang_limit, run_limited
from trainwise.cli.main import build_parser, main
from trainwise.cli.train import job_flags
from trainwise.config import JobConfig, load_config, read_toml
from trainwise.run.launch.schedulers import ClusterJob, pytorchjob_manifest, srun_line
from trainwise.run.launch.start import check_multi_node

REPO = Path(__file__).resolve().parents[2]
GOLDEN = REPO / "tests" / "golden"
CONFIG = GOLDEN / "job.toml"
NODES, GPUS = 4, 8
IMAGE = "registry.example.com/trainwise:0.1.0"
PYTHON = "/opt/venv/bin/python"  # default: the generator's own interpreter
COMMANDS = {
    "job.sbatch": ["launch", "slurm", "--config", str(CONFIG), "--nodes", str(NODES),
                   "--gpus-per-node", str(GPUS), "--partition", "gpu", "--time", "24:00:00",
                   "--python", PYTHON],
    "job.yaml": ["launch", "k8s", "--config", str(CONFIG), "--nodes", str(NODES),
                 "--gpus-per-node", str(GPUS), "--image", IMAGE],
}
# What the shell would put in for the srun line's variables.
SAMPLE_ENV = {"RUN_DIR": "runs/job", "HEAD_ADDR": "10.0.0.1", "SLURM_JOB_ID": "4242",
              "PYTHON": PYTHON}
KEYS = tomli_w.dumps(read_toml(CONFIG))  # the job file's keys, without its comments


def generate(name: str, capsys) -> str:
    capsys.readouterr()
    assert main([*COMMANDS[name], "--print"]) == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    return captured.out


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_print_equals_golden_and_is_stable(name, capsys):
    text = generate(name, capsys)
    assert generate(name, capsys) == text
    golden = GOLDEN / name
    if os.environ.get("TRAINWISE_UPDATE_GOLDEN") == "1":
        golden.write_bytes(text.encode())
    assert golden.read_bytes() == text.encode(), f"{name} differs from {golden}; see docstring"


def test_output_file_has_the_printed_bytes(tmp_path, capsys):
    out = tmp_path / "job.sbatch"
    assert main([*COMMANDS["job.sbatch"], "-o", str(out)]) == 0
    line = capsys.readouterr().out
    assert line.count("\n") == 1 and f"sbatch {out}" in line
    assert out.read_bytes() == (GOLDEN / "job.sbatch").read_bytes()


def readme_job() -> ClusterJob:
    """The documented example (docs/train.md): job.toml on 4 nodes x 8 GPUs, the rest default."""
    return ClusterJob(
        name="job", config_text=CONFIG.read_text(), nodes=NODES, nproc=GPUS, gpus_per_node=GPUS
    )


def test_sbatch_is_valid_bash_with_the_readme_srun_line(capsys):
    script = generate("job.sbatch", capsys)
    res = subprocess.run(["bash", "-n"], input=script, text=True, capture_output=True)
    assert res.returncode == 0, res.stderr
    line = srun_line(readme_job())
    assert line + " &\n" in script
    assert line in (REPO / "docs" / "train.md").read_text()
    for directive in ("--nodes=4", "--ntasks-per-node=1", "--gpus-per-node=8", "--requeue",
                      "--signal=B:USR1@180", "--partition=gpu", "--time=24:00:00"):
        assert f"#SBATCH {directive}\n" in script
    assert "#SBATCH --account" not in script
    # The job file's keys are embedded, unexpanded, without the file's comments.
    assert "<<'TRAINWISE_JOB_TOML'\n" + KEYS + "TRAINWISE_JOB_TOML\n" in script
    assert "# A GPT-2 (124M) job" not in script
    assert 'kill -USR1 "$SRUN_PID"' in script and 'scontrol requeue "$SLURM_JOB_ID"' in script


def test_signal_comes_before_the_launcher_gives_up_on_a_save():
    from trainwise.run.launch.schedulers import SIGNAL_LEAD_S, TERMINATION_GRACE_S
    from trainwise.run.launch.torchrun import SHUTDOWN_GRACE_S

    assert SIGNAL_LEAD_S > SHUTDOWN_GRACE_S and TERMINATION_GRACE_S > SHUTDOWN_GRACE_S


def parse_train(command: list[str]):
    """trainwise's own parser on a launcher command (from `trainwise` on)."""
    start = command.index("trainwise")
    args = build_parser().parse_args(command[start + 1 :])
    assert args.command == "train"
    return args


def assert_valid_multi_node_job(args, nnodes: str) -> JobConfig:
    assert (args.nnodes, args.nproc) == (nnodes, GPUS)
    cfg = load_config(CONFIG, job_flags(args), args.set)
    check_multi_node(cfg)  # rendezvous endpoint, id and run dir all given
    return cfg


@pytest.mark.parametrize("min_nodes", [None, 2])
def test_srun_line_parses_as_trainwise_train(min_nodes, monkeypatch):
    from trainwise.run.launch.start import is_worker

    job = ClusterJob(
        name="job", config_text=CONFIG.read_text(), nodes=NODES, nproc=GPUS, gpus_per_node=GPUS,
        min_nodes=min_nodes, sets=("optim.lr=3e-4", "train.seed=7"),
    )
    line = srun_line(job)
    for var, value in SAMPLE_ENV.items():
        line = line.replace(f"${var}", value)
    args = parse_train(shlex.split(line))
    assert args.rdzv_endpoint == "10.0.0.1:29400" and args.rdzv_id == "4242"
    assert args.set == ["optim.lr=3e-4", "train.seed=7"]
    cfg = assert_valid_multi_node_job(args, f"{min_nodes}:{NODES}" if min_nodes else str(NODES))
    # Each srun task (one per node) starts the elastic agent, not training as a rank.
    for var in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    srun_env = {"SLURM_STEP_ID": "0", "SLURM_PROCID": "1", "SLURM_NTASKS": str(NODES)}
    for var, value in srun_env.items():
        monkeypatch.setenv(var, value)
    assert not is_worker(cfg)


def by_kind(text: str) -> dict[str, dict]:
    return {doc["kind"]: doc for doc in yaml.safe_load_all(text)}


def manifest(capsys) -> tuple[dict, dict]:
    docs = by_kind(generate("job.yaml", capsys))
    return docs["ConfigMap"], docs["PyTorchJob"]


def test_manifest_is_a_pytorchjob(capsys, tmp_path):
    config_map, job = manifest(capsys)
    assert (job["apiVersion"], job["kind"], job["metadata"]["name"]) == (
        "kubeflow.org/v1",
        "PyTorchJob",
        "job",
    )
    policy = job["spec"]["elasticPolicy"]
    assert policy["rdzvBackend"] == "c10d"
    assert 1 <= policy["minReplicas"] <= policy["maxReplicas"] == NODES
    assert policy["maxRestarts"] == 3 and policy["nProcPerNode"] == GPUS
    worker = job["spec"]["pytorchReplicaSpecs"]["Worker"]
    # Kubeflow's ExitCode policy: 1-127 permanent (2: bad input), 128 + a signal retried.
    assert worker["replicas"] == NODES and worker["restartPolicy"] == "ExitCode"
    pod = worker["template"]["spec"]
    (container,) = pod["containers"]
    assert container["name"] == "pytorch" and container["image"] == IMAGE
    assert container["resources"] == {
        "requests": {"cpu": GPUS, "memory": f"{8 * GPUS}Gi"},
        "limits": {"memory": f"{8 * GPUS}Gi", "nvidia.com/gpu": GPUS},
    }
    assert container["ports"] == [{"name": "pytorchjob-port", "containerPort": 29400}]
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert set(mounts.values()) <= set(volumes)
    assert volumes[mounts["/etc/trainwise"]]["configMap"]["name"] == config_map["metadata"]["name"]
    assert volumes[mounts["/runs"]]["persistentVolumeClaim"]["claimName"] == "job-runs"
    assert volumes[mounts["/dev/shm"]]["emptyDir"] == {"medium": "Memory"}

    assert (config_map["apiVersion"], config_map["kind"]) == ("v1", "ConfigMap")
    text = config_map["data"]["job.toml"]
    assert text == KEYS
    mounted = tmp_path / "job.toml"  # what the pods read
    mounted.write_text(text)
    assert load_config(mounted) == load_config(CONFIG)


def test_manifest_command_parses_as_trainwise_train(capsys):
    _, job = manifest(capsys)
    container = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
    args = parse_train(container["command"])
    assert args.config == "/etc/trainwise/job.toml"
    assert args.rdzv_endpoint == "job-worker-0:29400" and args.rdzv_id == "job"
    assert args.run_dir == "/runs/job"
    assert_valid_multi_node_job(args, str(NODES))


def test_manifest_elastic_range_and_sets():
    job = ClusterJob(
        name="job", config_text=CONFIG.read_text(), nodes=NODES, nproc=GPUS, gpus_per_node=GPUS,
        min_nodes=2, image=IMAGE, pvc="shared", max_restarts=5, sets=("optim.lr=3e-4",),
    )
    docs = by_kind(pytorchjob_manifest(job))
    assert "PersistentVolumeClaim" not in docs  # --pvc names an existing claim
    doc = docs["PyTorchJob"]
    policy = doc["spec"]["elasticPolicy"]
    assert (policy["minReplicas"], policy["maxReplicas"], policy["maxRestarts"]) == (2, NODES, 5)
    pod = doc["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    assert pod["volumes"][1]["persistentVolumeClaim"]["claimName"] == "shared"
    args = parse_train(pod["containers"][0]["command"])
    assert args.set == ["optim.lr=3e-4"]
    assert_valid_multi_node_job(args, f"2:{NODES}")


BAD = {
    "min-nodes above nodes": ["slurm", "--nodes", "2", "--min-nodes", "3"],
    "no nodes": ["slurm", "--nodes", "0"],
    "bad time": ["slurm", "--nodes", "2", "--time", "1h"],
    "bad slurm name": ["slurm", "--nodes", "2", "--name", "a b"],
    "k8s name not a label": ["k8s", "--nodes", "2", "--image", IMAGE, "--name", "Job_1"],
    "k8s name too long": ["k8s", "--nodes", "2", "--image", IMAGE, "--name", "a" * 60],
    "bad --set": ["k8s", "--nodes", "2", "--image", IMAGE, "--set", "optim.lrr=1"],
    "bad storage size": ["k8s", "--nodes", "2", "--image", IMAGE, "--storage", "lots"],
    "bad memory": ["k8s", "--nodes", "2", "--image", IMAGE, "--memory-per-node", "8 GB"],
    # 1 accumulation step cannot keep the global batch of 4 machines on 3.
    "elastic batch": ["slurm", "--nodes", "4", "--min-nodes", "3"],
}


@pytest.mark.parametrize("argv", list(BAD.values()), ids=list(BAD))
def test_bad_input_is_one_line_and_exit_2(argv, capsys):
    scheduler, *rest = argv
    code = main(["launch", scheduler, "--config", str(CONFIG), *rest, "--print"])
    captured = capsys.readouterr()
    assert code == 2 and captured.out == ""
    assert captured.err.count("\n") == 1 and captured.err.startswith("trainwise: error: ")


@pytest.mark.parametrize("scheduler", [["slurm"], ["k8s", "--image", IMAGE]])
def test_missing_config_is_exit_2(scheduler, tmp_path, capsys):
    missing = tmp_path / "nope.toml"
    code = main(["launch", *scheduler, "--config", str(missing), "--nodes", "2", "--print"])
    assert code == 2
    assert "not found" in capsys.readouterr().err


def test_default_name_is_dns_safe(tmp_path, capsys):
    config = tmp_path / "2 My_Job.v1.toml"
    config.write_text(CONFIG.read_text())
    argv = ["launch", "k8s", "--config", str(config), "--nodes", "2", "--image", IMAGE, "--print"]
    assert main(argv) == 0
    job = by_kind(capsys.readouterr().out)["PyTorchJob"]
    assert job["metadata"]["name"] == "job-2-my-job-v1"


# --- CPU jobs (cluster.device = "cpu") ------------------------------------------------

TINY_CPU = REPO / "examples" / "tiny_gpt_cpu.toml"  # cluster.nproc = 2, device = "cpu"


def slurm_print(capsys, config: Path, *flags: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(["launch", "slurm", "--config", str(config), "--nodes", "1", *flags, "--print"])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def directives(script: str) -> list[str]:
    return [
        line.removeprefix("#SBATCH ") for line in script.splitlines() if line.startswith("#SBATCH ")
    ]


@pytest.mark.parametrize(("flags", "cpus"), [((), 2), (("--cpus-per-node", "6"), 6)])
def test_cpu_job_asks_for_cpus_not_gpus(flags, cpus, capsys):
    code, script, err = slurm_print(capsys, TINY_CPU, *flags)
    assert code == 0 and err == ""
    res = subprocess.run(["bash", "-n"], input=script, text=True, capture_output=True)
    assert res.returncode == 0, res.stderr
    asked = directives(script)
    assert f"--cpus-per-task={cpus}" in asked
    assert not any("gpu" in d or "gres" in d for d in asked)
    # srun gets the CPUs itself (Slurm 22.05-23.02 does not pass them on from sbatch), and
    # the launcher starts cluster.nproc workers whatever the CPUs.
    (srun,) = [line for line in script.splitlines() if line.startswith("srun ")]
    words = shlex.split(srun.removesuffix(" &"))
    assert f"--cpus-per-task={cpus}" in words[: words.index("trainwise")]
    args = parse_train(words)
    assert args.nproc == 2


def test_gpu_count_defaults_to_cluster_nproc(tmp_path, capsys):
    config = tmp_path / "four.toml"
    config.write_text(CONFIG.read_text() + "\n[cluster]\nnproc = 4\n")
    code, script, _ = slurm_print(capsys, config)
    assert code == 0
    assert "--gpus-per-node=4" in directives(script) and "--nproc 4 " in script
    code, script, _ = slurm_print(capsys, config, "--gpus-per-node", "4")
    assert code == 0 and "--gpus-per-node=4" in directives(script)


def test_elastic_script_lets_slurm_start_on_fewer_nodes(capsys):
    code, script, _ = slurm_print(capsys, CONFIG, "--nodes", "4", "--min-nodes", "2",
                                  "--set", "data.grad_accum=6")
    assert code == 0
    assert "--nodes=2-4" in directives(script) and "--nnodes 2:4 " in script


def test_the_trap_is_set_before_srun_starts(capsys):
    """An early USR1 (Slurm may send it up to a minute before the lead time) requeues the
    job instead of killing the script."""
    script = generate("job.sbatch", capsys)
    assert script.index("\ntrap requeue USR1\n") < script.index("\nsrun ")


CPU_BAD = {
    "gpus on a cpu job": (TINY_CPU, ["--gpus-per-node", "2"], "--gpus-per-node 2"),
    "gpus differ from cluster.nproc": (None, ["--gpus-per-node", "8"], "cluster.nproc = 4"),
    "no cpus": (TINY_CPU, ["--cpus-per-node", "0"], "--cpus-per-node 0"),
    "no gpus": (CONFIG, ["--gpus-per-node", "0"], "--gpus-per-node 0"),
}


@pytest.mark.parametrize(("config", "flags", "named"), list(CPU_BAD.values()), ids=list(CPU_BAD))
def test_resource_flags_that_contradict_the_job_are_exit_2(config, flags, named, tmp_path, capsys):
    if config is None:
        config = tmp_path / "four.toml"
        config.write_text(CONFIG.read_text() + "\n[cluster]\nnproc = 4\n")
    out = tmp_path / "job.sbatch"
    capsys.readouterr()
    code = main(
        ["launch", "slurm", "--config", str(config), "--nodes", "1", *flags, "-o", str(out)]
    )
    captured = capsys.readouterr()
    assert code == 2 and captured.out == "" and not out.exists()
    assert captured.err.count("\n") == 1 and named in captured.err


def test_k8s_cpu_job_asks_for_cpus_not_gpus(capsys):
    capsys.readouterr()
    argv = ["launch", "k8s", "--config", str(TINY_CPU), "--nodes", "2", "--image", IMAGE]
    assert main([*argv, "--memory-per-node", "6Gi", "--print"]) == 0
    job = by_kind(capsys.readouterr().out)["PyTorchJob"]
    assert job["spec"]["elasticPolicy"]["nProcPerNode"] == 2
    pod = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    assert pod["containers"][0]["resources"] == {
        "requests": {"cpu": 2, "memory": "6Gi"}, "limits": {"memory": "6Gi"}
    }


# --- what the generated files do -------------------------------------------------------


def test_the_manifest_writes_the_claim_it_mounts(capsys):
    docs = by_kind(generate("job.yaml", capsys))
    claim = docs["PersistentVolumeClaim"]
    pod = docs["PyTorchJob"]["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    mounted = {v["name"]: v for v in pod["volumes"]}["runs"]["persistentVolumeClaim"]
    assert claim["metadata"]["name"] == mounted["claimName"] == "job-runs"
    assert claim["spec"] == {"accessModes": ["ReadWriteMany"],
                             "resources": {"requests": {"storage": "100Gi"}}}


FAKE_SLURM = {
    # srun: the hostname step prints the head node's addresses; the launchers' step
    # records its command line and exits with $SRUN_EXIT.
    "srun": """#!/bin/bash
if [ "${@: -2:1}" = hostname ]; then echo "10.1.2.3 fe80::1"; exit 0; fi
printf '%s\\n' "$@" > srun.args
exit "$SRUN_EXIT"
""",
    "scontrol": """#!/bin/bash
case "$1" in
    show) echo node001; echo node002 ;;
    requeue) echo "$2" > requeued ;;
esac
""",
}


@pytest.mark.parametrize(("srun_exit", "requeued", "status"),
                         [(0, False, 0), (143, True, 0), (130, True, 0), (1, False, 1),
                          (2, False, 2)])
def test_the_script_requeues_a_stop_and_nothing_else(srun_exit, requeued, status, tmp_path,
                                                     capsys):
    """The batch script under stand-ins for srun and scontrol: it runs trainwise with the
    interpreter it was written from (no `trainwise` on PATH), meets at the head node's
    address, and requeues the job when the launchers stopped after a checkpoint
    (128 + a signal), not when they finished or failed."""
    script = tmp_path / "job.sbatch"
    script.write_text(generate("job.sbatch", capsys))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in FAKE_SLURM.items():
        (bin_dir / name).write_text(body)
        (bin_dir / name).chmod(0o755)
    env = {"PATH": f"{bin_dir}{os.pathsep}/usr/bin{os.pathsep}/bin",
           "SLURM_JOB_NODELIST": "node[001-002]", "SLURM_JOB_ID": "4242",
           "SRUN_EXIT": str(srun_exit)}
    done = run_limited(["bash", str(script)], cwd=tmp_path, env=env,
                       what="the sbatch script on a fake Slurm", limit=hang_limit(procs=0))
    assert done.returncode == status, done.stderr
    assert (tmp_path / "requeued").exists() == requeued
    words = (tmp_path / "srun.args").read_text().splitlines()
    start = words.index(PYTHON)
    assert words[start : start + 4] == [PYTHON, "-m", "trainwise", "train"]
    args = build_parser().parse_args(words[start + 3 :])
    assert args.rdzv_endpoint == "10.1.2.3:29400" and args.rdzv_id == "4242"
    assert (tmp_path / "runs/job/job.toml").read_text() == KEYS


def test_the_script_requeues_every_status_a_stop_exits_with():
    from trainwise.run.engine.control import PREEMPT_SIGNALS, signal_name, stop_status
    from trainwise.run.job.lifeline import LAUNCHER_GONE
    from trainwise.run.launch.schedulers import STOP_STATUSES

    launcher_stops = [s for s in PREEMPT_SIGNALS if s != LAUNCHER_GONE]  # the workers' own
    assert set(STOP_STATUSES) == {stop_status(signal_name(s)) for s in launcher_stops}
    assert STOP_STATUSES == (129, 130, 138, 143)  # Linux's signal numbers
