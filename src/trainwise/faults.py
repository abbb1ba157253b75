"""The tests' one seam: every fault and pause a test needs, read from one environment
variable into one object, a no-op when the variable is unset. The real failure comes from
outside (the test sends SIGKILL to a pid, fills a disk, flips bytes); these points only make
*when* deterministic, or make a rank report something else.

`TRAINWISE_FAULTS` holds `;`-separated faults `KIND@key=value,...`:
- `pause@step=N,rank=R`: after step N, rank R writes `RUN_DIR/faults/pause-step-N.pid` and
  waits to be killed, or until the test creates `pause-step-N.go` beside it (or `seconds`,
  default forever).
- `pause_in_save@step=N,rank=R`: the same, inside the save of step N, after this rank's
  shards are written and before the commit.
- `pause_in_prepare@commit=N`: `trainwise data prepare`, after its N-th commit point,
  writes its pid to `OUT.partial.pid` and waits the same way (`OUT.partial.go`).
- `nan@step=N`: the loss of step N is multiplied by NaN on every rank.
- `hang@step=N,rank=R,seconds=S`: rank R sleeps S seconds before step N's collectives.
- `slow_data@seconds=S`: every training sample takes S seconds more to load.
- `slow_network@gbps=G`: DDP's gradient all-reduce waits as if its link carried G GB/s
  (nothing on one rank): a job made to scale badly.
- `tracker_raises@tracker=NAME`: every call to that experiment tracker (all of them without
  `tracker`) raises: a tracker gone bad.
- `versions@rank=R,FIELD=VALUE,...`: rank R (every rank without `rank`) reports VALUE for
  the version FIELD (e.g. `torch=9.9.9`): ranks made to differ.
The hooks are methods of one `Faults` object built once per process (`NO_FAULTS`, which
does nothing, when the variable is unset). A step's fault fires once, on the first attempt
only (TORCHELASTIC_RESTART_COUNT = 0): a transient fault, so that a rollback or a restart
gets past it. `always=1` fires it every time the step is reached, on every attempt: a fault
that repeats. The seam sits below every floor (the data preparation and the launcher use
it), so it imports nothing of trainwise's and torch only inside the hooks that need it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ENV = "TRAINWISE_FAULTS"
KINDS = frozenset({
    "pause", "pause_in_save", "pause_in_prepare", "nan", "hang", "slow_data", "slow_network",
    "tracker_raises", "versions",
})
_KEYS = frozenset({"step", "commit", "rank", "seconds", "gbps", "always", "tracker"})


@dataclass(frozen=True)
class Fault:
    kind: str
    step: int  # the step, or for pause_in_prepare the commit point
    rank: int | None = None
    seconds: float | None = None
    gbps: float | None = None
    always: bool = False
    tracker: str | None = None
    values: tuple[tuple[str, str], ...] = ()  # versions: the fields reported instead


def parse_faults(text: str) -> list[Fault]:
    """The faults of `text`; ValueError on an unknown kind (a test's typo fails loudly)."""
    faults = []
    for item in filter(None, (part.strip() for part in text.split(";"))):
        kind, _, args = item.partition("@")
        if kind not in KINDS:
            raise ValueError(f"{ENV}: unknown fault {kind!r} (known: {', '.join(sorted(KINDS))})")
        values = dict(pair.split("=", 1) for pair in args.split(",") if pair)
        faults.append(
            Fault(
                kind=kind,
                step=int(values.get("step", values.get("commit", 0))),
                rank=int(values["rank"]) if "rank" in values else None,
                seconds=float(values["seconds"]) if "seconds" in values else None,
                gbps=float(values["gbps"]) if "gbps" in values else None,
                always=values.get("always") == "1",
                tracker=values.get("tracker"),
                values=tuple((k, v) for k, v in values.items() if k not in _KEYS),
            )
        )
    return faults


class Faults:
    """The one seam for a test's faults: built once per process from TRAINWISE_FAULTS and
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
        cls, rank: int = 0, run_dir: Path | None = None, attempt: int = 0,
        environ: dict[str, str] | None = None,
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
        if self.run_dir is not None:
            self._pause("pause", step, self.run_dir / "faults" / f"pause-step-{step}.pid", until)

    def in_save(self, step: int) -> None:
        """`pause_in_save`: inside the save of `step`, shards written, before the commit."""
        if self.run_dir is not None:
            marker = self.run_dir / "faults" / f"pause_in_save-step-{step}.pid"
            self._pause("pause_in_save", step, marker, None)

    def in_prepare(self, partial: Path, commits: int) -> None:
        """`pause_in_prepare`: after the data preparation's `commits`-th commit point, the
        pid beside the unfinished output (`OUT.partial.pid`), so a kill lands there."""
        self._pause("pause_in_prepare", commits, partial.with_name(partial.name + ".pid"), None)

    def poisons(self, step: int) -> bool:
        """`nan`: the loss of this step is multiplied by NaN."""
        return self.fires("nan", step) is not None

    def versions(self, versions: dict[str, str]) -> dict[str, str]:
        """`versions`: what this rank reports, with the fault's fields in place of its own."""
        mine = [f for f in self.faults if f.kind == "versions" and f.rank in (None, self.rank)]
        return {**versions, **{k: v for f in mine for k, v in f.values}}

    def data(self, dataset: Any) -> Any:
        """`slow_data`: every sample takes `seconds` more to load."""
        fault = next((f for f in self.faults if f.kind == "slow_data"), None)
        return SlowDataset(dataset, fault.seconds) if fault and fault.seconds else dataset

    def network(self, model: Any, allreduce_factor: Callable[[int], float]) -> None:
        """`slow_network`: DDP's gradient all-reduce waits as if its link carried G GB/s;
        `allreduce_factor` (the planner's, passed in: the seam sits below it) gives the
        bytes an all-reduce moves per byte reduced."""
        fault = next((f for f in self.faults if f.kind == "slow_network"), None)
        if fault and fault.gbps:
            _slow_ddp(model, fault.gbps, allreduce_factor)

    def tracker(self, tracker: Any) -> Any:
        """`tracker_raises`: a tracker whose every call raises."""
        broken = [f for f in self.faults if f.kind == "tracker_raises"]
        if any(f.tracker in (None, tracker.name) for f in broken):
            return RaisingTracker(tracker.name)
        return tracker

    def _pause(
        self, kind: str, step: int, marker: Path, until: Callable[[], bool] | None
    ) -> None:
        """Announce this process's pid in `marker` and wait: for the test's SIGKILL, or until
        `until()` (e.g. a preemption signal arrived), or `seconds`, or `marker`.go."""
        fault = self.fires(kind, step)
        if fault is None:
            return
        marker.parent.mkdir(parents=True, exist_ok=True)
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


class SlowDataset:
    """A map-style dataset whose samples each take `seconds` more to load: a slow loader,
    made (DataLoader needs only `__len__` and `__getitem__`)."""

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


def _slow_ddp(model: Any, gbps: float, allreduce_factor: Callable[[int], float]) -> None:
    """A DDP model's buckets wait the time a ring all-reduce of their bytes takes at `gbps`
    GB/s before they are reduced: the network made slow, the rest of the job unchanged
    (nothing on one rank, or on a model DDP does not wrap)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(model, DistributedDataParallel):
        return
    group = model.process_group
    factor = allreduce_factor(group.size())

    def hook(state, bucket):  # unannotated: DDP rejects annotations other than its own
        buffer = bucket.buffer()
        time.sleep(buffer.numel() * buffer.element_size() * factor / (gbps * 1e9))
        return default_hooks.allreduce_hook(state, bucket)

    model.register_comm_hook(group, hook)
