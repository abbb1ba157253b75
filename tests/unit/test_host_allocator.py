"""A CPU job's workers keep what a step frees (run/engine/host_allocator.py): measured in
page faults, in a fresh process each, as a step's buffers come and go."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from limits import hang_limit
from trainwise.run.engine.host_allocator import (
    USER_KEYS,
    WORKER_KEY,
    glibc,
    keep_freed_host_memory,
)

# A step's worth of buffers (8 x 4 MiB, freed together), eight times: glibc, left to
# itself, gives the top of its heap back each time and faults the pages in again.
STEPS = """
import resource, sys, torch
from trainwise.run.engine.host_allocator import keep_freed_host_memory
fixed = keep_freed_host_memory(sys.argv[1])
def step():
    bufs = [torch.empty(1 << 20).fill_(1.0) for _ in range(8)]
    del bufs
step(); step()  # the first steps map what the rest may reuse
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(8):
    step()
print(fixed, (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 8)
"""


PAGES_A_STEP = 8 * (4 << 20) // 4096


def faults_a_step(device_type: str, worker: bool = True) -> tuple[bool, float]:
    env = {k: v for k, v in os.environ.items() if k not in (*USER_KEYS, WORKER_KEY)}
    if worker:  # as the elastic agent starts a worker
        env[WORKER_KEY] = "job"
    done = subprocess.run([sys.executable, "-c", STEPS, device_type], env=env,
                          capture_output=True, text=True, check=True,
                          timeout=hang_limit())
    fixed, faults = done.stdout.split()
    return fixed == "True", float(faults)


@pytest.mark.skipif(not glibc(), reason="glibc's malloc only")
def test_a_cpu_job_reuses_its_freed_buffers_without_page_faults():
    fixed, faults = faults_a_step("cpu")
    # 32 MiB a step is 8,192 pages, all faulted again without the fix (8,160 measured);
    # with it, what is left is the interpreter's own (a few dozen to 130 measured).
    assert fixed and faults < PAGES_A_STEP / 20
    # A GPU job's process, and the user's own (no launcher), are left as glibc sets them.
    assert faults_a_step("cuda")[0] is False
    assert faults_a_step("cpu", worker=False)[0] is False


@pytest.mark.parametrize(("key", "value"), [
    ("MALLOC_TRIM_THRESHOLD_", "0"), ("GLIBC_TUNABLES", "glibc.malloc.trim_threshold=0"),
])
def test_a_threshold_the_user_set_is_kept(monkeypatch, key, value):
    monkeypatch.setenv(WORKER_KEY, "job")
    monkeypatch.setenv(key, value)
    assert keep_freed_host_memory("cpu") is False
