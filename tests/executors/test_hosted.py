"""Clients hosted several to a model replica (``clients_per_actor``): same math, one partial sum per host,
failures of a hosting actor survived, per-actor resources, exact resume."""

from __future__ import annotations

import logging
import os
import re
import signal

import numpy as np
import pytest
import raytest
from oracle import assert_matches, run_oracle
from test_oracle import initial_v

import fdam_ray
from fdam_ray.algorithms.server import PartialSum, RoundReducer
from fdam_ray.assembly.recipe import run
from fdam_ray.cli import main
from fdam_ray.config import ConfigError, build_config
from fdam_ray.core.state import ClientUpdate, GlobalState, StepStats
from fdam_ray.data.arrays import ArraysSource
from fdam_ray.executors.base import ExecutorSetup, actor_groups
from fdam_ray.executors.inline import InlineExecutor
from fdam_ray.tuning.trial import trial_bundles

K = 5
BASE = dict(model="linear", batch_size=8, eval_every=1000, seed=0, executor="inline", algorithm="codasca",
            local_steps=3, iterations=18, lr=0.2, stage_length=9, client_weighting="samples", tensorboard=False)


def sized_clients(sizes=(12, 30, 18, 40, 24), d=4, seed=3):
    """Clients of different sizes and prevalences (weights by samples differ from uniform), and a test set."""
    rng = np.random.default_rng(seed)
    u = rng.standard_normal(d)
    out = []
    for k, n in enumerate(sizes):
        y = (rng.random(n) < 0.15 + 0.1 * k).astype(np.float32)
        y[:2] = (1, 0)
        X = rng.standard_normal((n, d)) + np.outer(2 * y - 1, u) * 0.8 + rng.standard_normal(d)
        out.append((X.astype(np.float32), y))
    yt = np.r_[np.ones(40), np.zeros(40)].astype(np.float32)
    Xt = (rng.standard_normal((80, d)) + np.outer(2 * yt - 1, u) * 0.8).astype(np.float32)
    return out, (Xt, yt)


def train(cfg: dict, clients, test, executor=None, **kw):
    config = build_config(dict(cfg, dataset="arrays", num_clients=len(clients)))
    return run(config, source=ArraysSource(clients, test), executor=executor, save=False, **kw)


def assert_same_state(a, b, *, exact: bool, atol: float = 1e-6) -> None:
    pairs = [("v", a.state.v, b.state.v), ("alpha", a.alpha, b.alpha)]
    if a.control_variates is not None:
        pairs += [("c_v", a.control_variates[0], b.control_variates[0]),
                  ("c_alpha", a.control_variates[1], b.control_variates[1])]
    for name, x, y in pairs:
        if exact:
            np.testing.assert_array_equal(x, y, err_msg=name)
        else:
            np.testing.assert_allclose(x, y, rtol=0, atol=atol, err_msg=name)


# -- the partial-sum format ------------------------------------------------------------------------
def random_updates(rng, n=7, m=2, nb=3, count=5):
    return [ClientUpdate(rng.standard_normal(n).astype(np.float32), rng.random(m).astype(np.float32),
                         rng.random(nb).astype(np.float32), rng.integers(0, 9, 2),
                         rng.standard_normal(n).astype(np.float32), rng.standard_normal(m).astype(np.float32),
                         client_id=k, stats=StepStats(k, 0.5, 3, 24, 0.01, finite=k != 3)) for k in range(count)]


def test_partial_sums_merged_in_any_grouping_reduce_to_the_drivers_folds():
    rng = np.random.default_rng(0)
    prev = GlobalState(np.zeros(7, np.float32), np.zeros(2, np.float32), np.zeros(3, np.float32),
                       np.zeros(2, np.int64), np.zeros(7, np.float32), np.zeros(2, np.float32))
    ups = random_updates(rng)
    w = np.array([3.0, 1.0, 4.0, 1.0, 5.0])
    kw = dict(global_lr=1.2, alpha_nonnegative=True, control_variates=True, weights=w)
    direct = RoundReducer(prev, **kw)
    for u in ups:
        direct.fold(u)
    for groups in ([[0], [1], [2], [3], [4]], [[0, 1], [2, 3], [4]], [[0, 1, 2, 3, 4]]):
        red = RoundReducer(prev, **kw)
        for g in groups:
            part = PartialSum.zeros(prev, control_variates=True)
            for k in g:
                part.fold(ups[k], w[k])
            red.fold(part)
        assert (red.count, red.total_weight, red.bytes_up) == (5, 14.0, sum(u.nbytes for u in ups))
        assert [s.client_id for s in red.stats] == [0, 1, 2, 3, 4] and not red.stats[3].finite
        got, want = red.finish(steps=3), RoundReducer(prev, **kw)
        for u in ups:
            want.fold(u)
        want = want.finish(steps=3)
        for name in ("v", "alpha", "buffers", "c_v", "c_alpha"):
            if len(groups) == 5:  # one client per partial: 0 + w x is w x, so the sums are the driver's to the bit
                np.testing.assert_array_equal(getattr(got, name), getattr(want, name), err_msg=name)
            else:
                np.testing.assert_allclose(getattr(got, name), getattr(want, name), rtol=1e-6, err_msg=name)
        np.testing.assert_array_equal(got.counters, np.max([u.counters for u in ups], axis=0))
    # a partial sum travels as plain data (its scratch buffer stays behind) and merges after the trip
    import pickle

    part = PartialSum.zeros(prev, control_variates=True)
    part.fold(ups[0], 2.0)
    back = pickle.loads(pickle.dumps(part))
    assert "_scratch_by_size" not in back.__dict__ and back.stats[0].client_id == 0
    np.testing.assert_array_equal(back.v, ups[0].v * np.float32(2.0))
    with pytest.raises(ValueError, match=r"the partial sum of clients \[0\] holds no control variate"):
        RoundReducer(prev, **kw).fold(PartialSum(back.v, back.alpha, back.buffers, back.counters,
                                                 stats=back.stats))


def test_clients_go_to_actor_k_over_m():
    assert actor_groups(5, 1) == [[0], [1], [2], [3], [4]]
    assert actor_groups(5, 2) == [[0, 1], [2, 3], [4]]
    assert actor_groups(5, 5) == actor_groups(5, 9) == [[0, 1, 2, 3, 4]]


# -- inline: one replica, the same run whatever M ------------------------------------------------------
@pytest.mark.parametrize("sampled", [None, 3], ids=["all", "S=3"])
def test_inline_runs_with_1_2_or_k_clients_per_host_end_in_the_same_state(sampled):
    clients, test = sized_clients()
    cfg = dict(BASE, clients_per_round=sampled)
    one = train(cfg, clients, test)
    default = train({**cfg}, clients, test)
    assert_same_state(one, default, exact=True)
    for m in (2, K):
        hosted = train(dict(cfg, clients_per_actor=m), clients, test)
        assert_same_state(hosted, one, exact=False)
        assert hosted.summary["bytes_up"] == one.summary["bytes_up"]
        assert hosted.summary["bytes_down"] == one.summary["bytes_down"]
    assert np.abs(one.control_variates[0]).max() > 1e-3


def test_hosted_clients_with_sampling_and_weights_match_the_numpy_oracle():
    clients, test = sized_clients()
    case = dict(objective="auc_margin", local_steps=3, iterations=18, lr=0.3, prox_weight=0.02, stage_length=9,
                clients_per_round=3, client_weighting="samples", global_lr=1.1)
    result = train(dict(BASE, batch_size="full", **case, clients_per_actor=2), clients, test)
    v, alpha, c_v, c_a = run_oracle([(X.astype(np.float64), y) for X, y in clients], initial_v(4, 0),
                                    control_variates=True, **case)
    assert_matches(result, v, alpha, c_v, c_a)


def test_the_inline_executor_hosts_every_client_on_one_replica():
    clients, test = sized_clients()
    ex = InlineExecutor()
    result = train(dict(BASE, iterations=6), clients, test, executor=ex)
    assert result.state.round == 2
    ex = InlineExecutor()
    ex.start(ExecutorSetup.for_config(build_config(dict(BASE, dataset="arrays", num_clients=K, clients_per_actor=2))),
             ArraysSource(clients, test))
    assert len({id(c.replica) for c in ex.clients}) == 1 and ex.groups == [[0, 1], [2, 3], [4]]
    # each client keeps its own control variate and sampler; the replica's solver steps with the bound one
    assert len({id(c.cv[0]) for c in ex.clients}) == K
    assert ex.clients[3].solver.correction.c_v is ex.clients[3].cv[0]


def test_a_divergence_in_a_hosted_client_names_that_client(monkeypatch):
    from fdam_ray.clients.client import Client

    original = Client.local_round

    def poisoned(self, state, plan, **kw):
        update = original(self, state, plan, **kw)
        if plan.round == 2 and self.client_id == 3:
            update.stats.finite = False
        return update

    monkeypatch.setattr(Client, "local_round", poisoned)
    clients, test = sized_clients()
    with pytest.raises(fdam_ray.DivergenceError, match="round 2: client 3 sent a NaN"):
        train(dict(BASE, clients_per_actor=K), clients, test)


def test_resume_with_hosted_clients_equals_the_uninterrupted_run(tmp_path):
    clients, test = sized_clients()
    cfg = dict(BASE, clients_per_round=3, clients_per_actor=2, out_dir=str(tmp_path), checkpoint_every=1)
    whole = train(cfg, clients, test)
    config = build_config(dict(cfg, dataset="arrays", num_clients=K, iterations=9, run_name="r"))
    run(config, source=ArraysSource(clients, test), save=True)
    resumed = fdam_ray.resume(tmp_path / "r", {"iterations": 18}, source=ArraysSource(clients, test))
    assert_same_state(resumed, whole, exact=True)
    # the clients' states do not depend on how they were hosted: resuming with another M continues the same run
    run(config.replace(run_name="s"), source=ArraysSource(clients, test), save=True)
    other = fdam_ray.resume(tmp_path / "s", {"iterations": 18, "clients_per_actor": 1},
                            source=ArraysSource(clients, test))
    assert_same_state(other, whole, exact=False)


# -- resource fields ------------------------------------------------------------------------------------
def test_per_client_resource_names_are_read_as_per_actor_ones_only_when_an_actor_hosts_one_client():
    config = build_config(cpus_per_client=0.5, gpus_per_client=0.25, threads_per_client=2)
    assert (config.cpus_per_actor, config.gpus_per_actor, config.threads_per_actor) == (0.5, 0.25, 2)
    assert "cpus_per_client" not in config.to_dict()
    with pytest.raises(ConfigError, match=re.escape(
            "config field 'cpus_per_client' is now 'cpus_per_actor' (resources are reserved per actor, and "
            "clients_per_actor = 4 clients share one): set 'cpus_per_actor' instead")):
        build_config(cpus_per_client=0.5, clients_per_actor=4)
    with pytest.raises(ConfigError, match="config fields 'gpus_per_client' and 'gpus_per_actor' are both given"):
        build_config(gpus_per_client=0.5, gpus_per_actor=0.5)
    with pytest.raises(ConfigError, match=re.escape("config field 'cpus_per_client': 0.0 is not allowed (> 0)")):
        build_config(cpus_per_client=0)
    assert build_config(cpus_per_actor=2, clients_per_actor=4).cpus_per_actor == 2.0


def test_the_cli_says_in_one_line_what_an_old_resource_name_became(tmp_path, capsys):
    rc = main(["train", f"out_dir={tmp_path}", "clients_per_actor=2", "gpus_per_client=0.5"])
    err = capsys.readouterr().err
    assert rc == 2 and "'gpus_per_client' is now 'gpus_per_actor'" in err and err.count("\n") == 1
    assert not any(tmp_path.iterdir())


def test_a_tune_trial_reserves_the_driver_and_one_bundle_per_actor():
    config = build_config(executor="ray", num_clients=10, clients_per_actor=4, cpus_per_actor=2, gpus_per_actor=0.5)
    assert trial_bundles(config, 1.0) == [{"CPU": 1.0}] + [{"CPU": 2.0, "GPU": 0.5}] * 3
    assert trial_bundles(config.replace(clients_per_actor=1), 1.0) == [{"CPU": 1.0}] + [{"CPU": 2.0, "GPU": 0.5}] * 10


# -- Ray: actors hosting clients ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def ray_session():
    with raytest.ray_session(num_cpus=4):
        yield


RAY = dict(executor="ray", cpus_per_actor=0.5, threads_per_actor=1)


def recording_executor():
    from fdam_ray.executors.ray.executor import RayExecutor

    class Recording(RayExecutor):
        """Keeps which actors each round called, and with which clients."""

        def __init__(self) -> None:
            super().__init__()
            self.rounds: list[dict[int, list[int]]] = []

        def run_round(self, state, plan, fold, clients=None):
            called: dict[int, list[int]] = {}
            self.rounds.append(called)

            def record(partial):
                called[min(s.client_id for s in partial.stats) // self.config.clients_per_actor] = sorted(
                    s.client_id for s in partial.stats)
                fold(partial)

            super().run_round(state, plan, record, clients)

    return Recording()


def test_ray_actors_hosting_clients_equal_the_inline_run(ray_session):
    from fdam_ray.algorithms.sampling import sample_clients

    clients, test = sized_clients()
    cfg = dict(BASE, clients_per_round=3, **RAY)
    inline = {m: train(dict(cfg, executor="inline", clients_per_actor=m), clients, test) for m in (1, 2)}
    ex = recording_executor()
    two = train(dict(cfg, clients_per_actor=2, fold_order="client"), clients, test, executor=ex)
    assert_same_state(two, inline[2], exact=True)  # the same groups folded in the same order: to the bit
    assert ex.bundle_of == {0: 0, 1: 1, 2: 2}  # one bundle per actor
    for r, called in enumerate(ex.rounds, start=1):  # each round calls only the actors of its sampled clients
        sample = sample_clients(0, r, K, 3)
        assert called == {a: [k for k in sample if k // 2 == a] for a in {k // 2 for k in sample}}
    every = train(dict(cfg, clients_per_actor=K), clients, test)  # one actor, arrival order
    assert_same_state(every, inline[1], exact=False)
    assert every.summary["bytes_up"] == inline[1].summary["bytes_up"]
    assert [h["test_auc"] for h in every.history] == pytest.approx([h["test_auc"] for h in inline[1].history],
                                                                   abs=1e-6)


def killing_executor(victim_actor: int, at_round: int):
    from fdam_ray.executors.ray.executor import RayExecutor

    class KillActor(RayExecutor):
        """Kills actor ``victim_actor``'s process by pid as round ``at_round`` starts."""

        def run_round(self, state, plan, fold, clients=None):
            if plan.round == at_round:
                where = self.client_info()
                pid = next(w["pid"] for w in where.values() if w["actor"] == victim_actor)
                os.kill(pid, signal.SIGKILL)  # the round's call to it fails
            super().run_round(state, plan, fold, clients)

    return KillActor()


class AdoptGlobalC(InlineExecutor):
    """Inline oracle of a rebuilt actor: in round ``at_round`` its clients' c^k become the global c."""

    def __init__(self, victims, at_round: int) -> None:
        super().__init__()
        self.victims, self.at_round = victims, at_round

    def run_round(self, state, plan, fold, clients=None):
        if plan.round == self.at_round:
            for k in self.victims:
                self.clients[k].set_control_variate(state.c_v, state.c_alpha)
        super().run_round(state, plan, fold, clients)


def test_a_killed_actor_hosting_three_clients_is_rebuilt_and_the_run_goes_on(ray_session, caplog):
    clients, test = sized_clients(sizes=(40, 50, 45, 60, 35, 55))
    cfg = dict(BASE, batch_size="full", iterations=24, local_steps=3, stage_length=12, lr=0.3,
               positive_ratio=0.3, clients_per_actor=3, eval_every=12)
    ex = killing_executor(victim_actor=1, at_round=3)
    with caplog.at_level(logging.WARNING, logger="fdam_ray"):
        got = train(dict(cfg, **RAY), clients, test, executor=ex)
    [event] = ex.events
    assert (event["actor"], event["clients"], event["round"], event["action"]) == (1, [3, 4, 5], 3, "local_round")
    assert "died" in event["error"] and event["outcome"].startswith("replaced")
    assert "actor 1 (clients 3, 4, 5) failed in round 3 (local_round): its actor process died" in caplog.text
    # the rebuilt clients restart from the global c (full batches: no sampler position to lose)
    want = train(cfg, clients, test, executor=AdoptGlobalC([3, 4, 5], at_round=3))
    np.testing.assert_allclose(got.state.v, want.state.v, atol=1e-6)
    np.testing.assert_allclose(got.state.c_v, want.state.c_v, atol=1e-6)
    undisturbed = train(cfg, clients, test)
    assert np.abs(got.state.v - undisturbed.state.v).max() > 1e-5  # the rebuild did change the run
    assert abs(got.summary["final_test_auc"] - undisturbed.summary["final_test_auc"]) <= 0.01


@pytest.mark.fault  # in benchmarks/fault_tests.py, not the CI tiers
def test_a_ray_run_with_hosted_clients_stopped_and_resumed_equals_the_uninterrupted_run(ray_session, tmp_path):
    from fdam_ray.executors.ray.executor import RayExecutor

    class StopInRound(RayExecutor):
        def run_round(self, state, plan, fold, clients=None):
            if plan.round == 4:
                raise KeyboardInterrupt
            super().run_round(state, plan, fold, clients)

    clients, test = sized_clients()
    cfg = dict(BASE, clients_per_round=3, clients_per_actor=2, checkpoint_every=1, out_dir=str(tmp_path),
               run_name="r", fold_order="client", **RAY)
    config = build_config(dict(cfg, dataset="arrays", num_clients=K))
    with pytest.raises(KeyboardInterrupt):
        run(config, source=ArraysSource(clients, test), executor=StopInRound(), save=True)
    resumed = fdam_ray.resume(tmp_path / "r", source=ArraysSource(clients, test))
    whole = train(dict(cfg, executor="inline"), clients, test)
    assert_same_state(resumed, whole, exact=True)


@pytest.mark.fault  # in benchmarks/fault_tests.py, not the CI tiers
def test_drop_leaves_out_only_the_failing_client_of_an_actor_and_its_neighbour_goes_on(ray_session):
    from fdam_ray.executors.ray.executor import RayExecutor

    clients, test = sized_clients(sizes=(40, 50, 45, 60))
    cfg = dict(BASE, batch_size="full", iterations=9, local_steps=3, positive_ratio=0.3, clients_per_actor=2,
               client_weighting="uniform")
    source = ArraysSource(clients, test)
    x, y = source.trains[1]
    source.trains[1] = (np.concatenate([x, x], 1), y)  # client 1's first step raises in the model
    ex = RayExecutor()
    config = build_config(dict(cfg, **RAY, dataset="arrays", num_clients=4, on_client_failure="drop",
                               max_client_retries=0))
    got = run(config, source=source, executor=ex, save=False)
    [event] = ex.events
    assert (event["client"], event["actor"], event["dropped"], event["outcome"]) == (1, 0, [1], "dropped")
    assert ex.hosted == {0: [0], 1: [2, 3]} and ex.active_clients == 3
    without = train(cfg, [clients[0], clients[2], clients[3]], test)
    np.testing.assert_allclose(got.state.v, without.state.v, atol=1e-6)
