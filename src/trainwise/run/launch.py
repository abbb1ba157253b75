"""Starting the workers through torchrun's elastic agent (single node in this release).

The agent runs `python -m trainwise.run.worker RUN_DIR` per worker with torchrun's
variables set; the workers inherit this terminal, so their output and tracebacks reach
the user directly. A failed worker surfaces here as a LaunchError naming its rank.
"""

from __future__ import annotations

import os
import sys
import uuid
from pathlib import Path

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from trainwise.errors import TrainwiseError


class LaunchError(TrainwiseError):
    """A worker failed; the message names the rank, the exit code and the error."""


def launch_workers(
    run_dir: Path, nproc: int, master_port: int | None = None, max_restarts: int = 0
) -> None:
    # Each worker gets its share of the cores, not all of them (oversubscription on CPU).
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"trainwise-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{master_port or 0}",
        max_restarts=max_restarts,
        monitor_interval=0.1,
        start_method="spawn",
    )
    try:
        elastic_launch(config, entrypoint=sys.executable)(
            "-m", "trainwise.run.worker", str(run_dir)
        )
    except ChildFailedError as err:
        rank, failure = err.get_first_failure()
        message = failure.message
        if isinstance(message, dict):
            message = message.get("message", "")
        first = str(message).strip().splitlines()[-1] if message else "see its traceback above"
        raise LaunchError(
            f"worker rank {rank} failed with exit code {failure.exitcode}: {first}"
        ) from None
