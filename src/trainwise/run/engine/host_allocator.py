"""glibc's malloc on a CPU job: keep what a step frees for the next step.

A step on the CPU allocates and frees the same large buffers every time (FSDP's gathered
parameters and gradients, activations, the optimizer's temporaries). glibc maps a buffer
above its mmap threshold fresh on each allocation, and gives the top of its heap back to
the kernel once more than its trim threshold lies free there; both thresholds move with
what the process freed before. Either way the next step touches new pages: a page fault
and a page zeroed by the kernel for each 4 KiB. On the small model under fsdp 2 that was
1,800 to 8,800 faults a step of a worker against the hand-written loop's 520 to 1,500,
whose heap happened to keep more of its buffers (bench/step_threads.py counts them).
Fixed thresholds keep the step's buffers in the heap (as the CUDA caching allocator keeps
a GPU's) and stop glibc from moving them. Only in a worker a launcher started for the job
(torchrun's elastic agent, which trainwise's launcher runs too): a run in the user's own
Python process (the API's one-worker run) leaves its allocator as it was, since the
setting would outlast the job. Not on a GPU job: its large buffers are device memory. A
threshold the user set (MALLOC_*_, or glibc.malloc in GLIBC_TUNABLES) is kept.
"""

from __future__ import annotations

import ctypes
import os

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
# glibc's largest mmap threshold (HEAP_MAX_SIZE / 2 on 64-bit): larger buffers stay mapped.
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 1 << 30  # free memory kept at the heap's top before it is given back
USER_KEYS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")
WORKER_KEY = "TORCHELASTIC_RUN_ID"  # set by the elastic agent in every worker it starts


def keep_freed_host_memory(device_type: str) -> bool:
    """Fix glibc's thresholds in a launched worker of a CPU job (Linux with glibc).
    Returns whether they were set."""
    if device_type != "cpu" or WORKER_KEY not in os.environ or not glibc():
        return False
    if any(key in os.environ for key in USER_KEYS):
        return False
    if "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", ""):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    )


def glibc() -> bool:
    """Whether this process runs on GNU libc."""
    try:
        return os.confstr("CS_GNU_LIBC_VERSION").startswith("glibc")
    except (ValueError, OSError, AttributeError):  # not a GNU system
        return False
