"""benchmarks/_netlab_fit.py: the round-time line fit and the ring all-reduce's bound, against closed forms."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))

import _netlab_fit as F


def test_the_fit_recovers_a_line_exactly_and_its_residuals_are_zero():
    fit = F.fit_line([(1.0, 478.0 + 1104.0), (2.0, 478.0 + 2208.0), (4.0, 478.0 + 4416.0)])
    assert (fit.a, fit.b) == pytest.approx((478.0, 1104.0))
    assert fit.residuals == pytest.approx((0.0, 0.0, 0.0), abs=1e-9)
    assert fit.at(3.0) == pytest.approx(478.0 + 3 * 1104.0)
    assert fit.x_at(478.0 + 10 * 1104.0) == pytest.approx(10.0)  # the link a round of that length implies


def test_the_fit_is_least_squares_and_its_residuals_are_measured_minus_fitted():
    points = [(1.0, 10.0), (2.0, 14.0), (4.0, 19.0)]
    fit = F.fit_line(points)
    b, a = np.polyfit([x for x, _ in points], [y for _, y in points], 1)  # an independent least squares
    assert (fit.a, fit.b) == pytest.approx((a, b))
    # closed form: mean x 7/3, mean y 43/3, Sxy = 41/3, Sxx = 14/3, so b = 41/14 and a = 43/3 - 41/14 * 7/3 = 15/2
    assert fit.b == pytest.approx(41 / 14) and fit.a == pytest.approx(15 / 2)
    want = tuple(y - (fit.a + fit.b * x) for x, y in points)
    assert fit.residuals == pytest.approx(want)
    assert sum(fit.residuals) == pytest.approx(0.0, abs=1e-12)  # least squares with an intercept
    assert fit.max_residual == pytest.approx(max(abs(r) for r in want))
    with pytest.raises(ValueError, match="two distinct x"):
        F.fit_line([(1.0, 3.0), (1.0, 4.0)])


def test_ns_per_bit_is_one_at_one_gigabit():
    assert F.ns_per_bit(1e9) == 1.0 and F.ns_per_bit(250e6) == 4.0 and F.ns_per_bit(100e6) == pytest.approx(10.0)
    with pytest.raises(ValueError, match="above zero"):
        F.ns_per_bit(0)


def test_the_ring_bound_is_two_p_minus_one_over_p_states_per_node():
    # 7M float32 values among 4 nodes: 2 * 3/4 * 224e6 bits = 336e6 ns at 1 ns a bit = 336 ms
    assert F.ring_bound_ms(7_000_000, 4) == pytest.approx(336.0)
    assert F.state_ms(7_000_000) == pytest.approx(224.0)
    assert F.ring_bound_ms(7_000_000, 2) == pytest.approx(224.0)  # p = 2: one state each way
    assert F.ring_bound_ms(7_000_000, 1) == 0.0  # one node: nothing crosses a link
    assert F.ring_bound_ms(7_000_000, 4, bits_per_float=16) == pytest.approx(168.0)
    # as p grows the bound tends to two states, never reaching it
    assert F.ring_bound_ms(1_000_000, 1000) == pytest.approx(2 * 32 * (999 / 1000))
    with pytest.raises(ValueError):
        F.ring_bound_ms(1000, 0)
