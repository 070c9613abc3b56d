"""Client sampling under the Ray executor: S = K is the full run bit for bit, and a sample runs on the actors as
it does inline (the math itself is pinned in tests/unit/algorithms/test_sampling.py)."""

from __future__ import annotations

import numpy as np
import pytest
import raytest

import fdam_ray

BASE = dict(model="linear", batch_size="full", eval_every=1000, seed=0)


@pytest.fixture(scope="module")
def ray_session():
    with raytest.ray_session(num_cpus=4):
        yield


@pytest.mark.slow  # 15 s; tests/unit/algorithms/test_sampling.py holds S = K inline in the default run
def test_s_equal_k_is_the_full_run_bit_for_bit_under_ray(ray_session, clients_and_test):
    clients, test = clients_and_test
    cfg = dict(BASE, algorithm="codasca", local_steps=3, iterations=12, lr=0.2, batch_size=8, executor="ray",
               fold_order="client", cpus_per_client=0.5, threads_per_client=1)
    full = fdam_ray.train_arrays(cfg, clients, test)
    same = fdam_ray.train_arrays(dict(cfg, clients_per_round=len(clients)), clients, test)
    np.testing.assert_array_equal(full.state.v, same.state.v)
    np.testing.assert_array_equal(full.control_variates[0], same.control_variates[0])
    # and a sample runs on the actors as it does inline
    sampled = fdam_ray.train_arrays(dict(cfg, clients_per_round=2), clients, test)
    inline = fdam_ray.train_arrays(dict(cfg, clients_per_round=2, executor="inline"), clients, test)
    np.testing.assert_allclose(sampled.state.v, inline.state.v, rtol=1e-6, atol=1e-7)
    assert sampled.summary["bytes_up"] == inline.summary["bytes_up"]
