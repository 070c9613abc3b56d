"""benchmarks/_stats.py: t quantiles against published tables and closed forms, and the two intervals."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import _stats as S

# Student's t quantiles as printed in standard tables (5-6 significant digits).
TABLE = [(0.95, 1, 6.313752), (0.975, 1, 12.706205), (0.95, 2, 2.919986), (0.975, 2, 4.302653),
         (0.95, 3, 2.353363), (0.95, 4, 2.131847), (0.975, 4, 2.776445), (0.95, 9, 1.833113),
         (0.975, 10, 2.228139), (0.99, 5, 3.364930), (0.95, 30, 1.697261), (0.975, 120, 1.979930)]


@pytest.mark.parametrize(("p", "df", "expected"), TABLE)
def test_t_quantile_matches_the_printed_table(p, df, expected):
    assert S.t_quantile(p, df) == pytest.approx(expected, abs=2e-6)
    assert S.t_quantile(1 - p, df) == pytest.approx(-expected, abs=2e-6)  # symmetric


def test_t_cdf_closed_forms():
    # df 1 is the Cauchy distribution, df 2 has F(x) = 1/2 + x / (2 sqrt(x^2 + 2))
    for x in (-3.0, -0.4, 0.0, 0.7, 5.0):
        assert S.t_cdf(x, 1) == pytest.approx(0.5 + math.atan(x) / math.pi, abs=1e-15)
        assert S.t_cdf(x, 2) == pytest.approx(0.5 + x / (2 * math.sqrt(x * x + 2)), abs=1e-15)
    # df 3: F(x) = 1/2 + (atan(x/sqrt3) + sqrt3 x / (x^2 + 3)) / pi
    for x in (-2.0, 0.3, 1.5):
        expected = 0.5 + (math.atan(x / math.sqrt(3)) + math.sqrt(3) * x / (x * x + 3)) / math.pi
        assert S.t_cdf(x, 3) == pytest.approx(expected, abs=1e-15)
    assert S.t_cdf(math.inf, 4) == 1.0 and S.t_cdf(-math.inf, 4) == 0.0


def test_t_quantile_tends_to_the_normal_and_inverts_the_cdf():
    assert S.t_quantile(0.95, 5000) == pytest.approx(1.644854, abs=1e-3)
    for df in (1, 2, 3, 6, 7, 25):
        for p in (0.6, 0.9, 0.995):
            assert S.t_cdf(S.t_quantile(p, df), df) == pytest.approx(p, abs=1e-12)
    assert S.t_quantile(0.95, 4) > S.t_quantile(0.95, 5) > S.t_quantile(0.95, 30)  # heavier tails at small df


@pytest.mark.parametrize("bad", [0, -1, 2.5, True])
def test_t_rejects_non_integer_degrees_of_freedom(bad):
    with pytest.raises(ValueError, match="degrees of freedom"):
        S.t_quantile(0.95, bad)


@pytest.mark.parametrize("p", [0.0, 1.0, 1.5, -0.1])
def test_t_quantile_rejects_a_probability_outside_0_1(p):
    with pytest.raises(ValueError, match="strictly between 0 and 1"):
        S.t_quantile(p, 3)


def test_interval_of_constant_differences_is_a_point():
    for method in (S.t_interval, S.bootstrap_interval):
        assert method([-0.01] * 5) == pytest.approx((-0.01, -0.01, -0.01), abs=1e-15)
        assert method([0.0] * 5) == (0.0, 0.0, 0.0)


def test_t_interval_closed_form():
    values = [0.01, -0.004, 0.002, 0.015, -0.008]
    mean, lo, hi = S.t_interval(values, 0.9)
    half = 2.131847 * np.std(values, ddof=1) / math.sqrt(5)
    assert mean == pytest.approx(np.mean(values))
    assert (lo, hi) == pytest.approx((mean - half, mean + half), abs=1e-8)
    _, lo95, hi95 = S.t_interval(values, 0.95)
    assert lo95 < lo and hi95 > hi  # a higher level is wider
    m1, lo1, hi1 = S.t_interval([0.3])
    assert m1 == 0.3 and math.isnan(lo1) and math.isnan(hi1)  # one value: no spread to measure


def test_bootstrap_interval_covers_the_mean_and_is_reproducible():
    rng = np.random.default_rng(5)
    values = rng.normal(-0.01, 0.005, size=5).tolist()
    mean, lo, hi = S.bootstrap_interval(values, 0.9, seed=0)
    assert mean == pytest.approx(np.mean(values))
    assert lo < mean < hi
    assert min(values) <= lo and hi <= max(values)  # a mean of resampled values stays within their range
    assert S.bootstrap_interval(values, 0.9, seed=0) == (mean, lo, hi)  # the same seed, the same interval
    assert S.bootstrap_interval(values, 0.9, seed=1) != (mean, lo, hi)
    _, lo95, hi95 = S.bootstrap_interval(values, 0.95, seed=0)
    assert lo95 <= lo and hi95 >= hi


def test_bootstrap_interval_matches_the_exact_resampling_distribution():
    # two values a, b: a resample of two has mean a, (a+b)/2 or b with probabilities 1/4, 1/2, 1/4
    _, lo, hi = S.bootstrap_interval([0.0, 1.0], 0.4, resamples=20000, seed=3)
    assert (lo, hi) == (0.5, 0.5)  # the central 40% is the middle atom
    _, lo, hi = S.bootstrap_interval([0.0, 1.0], 0.9, resamples=20000, seed=3)
    assert (lo, hi) == (0.0, 1.0)


def test_intervals_refuse_bad_input():
    with pytest.raises(ValueError, match="NaN"):
        S.t_interval([0.1, math.nan])
    with pytest.raises(ValueError, match="no values"):
        S.bootstrap_interval([])
    with pytest.raises(ValueError, match="level"):
        S.t_interval([0.1, 0.2], 1.0)
    with pytest.raises(ValueError, match="resamples"):
        S.bootstrap_interval([0.1, 0.2], resamples=0)
