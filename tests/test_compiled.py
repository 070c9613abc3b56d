"""``transport: compiled``: the round as one Ray Compiled Graph is the classic round's math, built once."""

from __future__ import annotations

import numpy as np
import pytest
import raytest
from oracle import run_oracle
from raytest import first_state
from test_hosted import BASE, assert_same_state, sized_clients, train
from test_oracle import CASES as ORACLE_CASES
from test_oracle import initial_v, uneven_clients
from test_sampling import CASES as SAMPLING_CASES

import fdam_ray
from fdam_ray.config import ConfigError, build_config
from fdam_ray.data.arrays import ArraysSource
from fdam_ray.executors.ray_executor import REST_RATIO, RayExecutor
from fdam_ray.state import RoundPlan

RAY = dict(executor="ray", cpus_per_actor=0.5, threads_per_actor=1)


@pytest.fixture(scope="module", autouse=True)
def session():
    with raytest.ray_session(num_cpus=4):
        yield


def test_compiled_equals_classic_in_client_order_bit_for_bit_and_compiles_once():
    # client sampling (a different sample every round), hosted clients, weights by samples and two stage
    # changes: all inputs of the one graph, never a recompilation
    clients, test = sized_clients()
    cfg = dict(BASE, clients_per_round=3, clients_per_actor=2, **RAY)
    classic = train(dict(cfg, fold_order="client"), clients, test)
    executor = RayExecutor()
    compiled = train(dict(cfg, transport="compiled"), clients, test, executor=executor)
    assert_same_state(compiled, classic, exact=True)
    assert compiled.summary["bytes_up"] == classic.summary["bytes_up"]
    assert [h["test_auc"] for h in compiled.history] == [h["test_auc"] for h in classic.history]
    assert compiled.state.round == 6 and executor.graph.builds == 1
    inline = train(dict(cfg, executor="inline"), clients, test)
    assert_same_state(compiled, inline, exact=True)


@pytest.mark.parametrize("case", [ORACLE_CASES[2], SAMPLING_CASES[1]], ids=["codasca-stages", "sampled-weighted"])
def test_compiled_runs_match_the_numpy_oracle(case):
    clients, test = uneven_clients()
    cfg = dict(model="linear", batch_size="full", eval_every=1000, seed=0, transport="compiled", **RAY, **case)
    result = fdam_ray.train_arrays(cfg, clients, test)
    kwargs = {k: v for k, v in case.items() if k != "algorithm"}
    v, alpha, c_v, c_a = run_oracle([(X.astype(np.float64), y) for X, y in clients], initial_v(4), **kwargs,
                                    control_variates=True)
    np.testing.assert_allclose(result.state.v, v, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(result.alpha, [alpha], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(result.control_variates[0], c_v, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(result.control_variates[1], [c_a], rtol=1e-4, atol=1e-5)


def test_the_graph_ends_with_the_run():
    clients, test = sized_clients()
    executor = RayExecutor()
    train(dict(BASE, transport="compiled", iterations=6, **RAY), clients, test, executor=executor)
    assert executor.graph.builds == 1 and executor.graph.graph is None and executor.actors == {}


def test_compiled_with_per_node_reduction_is_refused_in_one_line():
    clients, test = sized_clients()
    with pytest.raises(ValueError, match="reduce=node needs transport=classic"):
        train(dict(BASE, transport="compiled", reduce="node", iterations=3, **RAY), clients, test)
    with pytest.raises(ConfigError, match="transport"):
        build_config(dict(transport="nccl"))


def test_the_graph_rests_during_scoring_only_when_scoring_takes_several_builds():
    clients, test = sized_clients()
    source = ArraysSource(clients, test)
    config = build_config(dict(BASE, dataset="arrays", num_clients=len(clients), transport="compiled", **RAY))
    with RayExecutor() as ex:
        ex.start(config, source)
        state = first_state(ex, config, source)
        ex.run_round(state, RoundPlan(1, 1, 2, 0.1, 0), lambda partial: None)
        assert ex.graph.graph is not None and ex.graph.build_s > 0
        ex.evaluate(state)  # no scoring timed yet: the graph stays
        assert ex.graph.graph is not None and ex._took["evaluate"] > 0
        ex._took["evaluate"] = REST_RATIO * ex.graph.build_s * 1.01  # as if the last scoring had been long
        ex.evaluate(state)
        assert ex.graph.graph is None  # ended for the scoring ...
        ex.run_round(state, RoundPlan(2, 1, 2, 0.1, 2), lambda partial: None)
        assert ex.graph.graph is not None and ex.graph.builds == 2 and ex.graph.actor_sets == 1  # ... and back
