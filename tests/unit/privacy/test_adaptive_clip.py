"""Adaptive clipping of dp: client (fdam_ray/privacy/adaptive.py, Andrew et al. 2021) against closed forms and
independent recomputations: sigma_z and the pair's composition into one Gaussian of sigma (RDP exactly, PLD to its
discretization), the geometric update's fixed point at the gamma-quantile of a known norm distribution, the count
noise's std and stream, the server's reducer (the released fraction, the update noise of sigma_z C_r) and the
section's refusals."""

from __future__ import annotations

import math

import numpy as np
import pytest

from fdam_ray.config import build_config
from fdam_ray.core.state import ClientUpdate, GlobalState, StepStats
from fdam_ray.privacy.adaptive import (
    AdaptiveClip,
    AdaptiveClipState,
    composed_multiplier,
    count_generator,
    default_count_noise,
    next_clip,
    noised_fraction,
    update_noise_multiplier,
)
from fdam_ray.privacy.client_level import ClientLevel, ServerRound, private_finish, private_update
from fdam_ray.privacy.mechanisms import gaussian_noise, noise_generator
from fdam_ray.settings.sections import ConfigError

E = np.empty(0, dtype=np.float32)
CNT = np.empty(0, dtype=np.int64)
CLIENT = {"dp": "client", "model": "mlp", "dp_noise_multiplier": 1.0, "positive_ratio": 0.2, "algorithm": "coda_plus"}


# -- sigma_z and the composition -------------------------------------------------------------------------------------
@pytest.mark.parametrize(("sigma", "sigma_b"), [(1.0, 1.0), (0.8, 5.0), (2.0, 1.01), (0.3, 0.2)])
def test_sigma_z_closed_form_and_the_pair_composes_to_sigma(sigma, sigma_b):
    z = update_noise_multiplier(sigma, sigma_b)
    assert z == pytest.approx(1.0 / math.sqrt(1.0 / sigma**2 - 1.0 / (4.0 * sigma_b**2)), rel=1e-12)
    assert z > sigma and composed_multiplier(z, sigma_b) == pytest.approx(sigma, rel=1e-12)


def test_sigma_1_sigma_b_1_gives_2_over_sqrt_3():
    assert update_noise_multiplier(1.0, 1.0) == pytest.approx(2.0 / math.sqrt(3.0), rel=1e-14)
    assert update_noise_multiplier(0.0, 0.1) == 0.0  # no noise to share


@pytest.mark.parametrize("sigma_b", [0.5, 0.4, 0.0])
def test_a_count_noise_at_most_half_sigma_is_refused_in_one_line(sigma_b):
    with pytest.raises(ValueError) as caught:
        update_noise_multiplier(1.0, sigma_b)
    message = str(caught.value)
    assert "\n" not in message and "dp_clip_count_noise" in message and "dp_noise_multiplier" in message


def test_rdp_and_pld_of_the_pair_equal_one_gaussian_of_sigma():
    dp_accounting = pytest.importorskip("dp_accounting")
    from dp_accounting import pld, rdp

    sigma, sigma_b, rounds, delta = 1.1, 0.9, 50, 1e-5
    z = update_noise_multiplier(sigma, sigma_b)
    # the update: sensitivity C, std z C (multiplier z); the count: sensitivity 1/2, std sigma_b (multiplier 2 sigma_b)
    pair = dp_accounting.ComposedDpEvent([dp_accounting.GaussianDpEvent(z),
                                          dp_accounting.GaussianDpEvent(2 * sigma_b)])
    one = dp_accounting.GaussianDpEvent(sigma)
    orders = [1.5, 2, 4, 8, 16, 32, 64]
    a = rdp.RdpAccountant(orders).compose(pair, rounds)
    b = rdp.RdpAccountant(orders).compose(one, rounds)
    np.testing.assert_allclose(a._rdp, b._rdp, rtol=1e-12)  # alpha / (2 sigma^2) per round, both
    np.testing.assert_allclose(b._rdp, [rounds * o / (2 * sigma**2) for o in orders], rtol=1e-12)
    pa = pld.PLDAccountant(value_discretization_interval=1e-4).compose(pair, rounds)
    pb = pld.PLDAccountant(value_discretization_interval=1e-4).compose(one, rounds)
    assert pa.get_epsilon(delta) == pytest.approx(pb.get_epsilon(delta), rel=2e-3)
    # and the update alone at sigma_z would be cheaper: the count's share is real
    pz = pld.PLDAccountant(value_discretization_interval=1e-4).compose(dp_accounting.GaussianDpEvent(z), rounds)
    assert pz.get_epsilon(delta) < 0.95 * pb.get_epsilon(delta)


# -- the geometric update ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("gamma", [0.5, 0.8, 0.3])
def test_the_clip_converges_to_the_gamma_quantile_of_lognormal_norms(gamma):
    from statistics import NormalDist

    rng = np.random.default_rng(0)
    s, settings = 200, AdaptiveClip(quantile=gamma, lr=0.2, count_noise=1e-9)
    clip, seen = 0.01, []
    for r in range(1, 601):
        norms = rng.lognormal(mean=0.0, sigma=1.0, size=s)
        clip = next_clip(clip, noised_fraction(list(norms <= clip), s, settings.count_noise,
                                               count_generator(3, r)), settings)
        seen.append(clip)
    quantile = math.exp(NormalDist().inv_cdf(gamma))  # lognormal(0, 1)'s gamma-quantile
    assert np.mean(seen[-200:]) == pytest.approx(quantile, rel=0.04)
    assert abs(math.log(seen[0] / 0.01)) == pytest.approx(0.2 * gamma, rel=1e-6)  # no client within 0.01: b = 0


def test_one_step_is_the_closed_form():
    settings = AdaptiveClip(quantile=0.5, lr=0.2, count_noise=1.0)
    assert next_clip(2.0, 0.9, settings) == pytest.approx(2.0 * math.exp(-0.2 * 0.4), rel=1e-15)
    assert next_clip(2.0, 0.5, settings) == 2.0


def test_the_count_noise_has_std_sigma_b_over_s_in_its_own_stream():
    bits, s, sigma_b = [True] * 6 + [False] * 4, 10, 0.7
    draws = np.array([noised_fraction(bits, s, sigma_b, count_generator(11, r)) for r in range(1, 8001)])
    assert draws.mean() == pytest.approx(0.6, abs=4 * sigma_b / s / math.sqrt(8000))
    assert draws.std() == pytest.approx(sigma_b / s, rel=0.04)
    again = noised_fraction(bits, s, sigma_b, count_generator(11, 5))
    assert again == draws[4]  # replayable by (seed, round)
    first = count_generator(11, 5).standard_normal()
    assert first != noise_generator(11, 5).standard_normal()  # not the update noise's stream
    assert default_count_noise(40) == 2.0


def test_the_clip_state_is_kept_and_restored():
    settings = AdaptiveClip(quantile=0.5, lr=0.2, count_noise=1.0)
    st = AdaptiveClipState(0.3)
    assert st.state() == {} and st.value == 0.3
    st.update(0.8, settings)
    again = AdaptiveClipState(0.3, {"client": {}, **st.state()})
    assert again.value == st.value == pytest.approx(0.3 * math.exp(-0.2 * 0.3)) and again.fraction == 0.8
    assert st.record(True) == {"dp_clip": st.value} and st.record(False) == {}


# -- the client's bit and the server's reducer ------------------------------------------------------------------------
def test_the_client_bit_and_the_server_noise_of_sigma_z():
    rng = np.random.default_rng(4)
    n, m, k_clients, clip, sigma, sigma_b = 50, 2, 5, 0.5, 1.0, 1.0
    start = GlobalState(v=np.zeros(n, np.float32), alpha=np.zeros(m, np.float32), buffers=E, counters=CNT,
                        c_v=None, c_alpha=None, round=2, iteration=4)
    dp = ClientLevel(clip=clip, sigma=sigma, noise_at="server", seed=9, sampled=k_clients, num_clients=k_clients,
                     adaptive=AdaptiveClip(quantile=0.5, lr=0.2, count_noise=sigma_b))
    sums, bits = np.zeros(n + m), []
    for k in range(k_clients):
        scale = [0.01, 0.2, 0.03, 1.0, 0.02][k]
        u = ClientUpdate(v=(scale * rng.standard_normal(n)).astype(np.float32),
                         alpha=(scale * rng.standard_normal(m)).astype(np.float32), buffers=E, counters=CNT,
                         c_v=None, c_alpha=None, client_id=k, stats=StepStats(k, 0.0, 3, 9, 0.0))
        norm = np.linalg.norm(np.concatenate([u.v, u.alpha]).astype(np.float64))
        sent = private_update(u, start, dp)
        assert sent.stats.within_clip == (norm <= clip)
        bits.append(norm <= clip)
        sums += np.concatenate([sent.v, sent.alpha])
    assert bits.count(False) >= 1 and bits.count(True) >= 1
    from fdam_ray.core.state import StateVectors

    total = StateVectors(v=sums[:n].astype(np.float32), alpha=sums[n:].astype(np.float32), buffers=E,
                         counters=CNT, c_v=None, c_alpha=None)
    out = private_finish(total, k_clients, start, ServerRound(dp, 3, 0.1), global_lr=1.0, alpha_nonnegative=False,
                         steps=3)
    z = update_noise_multiplier(sigma, sigma_b)
    noise = gaussian_noise(n + m, z * clip, noise_generator(9, 3))
    expect = (sums.astype(np.float32) + noise) * np.float32(1.0 / k_clients)
    np.testing.assert_allclose(out["v"], expect[:n], rtol=0, atol=1e-6)
    centred = sum(bits) - 0.5 * k_clients
    fraction = (centred + sigma_b * count_generator(9, 3).standard_normal()) / k_clients + 0.5
    assert noised_fraction(bits, k_clients, sigma_b, count_generator(9, 3)) == pytest.approx(fraction, rel=1e-15)


# -- the section -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("values", "field", "words"), [
    ({**CLIENT, "dp_clip_quantile": 1.0}, "dp_clip_quantile", "in (0, 1)"),
    ({**CLIENT, "dp_clip_lr": 0.5}, "dp_clip_lr", "while dp_clip_quantile is null"),
    ({**CLIENT, "dp_clip_count_noise": 2.0}, "dp_clip_count_noise", "while dp_clip_quantile is null"),
    ({**CLIENT, "dp": "sample", "model": "cnn_gn", "dp_clip_quantile": 0.5}, "dp_clip_quantile",
     "adaptive clipping is client level"),
    ({**CLIENT, "dp_clip_quantile": 0.5, "dp_noise_at": "clients", "dp_clip_count_noise": 5.0}, "dp_noise_at",
     "server with dp_clip_quantile"),
    ({**CLIENT, "dp_clip_quantile": 0.5}, "dp_clip_count_noise", "> dp_noise_multiplier / 2 = 0.5"),  # S/20 = 0.2
    ({**CLIENT, "dp_clip_quantile": 0.5, "dp_clip_count_noise": 0.5}, "dp_clip_count_noise", "sigma^-2"),
    ({"dp_clip_quantile": 0.5}, "dp_clip_quantile", "while dp = off"),
])
def test_each_adaptive_refusal_is_one_line_naming_its_field(values, field, words):
    with pytest.raises(ConfigError) as caught:
        build_config(values)
    message = str(caught.value)
    assert "\n" not in message and f"'{field}'" in message and words in message


def test_an_adaptive_config_builds_with_the_paper_defaults():
    config = build_config({**CLIENT, "dp_clip_quantile": 0.5, "dp_clip_count_noise": 0.6})
    assert (config.dp_clip_quantile, config.dp_clip_lr, config.dp_clip_count_noise) == (0.5, 0.2, 0.6)
    assert build_config(CLIENT).dp_clip_quantile is None
    assert build_config({**CLIENT, "num_clients": 40, "dp_clip_quantile": 0.5}).dp_clip_count_noise is None
