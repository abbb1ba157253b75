"""How the planner's numbers are written for people: the one place for units and rounding
(the reasons, the tables and the pictures all call these)."""

from __future__ import annotations

import math


def fmt_bytes(n: float) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def fmt_count(n: float) -> str:
    """A parameter count: 68.98B, 210.8M, or whole below a million."""
    if n >= 1e9:
        return f"{n / 1e9:.2f}B"
    return f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n:,.0f}"


def fmt_params(trainable: float, total: float) -> str:
    """Trainable of total parameters (LoRA), or the total when every parameter trains."""
    if trainable >= total:
        return f"{fmt_count(total)} parameters"
    return (
        f"{fmt_count(trainable)} trainable of {fmt_count(total)} parameters "
        f"({100 * trainable / total:.2f} %)"
    )


def fmt_usd(x: float) -> str:
    return f"${x:,.0f}" if x >= 100 else f"${x:,.2f}"


def fmt_usd_exact(x: float) -> str:
    """fmt_usd, with two significant digits below a cent (a small CPU run: $0.000047)."""
    if x >= 0.01 or x <= 0:
        return fmt_usd(x)
    return f"${x:.{1 - math.floor(math.log10(x))}f}"


def fmt_gpu_hours(h: float) -> str:
    """GPU-hours with three significant digits at any scale (0.000667, 2.5, 1,234.5)."""
    if h >= 100:
        return f"{h:,.1f}"
    if h >= 0.01 or h <= 0:
        return f"{h:.3g}"
    return f"{h:.{2 - math.floor(math.log10(h))}f}"


def fmt_hours(h: float) -> str:
    if h >= 48:
        return f"{h / 24:,.1f} days"
    if h >= 1:
        return f"{h:.1f} h"
    return f"{h * 60:.1f} min"


def fmt_seconds(x: float) -> str:
    if x == 0:
        return "0"
    if x < 0.01:
        return "<0.01"
    return f"{x:,.0f}" if x >= 1000 else f"{x:.3g}"


# How far a measured figure may be from the plan's: beyond it the report names the
# assumption to check and a doctor check warns with the cost of the gap (one threshold).
PLAN_TOLERANCE = 0.25
