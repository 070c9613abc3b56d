"""Exact (epsilon, delta) accounting: the analytic Gaussian and privacy loss distributions (PLD).

Two cases, both under add-or-remove-one neighbours (the accountant's module docstring says which event is which):

- every record in every release (full participation): T_i releases at noise multipliers sigma_i compose to one
  Gaussian mechanism of sensitivity 1 and noise multiplier sigma_eff, 1 / sigma_eff^2 = sum_i T_i / sigma_i^2, whose
  epsilon is exact (Balle and Wang 2018, Thm. 8): the root of
  delta(eps) = Phi(mu/2 - eps/mu) - e^eps Phi(-mu/2 - eps/mu), mu = 1 / sigma_eff
  (:func:`analytic_gaussian_epsilon`), solved in logs so large epsilons lose nothing to cancellation;
- the Poisson-subsampled Gaussian: dp_accounting's PLD of the mechanism (connect-the-dots, pessimistic estimate,
  so the epsilon is an upper bound of the exact one), self-composed per run of equal sigma, runs composed in
  order. Its discretization interval h is chosen per history (:func:`discretized_epsilon`): from
  :data:`PLD_INTERVAL` it is halved until the epsilon at 2h and at h differ by at most :data:`PLD_CHECK` of the
  latter (the error falls as h^2, so the one at h is about a third of that difference), down to
  :data:`PLD_MIN_INTERVAL`. The interval depends on the history only, so a resumed accountant and the one it
  continues compute the same PLDs and report the same epsilon to the bit.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

PLD_INTERVAL = 1e-3  # the first discretization interval of the privacy loss
PLD_MIN_INTERVAL = 1e-4  # the finest one tried
PLD_CHECK = 6e-3  # accept h when epsilon(2h) - epsilon(h) <= PLD_CHECK * epsilon(h) (error at h about a third)
_CACHED_RUNS = 16  # self-composed PLDs kept per accountant (the history's runs at the latest intervals)


def _log1mexp(x: float) -> float:
    """log(1 - exp(x)) for x < 0, accurate near 0 and far below it."""
    return math.log(-math.expm1(x)) if x > -math.log(2) else math.log1p(-math.exp(x))


def gaussian_log_delta(mu: float, epsilon: float) -> float:
    """log delta(epsilon) of the Gaussian mechanism with sensitivity / noise std = ``mu`` > 0 (Balle and Wang 2018,
    Thm. 8), as log Phi(a) + log(1 - exp(epsilon + log Phi(b) - log Phi(a))): no difference of near-equal numbers."""
    from scipy.special import log_ndtr

    log_a = float(log_ndtr(mu / 2 - epsilon / mu))
    log_b = epsilon + float(log_ndtr(-mu / 2 - epsilon / mu))
    if log_b >= log_a:  # only by rounding, where delta is below every float
        return -math.inf
    return log_a + _log1mexp(log_b - log_a)


def gaussian_epsilon(mu: float, delta: float) -> float:
    """The exact epsilon at ``delta`` of the Gaussian mechanism with sensitivity / noise std = ``mu`` (0: none
    released, inf: no noise): the root of :func:`gaussian_log_delta` = log delta, by Brent's method to about 1e-14
    relative (0 when delta(0) is already at most delta)."""
    from scipy.optimize import brentq

    if mu == 0:
        return 0.0
    if math.isinf(mu):
        return math.inf
    target = math.log(delta)

    def excess(eps: float) -> float:
        return gaussian_log_delta(mu, eps) - target

    if excess(0.0) <= 0:
        return 0.0
    hi = max(1.0, mu * mu / 2 + mu * math.sqrt(2 * math.log(1 / delta)))  # above the root for mu >= ~1
    while excess(hi) > 0:
        hi *= 2
    return float(brentq(excess, 0.0, hi, xtol=1e-15, rtol=1e-14, maxiter=500))


def gaussian_mu(history: Sequence[tuple[float, int]]) -> float:
    """mu = 1 / sigma_eff of a history of runs (sigma_i, T_i) of full-participation releases:
    sqrt(sum_i T_i / sigma_i^2), inf if a run with releases has no noise."""
    total = 0.0
    for sigma, count in history:
        if count == 0:
            continue
        if sigma == 0:
            return math.inf
        total += count / (sigma * sigma)
    return math.sqrt(total)


def analytic_gaussian_epsilon(noise_multiplier: float, delta: float, compositions: int = 1) -> float:
    """The exact epsilon at ``delta`` of ``compositions`` releases of a sensitivity-1 sum with Gaussian noise of
    std ``noise_multiplier`` (add-or-remove-one, every record in every release): one Gaussian of noise
    multiplier sigma / sqrt(T) (Balle and Wang 2018). sigma = 0 gives inf."""
    if not (math.isfinite(noise_multiplier) and noise_multiplier >= 0):
        raise ValueError(f"noise_multiplier {noise_multiplier!r} is not allowed (a finite number >= 0)")
    if not 0 < delta < 1:
        raise ValueError(f"delta {delta!r} is not allowed (in (0, 1))")
    if compositions < 0:
        raise ValueError(f"compositions {compositions} is not allowed (>= 0)")
    return gaussian_epsilon(gaussian_mu([(float(noise_multiplier), int(compositions))]), delta)


class PoissonPLD:
    """The Poisson-subsampled Gaussian's PLDs at sampling rate ``q``, cached: one release's PLD by (sigma, h), the
    self-composed run by (sigma, count, h) (the latest :data:`_CACHED_RUNS`), as the RDP side caches one release's
    divergence by sigma."""

    def __init__(self, dp: Any, q: float) -> None:
        self._pld = dp.pld.privacy_loss_distribution
        self.q = q
        self._units: dict[tuple[float, float], Any] = {}
        self._runs: dict[tuple[float, int, float], Any] = {}

    def unit(self, sigma: float, interval: float) -> Any:
        key = (sigma, interval)
        if key not in self._units:
            self._units[key] = self._pld.from_gaussian_mechanism(
                standard_deviation=sigma, sampling_prob=self.q, value_discretization_interval=interval,
                pessimistic_estimate=True)
        return self._units[key]

    def run(self, sigma: float, count: int, interval: float) -> Any:
        key = (sigma, count, interval)
        if key not in self._runs:
            unit = self.unit(sigma, interval)
            self._runs[key] = unit if count == 1 else unit.self_compose(count)
            while len(self._runs) > _CACHED_RUNS:
                del self._runs[next(iter(self._runs))]  # the oldest
        return self._runs[key]

    def epsilon(self, history: Sequence[tuple[float, int]], delta: float, interval: float) -> float:
        """epsilon at ``delta`` of the history's runs composed in order, at discretization ``interval``."""
        runs = [(sigma, count) for sigma, count in history if count > 0]
        if not runs:
            return 0.0
        if any(sigma == 0 for sigma, _ in runs):
            return math.inf
        composed = self.run(*runs[0], interval)
        for sigma, count in runs[1:]:
            composed = composed.compose(self.run(sigma, count, interval))
        return float(composed.get_epsilon_for_delta(delta))


def discretized_epsilon(epsilon_at: Callable[[float], float]) -> float:
    """epsilon_at(h) at the coarsest h = :data:`PLD_INTERVAL` / 2^k (down to :data:`PLD_MIN_INTERVAL`) where
    epsilon_at(2h) - epsilon_at(h) <= :data:`PLD_CHECK` * epsilon_at(h)."""
    interval = PLD_INTERVAL
    coarse = epsilon_at(2 * interval)
    while True:
        fine = epsilon_at(interval)
        if not math.isfinite(fine) or fine == 0 or coarse - fine <= PLD_CHECK * fine:
            return fine
        if interval / 2 < PLD_MIN_INTERVAL * (1 - 1e-9):
            return fine
        interval, coarse = interval / 2, fine
