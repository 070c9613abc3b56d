"""``transport: collective``: the actors all-reduce their partial sums and apply the server step themselves.

Equal to a classic ``fold_order: client`` run to float32 rounding (the all-reduce sums in another order), with
hosted clients and client sampling; the state goes down only when the actors' copy is stale; failures are
recovered as under the other transports; ``reduce: node`` is refused in one line.
"""

from __future__ import annotations

import numpy as np
import pytest
from raytest import ray_session
from sample_clients import gaussian_clients

from fdam_ray.config import build_config
from fdam_ray.data.arrays import ArraysSource
from fdam_ray.executors.ray.executor import RayExecutor
from fdam_ray.executors.ray.transports import REFUSED, transport_for
from fdam_ray.recipe import run

ARRAYS = dict(model="mlp", model_width=8, batch_size="full", eval_every=2, seed=2, lr=0.2, local_steps=2,
              cpus_per_actor=0.5)
FIELDS = ("v", "alpha", "buffers", "counters", "c_v", "c_alpha")


@pytest.fixture(scope="module", autouse=True)
def session():
    with ray_session():
        yield


def arrays_run(cfg: dict, clients, test, executor=None):
    config = build_config(dict(cfg, dataset="arrays", num_clients=len(clients)))
    return run(config, source=ArraysSource(clients, test), executor=executor, save=False)


def assert_same_run(got, want, atol=1e-6):
    for name in FIELDS:
        a, b = getattr(got.state, name), getattr(want.state, name)
        if b is None:
            assert a is None, name
            continue
        np.testing.assert_allclose(a, b, rtol=0, atol=atol, err_msg=name)
    assert [h["test_auc"] for h in got.history] == pytest.approx([h["test_auc"] for h in want.history], abs=1e-4)


@pytest.mark.parametrize("extra", [
    dict(algorithm="codasca", global_lr=1.1),
    dict(algorithm="coda_plus", clients_per_actor=2),
    dict(algorithm="codasca", clients_per_round=2, client_weighting="samples"),
], ids=["codasca", "hosted", "sampled"])
def test_a_collective_run_equals_the_classic_run_in_client_order(extra):
    clients, test = gaussian_clients(num_clients=4)
    cfg = dict(ARRAYS, iterations=12, stage_length=6, executor="ray", **extra)
    classic = arrays_run(dict(cfg, transport="classic", fold_order="client"), clients, test)
    executor = RayExecutor()
    got = arrays_run(dict(cfg, transport="collective"), clients, test, executor=executor)
    assert got.state.round == classic.state.round == 6
    assert_same_run(got, classic)
    transport = executor.transport
    assert transport.name == "collective" and transport.builds == 1 and transport.backend == "gloo"
    # the state went down in the first round and at the stage start only; the actors kept their copy otherwise
    assert transport.rounds_sent == 2


def test_reduce_node_is_refused_in_one_line():
    with pytest.raises(ValueError) as info:
        transport_for("collective", "node")
    assert str(info.value) == REFUSED["collective", "node"] and "\n" not in str(info.value)
    assert transport_for("collective", "star") == "collective"
