"""Fault injection points for tests: the real failure comes from outside (the test sends
SIGKILL to a pid, fills a disk, flips bytes); these points only make *when* deterministic.

`TRAINWISE_FAULTS` holds `;`-separated faults `KIND@key=value,...`:
- `pause@step=N,rank=R`: after step N, rank R writes `RUN_DIR/faults/pause-step-N.pid` and
  waits to be killed, or until the test creates `pause-step-N.go` beside it (or `seconds`,
  default forever).
- `pause_in_save@step=N,rank=R`: the same, inside the save of step N, after this rank's
  shards are written and before the commit.
- `nan@step=N`: the loss of step N is multiplied by NaN on every rank.
- `hang@step=N,rank=R,seconds=S`: rank R sleeps S seconds before step N's collectives.
- `slow_data@seconds=S`: every training sample takes S seconds more to load.
- `slow_network@gbps=G`: DDP's gradient all-reduce waits as if its link carried G GB/s
  (nothing on one rank): a job made to scale badly.
- `tracker_raises@tracker=NAME`: every call to that experiment tracker (all of them without
  `tracker`) raises: a tracker gone bad.
The hooks are methods of one `Faults` object built once per worker (`NO_FAULTS`, which
does nothing, when the variable is unset). Each fires once, on the first attempt only
(TORCHELASTIC_RESTART_COUNT = 0): a transient
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
    tracker: str | None = None


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
                tracker=values.get("tracker"),
            )
        )
    return faults


class Faults:
    """The one seam for a test's faults: built once per worker from TRAINWISE_FAULTS and
    passed where a fault can fire. Without the variable it is `NO_FAULTS`, whose hooks do
    nothing. `attempt` is the launcher's restart count (DistEnv.attempt)."""

    def __init__(self, faults: list[Fault], rank: int = 0, run_dir: Path | None = None,
                 attempt: int = 0):
        self.faults = faults
        self.rank = rank
        self.run_dir = run_dir
        self.attempt = attempt
        self.fired: set[Fault] = set()

    @classmethod
    def from_env(
        cls, rank: int, run_dir: Path, attempt: int, environ: dict[str, str] | None = None
    ) -> Faults:
        env = os.environ if environ is None else environ
        faults = parse_faults(env.get(ENV, ""))
        return cls(faults, rank, run_dir, attempt) if faults else NO_FAULTS

    def fires(self, kind: str, step: int) -> Fault | None:
        for f in self.faults:
            mine = f.kind == kind and f.step == step and f.rank in (None, self.rank)
            if mine and (f.always or (self.attempt == 0 and f not in self.fired)):
                self.fired.add(f)
                return f
        return None

    # -- the hooks ----------------------------------------------------------------------

    def before_step(self, step: int, until: Callable[[], bool] | None = None) -> None:
        """`hang`: sleep before the step's collectives; the peers wait in them (until
        `until()`, e.g. the agent's SIGTERM once a peer gave up)."""
        fault = self.fires("hang", step)
        if fault is not None:
            _wait(fault.seconds or 0.0, until)

    def after_step(self, step: int, until: Callable[[], bool] | None = None) -> None:
        """`pause`: announce the pid after the step and wait for the test."""
        self._pause("pause", step, until)

    def in_save(self, step: int) -> None:
        """`pause_in_save`: inside the save of `step`, shards written, before the commit."""
        self._pause("pause_in_save", step, None)

    def poisons(self, step: int) -> bool:
        """`nan`: the loss of this step is multiplied by NaN."""
        return self.fires("nan", step) is not None

    def data(self, dataset: Any) -> Any:
        """`slow_data`: every sample takes `seconds` more to load."""
        fault = next((f for f in self.faults if f.kind == "slow_data"), None)
        return SlowDataset(dataset, fault.seconds) if fault and fault.seconds else dataset

    def network(self, model: Any) -> None:
        """`slow_network`: DDP's gradient all-reduce waits as if its link carried G GB/s."""
        fault = next((f for f in self.faults if f.kind == "slow_network"), None)
        if fault and fault.gbps:
            _slow_ddp(model, fault.gbps)

    def tracker(self, tracker: Any) -> Any:
        """`tracker_raises`: a tracker whose every call raises."""
        broken = [f for f in self.faults if f.kind == "tracker_raises"]
        if any(f.tracker in (None, tracker.name) for f in broken):
            return RaisingTracker(tracker.name)
        return tracker

    def _pause(self, kind: str, step: int, until: Callable[[], bool] | None) -> None:
        """Announce this process's pid and wait: for the test's SIGKILL, or until `until()`
        (e.g. a preemption signal arrived), or `seconds`."""
        fault = self.fires(kind, step)
        if fault is None or self.run_dir is None:
            return
        folder = self.run_dir / "faults"
        folder.mkdir(parents=True, exist_ok=True)
        marker = folder / f"{kind}-step-{step}.pid"
        part = marker.with_suffix(".part")
        part.write_text(str(os.getpid()))
        part.rename(marker)  # the test sees the whole pid or nothing
        go = marker.with_suffix(".go")  # an empty file: it can be made on a full disk
        _wait(
            fault.seconds if fault.seconds is not None else 1e9,
            lambda: go.exists() or bool(until and until()),
        )


NO_FAULTS = Faults([])


def _wait(seconds: float, until: Callable[[], bool] | None) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not (until and until()):
        time.sleep(0.05)


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


class RaisingTracker:
    """An experiment tracker whose every call raises, as a broken server or package would."""

    def __init__(self, name: str):
        self.name = name

    def __getattr__(self, method: str) -> Callable[..., None]:
        def fail(*args: Any, **kwargs: Any) -> None:
            raise RuntimeError(f"{self.name}.{method}: the tracker_raises fault")

        return fail


def _slow_ddp(model: Any, gbps: float) -> None:
    """A DDP model's buckets wait the time a ring all-reduce of their bytes takes at `gbps`
    GB/s before they are reduced: the network made slow, the rest of the job unchanged
    (nothing on one rank, or on a model DDP does not wrap)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel

    from trainwise.plan.model.comm import allreduce_factor

    if not isinstance(model, DistributedDataParallel):
        return
    group = model.process_group
    factor = allreduce_factor(group.size())

    def hook(state, bucket):  # unannotated: DDP rejects annotations other than its own
        buffer = bucket.buffer()
        time.sleep(buffer.numel() * buffer.element_size() * factor / (gbps * 1e9))
        return default_hooks.allreduce_hook(state, bucket)

    model.register_comm_hook(group, hook)
