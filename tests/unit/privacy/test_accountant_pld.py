"""The exact accounting (accounting="pld") against independent math: the analytic Gaussian mechanism recomputed here
with scipy.stats.norm and brentq, dp_accounting's PLD accountant at a ten times finer discretization, the RDP bound;
and its bookkeeping (lookahead, checkpoints of version 2 and 1, mixed noise, no noise, the fixed-size fallback)."""

from __future__ import annotations

import json
import math
import time

import pytest

from fdam_ray.privacy.accountant import (
    SOLVE_RTOL,
    STATE_VERSION,
    Accountant,
    analytic_gaussian_epsilon,
    shares_noise_multiplier,
    solve_sigma,
)
from fdam_ray.privacy.pld import PLD_INTERVAL

dp_accounting = pytest.importorskip("dp_accounting")  # the privacy extra
norm = pytest.importorskip("scipy.stats").norm
brentq = pytest.importorskip("scipy.optimize").brentq

DELTA = 1e-5


# -- independent recomputations --------------------------------------------------------------------------------------
def balle_wang_epsilon(mu: float, delta: float) -> float:
    """Balle and Wang 2018, Thm. 8, as written: the eps where Phi(mu/2 - eps/mu) - e^eps Phi(-mu/2 - eps/mu) = delta,
    mu = sensitivity / noise std."""
    def excess(eps: float) -> float:
        return norm.cdf(mu / 2 - eps / mu) - math.exp(eps) * norm.cdf(-mu / 2 - eps / mu) - delta

    if excess(0.0) <= 0:
        return 0.0
    hi = 1.0
    while excess(hi) > 0:
        hi *= 2
    return brentq(excess, 0.0, hi, xtol=1e-14, rtol=1e-14)


def library_pld_epsilon(q: float, runs: list[tuple[float, int]], interval: float, delta: float = DELTA) -> float:
    """dp_accounting's PLDAccountant composing PoissonSampledDpEvent(q, Gaussian(sigma)) count times per run."""
    acc = dp_accounting.pld.PLDAccountant(value_discretization_interval=interval)
    for sigma, count in runs:
        acc.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), count)
    return acc.get_epsilon(delta)


def poisson(sigma: float, n: int = 1000, s: int = 100, accounting: str = "pld") -> Accountant:
    return Accountant(noise_multiplier=sigma, delta=DELTA, population=n, sample_size=s, sampling="poisson",
                      accounting=accounting)


def full(sigma: float, accounting: str = "pld") -> Accountant:
    return Accountant.for_clients(noise_multiplier=sigma, delta=DELTA, num_clients=4, clients_per_round=None,
                                  accounting=accounting)


# -- full participation: the analytic Gaussian ------------------------------------------------------------------------
@pytest.mark.parametrize(("sigma", "rounds", "delta"), [(1.0, 40, 1e-5), (1.0, 1, 1e-5), (0.5, 1, 1e-5),
                                                        (2.0, 100, 1e-5), (5.0, 1000, 1e-6), (0.8, 50, 1e-3),
                                                        (20.0, 1, 1e-5), (1.3, 300, 1e-8), (0.3, 10, 1e-5)])
def test_full_participation_is_the_analytic_gaussian(sigma, rounds, delta):
    exact = balle_wang_epsilon(math.sqrt(rounds) / sigma, delta)
    assert analytic_gaussian_epsilon(sigma, delta, rounds) == pytest.approx(exact, rel=1e-6)
    acc = Accountant.for_clients(noise_multiplier=sigma, delta=delta, num_clients=4, clients_per_round=None)
    assert acc.accounting == acc.accounting_used == "pld" and acc.accounting_reason is None
    acc.step(rounds)
    assert acc.epsilon() == pytest.approx(exact, rel=1e-6)
    assert acc.epsilon() <= acc.epsilon_rdp()  # RDP is an upper bound


def test_forty_rounds_at_sigma_one_cost_the_exact_epsilon_not_the_rdp_bound():
    acc = full(1.0)
    acc.step(40)
    assert acc.epsilon() == pytest.approx(46.21, abs=0.005)  # Balle and Wang at mu = sqrt(40)
    assert acc.epsilon_rdp() == pytest.approx(48.80, abs=0.005)
    rdp = full(1.0, accounting="rdp")
    rdp.step(40)
    assert rdp.epsilon() == rdp.epsilon_rdp() == acc.epsilon_rdp()


def test_analytic_gaussian_extremes():
    assert analytic_gaussian_epsilon(0.0, DELTA, 3) == math.inf
    assert analytic_gaussian_epsilon(1.0, DELTA, 0) == 0.0
    assert analytic_gaussian_epsilon(1e4, DELTA) == pytest.approx(balle_wang_epsilon(1e-4, DELTA), rel=1e-6)
    assert analytic_gaussian_epsilon(1e6, DELTA) == 0.0  # delta(0) is already below delta
    big = analytic_gaussian_epsilon(0.01, 1e-10, 1000)  # mu ~ 3162: no cancellation in logs
    assert big == pytest.approx(1000 / (2 * 0.01 ** 2) + math.sqrt(1000) / 0.01 * 6.36, rel=1e-2)
    with pytest.raises(ValueError, match="noise_multiplier -1"):
        analytic_gaussian_epsilon(-1.0, DELTA)


# -- Poisson sampling: dp_accounting's PLD ----------------------------------------------------------------------------
@pytest.mark.parametrize(("n", "s", "sigma", "rounds"), [(1000, 100, 1.5, 200), (1000, 10, 5.0, 10),
                                                         (100, 30, 1.0, 50)])
def test_poisson_pld_is_within_one_percent_of_a_ten_times_finer_pld(n, s, sigma, rounds):
    acc = poisson(sigma, n, s)
    acc.step(rounds)
    fine = library_pld_epsilon(s / n, [(sigma, rounds)], PLD_INTERVAL / 10)
    assert acc.epsilon() == pytest.approx(fine, rel=1e-2)
    assert acc.epsilon() >= fine * (1 - 1e-9)  # pessimistic: the coarser grid only rounds up
    assert fine <= acc.epsilon_rdp()


def test_poisson_pld_is_dp_accountings_pld_accountant_at_the_same_interval():
    acc = poisson(1.5)
    acc.step(200)
    assert acc.epsilon() == pytest.approx(library_pld_epsilon(0.1, [(1.5, 200)], PLD_INTERVAL), rel=1e-9)


@pytest.mark.parametrize(("q", "sigma", "rounds"), [(0.1, 1.5, 200), (0.01, 1.0, 1000), (0.3, 2.0, 20)])
def test_poisson_pld_is_below_rdp_and_not_far_below(q, sigma, rounds):
    acc = poisson(sigma, 1000, round(1000 * q))
    acc.step(rounds)
    assert 0.75 * acc.epsilon_rdp() <= acc.epsilon() <= acc.epsilon_rdp()


def test_two_hundred_poisson_rounds_take_well_under_a_second():
    poisson(1.3).epsilon_after(5)  # imports and first calls outside the clock
    start = time.perf_counter()
    acc = poisson(1.5)
    acc.step(200)
    eps = acc.epsilon()
    assert time.perf_counter() - start < 1.0
    assert eps == pytest.approx(5.0544, abs=1e-3) and acc.epsilon_rdp() == pytest.approx(5.6124, abs=1e-3)


# -- histories: mixed noise, no noise, lookahead, checkpoints ----------------------------------------------------------
def test_a_mixed_sigma_history_composes_each_run():
    runs = [(1.0, 5), (shares_noise_multiplier(1.0, 4, 2), 2), (1.0, 3)]
    acc = full(1.0)
    for sigma, count in runs:
        acc.step(count, noise_multiplier=sigma)
    mu = math.sqrt(sum(count / sigma ** 2 for sigma, count in runs))  # one Gaussian, 1/sigma_eff^2 summed
    assert acc.epsilon() == pytest.approx(balle_wang_epsilon(mu, DELTA), rel=1e-6)
    sampled = poisson(1.5)
    for sigma, count in runs:
        sampled.step(count, noise_multiplier=1.5 * sigma)
    fine = library_pld_epsilon(0.1, [(1.5 * sigma, count) for sigma, count in runs], PLD_INTERVAL / 5)
    assert sampled.epsilon() == pytest.approx(fine, rel=1e-2)
    kept = poisson(1.5)
    kept.step(10)
    assert kept.epsilon() < sampled.epsilon()  # the dropped shares cost privacy


def test_no_noise_is_no_privacy():
    for acc in (full(0.0), poisson(0.0), poisson(1.0)):
        acc.step(2)
        acc.step(1, noise_multiplier=0.0)
        assert acc.epsilon() == acc.epsilon_rdp() == math.inf
    assert full(0.0).epsilon() == 0.0  # nothing released yet


@pytest.mark.parametrize("make", [lambda: full(1.1), lambda: poisson(1.1)])
def test_lookahead_equals_stepping_to_the_bit(make):
    acc, one_by_one = make(), make()
    ahead = acc.epsilon_after(3)
    assert acc.epsilon() == 0.0 and acc.rounds == 0
    for _ in range(3):
        one_by_one.step()
    acc.step(3)
    assert acc.epsilon() == ahead == one_by_one.epsilon()
    ahead = acc.epsilon_after(2, noise_multiplier=0.8)
    acc.step(2, noise_multiplier=0.8)
    assert acc.epsilon() == ahead > one_by_one.epsilon()


@pytest.mark.parametrize("make", [lambda: full(1.3), lambda: poisson(1.3)])
def test_a_checkpointed_pld_accountant_continues_to_the_bit(make):
    whole, first = make(), make()
    for acc in (whole, first):
        acc.step(5)
        acc.step(1, noise_multiplier=1.0)
    state = json.loads(json.dumps(first.state()))
    assert state["version"] == STATE_VERSION == 2 and state["accounting"] == "pld"
    resumed = Accountant.from_state(state)
    assert resumed.accounting == "pld" and resumed.epsilon() == first.epsilon() and resumed.rounds == 6
    for acc in (whole, resumed):
        acc.step(7)
    assert resumed.epsilon() == whole.epsilon() and resumed.state() == whole.state()


def test_a_version_1_state_is_read_as_rdp():
    old = poisson(1.3, accounting="rdp")
    old.step(5)
    state = {key: value for key, value in old.state().items() if key != "accounting"}
    state["version"] = 1  # what fdam-ray wrote before the PLD accounting
    resumed = Accountant.from_state(state)
    assert resumed.accounting == resumed.accounting_used == "rdp"
    assert resumed.epsilon() == old.epsilon() == resumed.epsilon_rdp()
    assert resumed.state()["version"] == 2 and resumed.state()["accounting"] == "rdp"


# -- the fixed-size sampler: no PLD in dp_accounting, RDP said so ------------------------------------------------------
def test_fixed_size_sampling_falls_back_to_rdp_and_says_why():
    acc = Accountant.for_clients(noise_multiplier=1.5, delta=DELTA, num_clients=10, clients_per_round=3)
    assert acc.accounting == "pld" and acc.accounting_used == "rdp" and acc.relation == "replace_one"
    assert "fixed-size" in acc.accounting_reason and "\n" not in acc.accounting_reason
    assert not dp_accounting.pld.PLDAccountant(
        neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE).supports(acc.event())
    acc.step(5)
    rdp = Accountant.for_clients(noise_multiplier=1.5, delta=DELTA, num_clients=10, clients_per_round=3,
                                 accounting="rdp")
    rdp.step(5)
    assert acc.epsilon() == acc.epsilon_rdp() == rdp.epsilon() and rdp.accounting_reason is None
    with pytest.raises(ValueError, match="accounting 'exact'"):
        full(1.0, accounting="exact")


# -- solving sigma --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("population", "sample", "sampling", "compositions", "target"), [
    (4, 4, "fixed", 20, 8.0),
    (4, 4, "fixed", 1000, 2.0),
    (10, 3, "poisson", 10, 4.0),
])
def test_solved_pld_sigma_meets_the_target_with_less_noise_than_rdp(population, sample, sampling, compositions,
                                                                    target):
    def spent(s: float, accounting: str = "pld") -> float:
        acc = Accountant(noise_multiplier=s, delta=DELTA, population=population, sample_size=sample,
                         sampling=sampling, accounting=accounting)
        return acc.epsilon_after(compositions)

    sigma = solve_sigma(target, DELTA, population=population, sample_size=sample, sampling=sampling,
                        compositions=compositions)
    assert spent(sigma) <= target < spent(sigma / (1 + SOLVE_RTOL))
    rdp_sigma = solve_sigma(target, DELTA, population=population, sample_size=sample, sampling=sampling,
                            compositions=compositions, accounting="rdp")
    assert spent(rdp_sigma, "rdp") <= target
    assert 0.03 < 1 - sigma / rdp_sigma < 0.2  # the exact accounting needs 6-10 % less noise here
