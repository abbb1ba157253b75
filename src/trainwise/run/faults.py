"""Fault injection points for tests: the real failure comes from outside (the test sends
SIGKILL to a pid, fills a disk, flips bytes); these points only make *when* deterministic.

`TRAINWISE_FAULTS` holds `;`-separated faults `KIND@key=value,...`:
- `pause@step=N,rank=R`: after step N, rank R writes `RUN_DIR/faults/pause-step-N.pid` and
  waits to be killed (or until `seconds`, default forever).
- `pause_in_save@step=N,rank=R`: the same, inside the save of step N, after this rank's
  shards are written and before the commit.
- `nan@step=N`: the loss of step N is multiplied by NaN on every rank.
- `hang@step=N,rank=R,seconds=S`: rank R sleeps S seconds before step N's collectives.
- `slow_data@seconds=S`: every training sample takes S seconds more to load.
- `slow_network@gbps=G`: DDP's gradient all-reduce waits as if its link carried G GB/s
  (nothing on one rank): a job made to scale badly.
Each fires once, on the first attempt only (TORCHELASTIC_RESTART_COUNT = 0): a transient
fault, so that a rollback or a restart gets past it. `always=1` fires it every time the
step is reached, on every attempt: a fault that repeats.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch.utils.data import Dataset

ENV = "TRAINWISE_FAULTS"


@dataclass(frozen=True)
class Fault:
    kind: str
    step: int
    rank: int | None = None
    seconds: float | None = None
    gbps: float | None = None
    always: bool = False


def parse_faults(text: str) -> list[Fault]:
    faults = []
    for item in filter(None, (part.strip() for part in text.split(";"))):
        kind, _, args = item.partition("@")
        values = dict(pair.split("=", 1) for pair in args.split(",") if pair)
        faults.append(
            Fault(
                kind=kind,
                step=int(values.get("step", 0)),
                rank=int(values["rank"]) if "rank" in values else None,
                seconds=float(values["seconds"]) if "seconds" in values else None,
                gbps=float(values["gbps"]) if "gbps" in values else None,
                always=values.get("always") == "1",
            )
        )
    return faults


class Faults:
    def __init__(self, rank: int, run_dir: Path, environ: dict[str, str] | None = None):
        env = os.environ if environ is None else environ
        self.rank = rank
        self.run_dir = run_dir
        self.attempt = int(env.get("TORCHELASTIC_RESTART_COUNT", "0"))
        self.faults = parse_faults(env.get(ENV, ""))
        self.fired: set[Fault] = set()

    def fires(self, kind: str, step: int) -> Fault | None:
        for f in self.faults:
            mine = f.kind == kind and f.step == step and f.rank in (None, self.rank)
            if mine and (f.always or (self.attempt == 0 and f not in self.fired)):
                self.fired.add(f)
                return f
        return None

    def pause(self, kind: str, step: int, until: Callable[[], bool] | None = None) -> None:
        """Announce this process's pid and wait: for the test's SIGKILL, or until `until()`
        (e.g. a preemption signal arrived)."""
        fault = self.fires(kind, step)
        if fault is None:
            return
        folder = self.run_dir / "faults"
        folder.mkdir(parents=True, exist_ok=True)
        marker = folder / f"{kind}-step-{step}.pid"
        part = marker.with_suffix(".part")
        part.write_text(str(os.getpid()))
        part.rename(marker)  # the test sees the whole pid or nothing
        deadline = time.monotonic() + (fault.seconds if fault.seconds is not None else 1e9)
        while time.monotonic() < deadline and not (until and until()):
            time.sleep(0.05)

    def hang(self, step: int, until: Callable[[], bool] | None = None) -> None:
        """Sleep before the step's collectives: the peers wait in them (until `until()`,
        e.g. the agent's SIGTERM once a peer gave up)."""
        fault = self.fires("hang", step)
        if fault is None:
            return
        deadline = time.monotonic() + (fault.seconds or 0.0)
        while time.monotonic() < deadline and not (until and until()):
            time.sleep(0.05)

    def nan(self, step: int) -> bool:
        return self.fires("nan", step) is not None


class SlowDataset(Dataset):
    """A dataset whose samples each take `seconds` more to load: a slow loader, made."""

    def __init__(self, inner: Any, seconds: float):
        self.inner = inner
        self.seconds = seconds

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, index: int) -> Any:
        time.sleep(self.seconds)
        return self.inner[index]


def first_fault(kind: str, environ: dict[str, str] | None = None) -> Fault | None:
    """The first fault of `kind` in TRAINWISE_FAULTS (the step-less ones: slow_data,
    slow_network)."""
    env = os.environ if environ is None else environ
    return next((f for f in parse_faults(env.get(ENV, "")) if f.kind == kind), None)


def slowed(dataset: Any, environ: dict[str, str] | None = None) -> Any:
    """`dataset`, slowed when TRAINWISE_FAULTS holds `slow_data@seconds=S`."""
    fault = first_fault("slow_data", environ)
    return SlowDataset(dataset, fault.seconds) if fault and fault.seconds else dataset


def slow_network(model: Any, environ: dict[str, str] | None = None) -> None:
    """Under `slow_network@gbps=G`, a DDP model's buckets wait the time a ring all-reduce
    of their bytes takes at G GB/s before they are reduced: the network made slow, the
    rest of the job unchanged."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel

    from trainwise.plan.comm import allreduce_factor

    fault = first_fault("slow_network", environ)
    gbps = fault.gbps if fault else None
    if not gbps or not isinstance(model, DistributedDataParallel):
        return
    group = model.process_group
    factor = allreduce_factor(group.size())

    def hook(state, bucket):  # unannotated: DDP rejects annotations other than its own
        buffer = bucket.buffer()
        time.sleep(buffer.numel() * buffer.element_size() * factor / (gbps * 1e9))
        return default_hooks.allreduce_hook(state, bucket)

    model.register_comm_hook(group, hook)
