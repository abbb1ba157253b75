"""The doctor's one rule for a figure it compares with the plan: it passes only within
PLAN_TOLERANCE of the plan's figure (the report's flag level: one threshold for "off the
plan" everywhere); beyond it, the check warns with what the gap costs the planned job, as
step time, money per 1000 steps and hours of the whole job."""

from __future__ import annotations

from dataclasses import dataclass

from trainwise.plan.units import PLAN_TOLERANCE, fmt_hours, fmt_usd_exact


def short_of(measured: float, planned: float, tolerance: float = PLAN_TOLERANCE) -> bool:
    """Whether `measured` falls short of `planned` by more than `tolerance` (a figure where
    more is better: a speed, an efficiency; doing better than the plan is no fault)."""
    return measured < (1.0 - tolerance) * planned


def threshold(planned: float, unit: str = "", tolerance: float = PLAN_TOLERANCE) -> str:
    """The stated pass level beside a plan figure, e.g. 'passes at >= 74%'."""
    return f"passes at >= {(1.0 - tolerance) * planned:{unit}}"


@dataclass(frozen=True)
class JobTerms:
    """The planned job a slower step is charged to: its step seconds, steps, workers and
    price per worker-hour (0: a machine without a price, e.g. a CPU)."""

    step_s: float
    steps: int
    gpus: int
    price_per_gpu_hour: float

    def cost_of(self, step_s: float) -> str:
        """What a step of `step_s` instead of the plan's costs, in words."""
        extra_s = step_s - self.step_s
        per_1000_h = extra_s * 1000 / 3600
        usd = per_1000_h * self.gpus * self.price_per_gpu_hour
        money = (
            f"{fmt_usd_exact(usd)} per 1000 steps on {self.gpus} workers"
            if self.price_per_gpu_hour > 0
            else f"{_duration(extra_s * 1000)} more per 1000 steps"
        )
        job = self.step_s * self.steps
        return (
            f"{_share(extra_s / self.step_s)} step time = {money} "
            f"({_duration(extra_s * self.steps)} more on the planned {_duration(job)} "
            f"of {self.steps} steps)"
        )


def _share(x: float) -> str:
    """+68%, or two significant digits under 1 % (+0.0016%): never a bare +0%."""
    return f"{x:+.0%}" if abs(x) >= 0.01 else f"{100 * x:+.2g}%"


def _duration(seconds: float) -> str:
    return f"{seconds:.3g} s" if seconds < 60 else fmt_hours(seconds / 3600)
