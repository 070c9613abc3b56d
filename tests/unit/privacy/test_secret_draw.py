"""Under dp the client draw is keyed by the privacy secret, never by the public seed (docs/algorithms.md s.8b):
the draw itself, where its key comes from, and that it is uniform."""

from __future__ import annotations

import numpy as np

from fdam_ray.algorithms.sampling import ClientSampler, sample_clients, secret_sample_clients
from fdam_ray.privacy.driver import ClientLevelRun, SampleLevelRun
from fdam_ray.privacy.section import PrivacySection


def section(**values) -> PrivacySection:
    base = dict(num_clients=10, clients_per_round=3, client_weighting="uniform", algorithm="coda_plus",
                positive_ratio=0.5, pretrain_iterations=0, batch_size=8, positive_sampling="natural",
                precision="fp32", model="linear")
    return PrivacySection(**{**base, **values})


def test_the_secret_draw_is_its_own_stream_and_replays():
    draws = [secret_sample_clients(7, r, 10, 3) for r in range(1, 40)]
    assert draws == [secret_sample_clients(7, r, 10, 3) for r in range(1, 40)]
    assert draws != [secret_sample_clients(8, r, 10, 3) for r in range(1, 40)]
    assert draws != [sample_clients(7, r, 10, 3) for r in range(1, 40)]  # not the public stream of the same number
    assert all(len(d) == 3 and d == sorted(set(d)) and 0 <= d[0] and d[-1] < 10 for d in draws)
    assert secret_sample_clients(7, 1, 10, None) is None and secret_sample_clients(7, 1, 10, 10) is None
    assert "7" not in repr(ClientSampler(10, 3, 7, True))  # the key is never shown


def test_the_secret_draw_is_uniform():
    # each client is in a round's set with probability S / K: counts over R rounds within 5 sd of R S / K
    k, s, rounds = 10, 3, 4000
    counts = np.zeros(k)
    for r in range(1, rounds + 1):
        counts[secret_sample_clients(12345, r, k, s)] += 1
    p = s / k
    assert np.all(np.abs(counts - rounds * p) < 5 * np.sqrt(rounds * p * (1 - p)))


def test_the_key_is_the_noise_seed_or_fresh_entropy_kept_for_a_resume():
    given = ClientLevelRun(section(dp="client", dp_noise_multiplier=1.0, dp_noise_seed=5), rounds=4)
    assert given.draw_secret == 5
    fresh = [ClientLevelRun(section(dp="client", dp_noise_multiplier=1.0), rounds=4) for _ in range(2)]
    assert fresh[0].draw_secret != fresh[1].draw_secret and fresh[0].draw_secret >= 0
    assert max(f.draw_secret for f in fresh) > 2**64  # 128 bits (fails with probability 2^-63)
    resumed = ClientLevelRun(fresh[0].section, rounds=4, state=fresh[0].state())
    assert resumed.draw_secret == fresh[0].draw_secret
    sample = SampleLevelRun(section(dp="sample", dp_noise_multiplier=1.0), iterations=10, batch_size=8,
                            num_train=None, labels=list("abcdefghij"))
    sample.sites_known([20] * 10)
    assert SampleLevelRun(sample.section, iterations=10, batch_size=8, num_train=None, labels=list("abcdefghij"),
                          state=sample.state()).draw_secret == sample.draw_secret
