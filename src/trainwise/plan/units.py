"""How the planner's numbers are written for people: the one place for units and rounding
(the reasons, the tables and the pictures all call these)."""

from __future__ import annotations


def fmt_bytes(n: float) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def fmt_usd(x: float) -> str:
    return f"${x:,.0f}" if x >= 100 else f"${x:,.2f}"


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
