"""A worker's start-up leaves no gloo group behind: each gloo group keeps a thread that
wakes every 10 ms (gloo's event loop), taking a core from the training step for the whole
run; `destroy_process_group` alone stops it only once nothing references the group."""

from __future__ import annotations

import os

import torch.distributed as dist

from trainwise.config import load_config
from trainwise.run.engine.worker import check_versions
from trainwise.run.job.distributed import free_port


def gloo_loops() -> set[str]:
    """The ids of the live threads of gloo's event loops in this process (one per gloo
    group; by id, so that a thread of an earlier test ending meanwhile changes nothing)."""
    found = set()
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as comm:
                if comm.read().strip() == "gloo_tcp_loop":
                    found.add(tid)
        except OSError:  # the thread ended meanwhile
            continue
    return found


def test_the_version_check_leaves_no_gloo_thread_running():
    store = dist.TCPStore("127.0.0.1", free_port(), 1, is_master=True)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        before = gloo_loops()
        check_versions(load_config(None), local_rank=0)
        assert gloo_loops() - before == set()
        kept = dist.new_group(backend="gloo")  # the count sees a group that stays
        assert len(gloo_loops() - before) == 1
        dist.destroy_process_group(kept)
    finally:
        dist.destroy_process_group()
