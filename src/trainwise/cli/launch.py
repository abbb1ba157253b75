"""`trainwise launch slurm|k8s`: the same job as an sbatch script or a Kubernetes
PyTorchJob manifest, for a cluster with several machines. Parsing and writing only;
the files come from trainwise.run.launch.schedulers."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import tomli_w

from trainwise.config import load_config, read_toml
from trainwise.errors import ConfigError
from trainwise.run.launch.schedulers import DEFAULT_MEMORY_PER_WORKER_GI, DEFAULT_STORAGE


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "launch",
        help="write a Slurm batch script or a Kubernetes PyTorchJob for a multi-node job",
        description="Write the scheduler file that runs a job on several machines: one "
        "trainwise launcher per node, c10d rendezvous on the first node, the run directory "
        "on shared storage.",
    )
    p.set_defaults(run=lambda args: _usage(p))
    kinds = p.add_subparsers(dest="scheduler", metavar="SCHEDULER")

    s = kinds.add_parser(
        "slurm",
        help="an sbatch script (checkpoint and requeue before the time limit)",
        description="Write an sbatch script: srun starts one launcher per node; 180 s before "
        "the time limit the workers save a checkpoint and the job requeues itself.",
    )
    _add_common(s)
    s.add_argument("--partition", help="Slurm partition (#SBATCH --partition)")
    s.add_argument("--time", metavar="LIMIT", help="time limit, e.g. 24:00:00 (#SBATCH --time)")
    s.add_argument("--account", help="account to charge (#SBATCH --account)")
    s.add_argument(
        "--run-dir",
        metavar="DIR",
        help="run directory on storage every node sees (default: runs/NAME)",
    )
    s.add_argument(
        "--python",
        metavar="PATH",
        help="the interpreter with trainwise installed, at the same path on every node "
        "(default: this one)",
    )
    _add_output(s)
    s.set_defaults(run=run_slurm)

    k = kinds.add_parser(
        "k8s",
        help="a Kubeflow PyTorchJob manifest with a ConfigMap for the job file",
        description="Write a ConfigMap holding the job file and a kubeflow.org/v1 PyTorchJob "
        "(elastic policy, c10d) whose Worker pods each run one launcher; runs go to a "
        "PersistentVolumeClaim mounted at /runs.",
    )
    _add_common(k)
    k.add_argument("--image", required=True, help="container image with trainwise installed")
    k.add_argument(
        "--max-restarts",
        type=int,
        default=3,
        help="restarts of the worker group (elasticPolicy.maxRestarts; default 3)",
    )
    k.add_argument(
        "--pvc",
        metavar="CLAIM",
        help="an existing ReadWriteMany claim for /runs (default: the manifest creates NAME-runs)",
    )
    k.add_argument(
        "--storage",
        metavar="SIZE",
        default=DEFAULT_STORAGE,
        help=f"size of the claim the manifest creates (default {DEFAULT_STORAGE})",
    )
    k.add_argument(
        "--memory-per-node",
        metavar="QUANTITY",
        help="memory each pod requests and may use, e.g. 128Gi (default: "
        f"{DEFAULT_MEMORY_PER_WORKER_GI}Gi per worker)",
    )
    _add_output(k)
    k.set_defaults(run=run_k8s)


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="TOML", required=True, help="job file")
    p.add_argument("--nodes", type=int, required=True, help="machines (the most, if elastic)")
    p.add_argument(
        "--gpus-per-node",
        type=int,
        help="GPUs, one worker each, per machine (default: cluster.nproc, else 8); not for "
        'a CPU job (cluster.device = "cpu")',
    )
    p.add_argument(
        "--cpus-per-node",
        type=int,
        help="CPUs per machine (default on a CPU job: one per worker, cluster.nproc)",
    )
    p.add_argument("--min-nodes", type=int, help="elastic: the fewest machines to train on")
    p.add_argument("--port", type=int, default=29400, help="rendezvous port (default 29400)")
    p.add_argument("--name", help="job name (default: the config file's name)")
    p.add_argument(
        "--set",
        metavar="KEY=VALUE",
        action="append",
        default=[],
        help="override a key on every node, e.g. --set optim.lr=3e-4 (repeatable)",
    )


def _add_output(p: argparse.ArgumentParser) -> None:
    out = p.add_mutually_exclusive_group(required=True)
    out.add_argument("-o", "--output", metavar="FILE", help="write the file here")
    out.add_argument("--print", dest="to_stdout", action="store_true", help="write to stdout")


def _usage(p: argparse.ArgumentParser) -> int:
    p.print_help(sys.stderr)
    return 2


def build_job(args: argparse.Namespace, scheduler: str, **extra: object):
    """Read and check the job file and the generator's input; the ClusterJob to render."""
    from trainwise.run.launch.schedulers import (
        ClusterJob,
        check_cluster_job,
        default_job_name,
        job_run_dir,
        node_resources,
    )

    path = Path(args.config)
    keys = read_toml(path)  # a missing or malformed file: one line naming it
    # The job file as written (with --set): whether it trains on CPUs, and its workers.
    nproc, gpus, cpus = node_resources(
        load_config(path, {}, list(args.set)), args.gpus_per_node, args.cpus_per_node, str(path)
    )
    job = ClusterJob(
        name=args.name or default_job_name(path.stem),
        config_text=tomli_w.dumps(keys),  # the keys, not the comments around them
        nodes=args.nodes,
        nproc=nproc,
        gpus_per_node=gpus,
        cpus_per_node=cpus,
        min_nodes=args.min_nodes,
        port=args.port,
        sets=tuple(args.set),
        **extra,  # type: ignore[arg-type]
    )
    check_cluster_job(job, scheduler)
    # The job as every node will run it: the same file, machine counts and --set.
    flags = {
        "cluster.nodes": job.nodes,
        "cluster.min_nodes": job.min_nodes,
        "cluster.nproc": job.nproc,
        "logging.run_dir": job_run_dir(job, scheduler),
    }
    names = {
        "cluster.nodes": "--nodes",
        "cluster.min_nodes": "--min-nodes",
        "cluster.nproc": "--gpus-per-node",
        "logging.run_dir": "--run-dir",
    }
    cfg = load_config(path, flags, list(args.set), flag_names=names)
    # An elastic range must keep its global batch on every machine count (as train checks).
    from trainwise.run.job.resolve import elastic_accum

    _, problem = elastic_accum(cfg, job.nodes * job.nproc, job.nproc)
    if problem:
        raise ConfigError(problem.replace("--nnodes", "--min-nodes/--nodes"))
    return job


def run_slurm(args: argparse.Namespace) -> int:
    from trainwise.run.launch.schedulers import slurm_script

    job = build_job(
        args, "slurm", run_dir=args.run_dir, partition=args.partition, time=args.time,
        account=args.account, python=args.python or sys.executable,
    )
    return _emit(args, slurm_script(job), "an sbatch script", "sbatch")


def run_k8s(args: argparse.Namespace) -> int:
    from trainwise.run.launch.schedulers import pytorchjob_manifest

    job = build_job(
        args, "k8s", image=args.image, max_restarts=args.max_restarts, pvc=args.pvc,
        storage=args.storage, memory_per_node=args.memory_per_node,
    )
    return _emit(args, pytorchjob_manifest(job), "a PyTorchJob manifest", "kubectl apply -f")


def _emit(args: argparse.Namespace, text: str, what: str, submit: str) -> int:
    if args.to_stdout:
        sys.stdout.write(text)
        return 0
    out = Path(args.output)
    try:
        out.write_text(text)
    except OSError as err:
        raise ConfigError(
            f"-o {out}: cannot write ({err.strerror}): give a writable path"
        ) from None
    print(f"trainwise: wrote {what} to {out}; submit it with: {submit} {out}")
    return 0
