"""A step's routing load (models.moe.load): the figures the runtime records and the
planner's moe.imbalance means, by hand; and the recorder's one collective that sums a
step's tokens per expert (run.engine.recorder.reduce_steps, on one process)."""

from __future__ import annotations

import pytest
import torch

from trainwise.models.moe.load import busiest_over_mean, rank_loads, step_load
from trainwise.records import RunSummary, StepRecord
from trainwise.report.summary import render_summary
from trainwise.run.engine.recorder import reduce_steps
from trainwise.run.engine.step import StepResult


def test_even_routing_is_one():
    load = step_load([[4, 4, 4, 4], [2, 2, 2, 2]], ep=2)
    assert load.tokens == [6, 6, 6, 6]
    assert load.expert_imbalance == 1.0 and load.ep_imbalance == 1.0


def test_imbalance_by_hand():
    # Layer 0: experts 8, 0, 4, 4 (mean 4): the busiest expert 2x; ranks of 2 experts each
    # get 8 and 8: even. Layer 1: 6, 2, 2, 6: 1.5x; ranks 8 and 8.
    load = step_load([[8, 0, 4, 4], [6, 2, 2, 6]], ep=2)
    assert load.expert_imbalance == pytest.approx((2.0 + 1.5) / 2)
    assert load.ep_imbalance == 1.0
    # Split 4 ways, each expert is a rank: the rank imbalance is the expert one.
    assert step_load([[8, 0, 4, 4]], ep=4).ep_imbalance == 2.0
    assert rank_loads([8, 0, 4, 4], 2) == [8, 4 + 4]
    assert busiest_over_mean([3, 1]) == 1.5


def test_ep_1_has_no_rank_imbalance_and_layers_without_tokens_are_left_out():
    load = step_load([[0, 0], [3, 1]], ep=1)
    assert load.ep_imbalance is None and load.expert_imbalance == 1.5
    assert load.tokens == [3, 1]
    assert step_load([[0, 0]], ep=1) is None


def _result(loss: float, tokens: list[list[float]] | None) -> StepResult:
    return StepResult(
        loss=torch.tensor(loss), grad_norm=torch.tensor(1.0), marks=[], probe=False, end=0.0,
        aux_loss=torch.tensor(loss / 10),
        expert_tokens=torch.tensor(tokens) if tokens is not None else None,
    )


def test_the_flush_reduces_losses_and_tokens_together():
    results = [_result(2.0, [[6, 2], [4, 4]]), _result(1.0, [[1, 3], [2, 2]])]
    losses, auxes, tokens = reduce_steps(results)
    assert losses == [2.0, 1.0] and auxes == pytest.approx([0.2, 0.1])
    assert tokens == [[[6, 2], [4, 4]], [[1, 3], [2, 2]]]
    # A dense model's steps have none.
    assert reduce_steps([_result(1.0, None)])[2] == [None]


def test_old_metrics_read_without_the_expert_fields():
    old = {k: v for k, v in StepRecord(
        step=1, loss=1.0, eval_loss=None, lr=0.1, grad_norm=1.0, step_s=1.0, data_s=0.0,
        compute_s=1.0, sync_s=None, optim_s=0.0, ckpt_s=0.0, tokens=1, tokens_per_s=1.0,
        samples_per_s=1.0, mfu=None, mem_bytes=0, mem_kind="rss_peak", elapsed_s=1.0,
        time=0.0, attempt=0).to_dict().items() if k not in ("a2a_s", "expert_tokens",
                                                            "expert_imbalance", "ep_imbalance")}
    record = StepRecord.from_dict(old)
    assert record.a2a_s is None and record.expert_tokens is None


def test_the_summary_shows_the_all_to_all_and_the_routing():
    text = render_summary(RunSummary(
        stage_share={"data": 0.1, "compute": 0.5, "sync": 0.3, "optim": 0.1}, a2a_share=0.2,
        expert_imbalance=1.3, ep_imbalance=1.05, world=2,
    ))
    assert "exposed sync 30.0% (all-to-all 20.0%)" in text
    assert "routing    busiest expert 1.30 x the mean, busiest ep rank 1.05" in text
    assert "routing" not in render_summary(RunSummary(world=1))


def test_the_load_figures_import_no_torch():
    """A calibration (plan/) reads them: they import no torch."""
    import subprocess
    import sys

    from helpers import cli_env, hang_limit

    code = ("import sys; import trainwise.models.moe.load; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    proc = subprocess.run([sys.executable, "-c", code], env=cli_env(), capture_output=True,
                          text=True, timeout=hang_limit())
    assert proc.returncode == 0, proc.stderr
