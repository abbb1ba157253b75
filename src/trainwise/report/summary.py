"""The terminal summary that ends `trainwise train`, rendered from summary.json
(`RunSummary`)."""

from __future__ import annotations

from typing import Any

from trainwise.plan.units import fmt_params, fmt_seconds
from trainwise.records import RunSummary

MISSING = "n/a"  # a figure the summary lacks (a rerun that trained nothing, an older file)


def fig(value: Any, spec: str = "", unit: str = "", scale: float = 1) -> str:
    """`value` x `scale` formatted with `spec` and `unit`, or MISSING when not a number."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return MISSING
    return f"{value * scale:{spec}}{unit}"


def _or_missing(value: Any) -> Any:
    return MISSING if value is None else value


def render_summary(summary: RunSummary | dict[str, Any]) -> str:
    """The summary's lines; a dict is read as summary.json's (RunSummary.from_dict)."""
    s = summary if isinstance(summary, RunSummary) else RunSummary.from_dict(summary)
    shares = s.stage_share or {}
    inside = [f"{what} {fig(share, '.1f', '%', scale=100)}"
              for what, share in (("tensor-parallel", s.tp_comm_share),
                                  ("all-to-all", s.a2a_share)) if share]
    parts = {"sync": f" ({', '.join(inside)})"} if inside else {}
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
    if (s.world or 1) > 1 and not s.sync_measured:
        stages += "  (sync not probed)"
    loss = f"{fig(s.first_loss, '.4f')} -> {fig(s.final_loss, '.4f')}"
    if s.final_eval_loss is not None:
        loss += f"  (held-out {fig(s.final_eval_loss, '.4f')})"
    unit = " tokens/s" if (s.tokens_per_sample or 1) > 1 else " samples/s"
    speed = fig(s.tokens_per_s, ",.0f", unit)
    # The report's wall figure (run.wall), written as the report writes it.
    wall = fig(s.wall_s)
    wall = f"{fmt_seconds(s.wall_s)} s" if wall != MISSING else wall
    head = "trainwise: training finished"
    if s.preempted:
        head = f"trainwise: preempted by {s.preempted} after step {s.last_step}; saved"
    params = f"{fig(s.params, ',')} parameters"
    if s.trainable_params is not None and s.total_params:  # LoRA
        params = fmt_params(s.trainable_params, s.total_params)
    lines = [
        head,
        f"  strategy   {_or_missing(s.reason)}",
        f"  model      {_or_missing(s.model)}, {params}, {_or_missing(s.precision)}",
        f"  steps      {_or_missing(s.steps)} x global batch {_or_missing(s.global_batch)}"
        f" on {_or_missing(s.world)} x {_or_missing(s.device)}",
        f"  loss       {loss}",
        f"  speed      {speed}  (wall {wall})",
        f"  step time  {stages}",
        f"  run dir    {_or_missing(s.run_dir)}",
    ]
    if s.expert_imbalance is not None:  # a MoE model: how evenly its routing spread
        ranks = f", busiest ep rank {fig(s.ep_imbalance, '.2f')}" if s.ep_imbalance else ""
        lines.insert(-1, f"  routing    busiest expert {fig(s.expert_imbalance, '.2f')} x the "
                     f"mean{ranks} (median of the steady steps)")
    if (s.tp or 1) > 1 or (s.pp or 1) > 1:  # every degree, beside the name
        lines.insert(2, f"  layout     {_or_missing(s.layout)}")
    if s.resumed_from is not None:
        lines.insert(-1, f"  resumed    {_or_missing(s.resume)}")
    if s.retry_cost is not None and s.retry_cost.failures:
        lines.insert(-1, f"  failures   {_or_missing(s.retry_line)}")
    return "\n".join(lines)
