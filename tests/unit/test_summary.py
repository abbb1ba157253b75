"""The recorder's records and the summary's figures across attempts and launches
(run.recorder) and its rendering (report.summary): every step keeps a record of its own
loss however the records are batched, the run's first loss after a resume, a rerun that
trains nothing keeps what the run measured, and missing figures print as n/a instead of
failing."""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from trainwise.config.schema import LoggingConfig
from trainwise.data.shards import IGNORE
from trainwise.report.summary import MISSING, render_summary
from trainwise.run.engine.recorder import Recorder
from trainwise.run.engine.step import StepResult, evaluate

STEPS = 6
LOSSES = {1: 5.0, 2: 4.0, 3: 3.0, 4: 2.5, 5: 2.0, 6: 1.5}


def recorder(
    run_dir: Path, start_step: int, attempt: int = 0, steps: int = STEPS, flush_every: int = 10
) -> Recorder:
    cfg = LoggingConfig(progress="none", tensorboard=False, flush_every=flush_every)
    return Recorder(
        steps=steps, cfg=cfg, is_main=True,
        run_dir=run_dir, distributed=False, tokens_per_step=100, tokens_per_sample=10,
        flops_per_token=None, peak_flops_total=None, device=torch.device("cpu"),
        start_step=start_step, attempt=attempt,
    )


def result(loss: float, grad_norm: float = 1.0) -> StepResult:
    t = time.perf_counter()
    marks = [("start", t), ("data", t + 0.01), ("compute", t + 0.02), ("last", t + 0.03),
             ("optim", t + 0.04)]
    return StepResult(
        torch.tensor(loss), torch.tensor(grad_norm), marks, probe=False, end=t + 0.04
    )


def train(run_dir: Path, first: int, last: int, attempt: int = 0) -> dict:
    """Steps first..last in one attempt that resumed from step first - 1."""
    rec = recorder(run_dir, first - 1, attempt)
    for step in range(first, last + 1):
        rec.add(step, result(LOSSES[step]), lr=1e-3)
    return rec.finish()


def written(rec: Recorder, closed: bool = False) -> dict[int, float]:
    """Step -> loss of every record in metrics.jsonl so far (a step twice fails)."""
    if not closed:
        rec.writer.sync()  # what the background writer has been given is in the file
    rows = [json.loads(line) for line in rec.writer.path.read_text().splitlines()]
    steps = [r["step"] for r in rows]
    assert len(steps) == len(set(steps)), steps
    return {r["step"]: r["loss"] for r in rows}


def test_every_step_has_a_record_of_its_own_loss_however_they_are_batched(tmp_path: Path):
    """The losses are reduced over ranks every flush_every steps, the collective completed
    and the records written at the next step (and at once after a save, and at the end):
    never a step dropped, nor steps merged into one."""
    steps, losses = 11, {s: 10.0 - 0.5 * s for s in range(1, 12)}
    rec = recorder(tmp_path, 0, steps=steps, flush_every=4)
    for step in range(1, steps + 1):
        rec.add(step, result(losses[step]), lr=1e-3, ckpt_s=0.25 if step == 6 else 0.0)
        if step in (3, 4):
            assert written(rec) == {}  # buffered, then reduced beside step 5's work
        if step == 5:
            assert written(rec) == {s: losses[s] for s in range(1, 5)}
        if step == 6:  # step 6 saved: its record and 5's were written with it, at once
            assert written(rec) == {s: losses[s] for s in range(1, 7)}
        if step == 9:  # 8's reduction completes at step 9
            assert written(rec) == {s: losses[s] for s in range(1, 9)}
    rec.finish()
    assert written(rec, closed=True) == losses


def test_every_record_keeps_its_own_steps_gradient_norm(tmp_path: Path):
    """The norms are read once per flush, beside the losses' reduction: each record still
    holds its own step's, in order."""
    norms = {s: 0.25 * s for s in range(1, STEPS + 1)}
    rec = recorder(tmp_path, 0, flush_every=4)
    for step in range(1, STEPS + 1):
        rec.add(step, result(LOSSES[step], norms[step]), lr=1e-3)
    rec.finish()
    rows = [json.loads(line) for line in rec.writer.path.read_text().splitlines()]
    assert {r["step"]: r["grad_norm"] for r in rows} == norms
    assert {r["step"]: r["loss"] for r in rows} == LOSSES


def test_flush_every_one_writes_each_record_at_its_step(tmp_path: Path):
    """flush_every = 1 asks for every record at its own step (records that outlive a kill):
    no reduction is left to the next step."""
    rec = recorder(tmp_path, 0, flush_every=1)
    for step in range(1, STEPS + 1):
        rec.add(step, result(LOSSES[step]), lr=1e-3)
        assert written(rec) == {s: LOSSES[s] for s in range(1, step + 1)}
    rec.finish()


def test_make_durable_completes_the_reduction_in_flight(tmp_path: Path):
    """Before a checkpoint commits, every record so far is on disk, the one whose
    reduction was still in flight included."""
    rec = recorder(tmp_path, 0, flush_every=2)
    for step in (1, 2, 3):
        rec.add(step, result(LOSSES[step]), lr=1e-3)
    rec.add(4, result(LOSSES[4]), lr=1e-3)  # 4's reduction in flight
    assert written(rec) == {s: LOSSES[s] for s in (1, 2)}
    rec.make_durable()
    assert written(rec) == {s: LOSSES[s] for s in (1, 2, 3, 4)}
    rec.finish()


def test_after_a_resume_the_first_loss_is_the_runs(tmp_path: Path):
    train(tmp_path, 1, 3)  # then a failure; the checkpoint was of step 2
    figures = train(tmp_path, 3, STEPS, attempt=1)
    assert figures["first_loss"] == LOSSES[1]
    assert figures["final_loss"] == LOSSES[STEPS]


def test_a_rerun_that_trains_nothing_keeps_the_runs_figures(tmp_path: Path):
    done = train(tmp_path, 1, STEPS)
    (tmp_path / "summary.json").write_text(json.dumps(done))
    again = train(tmp_path, STEPS + 1, STEPS)  # resumed at the last step: no step to run
    assert again["first_loss"] == LOSSES[1] and again["final_loss"] == LOSSES[STEPS]
    for key in ("tokens_per_s", "stage_share"):
        assert again[key] == done[key], key


def test_missing_figures_print_as_n_a():
    summary = {
        "run_dir": "runs/x", "model": "tiny", "params": 120576, "strategy": "ddp",
        "reason": "ddp", "world": 2, "device": "cpu", "precision": "fp32", "steps": 6,
        "global_batch": 32, "first_loss": None, "final_loss": None, "final_eval_loss": None,
        "tokens_per_s": None, "wall_s": None, "stage_share": {"data": None, "compute": 0.5},
    }
    text = render_summary(summary)
    assert f"loss       {MISSING} -> {MISSING}" in text
    assert f"(wall {MISSING})" in text and f"data wait {MISSING}" in text
    assert "compute 50.0%" in text
    assert render_summary({}).count(MISSING) >= 5  # an empty file still renders


def test_an_attempt_that_timed_nothing_reports_no_speed_not_zero(tmp_path: Path):
    train(tmp_path, 1, STEPS)  # no summary.json: the run was cut short before writing it
    again = train(tmp_path, STEPS + 1, STEPS)
    assert again["tokens_per_s"] is None and again["stage_share"] == {}
    assert again["first_loss"] == LOSSES[1]
    text = render_summary({**again, "world": 1})
    assert f"speed      {MISSING}" in text and f"step time  {MISSING}" in text
    assert f"loss       {LOSSES[1]:.4f} -> {LOSSES[STEPS]:.4f}" in text


def test_the_held_out_pass_keeps_no_graph_and_leaves_out_batches_without_a_target():
    """evaluate runs the model without autograd (no activations kept for a backward that
    never comes), and a batch whose targets are all ignored runs but adds nothing to the
    mean (cross entropy's mean over no target is NaN)."""
    grad_modes = []

    class Probe(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 3)

        def forward(self, x):
            grad_modes.append(torch.is_grad_enabled())
            return self.lin(x)

    model, x = Probe(), torch.randn(2, 4)
    counted, ignored = torch.tensor([0, 2]), torch.full((2,), IGNORE)
    got = evaluate(model, F.cross_entropy, [(x, counted), (x, ignored)],
                   contextlib.nullcontext, torch.device("cpu"))
    assert grad_modes == [False, False]
    with torch.no_grad():
        assert got == pytest.approx(float(F.cross_entropy(model.lin(x), counted)))
