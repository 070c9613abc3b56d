"""transfer_precision bf16 under Ray (classic transport, star and node): the driver and every actor hold the same
float32 master, a replacement actor catches up, a run equals the inline executor's rounding and moves half the
bytes."""

from __future__ import annotations

import numpy as np
import pytest
import ray
from raytest import first_state, ray_session
from sample_clients import gaussian_clients

import fdam_ray
from fdam_ray.algorithms import AlgorithmSection, build_algorithm
from fdam_ray.config import build_config
from fdam_ray.core.state import RoundPlan
from fdam_ray.data.arrays import ArraysSource
from fdam_ray.executors import make_executor
from fdam_ray.executors.base import ExecutorSetup

K = 3
NAMES = ("v", "alpha", "buffers", "counters", "c_v", "c_alpha")


@pytest.fixture(scope="module", autouse=True)
def ray_on():
    with ray_session():
        yield


def config_of(**values):
    return build_config(dict(dataset="arrays", num_clients=K, model="mlp", model_width=8, batch_size=8,
                             algorithm="codasca", seed=1, cpus_per_client=0.5, transfer_precision="bf16",
                             error_feedback=True, fold_order="client", **values))


@pytest.mark.parametrize("reduce", ["star", pytest.param("node", marks=pytest.mark.slow)])  # node: 13 s
def test_the_driver_and_every_actor_hold_the_same_master(reduce):
    clients, test = gaussian_clients(num_clients=K, n=40)
    source, config = ArraysSource(clients, test), config_of(executor="ray", reduce=reduce)
    executor = make_executor("ray")
    executor.start(ExecutorSetup.for_config(config, executor.section), source)
    try:
        state = first_state(executor, config, source)
        algorithm = build_algorithm(AlgorithmSection.of(config))
        for r in range(1, 5):
            if r == 3:  # a replacement actor has no master: it fetches the full one, then follows the changes
                actor = executor.fleet.actors[1]
                ray.kill(actor, no_restart=True)
            reducer = algorithm.reducer(state, weights=None)
            executor.run_round(state, RoundPlan(r, 1, 2, 0.1, 2 * (r - 1)), reducer.fold)
            state = reducer.finish(steps=2)
            master = executor.downlink.master
            held = ray.get([a.transfer_master.remote() for a in executor.fleet.actors.values()])
            assert len(held) == K
            for version, got in held:
                assert version == executor.downlink.version
                for name in NAMES:
                    np.testing.assert_array_equal(getattr(got, name), getattr(master, name), err_msg=name)
        assert not np.array_equal(master.v, state.v)  # the master is the rounded state
        assert executor.broadcast_nbytes(master) * 2 == master.nbytes
    finally:
        executor.shutdown()


@pytest.mark.slow  # about 30 s in CI; the default run keeps test_the_driver_and_every_actor_hold_the_same_master
def test_a_ray_run_equals_the_inline_rounding_and_moves_half_the_bytes():
    clients, test = gaussian_clients(num_clients=K, n=40)
    values = dict(model="mlp", model_width=8, batch_size=8, algorithm="codasca", seed=1, cpus_per_client=0.5,
                  local_steps=2, iterations=8, eval_every=4, transfer_precision="bf16", error_feedback=True)
    inline = fdam_ray.train_arrays(dict(values, executor="inline"), clients, test)
    star = fdam_ray.train_arrays(dict(values, executor="ray", fold_order="client"), clients, test)
    node = fdam_ray.train_arrays(dict(values, executor="ray", reduce="node"), clients, test)
    fp32 = fdam_ray.train_arrays(dict(values, executor="ray", transfer_precision="fp32", error_feedback=False),
                                 clients, test)
    for name in ("v", "alpha", "buffers", "c_v", "c_alpha"):
        np.testing.assert_array_equal(getattr(star.state, name), getattr(inline.state, name), err_msg=name)
        # node rounds each node's merged sum once more on its way to the driver
        np.testing.assert_allclose(getattr(node.state, name), getattr(inline.state, name), atol=2e-2, err_msg=name)
    assert star.summary["bytes_up"] == inline.summary["bytes_up"] == node.summary["bytes_up"]
    assert fp32.summary["bytes_up"] == 2 * star.summary["bytes_up"]  # (the mlp has no integer buffers)
    assert star.summary["bytes_down"] == inline.summary["bytes_down"] < fp32.summary["bytes_down"]
