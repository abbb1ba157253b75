"""Compute that overlaps NCCL's collectives runs on the SMs the collectives leave free
(plan.comm.contention_seconds, added to the step's compute by plan.estimate)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from trainwise.config import load_config
from trainwise.plan.estimate import evaluate
from trainwise.plan.inputs import PLAN_DEFAULTS, resolve_inputs
from trainwise.plan.model.comm import contention_seconds
from trainwise.plan.model.gemm import GENERATIONS


def h100_job(gpus: int, channels: int | None = None):
    """llama-1b on `gpus` H100s, with the catalog's NCCL channels or `channels`."""
    inputs = resolve_inputs(load_config(None, {
        "model.name": "llama-1b", "cluster.gpu": "H100-SXM", "plan.gpus": gpus,
        "data.seq_len": 2048, "data.micro_batch": 2, "data.global_batch": 2 * gpus,
        "precision.dtype": "bf16",
    }, base=PLAN_DEFAULTS))
    if channels is None:
        return inputs
    return replace(inputs, hardware=replace(inputs.hardware, nccl_channels=channels))


def test_the_catalog_gives_nvlink4_nccl_32_channels():
    assert h100_job(8).hardware.nccl_channels == 32


def test_more_channels_take_more_of_the_overlapped_window():
    sms = GENERATIONS["hopper"].sms
    few, many = contention_seconds(1.0, 8, sms), contention_seconds(1.0, 32, sms)
    assert 0 < few < many
    assert many == pytest.approx(32 / sms)
    assert contention_seconds(1.0, 500, sms) == pytest.approx(1.0)  # at most every SM


def test_no_overlapped_communication_no_slowdown():
    assert contention_seconds(0.0, 32, 132) == 0.0
    assert contention_seconds(1.0, 0, 132) == 0.0  # channels unknown: not modelled
    one = h100_job(1)
    assert evaluate(one, "single").step.compute == evaluate(
        replace(one, hardware=replace(one.hardware, nccl_channels=0)), "single"
    ).step.compute


def test_fsdp_compute_slows_by_the_channels_share_of_its_hidden_communication():
    base = evaluate(h100_job(8, channels=0), "fsdp-full")
    slowed = evaluate(h100_job(8, channels=32), "fsdp-full")
    hidden = base.step.comm - base.step.exposed_comm
    assert hidden > 0
    added = slowed.step.compute - base.step.compute
    assert added == pytest.approx(hidden * 32 / GENERATIONS["hopper"].sms, rel=0.05)
    assert slowed.tokens_per_s < base.tokens_per_s


def test_gloo_on_cpu_overlaps_nothing_so_nothing_is_slowed():
    cpu = resolve_inputs(load_config(None, {
        "model.name": "tiny", "cluster.gpu": "cpu", "plan.gpus": 2,
        "data.global_batch": 8,
    }, base=PLAN_DEFAULTS))
    base = evaluate(cpu, "ddp")
    many = evaluate(replace(cpu, hardware=replace(cpu.hardware, nccl_channels=32)), "ddp")
    assert many.step.compute == base.step.compute


def test_an_efficiency_override_already_holds_the_slowdown():
    # A calibrated or user-set efficiency comes from whole steps that ran beside their
    # collectives: adding the SM share again would count it twice.
    fixed = replace(h100_job(8), efficiency=0.4)
    with_channels = evaluate(fixed, "fsdp-full")
    without = evaluate(replace(fixed, hardware=replace(fixed.hardware, nccl_channels=0)),
                       "fsdp-full")
    assert with_channels.step.compute == without.step.compute


def test_compute_lost_to_collectives_that_outlast_it_runs_while_the_step_waits():
    """Compute W = 10 s beside collectives C: compute-bound (C = 4 s) the step is
    W + 4 x 32/132; communication-bound (C = 12 s) the compute runs at 100/132 of its rate
    the whole 12 s, which covers its 10 s when 12 x 100/132 >= 10, and else only the rest
    adds; never the slowdown of a window the step already waits out."""
    from trainwise.plan.model.comm import Collective, outlasting_seconds

    sms, share = 132, 32 / 132

    def gather(seconds: float) -> list[Collective]:
        return [Collective("all-gather", seconds * 1e9, 1e9, per_micro_batch=True)]

    compute = 10.0
    assert outlasting_seconds(gather(4.0), compute) == 0.0
    assert contention_seconds(4.0, 32, sms, 0.0) == pytest.approx(4 * share)
    for comm in (12.0, 14.0):
        waits = outlasting_seconds(gather(comm), compute)
        assert waits == pytest.approx(comm - compute)
        hidden = comm - waits  # the window the compute overlaps
        step = compute + contention_seconds(hidden, 32, sms, waits) + waits
        assert step == pytest.approx(max(comm, comm + compute - (1 - share) * comm))
    # the reductions a step issues once wait past the last backward's window
    once = [Collective("reduce-scatter", 4e9, 1e9)]
    assert outlasting_seconds(once, compute, grad_accum=4) == pytest.approx(4 - 10 / 4 * 2 / 3)
