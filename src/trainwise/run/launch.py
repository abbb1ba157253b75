"""Starting this machine's workers through torchrun's elastic agent (c10d rendezvous).

The agent runs `python -m trainwise.run.worker RUN_DIR` per worker with torchrun's
variables set; the workers inherit this terminal, so their output and tracebacks reach
the user directly. When a worker dies the agent restarts the whole group (up to
`max_restarts` times) and the workers resume from the last checkpoint; each failure is
appended to the run's events. A failed run surfaces here as a LaunchError naming the rank.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
import uuid
from pathlib import Path

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from trainwise.config.schema import ClusterConfig
from trainwise.errors import TrainwiseError
from trainwise.run.events import append_event, read_events

# Set for the workers: a worker that hits an error no restart can fix records it and exits
# 0, so that the agent does not restart the group for nothing; the launcher reports it.
LAUNCHER_ENV = "TRAINWISE_LAUNCHER"
# The agent forwards these to the workers; SIGUSR1 is what `sbatch --signal` usually sends.
HANDLED_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"
SHUTDOWN_GRACE_S = 120  # how long a signalled worker may take to save before SIGKILL


class LaunchError(TrainwiseError):
    """A worker failed; the message names the rank, the exit code and the error."""


class Preempted(TrainwiseError):  # noqa: N818 - an outcome, reported with exit status 0
    """The run was stopped by a signal after saving a checkpoint."""


class _FailureEvents(logging.Handler):
    """Turns the agent's "worker failed" log record into a `failure` event (the agent
    keeps no other record of failures it restarts from)."""

    def __init__(self, run_dir: Path):
        super().__init__(logging.ERROR)
        self.run_dir = run_dir

    def emit(self, record: logging.LogRecord) -> None:
        if not str(record.msg).startswith("failed (exitcode") or len(record.args or ()) < 3:
            return
        exitcode, local_rank, pid = record.args[:3]  # type: ignore[index]
        sig = None
        if isinstance(exitcode, int) and exitcode < 0:
            try:
                sig = signal.Signals(-exitcode).name
            except ValueError:
                sig = str(-exitcode)
        append_event(
            self.run_dir, "failure", rank=local_rank, exit_code=exitcode, signal=sig, pid=pid
        )


def launch_workers(
    run_dir: Path,
    nproc: int,
    master_port: int | None = None,
    max_restarts: int = 0,
    module: str = "trainwise.run.worker",
    cluster: ClusterConfig | None = None,
) -> None:
    """`python -m MODULE RUN_DIR` on `nproc` workers of this machine under the elastic
    agent; with `cluster.nodes` > 1, one machine of several meeting at its c10d
    rendezvous (cluster.rdzv_endpoint, cluster.rdzv_id)."""
    c = cluster or ClusterConfig()
    # Each worker gets its share of the cores, not all of them (oversubscription on CPU).
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    os.environ[LAUNCHER_ENV] = "1"
    if c.socket_ifname:
        os.environ["GLOO_SOCKET_IFNAME"] = os.environ["NCCL_SOCKET_IFNAME"] = c.socket_ifname
    # A restarted group sharing the rendezvous store with the failed one can read its stale
    # addresses and fail to connect (pytorch/pytorch#135712): one fresh store per attempt.
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    config = LaunchConfig(
        min_nodes=c.min_nodes or c.nodes,
        max_nodes=c.nodes,
        nproc_per_node=nproc,
        run_id=c.rdzv_id or f"trainwise-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint=c.rdzv_endpoint or f"127.0.0.1:{master_port or 0}",
        rdzv_configs=rdzv_configs(c),
        local_addr=c.local_addr,
        max_restarts=max_restarts,
        monitor_interval=0.1,
        start_method="spawn",
        shutdown_timeout=SHUTDOWN_GRACE_S,
        signals_to_handle=HANDLED_SIGNALS,  # LaunchConfig sets TORCHELASTIC_SIGNALS_TO_HANDLE
    )
    handler = _FailureEvents(run_dir)
    agent_log = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    agent_log.addHandler(handler)
    started = time.time()
    try:
        elastic_launch(config, entrypoint=sys.executable)("-m", module, str(run_dir))
    except SignalException as err:
        stopped = _events_since(run_dir, started, "preempted")
        if stopped:
            raise Preempted(
                f"preempted by {stopped[-1].get('signal')} after step {stopped[-1].get('step')}; "
                "the checkpoint is saved: run the same command again to resume"
            ) from None
        raise LaunchError(f"stopped by {signal.Signals(err.sigval).name} before a save") from None
    except ChildFailedError as err:
        rank, failure = err.get_first_failure()
        message = failure.message
        if isinstance(message, dict):
            message = message.get("message", "")
        first = str(message).strip().splitlines()[-1] if message else "see its traceback above"
        raise LaunchError(
            f"worker rank {rank} failed with exit code {failure.exitcode}: {first}"
        ) from None
    finally:
        agent_log.removeHandler(handler)
    fatal = _events_since(run_dir, started, "fatal")
    if fatal:
        error = LaunchError(fatal[-1].get("message", "a worker stopped the run"))
        error.exit_status = fatal[-1].get("exit_status", 1)  # 2: the job cannot run as given
        raise error
    stopped = _events_since(run_dir, started, "preempted")
    if stopped:
        raise Preempted(
            f"preempted by {stopped[-1].get('signal')} after step {stopped[-1].get('step')}; "
            "the checkpoint is saved: run the same command again to resume"
        )


def rdzv_configs(c: ClusterConfig) -> dict[str, object]:
    """The c10d rendezvous' timing (torchrun's --rdzv-conf keys)."""
    conf: dict[str, object] = {
        "join_timeout": c.rdzv_timeout_s,
        "last_call_timeout": c.rdzv_last_call_s,
        "keep_alive_interval": max(1, c.node_timeout_s // 3),
        "keep_alive_max_attempt": 3,
    }
    if c.node_rank is not None:
        conf["is_host"] = c.node_rank == 0
    return conf


def _events_since(run_dir: Path, since: float, kind: str) -> list[dict]:
    return [e for e in read_events(run_dir) if e["kind"] == kind and e["time"] >= since]
