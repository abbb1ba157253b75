"""Unit tests of trainwise.plan.model.reliability: the checkpoint interval (Young 1974, Daly 2006)
and the expected cost of failures. Expected values are worked out by hand in the comments."""

from __future__ import annotations

import math

import pytest

from trainwise.plan import (
    FailureCost,
    expected_waste_fraction,
    failure_cost,
    interval_steps,
    optimal_interval_s,
    system_mtbf_s,
)

HOUR = 3600.0
# save 10 s, M = 1 h: sqrt(2*10*3600) - 10 = sqrt(72000) - 10 = 268.3282 - 10 = 258.3282 s
TAU_10_1H = math.sqrt(72000.0) - 10.0

SAVES = [0.1, 1.0, 10.0, 60.0, 300.0]
MTBFS = [600.0, HOUR, 10 * HOUR, 1000 * HOUR]


def test_system_mtbf_divides_by_nodes():
    assert system_mtbf_s(1.0, 1) == HOUR
    # 1000 h per node over 8 nodes: 125 h = 450000 s
    assert system_mtbf_s(1000.0, 8) == pytest.approx(450000.0)


def test_optimal_interval_hand_computed():
    assert optimal_interval_s(10.0, HOUR) == pytest.approx(258.3282, abs=1e-4)
    assert optimal_interval_s(10.0, HOUR) == pytest.approx(TAU_10_1H)
    # save 1 s, M = 20000 s: sqrt(40000) - 1 = 199 s
    assert optimal_interval_s(1.0, 20000.0) == pytest.approx(199.0)


@pytest.mark.parametrize("save", [1800.0, 2000.0, 3600.0, 10000.0])
def test_optimal_interval_is_mtbf_when_save_at_least_half_of_it(save):
    # delta >= M/2 (M = 3600 s): Daly's tau = M
    assert optimal_interval_s(save, HOUR) == HOUR


def test_optimal_interval_just_below_half_uses_the_formula():
    # delta = 1799, M = 3600: sqrt(2*1799*3600) - 1799 = sqrt(12952800) - 1799
    assert optimal_interval_s(1799.0, HOUR) == pytest.approx(math.sqrt(12952800.0) - 1799.0)


@pytest.mark.parametrize("mtbf", MTBFS)
def test_optimal_interval_grows_with_save_cost(mtbf):
    taus = [optimal_interval_s(s, mtbf) for s in SAVES]
    assert taus == sorted(taus)


@pytest.mark.parametrize("save", SAVES)
def test_optimal_interval_grows_with_mtbf(save):
    taus = [optimal_interval_s(save, m) for m in MTBFS]
    assert taus == sorted(taus)


def test_waste_hand_computed():
    # At the optimum T = tau + delta = sqrt(2*delta*M), so delta/T = T/(2M) = sqrt(delta/(2M)):
    # 10/268.328 + 268.328/7200 = 2 * 0.0372678 = 0.0745356
    assert expected_waste_fraction(TAU_10_1H, 10.0, HOUR) == pytest.approx(0.0745356, abs=1e-6)
    # + restart 36 s per failure: 36/3600 = 0.01
    assert expected_waste_fraction(TAU_10_1H, 10.0, HOUR, 36.0) == pytest.approx(0.0845356, 1e-5)
    # interval 90, save 10, M 3600: 10/100 + 100/7200 = 0.1 + 0.0138889
    assert expected_waste_fraction(90.0, 10.0, HOUR) == pytest.approx(0.1138889, abs=1e-6)


def test_waste_is_clamped_to_one():
    # 1000/1001 + 1001/200 > 1
    assert expected_waste_fraction(1.0, 1000.0, 100.0) == 1.0


# The tau = M branch (delta >= M/2) is a cap, not a minimum of the waste, so it is left out.
@pytest.mark.parametrize("save,mtbf", [(s, m) for s in SAVES for m in MTBFS if s < m / 2])
@pytest.mark.parametrize("restart", [0.0, 30.0])
def test_waste_is_least_near_the_optimum(save, mtbf, restart):
    opt = optimal_interval_s(save, mtbf)
    w = expected_waste_fraction(opt, save, mtbf, restart)
    assert w <= expected_waste_fraction(opt * 0.5, save, mtbf, restart)
    assert w <= expected_waste_fraction(opt * 2.0, save, mtbf, restart)
    assert w <= expected_waste_fraction(opt * 0.9, save, mtbf, restart)
    assert w <= expected_waste_fraction(opt * 1.1, save, mtbf, restart)


def test_interval_steps_hand_computed():
    # 258.33 s / 1 s = 258; / 0.5 s = 516.66 -> 517
    assert interval_steps(10.0, 1.0, 1.0, 1) == 258
    assert interval_steps(10.0, 0.5, 1.0, 1) == 517
    # 2 nodes of 1 h: M = 1800 s, sqrt(36000) - 10 = 179.74 -> 180
    assert interval_steps(10.0, 1.0, 1.0, 2) == 180


def test_interval_steps_bounds():
    assert interval_steps(10.0, 1.0, 1.0, 1, max_steps=100) == 100
    assert interval_steps(10.0, 1.0, 1.0, 1, max_steps=1000) == 258
    assert interval_steps(10.0, 10000.0, 1.0, 1) == 1  # a step longer than the interval
    assert interval_steps(10.0, 10000.0, 1.0, 1, max_steps=1) == 1


def test_failure_cost_at_the_optimum():
    c = failure_cost(save_s=10.0, restart_s=30.0, mtbf_hours_per_node=1.0, nodes=1)
    assert isinstance(c, FailureCost)
    assert c.interval_s == pytest.approx(TAU_10_1H)
    # 30 + 258.328/2 = 159.164
    assert c.expected_loss_per_failure_s == pytest.approx(30.0 + TAU_10_1H / 2)
    assert c.failures_per_day == pytest.approx(24.0)
    # 0.0745356 + 30/3600
    assert c.waste_fraction == pytest.approx(0.0745356 + 30.0 / 3600.0, abs=1e-6)


def test_failure_cost_with_a_given_interval():
    # 4 nodes of 100 h: M = 25 h = 90000 s, 86400/90000 = 0.96 failures a day
    c = failure_cost(10.0, 30.0, 100.0, 4, interval_s=100.0)
    assert c.interval_s == 100.0
    assert c.expected_loss_per_failure_s == pytest.approx(80.0)
    assert c.failures_per_day == pytest.approx(0.96)
    assert c.waste_fraction == pytest.approx(10 / 110 + 110 / 180000 + 30 / 90000)


@pytest.mark.parametrize(
    "call",
    [
        lambda: optimal_interval_s(0.0, HOUR),
        lambda: optimal_interval_s(-1.0, HOUR),
        lambda: optimal_interval_s(10.0, 0.0),
        lambda: optimal_interval_s(10.0, math.nan),
        lambda: system_mtbf_s(-5.0, 2),
        lambda: system_mtbf_s(5.0, 0),
        lambda: expected_waste_fraction(0.0, 10.0, HOUR),
        lambda: expected_waste_fraction(100.0, 10.0, HOUR, -1.0),
        lambda: interval_steps(10.0, 0.0, 1.0, 1),
        lambda: interval_steps(10.0, 1.0, 0.0, 1),
        lambda: interval_steps(10.0, 1.0, 1.0, 1, max_steps=0),
        lambda: failure_cost(10.0, -1.0, 1.0, 1),
        lambda: failure_cost(10.0, 1.0, 1.0, 1, interval_s=0.0),
    ],
)
def test_bad_inputs_raise_value_error(call):
    with pytest.raises(ValueError) as err:
        call()
    assert "\n" not in str(err.value)


def test_plan_stays_torch_free():
    import subprocess
    import sys

    code = "import sys, trainwise.plan.model.reliability, trainwise.plan; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
