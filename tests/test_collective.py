"""``transport: collective``: the actors all-reduce their partial sums and apply the server step themselves.

Equal to a classic ``fold_order: client`` run to float32 rounding (the all-reduce sums in another order), with
hosted clients and client sampling; the state goes down only when the actors' copy is stale; failures are
recovered as under the other transports; ``reduce: node`` is refused in one line.
"""

from __future__ import annotations

import numpy as np
import pytest
from oracle import assert_matches, run_oracle
from raytest import ray_session
from sample_clients import gaussian_clients
from test_hosted import BASE, assert_same_state, sized_clients, train
from test_oracle import CASES as ORACLE_CASES
from test_oracle import initial_v, uneven_clients
from test_sampling import CASES as SAMPLING_CASES

import fdam_ray
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


RAY = dict(executor="ray", cpus_per_actor=0.5, threads_per_actor=1)


@pytest.mark.parametrize("case", [ORACLE_CASES[1], ORACLE_CASES[2], ORACLE_CASES[3], SAMPLING_CASES[1]],
                         ids=["coda-margin-stages", "codasca-stages", "codasca-keep-c", "sampled-weighted"])
def test_collective_runs_match_the_numpy_oracle(case):
    clients, test = uneven_clients()
    cfg = dict(model="linear", batch_size="full", eval_every=1000, seed=0, transport="collective", **RAY, **case)
    result = fdam_ray.train_arrays(cfg, clients, test)
    kwargs = {k: v for k, v in case.items() if k != "algorithm"}
    codasca = case["algorithm"] == "codasca"
    v, alpha, c_v, c_a = run_oracle([(X.astype(np.float64), y) for X, y in clients], initial_v(4), **kwargs,
                                    control_variates=codasca)
    assert_matches(result, v, alpha, *((c_v, c_a) if codasca else ()))
    assert result.state.round == -(-case["iterations"] // case["local_steps"])


def test_hosted_sampled_weighted_rounds_over_stage_changes_equal_classic():
    clients, test = sized_clients()
    cfg = dict(BASE, clients_per_round=3, clients_per_actor=2, **RAY)
    classic = train(dict(cfg, fold_order="client"), clients, test)
    executor = RayExecutor()
    got = train(dict(cfg, transport="collective"), clients, test, executor=executor)
    assert_same_state(got, classic, exact=False)
    assert got.summary["bytes_up"] == classic.summary["bytes_up"]
    assert got.state.round == 6 and executor.transport.builds == 1


def test_reduce_node_is_refused_in_one_line():
    with pytest.raises(ValueError) as info:
        transport_for("collective", "node")
    assert str(info.value) == REFUSED["collective", "node"] and "\n" not in str(info.value)
    assert transport_for("collective", "star") == "collective"
