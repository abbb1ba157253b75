"""What ties a worker to the launch that started it.

The launcher hands its workers, through their environment, the resolved config (they never
re-read the run directory's config.toml, which a later launch could rewrite) and a launch
record: its pid, its start time, a scratch folder outside the run directory, and what it
computed once for all of them (a LoRA run's frozen-base id: each worker would read every
weight to compute it again). A worker
that hits an error no restart can fix writes `fatal.json` there (it still works when the
run directory's disk is full); its peers and any restarted worker see it and exit at once,
and the launcher reports it. Each worker also asks the kernel for a signal of its own
(LAUNCHER_GONE) when its launcher dies (PR_SET_PDEATHSIG; a watchdog thread where there is
none): the preemption path then saves and exits, so no worker outlives its launcher. It is
not SIGTERM because the kernel sends it once per exiting thread of the launcher: repeats of
it are one event, while a second SIGTERM means "exit now".
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainwise.whole_file import write_whole

LAUNCH_ENV = "TRAINWISE_LAUNCH"
CONFIG_ENV = "TRAINWISE_CONFIG"
FATAL_FILE = "fatal.json"
PR_SET_PDEATHSIG = 1  # linux/prctl.h
WATCHDOG_S = 1.0
LAUNCHER_GONE = signal.SIGUSR2  # what a worker receives when its launcher dies


@dataclass(frozen=True)
class Launch:
    pid: int  # the launcher, parent of the workers
    since: float  # unix time the launch began: its events are those after it
    scratch: Path
    base_weights: str | None = None  # registry.base_weights_id, computed by the launcher

    def record_fatal(self, message: str, exit_status: int, rank: int) -> None:
        """The first fatal error of the launch, whole or not at all."""
        path = self.scratch / FATAL_FILE
        if path.exists():
            return
        write_whole(path, json.dumps({"message": message, "exit_status": exit_status,
                                      "rank": rank}))

    def fatal(self) -> dict[str, Any] | None:
        try:
            return json.loads((self.scratch / FATAL_FILE).read_text())
        except (OSError, ValueError):
            return None


def start_launch(config_toml: str, base_weights: str | None = None) -> Launch:
    """A new launch from this process: its record and the config, in the environment the
    elastic agent passes on to every worker it starts."""
    scratch = Path(tempfile.mkdtemp(prefix="trainwise-launch-"))
    launch = Launch(os.getpid(), time.time(), scratch, base_weights)
    os.environ[LAUNCH_ENV] = json.dumps(
        {"pid": launch.pid, "since": launch.since, "scratch": str(launch.scratch),
         "base_weights": base_weights}
    )
    os.environ[CONFIG_ENV] = config_toml
    return launch


def end_launch(launch: Launch) -> None:
    shutil.rmtree(launch.scratch, ignore_errors=True)
    for name in (LAUNCH_ENV, CONFIG_ENV):
        os.environ.pop(name, None)


def this_launch() -> Launch | None:
    """The launch this worker belongs to; None outside trainwise's launcher."""
    text = os.environ.get(LAUNCH_ENV)
    if not text:
        return None
    held = json.loads(text)
    return Launch(
        int(held["pid"]), float(held["since"]), Path(held["scratch"]), held.get("base_weights")
    )


def die_with_launcher(launch: Launch) -> None:
    """LAUNCHER_GONE to this process when the launcher dies, by any signal, SIGKILL included."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(LAUNCHER_GONE), 0, 0, 0) == 0:
            if os.getppid() != launch.pid:  # it died before the request took effect
                os.kill(os.getpid(), LAUNCHER_GONE)
            return
    threading.Thread(target=_watch_parent, args=(launch.pid,), daemon=True).start()


def _watch_parent(pid: int) -> None:
    while os.getppid() == pid:
        time.sleep(WATCHDOG_S)
    os.kill(os.getpid(), LAUNCHER_GONE)
