"""The privacy accountant: epsilon spent so far, epsilon after the next rounds, sigma for a target epsilon.

Two accountings (``accounting``): ``pld`` (the default) is exact where an exact one is known
(:mod:`fdam_ray.privacy.pld`): the analytic Gaussian for full participation, dp_accounting's privacy loss
distributions for Poisson sampling; fixed-size sampling has no PLD in dp_accounting, so there ``pld`` counts
with RDP and says so (:attr:`Accountant.accounting_used`, :attr:`Accountant.accounting_reason`). ``rdp`` is
dp_accounting's Renyi-DP accountant (Mironov 2017; ``RdpAccountant``)
over fixed orders (:data:`ORDERS`, those of dp_accounting 0.6.0's default, for the plain Gaussian;
:data:`INTEGER_ORDERS` for a subsampled release, where the divergence has a closed form; both written out
here so an upgrade of the library cannot move our numbers), with
its conversion to (epsilon, delta): the improved bound of Balle et al. 2020
(arXiv:2004.00010, Prop. 12) / Canonne et al. 2020 (arXiv:2001.05990, eq. 20),
epsilon = min over orders a of rdp(a) + log(1 - 1/a) - log(delta * a) / (a - 1).

One composition is one release of a clipped sum with noise multiplier sigma,
drawn from a population of n records with sample size s:

- s = n (every client takes part, or a full batch): ``GaussianDpEvent``, with
  add-or-remove-one neighbours (L2 sensitivity C);
- ``poisson``: ``PoissonSampledDpEvent(q = s / n)``, add-or-remove-one
  (Mironov, Talwar, Zhang 2019);
- ``fixed``: exactly s of n without replacement,
  ``SampledWithoutReplacementDpEvent``, which dp_accounting's RDP accountant
  supports under replace-one neighbours only (Wang, Balle, Kasiviswanathan
  2019, Thm. 27). Replacing one record's clipped vector by another moves the
  sum by up to 2C, so the event's Gaussian has noise multiplier sigma / 2;
  the epsilon is then a replace-one epsilon (:attr:`Accountant.relation`).

dp: client composes one event per round over the K clients (s = S);
dp: sample composes one per local step over a site's n_k samples (s = B),
for each site apart. A round whose noise shares came from fewer sites than
were asked is composed at its smaller sigma (:func:`shares_noise_multiplier`).

The accountant keeps its history as runs of (sigma, compositions), and its
Renyi divergence is recomputed from that history, so a resumed run (from
:meth:`Accountant.state`) and the run it continues report the same epsilon to
the bit; so with ``pld``. dp_accounting is an optional extra; without it, building an
accountant raises :class:`AccountingUnavailable` in one line.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from fdam_ray.files.extras import extra_hint
from fdam_ray.privacy.pld import (
    PoissonPLD,
    analytic_gaussian_epsilon,
    discretized_epsilon,
    gaussian_epsilon,
    gaussian_mu,
)

__all__ = ["ACCOUNTINGS", "ADD_OR_REMOVE", "INTEGER_ORDERS", "ORDERS", "REPLACE_ONE", "SAMPLINGS", "SOLVE_RTOL",
           "STATE_VERSION", "Accountant", "AccountingUnavailable", "analytic_gaussian_epsilon",
           "shares_noise_multiplier", "solve_sigma"]

SAMPLINGS = ("fixed", "poisson")
ACCOUNTINGS = ("pld", "rdp")
ADD_OR_REMOVE = "add_or_remove_one"
REPLACE_ONE = "replace_one"
STATE_VERSION = 2  # 2: with the accounting; a version-1 state (before PLD) is read as rdp
_CACHED_EPSILONS = 8  # epsilons of the latest histories, so epsilon_after then step then epsilon computes once
SOLVE_RTOL = 1e-4  # solve_sigma: relative width of the final bracket of sigma
_SIGMA_MAX = 2.0 ** 20  # solve_sigma gives up above this (a target no noise reaches)
_SIGMA_MIN = 2.0 ** -20

# dp_accounting 0.6.0's DEFAULT_RDP_ORDERS: 1.1 .. 10.9 by 0.1, 11 .. 63, 128, 256, 512, 1024.
ORDERS: tuple[float, ...] = (tuple(1 + x / 10 for x in range(1, 100)) + tuple(float(a) for a in range(11, 64))
                             + (128.0, 256.0, 512.0, 1024.0))
# The orders of a subsampled release (poisson, or fixed with s < n): the integer ones. There the Renyi divergence
# has a closed form (a finite binomial sum) that an independent recomputation reproduces to float precision;
# at fractional orders the library bounds it by a series, above the divergence itself (by 59% at order 1.5 for
# q = 0.14, sigma = 2.65, against direct numerical integration), so those orders only loosen the minimum.
INTEGER_ORDERS: tuple[float, ...] = (*tuple(float(a) for a in range(2, 64)), 128.0, 256.0, 512.0, 1024.0)


class AccountingUnavailable(ImportError, ValueError):
    """dp_accounting, the optional extra the accountant needs, is not installed (a ValueError too, so the CLI
    reports it in one line)."""


def _dp() -> Any:
    try:
        import dp_accounting
    except ImportError as exc:
        raise AccountingUnavailable("the privacy accountant needs dp-accounting: "
                                    + extra_hint("privacy", "dp-accounting==0.6.0")) from exc
    return dp_accounting


def shares_noise_multiplier(sigma: float, planned_sites: int, reported_sites: int) -> float:
    """The noise multiplier of a round whose shares N(0, sigma^2 C^2 / m) came from ``reported_sites`` of the
    m = ``planned_sites`` sites asked: sigma * sqrt(reported / planned)."""
    if not 0 <= reported_sites <= planned_sites or planned_sites < 1:
        raise ValueError(f"reported_sites {reported_sites} must lie in 0..planned_sites = {planned_sites}")
    return sigma * math.sqrt(reported_sites / planned_sites)


class Accountant:
    """(epsilon, delta) of a sequence of noised, clipped sums over one population (module docstring).

    Keyword-only: ``noise_multiplier`` sigma >= 0, ``delta`` in (0, 1), ``population`` n (K clients, or a
    site's n_k samples), ``sample_size`` s in 1..n (S, or B), ``sampling`` fixed | poisson, ``per_round``
    compositions a round makes by default (1 for dp: client, the local steps I for dp: sample), ``orders`` (of
    the RDP accounting), ``accounting`` pld | rdp.
    """

    def __init__(self, *, noise_multiplier: float, delta: float, population: int, sample_size: int,
                 sampling: str = "fixed", per_round: int = 1, orders: tuple[float, ...] | None = None,
                 accounting: str = "pld") -> None:
        if not (math.isfinite(noise_multiplier) and noise_multiplier >= 0):
            raise ValueError(f"noise_multiplier {noise_multiplier!r} is not allowed (a finite number >= 0)")
        if not 0 < delta < 1:
            raise ValueError(f"delta {delta!r} is not allowed (in (0, 1))")
        if population < 1 or not 1 <= sample_size <= population:
            raise ValueError(f"sample_size {sample_size} is not allowed (in 1..population = {population})")
        if sampling not in SAMPLINGS:
            raise ValueError(f"sampling {sampling!r} is not allowed ({', '.join(SAMPLINGS)})")
        if per_round < 1:
            raise ValueError(f"per_round {per_round} is not allowed (>= 1)")
        if accounting not in ACCOUNTINGS:
            raise ValueError(f"accounting {accounting!r} is not allowed ({', '.join(ACCOUNTINGS)})")
        if orders is None:  # the Gaussian's divergence is exact at every order; a subsampled one's at integers
            orders = ORDERS if sample_size == population else INTEGER_ORDERS
        if not orders or min(orders) <= 1:
            raise ValueError("orders must be a non-empty list of Renyi orders > 1")
        self._dp = _dp()
        self.noise_multiplier = float(noise_multiplier)
        self.delta = float(delta)
        self.population = int(population)
        self.sample_size = int(sample_size)
        self.sampling = sampling
        self.per_round = int(per_round)
        self.orders = tuple(float(a) for a in orders)
        self.accounting = accounting
        self.rounds = 0
        self._history: list[tuple[float, int]] = []  # runs of (sigma, compositions), in order
        self._unit: dict[float, np.ndarray] = {}  # Renyi divergence of one composition, by sigma
        self._pld: PoissonPLD | None = None  # the Poisson PLDs, made on first use
        self._epsilons: dict[tuple[str, tuple[tuple[float, int], ...]], float] = {}  # by (accounting, history)

    @classmethod
    def for_clients(cls, *, noise_multiplier: float, delta: float, num_clients: int,
                    clients_per_round: int | None, sampling: str = "fixed", accounting: str = "pld") -> Accountant:
        """dp: client: one composition a round, S = clients_per_round of K = num_clients (None: all K)."""
        sampled = num_clients if clients_per_round is None else min(clients_per_round, num_clients)
        return cls(noise_multiplier=noise_multiplier, delta=delta, population=num_clients, sample_size=sampled,
                   sampling=sampling, accounting=accounting)

    @classmethod
    def for_site(cls, *, noise_multiplier: float, delta: float, num_samples: int, batch_size: int,
                 local_steps: int, sampling: str = "poisson", accounting: str = "pld") -> Accountant:
        """dp: sample, one site: one composition a local step, batches of B = ``batch_size`` of its n_k =
        ``num_samples`` (0 or B >= n_k: the full batch)."""
        batch = num_samples if batch_size <= 0 else min(batch_size, num_samples)
        return cls(noise_multiplier=noise_multiplier, delta=delta, population=num_samples, sample_size=batch,
                   sampling=sampling, per_round=local_steps, accounting=accounting)

    @property
    def sampling_rate(self) -> float:
        """q = s / n."""
        return self.sample_size / self.population

    @property
    def relation(self) -> str:
        """The neighbouring relation the epsilon is stated under: replace-one for fixed-size subsampling (the
        only relation dp_accounting's RDP accountant takes it under), add-or-remove-one otherwise."""
        if self.sampling == "fixed" and self.sample_size < self.population:
            return REPLACE_ONE
        return ADD_OR_REMOVE

    @property
    def accounting_used(self) -> str:
        """The accounting the epsilon comes from: :attr:`accounting`, except ``rdp`` for ``pld`` on fixed-size
        sampling (:attr:`accounting_reason`)."""
        return "rdp" if self.accounting_reason is not None else self.accounting

    @property
    def accounting_reason(self) -> str | None:
        """Why ``pld`` was not used where it was asked for (None where it was, or where rdp was asked for)."""
        if self.accounting == "pld" and self.relation == REPLACE_ONE:
            return ("fixed-size sampling without replacement (replace-one) has no privacy loss distribution in "
                    "dp_accounting: counted with RDP")
        return None

    def event(self, noise_multiplier: float | None = None) -> Any:
        """The dp_accounting event of one composition (at sigma = ``noise_multiplier``, default this
        accountant's)."""
        dp = self._dp
        sigma = self.noise_multiplier if noise_multiplier is None else float(noise_multiplier)
        if self.sample_size == self.population:
            return dp.GaussianDpEvent(sigma)
        if self.sampling == "poisson":
            return dp.PoissonSampledDpEvent(self.sampling_rate, dp.GaussianDpEvent(sigma))
        # replace-one: one record's clipped vector replaced by another moves the sum by up to 2C
        return dp.SampledWithoutReplacementDpEvent(self.population, self.sample_size, dp.GaussianDpEvent(sigma / 2))

    def _rdp_accountant(self) -> Any:
        relation = self._dp.NeighboringRelation
        chosen = relation.REPLACE_ONE if self.relation == REPLACE_ONE else relation.ADD_OR_REMOVE_ONE
        return self._dp.rdp.RdpAccountant(orders=list(self.orders), neighboring_relation=chosen)

    def _unit_rdp(self, sigma: float) -> np.ndarray:
        if sigma not in self._unit and sigma == 0:
            self._unit[sigma] = np.full(len(self.orders), np.inf)  # no noise, no privacy (and no division by 0)
        if sigma not in self._unit:
            single = self._rdp_accountant()
            single.compose(self.event(sigma), 1)
            self._unit[sigma] = single.rdp
        return self._unit[sigma]

    def _planned(self, rounds: int, compositions: int | None, noise_multiplier: float | None) -> tuple[float, int]:
        if rounds < 0 or (compositions is not None and compositions < 0):
            raise ValueError(f"rounds {rounds} and compositions {compositions} must be >= 0")
        sigma = self.noise_multiplier if noise_multiplier is None else float(noise_multiplier)
        if not (math.isfinite(sigma) and sigma >= 0):
            raise ValueError(f"noise_multiplier {noise_multiplier!r} is not allowed (a finite number >= 0)")
        return sigma, rounds * (self.per_round if compositions is None else compositions)

    @staticmethod
    def _joined(history: list[tuple[float, int]], sigma: float, count: int) -> list[tuple[float, int]]:
        if count == 0:
            return list(history)
        if history and history[-1][0] == sigma:
            return [*history[:-1], (sigma, history[-1][1] + count)]
        return [*history, (sigma, count)]

    def _rdp_of(self, history: list[tuple[float, int]]) -> np.ndarray:
        total = np.zeros(len(self.orders), dtype=np.float64)
        for sigma, count in history:
            total += count * self._unit_rdp(sigma)  # as RdpAccountant.compose(event, count) adds it
        return total

    def _epsilon_of(self, history: list[tuple[float, int]], accounting: str | None = None) -> float:
        if not history:
            return 0.0
        used = self.accounting_used if accounting is None else accounting
        key = (used, tuple(history))
        if key not in self._epsilons:
            self._epsilons[key] = self._rdp_epsilon(history) if used == "rdp" else self._pld_epsilon(history)
            while len(self._epsilons) > _CACHED_EPSILONS:
                del self._epsilons[next(iter(self._epsilons))]  # the oldest
        return self._epsilons[key]

    def _rdp_epsilon(self, history: list[tuple[float, int]]) -> float:
        # an order at inf (sigma = 0, or an order dp_accounting could not compute) drops out of the minimum
        eps, _ = self._dp.rdp.rdp_privacy_accountant.compute_epsilon(self.orders, self._rdp_of(history), self.delta)
        return float(eps)

    def _pld_epsilon(self, history: list[tuple[float, int]]) -> float:
        if self.sample_size == self.population:  # one Gaussian: exact
            return gaussian_epsilon(gaussian_mu(history), self.delta)
        if self._pld is None:
            self._pld = PoissonPLD(self._dp, self.sampling_rate)
        made = self._pld
        return discretized_epsilon(lambda interval: made.epsilon(history, self.delta, interval))

    def rdp(self) -> np.ndarray:
        """The Renyi divergence spent so far, at each of :attr:`orders`."""
        return self._rdp_of(self._history)

    def step(self, rounds: int = 1, *, compositions: int | None = None, noise_multiplier: float | None = None) -> None:
        """Count ``rounds`` rounds of ``compositions`` releases each (default :attr:`per_round`), at sigma =
        ``noise_multiplier`` (default this accountant's; a smaller one after dropped noise shares)."""
        sigma, count = self._planned(rounds, compositions, noise_multiplier)
        self._history = self._joined(self._history, sigma, count)
        self.rounds += rounds

    def epsilon(self) -> float:
        """epsilon at :attr:`delta` of everything counted so far (0 before the first round, inf without noise), by
        :attr:`accounting_used`."""
        return self._epsilon_of(self._history)

    def epsilon_rdp(self) -> float:
        """The RDP epsilon of the same history, whatever the accounting (to compare, in a summary)."""
        return self._epsilon_of(self._history, "rdp")

    def epsilon_after(self, rounds: int = 1, *, compositions: int | None = None,
                      noise_multiplier: float | None = None) -> float:
        """epsilon after ``rounds`` more rounds, without counting them (so a run can stop before a round that
        would take it past its budget); equals :meth:`step` then :meth:`epsilon`, to the bit."""
        sigma, count = self._planned(rounds, compositions, noise_multiplier)
        return self._epsilon_of(self._joined(self._history, sigma, count))

    def state(self) -> dict[str, Any]:
        """The accountant as plain values (ints, floats, the sampling's name, lists of them) for a checkpoint."""
        return {"version": STATE_VERSION, "noise_multiplier": self.noise_multiplier, "delta": self.delta,
                "population": self.population, "sample_size": self.sample_size, "sampling": self.sampling,
                "per_round": self.per_round, "orders": list(self.orders), "accounting": self.accounting,
                "rounds": self.rounds,
                "history": [[sigma, count] for sigma, count in self._history]}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Accountant:
        """The accountant :meth:`state` described (its sigma included: a resumed run must not solve sigma
        again). A version-1 state, from before the PLD accounting, counts with rdp, as it did."""
        version = state.get("version")
        if version not in (1, STATE_VERSION):
            raise ValueError(f"privacy accountant state of version {version!r} is not readable "
                             f"(this fdam-ray reads versions 1 and {STATE_VERSION})")
        made = cls(noise_multiplier=state["noise_multiplier"], delta=state["delta"], population=state["population"],
                   sample_size=state["sample_size"], sampling=state["sampling"], per_round=state["per_round"],
                   orders=tuple(state["orders"]), accounting="rdp" if version == 1 else state["accounting"])
        made.rounds = int(state["rounds"])
        made._history = [(float(sigma), int(count)) for sigma, count in state["history"]]
        return made


def solve_sigma(target_epsilon: float, delta: float, *, population: int, sample_size: int, sampling: str = "fixed",
                compositions: int, orders: tuple[float, ...] | None = None, accounting: str = "pld") -> float:
    """The smallest sigma (to relative tolerance :data:`SOLVE_RTOL`) whose ``compositions`` releases spend at
    most ``target_epsilon`` at ``delta`` by ``accounting``; the returned sigma always meets the target (the
    bracket's upper end, kept by Brent's method on log sigma, then by bisection). Raises ValueError for a target no
    sigma up to 2^20 reaches."""
    from scipy.optimize import brentq

    if not (math.isfinite(target_epsilon) and target_epsilon > 0):
        raise ValueError(f"target_epsilon {target_epsilon!r} is not allowed (a finite number > 0)")
    if compositions < 1:
        raise ValueError(f"compositions {compositions} is not allowed (>= 1)")
    tried: dict[float, float] = {}  # epsilon by sigma

    def spent(sigma: float) -> float:
        if sigma not in tried:
            made = Accountant(noise_multiplier=sigma, delta=delta, population=population, sample_size=sample_size,
                              sampling=sampling, orders=orders, accounting=accounting)
            tried[sigma] = made.epsilon_after(compositions)
        return tried[sigma]

    hi = 1.0
    while spent(hi) > target_epsilon:
        hi *= 2
        if hi > _SIGMA_MAX:
            raise ValueError(f"target_epsilon {target_epsilon} is not reached at delta {delta} by any noise "
                             f"multiplier up to {_SIGMA_MAX:g}")
    lo = hi / 2
    while spent(lo) <= target_epsilon:
        if lo < _SIGMA_MIN:
            return lo  # so much budget that (almost) no noise is needed
        hi, lo = lo, lo / 2
    # spent(lo) > target >= spent(hi): Brent's method narrows the bracket in few evaluations (a PLD's are slow)
    brentq(lambda x: spent(math.exp(x)) - target_epsilon, math.log(lo), math.log(hi),
           xtol=math.log1p(SOLVE_RTOL) / 4, maxiter=200)
    hi = min(sigma for sigma, eps in tried.items() if eps <= target_epsilon)
    lo = max(sigma for sigma, eps in tried.items() if eps > target_epsilon and sigma < hi)
    while hi / lo > 1 + SOLVE_RTOL:
        mid = math.sqrt(lo * hi)
        if spent(mid) <= target_epsilon:
            hi = mid
        else:
            lo = mid
    return hi
