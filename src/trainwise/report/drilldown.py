"""Where to look next: what the run left for an investigation, as plain figures: the
profiler's window (time by group per rank, the top operators, the trace files), the
memory timeline (CUDA snapshots, or why there is none), and hangs (who did not arrive,
with each rank's stacks)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from trainwise.report.rundir import RunFiles

GROUPS = ("compute", "communication", "copies", "data", "other")
TOP = 10


@dataclass(frozen=True)
class RankProfile:
    rank: int
    steps: list[int]
    window_s: float
    groups_s: dict[str, float]  # by GROUPS; they add up to window_s


@dataclass(frozen=True)
class Operator:
    name: str
    group: str
    calls: int
    self_s: float  # rank 0's, over the window
    share: float  # of rank 0's window


@dataclass(frozen=True)
class Attributed:
    """One stage of a traced step: the plan's figure, the loop's own timers over the same
    steps, and the trace's (rank 0), in seconds per step."""

    stage: str
    plan: float | None  # the planner counts the optimizer inside compute
    loop: float | None
    trace: float | None


# (stage, the plan's key, metrics.jsonl's field, the trace summary's stages_s key)
ATTRIBUTED = (
    ("data wait", "data", "data_s", "data"),
    ("compute", "compute", "compute_s", "compute"),
    ("exposed sync", "exposed_comm", "sync_s", "exposed_comm"),
    ("optimizer", None, "optim_s", "optimizer"),
)


@dataclass(frozen=True)
class Hang:
    step: int
    stage: str
    cause: str  # "timeout" | "lost"
    absent: list[int]  # ranks that did not check in on the job's store (peers.absent_ranks)
    seen_by: list[int]  # ranks that reported it
    message: str


@dataclass(frozen=True)
class DrillDown:
    profiles: list[RankProfile] = field(default_factory=list)
    attributed: list[Attributed] = field(default_factory=list)  # a traced step by stage
    top: list[Operator] = field(default_factory=list)
    traces: list[str] = field(default_factory=list)  # run-relative paths
    memory: str = ""  # the memory timeline: its files, or why there is none
    hangs: list[Hang] = field(default_factory=list)
    dumps: dict[int, str] = field(default_factory=dict)  # rank: its stacks

    @property
    def empty(self) -> bool:
        return not (self.profiles or self.traces or self.hangs or self.dumps)


def drill_down(run: RunFiles) -> DrillDown:
    profiles = [
        RankProfile(
            rank=int(p.get("rank", 0)),
            steps=list(p.get("steps", [])),
            window_s=float(p.get("window_s", 0.0)),
            groups_s={g: float(p.get("groups_s", {}).get(g, 0.0)) for g in GROUPS},
        )
        for p in run.profiles
    ]
    profiles.sort(key=lambda p: p.rank)
    return DrillDown(
        profiles=profiles,
        attributed=attributed(run),
        top=top_operators(run.profiles),
        traces=run.traces,
        memory=memory_line(run),
        hangs=hangs(run.events),
        dumps=run.hang_dumps,
    )


def attributed(run: RunFiles) -> list[Attributed]:
    """The traced steps split by stage three ways: plan, loop timers, trace (rank 0)."""
    if not run.profiles:
        return []
    first = min(run.profiles, key=lambda p: p.get("rank", 0))
    trace = first.get("stages_s") or {}
    lo, hi = (first.get("steps") or [0, 0])[:2]
    traced = [r for r in run.records if lo <= r.step <= hi]
    step = run.plan.step if run.plan is not None else None
    out = []
    for stage, plan_key, field_name, trace_key in ATTRIBUTED:
        values = [float(v) for r in traced if (v := getattr(r, field_name)) is not None]
        out.append(
            Attributed(
                stage, getattr(step, plan_key) if step is not None and plan_key else None,
                sum(values) / len(values) if values else None, trace.get(trace_key),
            )
        )
    return out


def top_operators(summaries: list[dict[str, Any]]) -> list[Operator]:
    """Rank 0's top operators by self time (the first rank that wrote a summary)."""
    if not summaries:
        return []
    first = min(summaries, key=lambda p: p.get("rank", 0))
    window = float(first.get("window_s") or 0.0) or 1.0
    ops = first.get("top", [])[:TOP]
    return [
        Operator(o["name"], o.get("group", "compute"), int(o.get("calls", 0)),
                 float(o.get("self_s", 0.0)), float(o.get("self_s", 0.0)) / window)
        for o in ops
    ]


def memory_line(run: RunFiles) -> str:
    snapshots = [t for t in run.traces if t.startswith("profile/memory-")]
    if snapshots:
        return (
            f"memory snapshots {', '.join(snapshots)}: open them in PyTorch's memory "
            "visualizer (pytorch.org/memory_viz) for the timeline and what held the peak"
        )
    if not run.profiles:
        return "no traced window: set logging.profile_steps = [first, last] to trace steps"
    return (
        "the memory timeline needs CUDA (torch.cuda.memory._record_memory_history); on CPU "
        "the Curves show the resident set over the steps"
    )


def hangs(events: list[dict[str, Any]]) -> list[Hang]:
    """One per (attempt's) failed collective, from the ranks' peer_failure events: the
    absent ranks as rank 0's check-in named them."""
    by_step: dict[int, list[dict[str, Any]]] = {}
    for e in events:
        if e.get("kind") == "peer_failure" and isinstance(e.get("step"), int):
            by_step.setdefault(e["step"], []).append(e)
    out = []
    for step, seen in sorted(by_step.items()):
        absent = sorted({r for e in seen for r in (e.get("absent") or [])})
        first = min(seen, key=lambda e: e.get("rank", 0))
        out.append(
            Hang(step=step, stage=str(first.get("stage", "")), cause=str(first.get("cause", "")),
                 absent=absent, seen_by=sorted(e.get("rank", 0) for e in seen),
                 message=str(first.get("message", "")))
        )
    return out
