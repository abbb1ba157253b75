"""Starting this machine's workers through torchrun's elastic agent (c10d rendezvous).

The agent runs `python -m trainwise.run.engine.worker RUN_DIR` per worker with torchrun's
variables set; the workers inherit this terminal, so their output and tracebacks reach
the user directly. When a worker dies the agent restarts the whole group (up to
`max_restarts` times) and the workers resume from the last checkpoint; each failure is
appended to the run's events. A failed run surfaces here as a LaunchError naming the rank.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import uuid
from collections.abc import Mapping
from pathlib import Path

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from trainwise.config.schema import ClusterConfig
from trainwise.errors import LaunchError, TrainwiseError
from trainwise.run.checkpoint.store import find_latest_valid
from trainwise.run.engine.control import stop_status
from trainwise.run.job.lifeline import Launch
from trainwise.run.observe.events import append_event, read_events
from trainwise.run.observe.hang import enable_flight_recorder, flight_recorder_env

# The agent forwards these to the workers: SIGUSR1 is what `sbatch --signal` usually
# sends, SIGINT is Ctrl-C, SIGHUP a closed terminal; each makes the workers save and stop.
HANDLED_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"
SHUTDOWN_GRACE_S = 120  # how long a signalled worker may take to save before SIGKILL


class Preempted(TrainwiseError):  # noqa: N818 - an outcome: saved, not finished
    """The run was stopped by a signal after saving a checkpoint (its `preempted` event);
    its exit status is 128 + the signal (control.stop_status), never 0. `run_dir` is the
    run it stopped (set by start_job)."""

    run_dir: Path | None = None

    def __init__(self, event: dict):
        super().__init__(f"stopped by {event.get('signal')} after step {event.get('step')}")
        self.event = event
        self.exit_status = stop_status(event.get("signal"))


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
        with contextlib.suppress(OSError):  # a full disk: the launcher's last line says so
            append_event(
                self.run_dir, "failure", rank=local_rank, exit_code=exitcode, signal=sig, pid=pid
            )


class _QuietStops(logging.Filter):
    """Drops the agent's lines about forwarding a stop signal: the workers' own line and
    the launcher's last line say what happened (a user's Ctrl-C gets no log noise)."""

    NOISE = ("Received %s death signal", "Sending process %s closing signal")

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.NOISE)


QUIET_STOPS = _QuietStops()
AGENT_LOGGERS = (
    "torch.distributed.elastic.agent.server.api",
    "torch.distributed.elastic.multiprocessing.api",
)


def launch_workers(
    run_dir: Path,
    nproc: int,
    launch: Launch,
    master_port: int | None = None,
    max_restarts: int = 0,
    module: str = "trainwise.run.engine.worker",
    cluster: ClusterConfig | None = None,
    checkpoints: Path | None = None,
    device_kind: str = "cpu",
) -> None:
    """`python -m MODULE RUN_DIR` on `nproc` workers of this machine under the elastic
    agent; with `cluster.nodes` > 1, one machine of several meeting at its c10d
    rendezvous (cluster.rdzv_endpoint, cluster.rdzv_id). `launch` (lifeline) carries the
    config to the workers and their fatal errors back; a failure names the newest valid
    checkpoint under `checkpoints`. The workers inherit this process's environment, with
    `worker_environment` added for a job on `device_kind`."""
    c = cluster or ClusterConfig()
    os.environ.update(worker_environment(run_dir, nproc, c, device_kind, os.environ))
    if device_kind == "cuda":
        enable_flight_recorder(run_dir)  # the folder NCCL's dumps go into
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
    for name in AGENT_LOGGERS:
        logging.getLogger(name).addFilter(QUIET_STOPS)
    # The agent installs its handlers of HANDLED_SIGNALS and leaves them: a process that
    # goes on after the run (a notebook, a script) gets its own back.
    handlers = kept_signal_handlers()
    try:
        elastic_launch(config, entrypoint=sys.executable)("-m", module, str(run_dir))
    except SignalException as err:
        _raise_outcome(run_dir, launch)
        if _events_since(run_dir, launch.since, "finish"):
            return  # the signal came after the last step, in teardown: the run finished
        stopped = LaunchError(
            f"stopped by {signal.Signals(err.sigval).name} before a save; "
            f"{resume_line(checkpoints)}"
        )
        stopped.exit_status = 128 + int(err.sigval)  # as a shell reports a signalled job
        raise stopped from None
    except ChildFailedError as err:
        _raise_outcome(run_dir, launch)  # a fatal error can end in a failure too
        rank, failure = err.get_first_failure()
        message = failure.message
        if isinstance(message, dict):
            message = message.get("message", "")
        first = str(message).strip().splitlines()[-1] if message else "see its traceback above"
        raise LaunchError(
            f"worker rank {rank} failed with exit code {failure.exitcode}: {first}; "
            f"{restarts_line(max_restarts)}; {resume_line(checkpoints)}"
        ) from None
    finally:
        agent_log.removeHandler(handler)
        for name in AGENT_LOGGERS:
            logging.getLogger(name).removeFilter(QUIET_STOPS)
        for sig, previous in handlers.items():
            signal.signal(sig, previous)
    _raise_outcome(run_dir, launch)


def kept_signal_handlers() -> dict[signal.Signals, object]:
    """This process's handlers of HANDLED_SIGNALS, to restore after the agent (only the
    main thread sets handlers; elsewhere the agent sets none either)."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    signals = [signal.Signals[name] for name in HANDLED_SIGNALS.split(",")]
    return {sig: signal.getsignal(sig) for sig in signals}


def worker_environment(
    run_dir: Path, nproc: int, cluster: ClusterConfig, device_kind: str,
    environ: Mapping[str, str],
) -> dict[str, str]:
    """The variables the launcher adds to `environ` for its `nproc` workers: their share of
    the cores, the network interface, a fresh rendezvous store per attempt and, on CUDA,
    NCCL's flight recorder writing into RUN/hang/. A variable the user set keeps its value
    (the interface excepted: cluster.socket_ifname is the user's too)."""
    added = {
        # Each worker its share of the cores, not all of them (oversubscription on CPU).
        "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // nproc)),
        # A restarted group sharing the rendezvous store with the failed one can read its
        # stale addresses and fail to connect (pytorch/pytorch#135712).
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
    }
    added = {k: v for k, v in added.items() if k not in environ}
    if cluster.socket_ifname:
        added["GLOO_SOCKET_IFNAME"] = added["NCCL_SOCKET_IFNAME"] = cluster.socket_ifname
    if device_kind == "cuda":
        added |= flight_recorder_env(run_dir, environ)
    return added


def _raise_outcome(run_dir: Path, launch: Launch) -> None:
    """A fatal error of a worker (LaunchError with its exit status), or a stop after a
    save (Preempted): how this launch ended, when it did not simply finish."""
    fatal = launch.fatal()
    if fatal:
        error = LaunchError(fatal.get("message", "a worker stopped the run"))
        error.exit_status = fatal.get("exit_status", 1)  # 2: the job cannot run as given
        raise error
    stopped = _events_since(run_dir, launch.since, "preempted")
    if stopped:
        raise Preempted(stopped[-1])


def restarts_line(max_restarts: int) -> str:
    if max_restarts == 0:
        return "no restarts allowed (checkpoint.max_restarts = 0)"
    return f"all {max_restarts} restarts of checkpoint.max_restarts are used up"


def resume_line(checkpoints: Path | None) -> str:
    """Where a run that stopped resumes from: the newest checkpoint whose files check out."""
    newest, _ = find_latest_valid(checkpoints, "fast") if checkpoints else (None, [])
    if newest is None:
        return "no valid checkpoint was written: running the same command again starts over"
    return f"the newest valid checkpoint is {newest.path}: run the same command again to resume"


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
