"""``transport: compiled``: the round as one Ray Compiled Graph is the classic round's math, built once."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
import ray
import raytest
import torch
from oracle import assert_matches, run_oracle
from raytest import first_state
from test_hosted import BASE, assert_same_state, sized_clients, train
from test_oracle import CASES as ORACLE_CASES
from test_oracle import initial_v, uneven_clients
from test_sampling import CASES as SAMPLING_CASES

import fdam_ray
from fdam_ray.config import ConfigError, build_config
from fdam_ray.core.state import RoundPlan
from fdam_ray.data.arrays import ArraysSource
from fdam_ray.executors.base import ExecutorSetup
from fdam_ray.executors.ray.executor import RayExecutor
from fdam_ray.executors.ray.transports.compiled import REST_RATIO
from fdam_ray.executors.ray.transports.patience import PAUSE_CAP_S, PAUSE_OF_WAIT, patient_read

RAY = dict(executor="ray", cpus_per_actor=0.5, threads_per_actor=1)


@pytest.fixture(scope="module", autouse=True)
def session():
    with raytest.ray_session(num_cpus=4):
        yield


@pytest.mark.slow
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
    assert_matches(result, v, alpha, c_v, c_a)


@pytest.mark.slow  # in CI's slow tier: 8 s; the compiled-equals-classic run above stays in the default run
def test_the_graph_ends_with_the_run():
    clients, test = sized_clients()
    executor = RayExecutor()
    train(dict(BASE, transport="compiled", iterations=6, **RAY), clients, test, executor=executor)
    assert executor.graph.builds == 1 and executor.graph.graph is None and executor.actors == {}


@pytest.mark.slow  # a multi-node cluster of its own, 16 s
def test_compiled_with_per_node_reduction_merges_on_the_node_and_equals_classic_node_reduction_bit_for_bit():
    # one node: the three actors' sums are merged by its reducer inside the graph; a round that samples only
    # one of them passes that actor's sum on as it is, as the classic node transport does
    clients, test = sized_clients()
    cfg = dict(BASE, clients_per_round=3, clients_per_actor=2, reduce="node", fold_order="client", **RAY)
    classic = train(cfg, clients, test)
    executor = raytest.FoldCounting()
    compiled = train(dict(cfg, transport="compiled"), clients, test, executor=executor)
    assert_same_state(compiled, classic, exact=True)
    assert compiled.summary["bytes_up"] == classic.summary["bytes_up"]
    assert executor.folds == [1] * 6 and executor.graph.builds == 1
    assert executor.transport.serves == ("compiled", "node") and executor.transport.reducers == {}  # ended with the run
    with pytest.raises(ConfigError, match="transport"):
        build_config(dict(transport="nccl"))


def test_node_merges_are_folded_in_the_order_of_their_first_actor_in_the_round():
    from fdam_ray.executors.ray.transports.compiled import CompiledTransport, _sources

    a_, b_ = object(), object()
    sources = _sources(dict.fromkeys(range(5)), [(a_, [0, 3]), (b_, [1, 2])])
    assert sources == [(a_, [0, 3]), (b_, [1, 2]), (None, [4])]
    transport = CompiledTransport.__new__(CompiledTransport)
    transport.graph = type("G", (), {"groups": [g for _, g in sources]})()
    # actor 0 not in the round: node [1, 2]'s sum comes before node [0, 3]'s (classic: by first target)
    assert transport._in_fold_order(["n03", "n12", "a4"], [1, 2, 3, 4]) == ["n12", "n03", "a4"]
    assert transport._in_fold_order(["n03", None, "a4"], [0, 4]) == ["n03", "a4"]


@pytest.mark.slow
def test_a_spinning_graph_rests_during_scoring_only_when_scoring_takes_several_builds():
    clients, test = sized_clients()
    source = ArraysSource(clients, test)
    config = build_config(dict(BASE, dataset="arrays", num_clients=len(clients), transport="compiled",
                               channel_wait="spin", **RAY))
    with RayExecutor() as ex:
        ex.start(ExecutorSetup.for_config(config, ex.section), source)
        state = first_state(ex, config, source)
        ex.run_round(state, RoundPlan(1, 1, 2, 0.1, 0), lambda partial: None)
        assert ex.graph.graph is not None and ex.graph.build_s > 0
        ex.evaluate(state)  # no scoring timed yet: the graph stays
        assert ex.graph.graph is not None and ex.took["evaluate"] > 0
        ex.took["evaluate"] = REST_RATIO * ex.graph.build_s * 1.01  # as if the last scoring had been long
        ex.evaluate(state)
        assert ex.graph.graph is None  # ended for the scoring ...
        ex.run_round(state, RoundPlan(2, 1, 2, 0.1, 2), lambda partial: None)
        assert ex.graph.graph is not None and ex.graph.builds == 2 and ex.graph.actor_sets == 1  # ... and back


@pytest.mark.slow
def test_a_sleeping_graph_stays_through_scoring():
    clients, test = sized_clients()
    source = ArraysSource(clients, test)
    config = build_config(dict(BASE, dataset="arrays", num_clients=len(clients), transport="compiled", **RAY))
    assert config.channel_wait == "sleep"
    with RayExecutor() as ex:
        ex.start(ExecutorSetup.for_config(config, ex.section), source)
        state = first_state(ex, config, source)
        ex.run_round(state, RoundPlan(1, 1, 2, 0.1, 0), lambda partial: None)
        ex.took["evaluate"] = REST_RATIO * ex.graph.build_s * 10
        ex.evaluate(state)
        ex.run_round(state, RoundPlan(2, 1, 2, 0.1, 2), lambda partial: None)
        assert ex.graph.graph is not None and ex.graph.builds == 1


def _cpu_seconds(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def _idle_cores(wait: str, pids, **fields) -> float:
    """The most CPU (cores) any of ``pids(executor)`` took over 2 s while a compiled graph (``channel_wait`` =
    ``wait``, config ``fields``) waits between its first and second round."""
    clients, test = sized_clients()
    source = ArraysSource(clients, test)
    config = build_config(dict(BASE, dataset="arrays", num_clients=len(clients), transport="compiled",
                               channel_wait=wait, **fields, **RAY))
    with RayExecutor() as ex:
        ex.start(ExecutorSetup.for_config(config, ex.section), source)
        state = first_state(ex, config, source)
        ex.run_round(state, RoundPlan(1, 1, 2, 0.1, 0), lambda partial: None)
        watched = pids(ex)
        time.sleep(1.0)  # a process started with this round (a node reducer) also loads what it merged
        before, started = [_cpu_seconds(p) for p in watched], time.monotonic()
        time.sleep(2.0)
        took = time.monotonic() - started
        idle = max(_cpu_seconds(p) - b for p, b in zip(watched, before, strict=True)) / took
        ex.run_round(state, RoundPlan(2, 1, 2, 0.1, 2), lambda partial: None)  # the graph still answers
        assert ex.graph.builds == 1
    return idle


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="reads process CPU time from /proc")
@pytest.mark.slow
def test_waiting_actors_sleep_instead_of_keeping_a_core_busy():
    # between rounds a compiled graph's actors wait for the next input: polling (spin) keeps a core busy each,
    # sleeping waits cost almost nothing
    idle = {wait: _idle_cores(wait, lambda ex: [ex.where_of[a]["pid"] for a in sorted(ex.actors)])
            for wait in ("spin", "sleep")}
    assert idle["sleep"] < 0.1, idle  # cores per waiting actor
    assert idle["spin"] > 3 * idle["sleep"], idle


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="reads process CPU time from /proc")
@pytest.mark.slow
def test_a_waiting_node_reducer_sleeps_too():
    # reduce=node: the node's reducer waits on its actors' channels between rounds, as the actors wait on the
    # input; with channel_wait=sleep it checks now and then, with spin it reads as Ray does (Ray's read loop)
    def reducer_pid(ex) -> list[int]:
        (reducer,) = ex.transport.reducers.values()
        return [ray.get(reducer.__ray_call__.remote(lambda self: os.getpid()))]

    idle = {wait: _idle_cores(wait, reducer_pid, reduce="node") for wait in ("spin", "sleep")}
    assert idle["sleep"] < 0.05, idle  # cores
    assert idle["spin"] > 3 * idle["sleep"], idle


class _Channel:
    """A channel whose data arrive ``ready_s`` after it is made; counts the checks of a zero-timeout read."""

    def __init__(self, ready_s: float, value=None, error: BaseException | None = None) -> None:
        self.ready_at = time.monotonic() + ready_s
        self.value, self.error, self.checks = value, error, 0

    def read(self, timeout: float) -> object:
        from ray.exceptions import RayChannelTimeoutError

        if timeout > 0:  # Ray's polling wait, as one check
            time.sleep(max(0.0, min(timeout, self.ready_at - time.monotonic())))
        self.checks += 1
        if time.monotonic() < self.ready_at:
            raise RayChannelTimeoutError("no data yet")
        if self.error is not None:
            raise self.error
        return self.value


def test_a_patient_read_returns_soon_after_the_data_with_few_checks():
    from ray.exceptions import RayChannelTimeoutError

    wait = 0.5
    channel = _Channel(wait, value="data")
    assert patient_read(_Channel.read, channel, None) == "data"
    late = time.monotonic() - channel.ready_at
    assert late <= PAUSE_OF_WAIT * wait + 0.04, late  # the longest pause, plus slack for a busy machine
    assert channel.checks < 400, channel.checks  # a polling read checks hundreds of thousands of times
    whole = channel.checks
    # a wait split into short reads (Ray's read loop asks every 0.1 s) backs off as one wait
    channel = _Channel(wait, value="data")
    timeouts, since = 0, set()
    while True:
        try:
            got = patient_read(_Channel.read, channel, 0.05)
            break
        except RayChannelTimeoutError:
            timeouts += 1
            since.add(channel._fdam_waiting_since)
    assert got == "data" and timeouts >= 4
    assert len(since) == 1 and None not in since  # every read went on with the wait the first one began
    assert time.monotonic() - channel.ready_at <= PAUSE_OF_WAIT * wait + 0.04
    # and with its pause: a few checks a read more than the whole wait in one read (pauses begun afresh in
    # each read made it about 10 more a read)
    assert channel.checks <= whole + 5 * (timeouts + 1), (channel.checks, whole, timeouts)
    assert channel._fdam_waiting_since is None and channel._fdam_pause is None  # the next wait starts afresh
    # a timeout is kept to (within a pause), and errors pass through
    started = time.monotonic()
    with pytest.raises(RayChannelTimeoutError):
        patient_read(_Channel.read, _Channel(10.0), 0.05)
    assert 0.05 <= time.monotonic() - started < 0.05 + PAUSE_CAP_S + 0.04
    channel = _Channel(0.01, error=ValueError("broken"))
    with pytest.raises(ValueError, match="broken"):
        patient_read(_Channel.read, channel, None)
    assert channel._fdam_waiting_since is None


def _same(a, b) -> bool:
    """Equal nested states (dicts, sequences, tensors, arrays, scalars)."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(map(_same, a, b))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and np.array_equal(a, b)
    return a == b


def test_a_round_reported_not_started_never_runs_on_the_graph_thread_afterwards():
    # recovery asks each actor how its part of a broken round went; "not started" makes the driver re-run that
    # part with a classic call, so an input that reaches the actor later must not run it a second time
    clients, test = sized_clients()
    source = ArraysSource(clients, test)
    config = build_config(dict(BASE, dataset="arrays", num_clients=len(clients), transport="compiled", **RAY))
    with RayExecutor() as ex:
        ex.start(ExecutorSetup.for_config(config, ex.section), source)
        state = first_state(ex, config, source)
        actor = ex.actors[0]
        ids = ex.hosted[0]
        message = (state, RoundPlan(1, 1, 2, 0.1, 0), {0: (ids, [])})
        before = ray.get(actor.get_state.remote(ids))
        assert ray.get(actor.round_status.remote(1)) == ("not started", None)
        assert ray.get(actor.compiled_round.remote(message)) is None
        assert ray.get(actor.round_status.remote(1)) == ("not started", None)
        after = ray.get(actor.get_state.remote(ids))
        assert _same([s["sampler"] for s in after], [s["sampler"] for s in before])  # nothing ran
        message = (state, RoundPlan(2, 1, 2, 0.1, 0), {0: (ids, [])})
        partial = ray.get(actor.compiled_round.remote(message))  # the next round runs as usual
        assert [s.client_id for s in partial.stats] == list(ids)
        assert ray.get(actor.round_status.remote(2))[0] == "done"
