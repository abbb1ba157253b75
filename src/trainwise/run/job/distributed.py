"""The worker's place in the job (rank, world, local rank) and the process group.

Ranks come from torchrun's variables, or from Slurm's when started with srun; a worker
started by `trainwise train --nproc N` gets torchrun's variables from the elastic agent.
"""

from __future__ import annotations

import gc
import logging
import os
import socket
import struct
import sys
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

_STORE: dist.Store | None = None  # the job's rendezvous store (init_process_group)


@dataclass(frozen=True)
class DistEnv:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    local_world: int = 1
    launched: bool = False  # True when a launcher (torchrun, srun, our agent) set the ranks
    attempt: int = 0  # the elastic agent's restart count: 0 on a new launch

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def dist_env_from(environ: dict[str, str] | None = None) -> DistEnv:
    env = os.environ if environ is None else environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return DistEnv(
            rank=int(env["RANK"]),
            world=int(env["WORLD_SIZE"]),
            local_rank=int(env.get("LOCAL_RANK", 0)),
            local_world=int(env.get("LOCAL_WORLD_SIZE", env["WORLD_SIZE"])),
            launched=True,
            attempt=int(env.get("TORCHELASTIC_RESTART_COUNT", "0")),
        )
    # Only inside an srun step (SLURM_STEP_ID): the batch script of an allocation has
    # SLURM_PROCID=0 too, and must not wait for ranks that were never started.
    if "SLURM_STEP_ID" in env and "SLURM_PROCID" in env and int(env.get("SLURM_NTASKS", "1")) > 1:
        return DistEnv(
            rank=int(env["SLURM_PROCID"]),
            world=int(env["SLURM_NTASKS"]),
            local_rank=int(env.get("SLURM_LOCALID", 0)),
            local_world=int(env.get("SLURM_NTASKS_PER_NODE", "1").split("(")[0]),
            launched=True,
        )
    return DistEnv()


def network_line(environ: dict[str, str] | None = None) -> str:
    """Which interface this worker's collectives use, for the start-up log: the one gloo /
    NCCL were told to use, else the one holding the address that reaches the rendezvous."""
    env = os.environ if environ is None else environ
    chosen = env.get("GLOO_SOCKET_IFNAME") or env.get("NCCL_SOCKET_IFNAME")
    if chosen:
        return f"interface {chosen} (cluster.socket_ifname)"
    master = env.get("MASTER_ADDR", "127.0.0.1")
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((master, int(env.get("MASTER_PORT", "1"))))  # UDP: nothing is sent
            address = s.getsockname()[0]
    except (OSError, ValueError):
        return f"route to {master} unknown"
    name = interface_of(address)
    return f"interface {name or '?'} ({address}) towards {master}"


def interface_of(address: str) -> str | None:
    """The name of this machine's interface holding the IPv4 `address` (Linux; else None)."""
    try:
        import fcntl
    except ImportError:
        return None
    siocgifaddr = 0x8915
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), siocgifaddr, struct.pack("256s", name[:15].encode()))
            except OSError:  # no IPv4 address on it
                continue
            if socket.inet_ntoa(raw[20:24]) == address:
                return name
    return None


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_process_group(
    env: DistEnv, backend: str, device: torch.device, timeout_s: float = 600.0
) -> None:
    """Join the job's process group (a group of one when not launched, so that DDP and
    FSDP can run in a single process). A collective not done after `timeout_s` raises."""
    if dist.is_initialized():
        return
    if not env.launched:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
    elif "MASTER_ADDR" not in os.environ:
        # srun sets no rendezvous address; on one node the loopback is right.
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ.setdefault("MASTER_PORT", "29500")
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    timeout = timedelta(seconds=timeout_s)
    # The rendezvous init_process_group would do itself (env://: torchrun's agent store, or
    # rank 0's), done here so that the job keeps the store: torch exposes the default
    # group's store only under a private name. Prefixed as torch prefixes its own.
    store, rank, world = next(dist.rendezvous("env://", env.rank, env.world, timeout=timeout))
    store.set_timeout(timeout)
    store = dist.PrefixStore("default_pg", store)
    dist.init_process_group(
        backend=backend, store=store, rank=rank, world_size=world, timeout=timeout, **kwargs
    )
    global _STORE
    _STORE = store


def host_group(timeout_s: float) -> dist.ProcessGroup:
    """The group for the host-side collectives a worker issues from its main thread, in
    the same order on every rank (the control flags, a synchronous checkpoint's I/O).
    The job's own group when it is gloo: a gloo group runs operations in the order they
    are issued, which these already keep with training's, and every extra gloo group
    holds an event loop that wakes every 10 ms on every rank (three idle ones cost a
    2-worker FSDP loop 12 % of its tokens/s: docs/development.md). Under NCCL a gloo side
    group, as these exchange CPU tensors."""
    if dist.get_backend() == "gloo":
        return dist.group.WORLD
    return side_group(timeout_s)


def job_store() -> dist.Store | None:
    """The store the job's process group met on (torchrun's agent store, or rank 0's),
    for host-side agreements that need no process group: it outlives a failed collective.
    None where init_process_group above did not make the group (the caller's own group, or
    none): peers.absent_ranks then answers "unknown"."""
    return _STORE


def side_group(timeout_s: float) -> dist.ProcessGroup:
    """A gloo group of all ranks beside the training group (an async save's collectives,
    the host-side ones under NCCL, the version check, the doctor's): gloo matches
    operations by order, so background work needs its own group. (A failed collective's
    diagnosis needs none: peers.absent_ranks checks in on job_store.)
    It takes the run's collective timeout; new_group's default would be 30 minutes."""
    return dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))


def destroy_process_group() -> None:
    """Leave the job: wait for every rank, then tear the group down."""
    if dist.is_initialized():
        # Wrapped models keep their groups' pending work alive through reference cycles;
        # left to interpreter exit, gloo's threads can abort the process. Free them now.
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()
    global _STORE
    _STORE = None  # its group is gone; rank 0's store server goes with the last reference


def get_logger(env: DistEnv) -> logging.Logger:
    """Rank 0 logs at INFO; the other ranks log warnings only, prefixed with their rank."""
    log = logging.getLogger("trainwise")
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        prefix = "" if env.is_main else f"[rank{env.rank}] "
        handler.setFormatter(logging.Formatter(prefix + "%(levelname)s %(message)s"))
        log.addHandler(handler)
        log.propagate = False
    log.setLevel(logging.INFO if env.is_main else logging.WARNING)
    return log
