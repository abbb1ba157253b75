"""The terminal summary that ends `trainwise train`, rendered from summary.json."""

from __future__ import annotations

from typing import Any


def render_summary(s: dict[str, Any]) -> str:
    shares = s["stage_share"]
    stages = " | ".join(
        f"{name} {shares[key] * 100:.1f}%"
        for name, key in (
            ("data wait", "data"),
            ("compute", "compute"),
            ("exposed sync", "sync"),
            ("optimizer", "optim"),
            ("checkpoint", "ckpt"),
        )
        if key in shares
    )
    if s["world"] > 1 and not s.get("sync_measured"):
        stages += "  (sync not probed)"
    loss = f"{s['first_loss']:.4f} -> {s['final_loss']:.4f}"
    if s.get("final_eval_loss") is not None:
        loss += f"  (held-out {s['final_eval_loss']:.4f})"
    per_sample = s.get("tokens_per_sample", 1)
    speed = (
        f"{s['tokens_per_s']:,.0f} tokens/s"
        if per_sample > 1
        else f"{s['tokens_per_s']:,.0f} samples/s"
    )
    head = "trainwise: training finished"
    if s.get("preempted"):
        head = f"trainwise: preempted by {s['preempted']} after step {s['last_step']}; saved"
    lines = [
        head,
        f"  strategy   {s['reason']}",
        f"  model      {s['model']}, {s['params']:,} parameters, {s['precision']}",
        f"  steps      {s['steps']} x global batch {s['global_batch']} on "
        f"{s['world']} x {s['device']}",
        f"  loss       {loss}",
        f"  speed      {speed}  (wall {s['wall_s']:.1f} s)",
        f"  step time  {stages}",
        f"  run dir    {s['run_dir']}",
    ]
    if s.get("resumed_from") is not None:
        lines.insert(-1, f"  resumed    {s['resume']}")
    if s.get("retry_cost", {}).get("failures"):
        lines.insert(-1, f"  failures   {s['retry_line']}")
    return "\n".join(lines)
