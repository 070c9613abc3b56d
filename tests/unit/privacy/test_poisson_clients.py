"""The Poisson client draw of dp: client (docs/algorithms.md s.9 P2b): client k joins round r iff u_{k,r} < q = S / K,
u drawn from the privacy secret (never the public seed); the default of dp_sampling; the empty round's server step;
the warning when the fixed-size draw costs more than full participation."""

from __future__ import annotations

import logging
import re

import numpy as np
import pytest

from fdam_ray.algorithms.sampling import (
    ClientSampler,
    poisson_sample_clients,
    sample_clients,
    secret_sample_clients,
)
from fdam_ray.config import build_config
from fdam_ray.core.state import GlobalState
from fdam_ray.privacy.accountant import Accountant
from fdam_ray.privacy.client_level import ClientLevel, PrivateReducer, ServerRound
from fdam_ray.privacy.driver import ClientLevelRun, PrivacyPlug, RunFacts
from fdam_ray.privacy.mechanisms import gaussian_noise, noise_generator
from fdam_ray.privacy.section import PrivacySection
from fdam_ray.settings.sections import ConfigError

E = np.empty(0, dtype=np.float32)
CNT = np.empty(0, dtype=np.int64)
CLIENT = {"dp": "client", "model": "mlp", "dp_noise_multiplier": 1.0, "positive_ratio": 0.2, "algorithm": "coda_plus",
          "num_clients": 10, "clients_per_round": 3}


def u_of(secret, r, k):
    """The u_{k,r} of the spec, recomputed: SeedSequence(secret, spawn_key=(0x4350 "CP", r)), one uniform each."""
    return np.random.default_rng(np.random.SeedSequence(entropy=secret, spawn_key=(0x4350, r))).random(k)


def test_the_draw_is_u_below_q_from_the_secret_and_may_be_empty():
    k, s = 10, 3
    draws = [poisson_sample_clients(7, r, k, s) for r in range(1, 200)]
    assert draws == [list(np.flatnonzero(u_of(7, r, k) < s / k)) for r in range(1, 200)]
    assert [] in draws and any(len(d) > s for d in draws)  # the realised size varies, empty included
    assert all(d == sorted(set(d)) for d in draws)
    assert poisson_sample_clients(7, 1, k, None) is None and poisson_sample_clients(7, 1, k, k) is None
    sampler = ClientSampler(k, s, 7, secret=True, poisson=True)
    assert [sampler.draw(r) for r in range(1, 200)] == draws  # a list (possibly empty), never None with S < K
    assert "7" not in repr(sampler)
    with pytest.raises(ValueError, match="never the seed"):
        ClientSampler(k, s, 7, poisson=True)


def test_each_client_joins_at_rate_q_independently_of_the_others():
    k, s, rounds = 10, 3, 4000
    q = s / k
    joined = np.zeros((rounds, k), dtype=bool)
    for r in range(1, rounds + 1):
        joined[r - 1, poisson_sample_clients(12345, r, k, s)] = True
    sd = np.sqrt(rounds * q * (1 - q))
    assert np.all(np.abs(joined.sum(axis=0) - rounds * q) < 5 * sd)  # each client: q R within 5 sd
    empty = (~joined.any(axis=1)).sum()
    p0 = (1 - q) ** k
    assert abs(empty - rounds * p0) < 5 * np.sqrt(rounds * p0 * (1 - p0))  # independent joins: (1 - q)^K empty
    both = (joined[:, 0] & joined[:, 1]).sum()
    assert abs(both - rounds * q * q) < 5 * np.sqrt(rounds * q * q * (1 - q * q))


def test_the_sets_are_the_secrets_and_not_the_public_streams():
    k, s, r = 10, 3, range(1, 60)
    draws = [poisson_sample_clients(7, i, k, s) for i in r]
    assert draws != [poisson_sample_clients(8, i, k, s) for i in r]  # another secret: other sets
    public = [list(np.flatnonzero(np.random.default_rng([7, i]).random(k) < s / k)) for i in r]
    assert draws != public  # not u from the public seed's generator of the same number
    fixed_stream = [list(np.flatnonzero(np.random.default_rng(np.random.SeedSequence(
        entropy=7, spawn_key=(0x4353, i))).random(k) < s / k)) for i in r]
    assert draws != fixed_stream  # not the fixed-size draw's stream of the secret either
    assert draws != [sample_clients(7, i, k, s) for i in r] and draws != [secret_sample_clients(7, i, k, s) for i in r]


def test_dp_sampling_null_is_poisson_under_dp_client_with_s_below_k_and_server_noise():
    def sampling(**values):
        section = PrivacySection.of(build_config({**CLIENT, **values}))
        return section.dp_sampling, section.sampling, section.poisson_clients

    assert sampling() == (None, "poisson", True)
    assert sampling(dp_sampling="fixed") == ("fixed", "fixed", False)
    assert sampling(clients_per_round=None) == (None, "fixed", False)  # full participation: nothing drawn
    assert sampling(clients_per_round=None, dp_sampling="poisson") == ("poisson", "poisson", False)
    assert sampling(dp_noise_at="clients") == (None, "fixed", False)  # shares: the fixed-size draw
    assert sampling(dp="sample", model="cnn_gn", batch_size=8) == (None, "poisson", False)  # dp: sample's batches
    assert sampling(dp="sample", model="cnn_gn", batch_size="full") == (None, "fixed", False)  # nothing to sample
    with pytest.raises(ConfigError, match=r"'dp_sampling': 'poisson' .*dp_noise_at: clients"):
        build_config({**CLIENT, "dp_sampling": "poisson", "dp_noise_at": "clients"})
    assert build_config({"dp_sampling": "fixed"}).dp == "off"  # the old default, which old config.yaml files hold
    with pytest.raises(ConfigError, match="while dp = off"):
        build_config({"dp_sampling": "poisson"})


def plug(**values) -> PrivacyPlug:
    section = PrivacySection.of(build_config({**CLIENT, "dp_noise_seed": 5, **values}))
    made = PrivacyPlug(section, RunFacts(planned_rounds=8, iterations=16, batch_size=8, transport="classic",
                                         transfer_precision="fp32", labels=tuple("abcdefghij"), val_fraction=0.0,
                                         seed=0))
    made._run = ClientLevelRun(section, rounds=8) if section.dp == "client" else None
    return made


def test_the_plugs_sampler_is_poisson_only_where_the_accountant_counts_poisson():
    default = ClientSampler(10, 3, 0)
    poisson = plug().sampler(default)
    assert poisson.poisson and poisson.secret and poisson.seed == 5
    assert [poisson.draw(r) for r in range(1, 30)] == [poisson_sample_clients(5, r, 10, 3) for r in range(1, 30)]
    fixed = plug(dp_sampling="fixed").sampler(default)
    assert not fixed.poisson and fixed.draw(3) == secret_sample_clients(5, 3, 10, 3)
    assert plug().run.accountant.sampling == "poisson" and plug().run.relation == "add_or_remove_one"


def test_an_empty_round_is_the_noise_alone_divided_by_s_and_refused_without_server_noise():
    rng = np.random.default_rng(0)
    prev = GlobalState(v=rng.standard_normal(7).astype(np.float32), alpha=np.abs(rng.standard_normal(2)).astype(
        np.float32), buffers=E, counters=CNT, c_v=None, c_alpha=None, round=4, iteration=10)
    from fdam_ray.algorithms.server import RoundReducer

    def reducer(noise_at):
        dp = ClientLevel(clip=0.5, sigma=0.8, noise_at=noise_at, seed=11, sampled=3, num_clients=10)
        inner = RoundReducer(prev, global_lr=1.5, alpha_nonnegative=True, control_variates=False)
        return PrivateReducer(inner, ServerRound(dp, 5, 0.1))

    out = reducer("server").finish(steps=2)
    z = np.zeros(9, dtype=np.float32) + gaussian_noise(9, 0.8 * 0.5, noise_generator(11, 5))
    step = (z * np.float32(1 / 3)) * np.float32(1.5)
    np.testing.assert_array_equal(out.v, prev.v + step[:7])
    np.testing.assert_array_equal(out.alpha, np.maximum(prev.alpha + step[7:], 0))
    assert (out.round, out.iteration) == (5, 12) and not np.array_equal(out.v, prev.v)
    with pytest.raises(RuntimeError, match="no client update reached the server"):  # shares: no noise to apply
        reducer("clients").finish(steps=2)
    with pytest.raises(RuntimeError, match="no client update reached the server"):  # without dp: as before
        RoundReducer(prev, global_lr=1.0, alpha_nonnegative=True, control_variates=False).finish(steps=2)


def test_the_fixed_size_draw_says_when_it_costs_more_than_full_participation(caplog):
    def run(**values):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="fdam_ray.privacy.driver"):
            ClientLevelRun(PrivacySection.of(build_config({**CLIENT, **values})), rounds=8)
        return [r.getMessage() for r in caplog.records if "dp_sampling: fixed" in r.getMessage()]

    lines = run(dp_sampling="fixed")
    fixed = Accountant.for_clients(noise_multiplier=1.0, delta=1e-5, num_clients=10, clients_per_round=3,
                                   sampling="fixed").epsilon_after(8)
    full = Accountant.for_clients(noise_multiplier=1.0, delta=1e-5, num_clients=10, clients_per_round=None)
    assert len(lines) == 1 and fixed > full.epsilon_after(8)
    said = re.search(r"spends epsilon ([0-9.e+]+) .* full participation's ([0-9.e+]+)", lines[0])
    assert said and float(said[1]) == pytest.approx(fixed, rel=1e-3)
    assert float(said[2]) == pytest.approx(full.epsilon_after(8), rel=1e-3)
    assert "set dp_sampling: poisson" in lines[0]
    assert "dp_noise_at: server" in run(dp_sampling="fixed", dp_noise_at="clients")[0]  # poisson needs it
    assert run() == [] and run(clients_per_round=None) == []  # poisson, full participation: no line
    # few of many clients and much noise: the fixed-size draw costs less than full participation, so no line
    assert run(dp_sampling="fixed", num_clients=1000, clients_per_round=1, dp_noise_multiplier=5.0) == []


def test_a_replayed_record_is_checked_against_the_poisson_draw():
    from fdam_ray.executors.deadlines import ReplaySection, _round_sample

    section = ReplaySection.of(build_config({**CLIENT, "dp_noise_seed": 9}))
    assert [_round_sample(section, r, 10, 3) for r in range(1, 20)] == [poisson_sample_clients(9, r, 10, 3)
                                                                         for r in range(1, 20)]
    fixed = ReplaySection.of(build_config({**CLIENT, "dp_noise_seed": 9, "dp_sampling": "fixed"}))
    assert _round_sample(fixed, 4, 10, 3) == secret_sample_clients(9, 4, 10, 3)
