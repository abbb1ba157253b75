"""A worker's start-up leaves no gloo group behind: each gloo group keeps a thread that
wakes every 10 ms (gloo's event loop), taking a core from the training step for the whole
run; `destroy_process_group` alone stops it only once nothing references the group. A
gloo job's host-side collectives (control flags, checkpoint I/O) run on its own group.

Checked in a fresh interpreter, as a worker starts: in the test process, what earlier tests
left (their groups, objects that reference them) would decide the count instead. Every
thread the check leaves alive is counted, whatever its name: counted by gloo's thread name,
2 of 8 concurrent runs on a loaded machine missed a loop that had not yet named itself."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from helpers import hang_limit

CHECK = r"""
import json, os
import torch.distributed as dist
from trainwise.config import load_config
from trainwise.run.engine.worker import check_versions
from trainwise.run.job.distributed import free_port, host_group

def threads():
    # Every live thread's id. Not by name: a thread names itself ("gloo_tcp_loop") once it
    # runs, so under load a just-started one still bears the process's name.
    return set(os.listdir("/proc/self/task"))

store = dist.TCPStore("127.0.0.1", free_port(), 1, is_master=True)
dist.init_process_group("gloo", store=store, rank=0, world_size=1)
before = threads()
check_versions(load_config(None), local_rank=0)
left = len(threads() - before)
host = host_group(60.0)  # the control flags' and checkpoint's group: the job's own
shared = host is dist.group.WORLD and len(threads() - before) == 0
kept = dist.new_group(backend="gloo")  # the count sees a group that stays
seen = len(threads() - before)
dist.destroy_process_group(kept)
dist.destroy_process_group()
print(json.dumps({"left": left, "seen": seen, "shared": shared}))
"""


@pytest.mark.timeout(hang_limit(launches=1, procs=1))
def test_the_version_check_leaves_no_gloo_thread_and_the_host_group_adds_none():
    done = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True,
                          timeout=hang_limit(launches=1, procs=1))
    assert done.returncode == 0, done.stderr[-2000:]
    counts = json.loads(done.stdout.strip().splitlines()[-1])
    assert counts["left"] == 0 and counts["seen"] >= 1, counts
    assert counts["shared"], "a gloo job's host-side collectives made a group of their own"
