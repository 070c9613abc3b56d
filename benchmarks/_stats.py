"""Small statistics for benchmarks that compare paired runs over a handful of seeds.

NumPy only (no SciPy): Student's t quantiles for integer degrees of freedom
(the exact CDF of Abramowitz & Stegun 26.7.3-4, inverted by bisection), the
t-interval of a mean, and the percentile bootstrap interval of a mean with a
fixed RNG seed, so a results table built from it is reproducible.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np


def t_cdf(x: float, df: int) -> float:
    """P(T <= x) for Student's t with ``df`` (a positive integer) degrees of freedom, exactly.

    With theta = atan(x / sqrt(df)): odd df, 1/2 + (theta + sin theta cos theta (1 + 2/3 cos^2 theta + ...
    + (2*4*...*(df-3)) / (1*3*...*(df-2)) cos^(df-3) theta)) / pi; even df, 1/2 + sin theta (1 + 1/2
    cos^2 theta + ... + (1*3*...*(df-3)) / (2*4*...*(df-2)) cos^(df-2) theta) / 2.
    """
    if isinstance(df, bool) or not isinstance(df, int | np.integer) or df < 1:
        raise ValueError(f"degrees of freedom {df!r}: must be a positive integer")
    if math.isinf(x):
        return 1.0 if x > 0 else 0.0
    theta = math.atan2(x, math.sqrt(df))
    s, c2 = math.sin(theta), math.cos(theta) ** 2
    if df % 2:
        total, term = 0.0, 1.0
        for k in range(1, (df - 1) // 2 + 1):  # terms up to cos^(df-3): (df-1)/2 of them for df >= 3
            total += term
            term *= c2 * (2 * k) / (2 * k + 1)
        series = math.cos(theta) * total if df > 1 else 0.0
        return 0.5 + (theta + s * series) / math.pi
    total, term = 0.0, 1.0
    for k in range(1, df // 2 + 1):  # terms up to cos^(df-2): df/2 of them
        total += term
        term *= c2 * (2 * k - 1) / (2 * k)
    return 0.5 + 0.5 * s * total


def t_quantile(p: float, df: int) -> float:
    """The ``p`` quantile of Student's t with ``df`` degrees of freedom (e.g. 2.1318 for p 0.95, df 4)."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"probability {p!r}: must be strictly between 0 and 1")
    t_cdf(0.0, df)  # checks df
    if p < 0.5:
        return -t_quantile(1.0 - p, df)
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < p:
        hi *= 2.0
    for _ in range(200):  # bisection to the float resolution
        mid = 0.5 * (lo + hi)
        if mid in (lo, hi):
            break
        lo, hi = (mid, hi) if t_cdf(mid, df) < p else (lo, mid)
    return 0.5 * (lo + hi)


def _finite(values: Sequence[float], what: str) -> np.ndarray:
    arr = np.asarray(values, dtype=np.float64).reshape(-1)
    if arr.size == 0:
        raise ValueError(f"{what}: no values")
    if not np.isfinite(arr).all():
        raise ValueError(f"{what}: NaN or infinite value among {arr.tolist()}")
    return arr


def _check_level(level: float) -> None:
    if not 0.0 < level < 1.0:
        raise ValueError(f"confidence level {level!r}: must be strictly between 0 and 1")


def t_interval(values: Sequence[float], level: float = 0.9) -> tuple[float, float, float]:
    """(mean, low, high): the two-sided ``level`` t-interval of the mean of ``values``.

    Half-width t_{(1+level)/2, n-1} s / sqrt(n) with s the sample std (ddof 1). With a single value the
    spread is unknown and both bounds are NaN.
    """
    arr = _finite(values, "t_interval")
    _check_level(level)
    mean = float(arr.mean())
    if arr.size < 2:
        return mean, math.nan, math.nan
    half = t_quantile(0.5 + level / 2, arr.size - 1) * float(arr.std(ddof=1)) / math.sqrt(arr.size)
    return mean, mean - half, mean + half


def bootstrap_interval(values: Sequence[float], level: float = 0.9, *, resamples: int = 10000,
                       seed: int = 0) -> tuple[float, float, float]:
    """(mean, low, high): the percentile bootstrap ``level`` interval of the mean of ``values``.

    Resamples the values (for paired runs: the per-seed differences, so whole seeds are resampled) with
    replacement ``resamples`` times from ``numpy.random.default_rng(seed)``; the same inputs and seed give
    the same interval. With a single value both bounds equal it (a bootstrap cannot see a spread).
    """
    arr = _finite(values, "bootstrap_interval")
    _check_level(level)
    if resamples < 1:
        raise ValueError(f"resamples {resamples!r}: must be >= 1")
    rng = np.random.default_rng(seed)
    means = arr[rng.integers(0, arr.size, size=(resamples, arr.size))].mean(axis=1)
    lo, hi = np.quantile(means, [0.5 - level / 2, 0.5 + level / 2])
    mean = float(arr.mean())
    # a constant sample resamples to float sums that may differ from its mean in the last bit
    return mean, min(float(lo), mean), max(float(hi), mean)
