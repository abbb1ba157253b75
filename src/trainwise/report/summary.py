"""The terminal summary that ends `trainwise train`, rendered from summary.json."""

from __future__ import annotations

from typing import Any

from trainwise.plan.units import fmt_params, fmt_seconds

MISSING = "n/a"  # a figure the summary lacks (a rerun that trained nothing, an older file)


def fig(value: Any, spec: str = "", unit: str = "", scale: float = 1) -> str:
    """`value` x `scale` formatted with `spec` and `unit`, or MISSING when not a number."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return MISSING
    return f"{value * scale:{spec}}{unit}"


def render_summary(s: dict[str, Any]) -> str:
    shares = s.get("stage_share") or {}
    tp = s.get("tp_comm_share")
    parts = {"sync": f" (tensor-parallel {fig(tp, '.1f', '%', scale=100)})"} if tp else {}
    stages = (
        " | ".join(
            f"{name} {fig(shares[key], '.1f', '%', scale=100)}{parts.get(key, '')}"
            for name, key in (
                ("data wait", "data"),
                ("compute", "compute"),
                ("pipeline bubble", "bubble"),
                ("exposed sync", "sync"),
                ("optimizer", "optim"),
                ("checkpoint", "ckpt"),
            )
            if key in shares and (key != "bubble" or shares[key])  # pipelines only
        )
        or MISSING
    )
    if (s.get("world") or 1) > 1 and not s.get("sync_measured"):
        stages += "  (sync not probed)"
    loss = f"{fig(s.get('first_loss'), '.4f')} -> {fig(s.get('final_loss'), '.4f')}"
    if s.get("final_eval_loss") is not None:
        loss += f"  (held-out {fig(s['final_eval_loss'], '.4f')})"
    unit = " tokens/s" if (s.get("tokens_per_sample") or 1) > 1 else " samples/s"
    speed = fig(s.get("tokens_per_s"), ",.0f", unit)
    # The report's wall figure (run.wall), written as the report writes it.
    wall = fig(s.get("wall_s"))
    wall = f"{fmt_seconds(s['wall_s'])} s" if wall != MISSING else wall
    head = "trainwise: training finished"
    if s.get("preempted"):
        head = f"trainwise: preempted by {s['preempted']} after step {s.get('last_step')}; saved"
    params = f"{fig(s.get('params'), ',')} parameters"
    if s.get("trainable_params") is not None and s.get("total_params"):  # LoRA
        params = fmt_params(s["trainable_params"], s["total_params"])
    lines = [
        head,
        f"  strategy   {s.get('reason', MISSING)}",
        f"  model      {s.get('model', MISSING)}, {params}, {s.get('precision', MISSING)}",
        f"  steps      {s.get('steps', MISSING)} x global batch {s.get('global_batch', MISSING)}"
        f" on {s.get('world', MISSING)} x {s.get('device', MISSING)}",
        f"  loss       {loss}",
        f"  speed      {speed}  (wall {wall})",
        f"  step time  {stages}",
        f"  run dir    {s.get('run_dir', MISSING)}",
    ]
    if (s.get("tp") or 1) > 1 or (s.get("pp") or 1) > 1:  # every degree, beside the name
        lines.insert(2, f"  layout     {s.get('layout', MISSING)}")
    if s.get("resumed_from") is not None:
        lines.insert(-1, f"  resumed    {s.get('resume', MISSING)}")
    if (s.get("retry_cost") or {}).get("failures"):
        lines.insert(-1, f"  failures   {s.get('retry_line', MISSING)}")
    return "\n".join(lines)
