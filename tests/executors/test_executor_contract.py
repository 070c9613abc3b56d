"""The executor contract: the same tests run against every allowed (executor, transport, reduce) combination.

Inline; Ray with classic calls folded at the driver (star); Ray with per-node
reducers (node: on this one-node Ray every actor shares the node, so all of
them go through its reducer); Ray with the compiled graph.

The oracle is a set of :class:`fdam_ray.clients.client.Client` objects built in the test
process from the same data source spec: whatever runs the clients, a round
must fold exactly their updates, once per client, in client order. With one
client per actor (the default), each partial sum a round hands over is one
client's update.
"""

from __future__ import annotations

import copy
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
from raytest import ray_session
from sample_clients import gaussian_clients

from fdam_ray.algorithms import AlgorithmSection, build_algorithm
from fdam_ray.algorithms.server import PartialSum
from fdam_ray.clients.client import Client, Replica
from fdam_ray.config import build_config
from fdam_ray.core.state import ClientUpdate, RoundPlan
from fdam_ray.data.arrays import ArraysSource
from fdam_ray.executors import make_executor
from fdam_ray.executors.base import ExecutorSetup

K = 3
CPU = torch.device("cpu")


def make_source() -> ArraysSource:
    clients, test = gaussian_clients(num_clients=K, n=40)
    client_tests, _ = gaussian_clients(num_clients=K, n=20, seed=5)
    return ArraysSource(clients, test, client_tests)


def make_config(executor: str, **values):
    return build_config(dict(dataset="arrays", num_clients=K, model="mlp", model_width=8, batch_size=8,
                             algorithm="codasca", seed=1, executor=executor, cpus_per_client=0.5, **values))


def assert_partial_is_update(got: PartialSum, want: ClientUpdate) -> None:
    """A partial sum of one client (uniform weights) holds exactly that client's update."""
    assert (got.count, got.weight, got.bytes_up) == (1, 1.0, want.nbytes)
    [stats] = got.stats
    assert_update_equal(ClientUpdate(**got.vectors(), client_id=stats.client_id, stats=stats), want)


def keep(sums: list[PartialSum]):
    """A fold that keeps a copy of each partial sum: a fold may not hold the one it is given past the round
    (under the compiled transport it is a view of an output channel the next round writes again)."""
    return lambda p: sums.append(copy.deepcopy(p))


def by_client(p: PartialSum) -> int:
    return p.stats[0].client_id


def assert_update_equal(got: ClientUpdate, want: ClientUpdate) -> None:
    assert got.client_id == want.client_id
    for name in ("v", "alpha", "buffers", "c_v", "c_alpha"):
        np.testing.assert_allclose(getattr(got, name), getattr(want, name), rtol=1e-6, atol=1e-7, err_msg=name)
    np.testing.assert_array_equal(got.counters, want.counters)
    assert got.stats.steps == want.stats.steps and got.stats.samples == want.stats.samples
    assert got.stats.loss == pytest.approx(want.stats.loss, rel=1e-5)


@pytest.fixture(scope="module")
def one_ray():
    """One Ray session for the Ray classes below (started by the first of them, shut down with the module)."""
    with ray_session():
        yield


class ExecutorContract:
    """What every executor must do; subclasses name the executor."""

    executor_name: str
    scores_test_set_on_clients: bool
    transport, reduce = "classic", "star"  # of the Ray executor (the inline one has neither)
    sums_per_round = K  # partial sums a round folds (one client per actor; one per node with reduce: node)

    @pytest.fixture(scope="class")
    @classmethod
    def started(cls, request):
        if cls.executor_name == "ray":
            request.getfixturevalue("one_ray")  # the module's Ray session: each class starts its own executor
        source, config = make_source(), make_config(cls.executor_name, transport=cls.transport, reduce=cls.reduce)
        executor = make_executor(cls.executor_name)
        infos = executor.start(ExecutorSetup.for_config(config, executor.section), source)
        yield executor, source, config, infos
        executor.shutdown()

    @pytest.fixture
    def ready(self, started):
        """The executor's clients and fresh oracle clients in the same state (p, stage, c^k, sampler)."""
        executor, source, config, _ = started
        oracle = [Client(config, source, k, device=CPU) for k in range(K)]
        replica = Replica(config, source, device=CPU)
        p = np.array([0.3])
        reference = replica.flat.initial_state().v
        executor.configure(p)
        executor.begin_stage(reference, True)
        executor.restore_client_states([c.get_state() for c in oracle])
        for c in oracle:
            c.configure(p)
            c.begin_stage(reference, True)
        state = replica.flat.initial_state()
        state.c_v, state.c_alpha = np.zeros_like(state.v), np.zeros_like(state.alpha)
        return executor, oracle, replica, state, config, source

    def test_start_reports_every_client_in_order(self, started):
        _, source, config, infos = started
        size = Replica(config, source, device=CPU).flat.state_size
        assert [i.client_id for i in infos] == list(range(K))
        for k, info in enumerate(infos):
            y = source.client_shard(k).train.y.numpy()
            assert info.num_train == len(y) and info.num_test == 20
            np.testing.assert_array_equal(info.positives, (y == 1).sum(0))
            assert info.state_size == size

    def test_a_round_folds_each_clients_own_update_once(self, ready):
        executor, oracle, _, state, config, _ = ready
        plan = RoundPlan(round=1, stage=1, steps=3, lr=0.1, iteration=0)
        folded: list[PartialSum] = []
        executor.run_round(state, plan, keep(folded))
        assert sorted(s.client_id for p in folded for s in p.stats) == list(range(K))  # every client once
        assert len(folded) == self.sums_per_round
        updates = [c.local_round(state, plan) for c in oracle]
        if self.sums_per_round == K:  # one partial sum per client: each is exactly that client's update
            folded.sort(key=by_client)  # the Ray executor folds in arrival order by default
            for got, want in zip(folded, updates, strict=True):
                assert_partial_is_update(got, want)
            return
        algorithm = build_algorithm(AlgorithmSection.of(config))  # merged sums: the same server step
        reducer, expected = algorithm.reducer(state), algorithm.reducer(state)
        for p in folded:
            reducer.fold(p)
        for u in updates:
            expected.fold(u)
        got, want = reducer.finish(steps=3), expected.finish(steps=3)
        for name in ("v", "alpha", "buffers", "c_v", "c_alpha"):
            np.testing.assert_allclose(getattr(got, name), getattr(want, name), rtol=1e-6, atol=1e-7, err_msg=name)

    def test_control_variates_stay_with_the_clients_across_rounds(self, ready):
        executor, oracle, _, state, config, _ = ready
        algorithm = build_algorithm(AlgorithmSection.of(config))
        for r in (1, 2, 3):
            plan = RoundPlan(round=r, stage=1, steps=2, lr=0.1, iteration=2 * (r - 1))
            reducer, expected = algorithm.reducer(state), algorithm.reducer(state)
            executor.run_round(state, plan, reducer.fold)
            for c in oracle:
                expected.fold(c.local_round(state, plan))
            state, want = reducer.finish(steps=2), expected.finish(steps=2)
            np.testing.assert_allclose(state.v, want.v, rtol=1e-6, atol=1e-7)
            np.testing.assert_allclose(state.c_v, want.c_v, rtol=1e-5, atol=1e-6)
            assert np.abs(state.c_v).max() > 0  # control variates are in play
        for got, c in zip(executor.client_states(), oracle, strict=True):
            np.testing.assert_allclose(got["c_v"], c.get_state()["c_v"], rtol=1e-5, atol=1e-6)

    def test_a_stage_start_with_reset_zeroes_control_variates_and_without_keeps_them(self, ready):
        executor, _, _, state, _, _ = ready
        executor.run_round(state, RoundPlan(1, 1, 2, 0.1, 0), lambda u: None)
        kept = executor.client_states()
        assert all(np.abs(s["c_v"]).max() > 0 for s in kept)
        executor.begin_stage(state.v, False)
        for a, b in zip(executor.client_states(), kept, strict=True):
            np.testing.assert_array_equal(a["c_v"], b["c_v"])
        executor.begin_stage(state.v, True)
        assert all(not np.any(s["c_v"]) and not np.any(s["c_alpha"]) for s in executor.client_states())

    def test_restored_client_states_replay_the_same_round(self, ready):
        executor, _, _, state, _, _ = ready
        plan = RoundPlan(1, 1, 3, 0.1, 0)
        saved = executor.client_states()
        first: list[PartialSum] = []
        executor.run_round(state, plan, keep(first))
        executor.restore_client_states(saved)
        again: list[PartialSum] = []
        executor.run_round(state, plan, keep(again))
        for a, b in zip(sorted(again, key=by_client), sorted(first, key=by_client), strict=True):
            assert sorted(s.client_id for s in a.stats) == sorted(s.client_id for s in b.stats)
            for name in ("v", "alpha", "buffers", "c_v", "c_alpha"):
                np.testing.assert_allclose(getattr(a, name), getattr(b, name), rtol=1e-6, atol=1e-7)

    def test_evaluate_returns_each_clients_scores_on_its_own_test_split(self, ready):
        executor, oracle, _, state, _, _ = ready
        state.v = state.v + np.float32(0.05)  # not the initial model
        got = executor.evaluate(state)
        assert [s.client_id for s in got] == list(range(K))
        for s, c in zip(got, oracle, strict=True):
            want = c.evaluate(state)
            np.testing.assert_allclose(s.scores, want.scores, rtol=1e-6)
            np.testing.assert_array_equal(s.labels, want.labels)

    def test_score_moments_are_the_clients_sums_over_their_training_data(self, ready):
        executor, oracle, _, state, _, _ = ready
        got = executor.score_sums(state)
        for m, c in zip(got, oracle, strict=True):
            want = c.score_sums(state)
            np.testing.assert_allclose(m.sum_pos, want.sum_pos, rtol=1e-5)
            np.testing.assert_allclose(m.sum_neg, want.sum_neg, rtol=1e-5)
            np.testing.assert_array_equal(m.num_pos, want.num_pos)

    def test_global_test_set_scores_equal_the_drivers_or_are_left_to_it(self, ready):
        executor, _, replica, state, _, source = ready
        got = executor.score_test_set(state)
        if not self.scores_test_set_on_clients:
            assert got is None
            return
        want = replica.scores_of(state, source.test_set())
        np.testing.assert_allclose(got.scores, want.scores, rtol=1e-6, atol=1e-7)
        np.testing.assert_array_equal(got.labels, want.labels)


class TestInlineExecutor(ExecutorContract):
    executor_name = "inline"
    scores_test_set_on_clients = False


class TestRayExecutorStar(ExecutorContract):
    executor_name = "ray"
    scores_test_set_on_clients = True
    transport, reduce = "classic", "star"


class TestRayExecutorNode(ExecutorContract):
    executor_name = "ray"
    scores_test_set_on_clients = True
    transport, reduce = "classic", "node"
    sums_per_round = 1  # one node: every actor's sum goes through its reducer

    def test_the_actors_sums_go_through_their_nodes_reducer(self, ready):
        executor = ready[0]
        executor.run_round(ready[3], RoundPlan(1, 1, 1, 0.1, 0), lambda p: None)
        assert executor.transport.serves == ("classic", "node") and len(executor.transport.reducers) == 1


class TestRayExecutorCompiled(ExecutorContract):
    executor_name = "ray"
    scores_test_set_on_clients = True
    transport, reduce = "compiled", "star"

    def test_rounds_run_on_the_compiled_graph(self, ready):
        executor = ready[0]
        executor.run_round(ready[3], RoundPlan(1, 1, 1, 0.1, 0), lambda p: None)
        assert executor.transport.serves == ("compiled", "star") and executor.graph.builds >= 1


class TestRayExecutorCollective(ExecutorContract):
    executor_name = "ray"
    scores_test_set_on_clients = True
    transport, reduce = "collective", "star"
    sums_per_round = 1  # the actors all-reduce their sums; the lowest rank's reduced sum is folded once

    def test_rounds_run_on_the_actors_group(self, ready):
        executor = ready[0]
        executor.run_round(ready[3], RoundPlan(1, 1, 1, 0.1, 0), lambda p: None)
        assert executor.transport.serves == ("collective", "star") and executor.transport.builds == 1



def test_an_update_without_copies_is_views_of_the_clients_buffers_and_equal_to_the_copied_one():
    # The Ray actor returns copy=False updates (Ray serialises them at once): one state copy fewer per round.
    source, config = make_source(), make_config("inline")
    a, b = Client(config, source, 0, device=CPU), Client(config, source, 0, device=CPU)
    replica = Replica(config, source, device=CPU)
    state = replica.flat.initial_state()
    state.c_v, state.c_alpha = np.zeros_like(state.v), np.zeros_like(state.alpha)
    for c in (a, b):
        c.configure(np.array([0.3]))
        c.begin_stage(state.v, True)
    plan = RoundPlan(1, 1, 2, 0.1, 0)
    views, copies = a.local_round(state, plan, copy=False), b.local_round(state, plan)
    assert np.shares_memory(views.v, a.flat.v.numpy()) and np.shares_memory(views.c_v, a.solver.correction.c_v.numpy())
    assert not np.shares_memory(copies.v, b.flat.v.numpy())
    assert_update_equal(views, copies)


def test_the_core_and_the_inline_executor_import_without_ray():
    code = (
        "import sys\n"
        "class NoRay:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'ray' or name.startswith('ray.'):\n"
        "            raise ImportError('ray is blocked')\n"
        "sys.meta_path.insert(0, NoRay())\n"
        "import fdam_ray, fdam_ray.cli, fdam_ray.executors.inline, fdam_ray.executors.errors\n"
        "from fdam_ray.executors import make_executor\n"
        "make_executor('inline')\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


@pytest.mark.parametrize("field,value,message", [
    ("executor", "dask", "one of ray, inline"),
    ("cpus_per_client", 0, "'cpus_per_client': 0.0 is not allowed (> 0)"),
    ("gpus_per_client", 1.5, "0, a fraction in (0, 1], or a whole number"),
    ("gpus_per_client", -0.5, "'gpus_per_client': -0.5"),
    ("cpus_per_actor", 0, "'cpus_per_actor': 0.0 is not allowed (> 0)"),
    ("gpus_per_actor", 1.5, "'gpus_per_actor': 1.5 is not allowed (0, a fraction in (0, 1], or a whole number)"),
    ("clients_per_actor", 0, "'clients_per_actor': 0 is not allowed (>= 1)"),
    ("placement_strategy", "pack", "one of PACK, SPREAD, STRICT_PACK, STRICT_SPREAD"),
    ("eval_on", "gpu", "one of clients, driver"),
    ("on_client_failure", "ignore", "one of retry, drop, abort"),
    ("max_client_retries", -1, "'max_client_retries': -1 is not allowed (>= 0)"),
    ("ray_timeout_s", 0, "'ray_timeout_s': 0.0 is not allowed (> 0)"),
])
def test_bad_executor_fields_are_refused_with_what_is_allowed(field, value, message):
    from fdam_ray.config import ConfigError

    with pytest.raises(ConfigError, match=re.escape(message)):
        build_config({field: value})
    assert build_config(gpus_per_client=2).gpus_per_actor == 2.0 and build_config().executor == "ray"
