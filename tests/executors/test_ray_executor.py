"""The Ray executor: same math as inline, failures survived or reported, placement, devices, streaming."""

from __future__ import annotations

import gc
import logging
import os
import signal
import threading
import time
import weakref

import numpy as np
import pytest
import ray
import torch
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
from raytest import SlowClientSource, first_state, ray_session
from sample_clients import arrays_in, gaussian_clients

import fdam_ray
from fdam_ray.assembly.recipe import run
from fdam_ray.checkpoint import load_checkpoint, save_checkpoint
from fdam_ray.cli import main
from fdam_ray.clients.client import ClientSection
from fdam_ray.config import build_config
from fdam_ray.core.state import RoundPlan
from fdam_ray.data import make_source
from fdam_ray.data.arrays import ArraysSource
from fdam_ray.executors.base import ExecutorSetup
from fdam_ray.executors.errors import ClientError, ClientInputError, ClusterConnectionError
from fdam_ray.executors.inline import InlineExecutor
from fdam_ray.executors.ray import actor as actor_shell
from fdam_ray.executors.ray.executor import RayExecutor
from fdam_ray.executors.ray.fleet import Fleet
from fdam_ray.executors.ray.placement import Placement
from fdam_ray.executors.ray.session import check_cluster_access, ensure_ray

HALF = dict(cpus_per_client=0.5)  # K clients fit the module's 4 logical CPUs
ARRAYS = dict(model="mlp", model_width=8, batch_size="full", eval_every=2, seed=2, lr=0.2, local_steps=2, **HALF)
# the failure tests run under both ways a round reaches the actors
TRANSPORTS = pytest.mark.parametrize("transport", ["classic", "compiled", "collective"])
# fault handling: classic in the default run, the compiled and collective transports (6-9 s each) in the slow tier
TRANSPORTS_CLASSIC_FIRST = pytest.mark.parametrize("transport", [
    "classic", pytest.param("compiled", marks=pytest.mark.slow), pytest.param("collective", marks=pytest.mark.slow)])


@pytest.fixture(scope="module", autouse=True)
def session():
    with ray_session():
        yield


def no_leftover_groups() -> bool:
    return all(g["state"] == "REMOVED" for g in placement_group_table().values())


def arrays_run(cfg: dict, clients, test, executor=None, source=None):
    config = build_config(dict(cfg, dataset="arrays", num_clients=len(clients)))
    return run(config, source=source or ArraysSource(clients, test), executor=executor, save=False)


# -- same math ------------------------------------------------------------------------------
@pytest.mark.slow
def test_three_rounds_of_codasca_on_digits_equal_the_inline_run():
    cfg = dict(dataset="digits", num_clients=3, model="cnn", model_width=8, batch_size=16, local_steps=4,
               iterations=12, eval_every=4, seed=7, algorithm="codasca", global_lr=1.1, **HALF)
    inline = run(build_config(dict(cfg, executor="inline")), save=False)
    on_ray = run(build_config(dict(cfg, executor="ray", eval_on="clients")), save=False)
    assert on_ray.state.round == 3
    for name in ("v", "alpha", "buffers", "c_v", "c_alpha"):
        np.testing.assert_allclose(getattr(on_ray.state, name), getattr(inline.state, name), rtol=0, atol=1e-6,
                                   err_msg=name)
    assert np.abs(inline.state.c_v).max() > 1e-3 and np.abs(inline.state.buffers).max() > 0
    assert [h["test_auc"] for h in on_ray.history] == pytest.approx([h["test_auc"] for h in inline.history],
                                                                    abs=1e-6)
    # folded in client order, the sums are the inline executor's to the bit
    ordered = run(build_config(dict(cfg, executor="ray", fold_order="client")), save=False)
    for name in ("v", "alpha", "buffers", "c_v", "c_alpha"):
        np.testing.assert_array_equal(getattr(ordered.state, name), getattr(inline.state, name), err_msg=name)
    assert no_leftover_groups()


def test_with_eval_on_driver_the_driver_scores_the_global_test_set():
    clients, test = gaussian_clients(num_clients=2)
    cfg = dict(ARRAYS, algorithm="coda_plus", iterations=4, executor="ray")
    executor = RayExecutor()
    on_driver = arrays_run(dict(cfg, eval_on="driver"), clients, test, executor=executor)
    assert executor.fleet.test_size == 0  # the clients did not load the test set
    on_clients = arrays_run(dict(cfg, eval_on="clients"), clients, test)
    assert [h["test_auc"] for h in on_driver.history] == pytest.approx([h["test_auc"] for h in on_clients.history],
                                                                        abs=1e-9)


@pytest.mark.slow
def test_updates_are_folded_one_at_a_time():
    clients, test = gaussian_clients(num_clients=3)
    source = ArraysSource(clients, test)
    config = build_config(dict(ARRAYS, dataset="arrays", num_clients=3, algorithm="codasca"))
    with RayExecutor() as ex:
        ex.start(ExecutorSetup.for_config(config, ex.section), source)
        state = first_state(ex, config, source)
        seen, alive_at_fold = [], []

        def fold(update):
            gc.collect()
            alive_at_fold.append(sum(r() is not None for r in seen))
            seen.append(weakref.ref(update))

        ex.run_round(state, RoundPlan(1, 1, 2, 0.1, 0), fold)
    assert len(seen) == 3 and alive_at_fold == [0, 0, 0]  # the driver held one update at a time


# -- failures ---------------------------------------------------------------------------------
class KillDuringRound(RayExecutor):
    """Kills client ``victim``'s actor in round ``at_round``: its process by pid, or with ``ray.kill``."""

    def __init__(self, victim: int, at_round: int, how: str) -> None:
        super().__init__()
        self.victim, self.at_round, self.how = victim, at_round, how
        self.rebuilt: dict[int, list[int]] = {}  # what the loop recorded (LoopState.rebuilt)

    def take_rebuilt(self):
        got = super().take_rebuilt()
        self.rebuilt.update(got)
        return got

    def run_round(self, state, plan, fold):
        if plan.round == self.at_round:
            if self.how == "pid":
                pid = self.client_info()[self.victim]["pid"]
                threading.Timer(0.02, os.kill, (pid, signal.SIGKILL)).start()
            else:
                ray.kill(self.actors[self.victim])
        super().run_round(state, plan, fold)


@TRANSPORTS
@pytest.mark.fault  # in benchmarks/fault_tests.py, not the CI tiers
def test_a_killed_client_process_is_replaced_and_the_run_ends_near_the_undisturbed_one(transport, caplog):
    cfg = dict(dataset="digits", num_clients=4, model="cnn", model_width=8, batch_size=32, local_steps=25,
               iterations=200, eval_every=100, seed=3, algorithm="codasca", lr=0.1, **HALF)
    undisturbed = run(build_config(dict(cfg, executor="inline")), save=False)
    executor = KillDuringRound(victim=1, at_round=2, how="pid")
    with caplog.at_level(logging.WARNING, logger="fdam_ray"):
        # one round a call under collective: the kill lands in round 2 (runs of rounds:
        # tests/executors/test_collective_runs.py)
        disturbed = run(build_config(dict(cfg, executor="ray", transport=transport, collective_rounds=1)),
                        executor=executor, save=False)
    event, *more = executor.events
    assert (event["client"], event["round"], event["action"]) == (1, 2, "local_round")
    assert "died" in event["error"] and event["outcome"].startswith("replaced")
    assert "client 1 failed in round 2 (local_round)" in caplog.text
    # under collective, a peer can hang ending the broken group (torch's destroy_process_group): it is ended
    # as late after collective.BROKEN_GRACE_S and replaced too, rather than waited for until ray_timeout_s
    assert all(transport == "collective" and e["round"] == 2 and "no answer" in e["error"]
               and e["outcome"].startswith("replaced") for e in more), more
    assert disturbed.state.round == 8
    assert abs(disturbed.summary["final_test_auc"] - undisturbed.summary["final_test_auc"]) <= 0.01


class AdoptGlobalC(InlineExecutor):
    """Inline oracle of a replacement in round ``at_round``: c^k of client ``victim`` set to the global c."""

    def __init__(self, victim: int, at_round: int) -> None:
        super().__init__()
        self.victim, self.at_round = victim, at_round

    def run_round(self, state, plan, fold):
        if plan.round == self.at_round:
            self.clients[self.victim].set_control_variate(state.c_v, state.c_alpha)
        super().run_round(state, plan, fold)


@pytest.mark.slow
@TRANSPORTS_CLASSIC_FIRST
def test_a_replaced_client_restarts_from_the_global_control_variate_recorded_and_replayed(transport, tmp_path):
    clients, test = gaussian_clients(num_clients=3)
    cfg = dict(ARRAYS, algorithm="codasca", iterations=10, positive_ratio=0.3)
    executor = KillDuringRound(victim=2, at_round=3, how="ray.kill")
    got = arrays_run(dict(cfg, executor="ray", transport=transport), clients, test, executor=executor)
    want = arrays_run(dict(cfg, executor="inline"), clients, test, executor=AdoptGlobalC(victim=2, at_round=3))
    plain = arrays_run(dict(cfg, executor="inline"), clients, test)
    assert [(e["client"], e["round"]) for e in executor.events] == [(2, 3)]
    assert executor.rebuilt == {3: [2]}  # recorded: client 2 ran round 3 as a rebuilt client
    folder = run(build_config(dict(cfg, dataset="arrays", num_clients=3, executor="inline", out_dir=str(tmp_path))),
                 source=ArraysSource(clients, test)).run_dir  # a record of this run: rebuilt = {3: [2]}
    checkpoint = load_checkpoint(folder / "checkpoint.pt")
    checkpoint.loop.rebuilt = {"3": [2]}
    save_checkpoint(folder / "checkpoint.pt", checkpoint)
    replay = arrays_run(dict(cfg, executor="inline", participation_record=str(folder)), clients, test)
    np.testing.assert_allclose(got.state.v, replay.state.v, atol=1e-6)
    np.testing.assert_allclose(got.state.c_v, replay.state.c_v, atol=1e-6)
    if transport == "compiled":  # built for the first actors, then once more over the replaced one
        assert executor.graph.actor_sets == 2
    if transport == "collective":  # the group formed over the first actors, then once more over the replaced one
        assert executor.transport.builds == 2
    np.testing.assert_allclose(got.state.v, want.state.v, atol=1e-6)
    np.testing.assert_allclose(got.state.c_v, want.state.c_v, atol=1e-6)
    assert np.abs(got.state.v - plain.state.v).max() > 1e-4  # the replacement did change the run


def poisoned(clients, test, bad: int) -> ArraysSource:
    """Client ``bad`` holds samples of the wrong width: its first local step raises in the model."""
    source = ArraysSource(clients, test)
    x, y = source.trains[bad]
    source.trains[bad] = (np.concatenate([x, x], 1), y)
    return source


@TRANSPORTS
def test_an_exception_in_client_code_reaches_the_driver_with_client_round_and_traceback(transport):
    clients, test = gaussian_clients(num_clients=3)
    executor = RayExecutor()
    with pytest.raises(ClientError) as info:
        arrays_run(dict(ARRAYS, iterations=6, executor="ray", on_client_failure="abort", transport=transport),
                   clients, test,
                   executor=executor, source=poisoned(clients, test, bad=1))
    err = info.value
    assert (err.client_id, err.round, err.action) == (1, 1, "local_round")
    assert str(err).startswith("client 1 failed in round 1 (local_round): RuntimeError:")
    assert "\n" not in str(err)
    assert "in local_round" in err.traceback and "in train_step" in err.traceback and "mat1 and mat2" in err.traceback
    assert any("client 1's traceback" in note for note in err.__notes__)
    assert [e["outcome"] for e in executor.events] == ["abort"]
    assert no_leftover_groups()


@TRANSPORTS_CLASSIC_FIRST
def test_retry_replaces_a_failing_client_up_to_the_limit_then_stops_the_run(transport):
    clients, test = gaussian_clients(num_clients=2)
    executor = RayExecutor()
    with pytest.raises(ClientError, match="client 0 failed in round 1"):
        arrays_run(dict(ARRAYS, iterations=6, executor="ray", on_client_failure="retry", max_client_retries=1,
                        transport=transport), clients, test, executor=executor, source=poisoned(clients, test, bad=0))
    assert [e["outcome"] for e in executor.events] == ["replaced (attempt 1 of 1)", "abort"]


@TRANSPORTS_CLASSIC_FIRST
def test_drop_goes_on_without_the_failing_client(transport):
    clients, test = gaussian_clients(num_clients=3)
    cfg = dict(ARRAYS, algorithm="codasca", iterations=8, positive_ratio=0.3)
    executor = RayExecutor()
    got = arrays_run(dict(cfg, executor="ray", on_client_failure="drop", max_client_retries=0, transport=transport),
                     clients, test,
                     executor=executor, source=poisoned(clients, test, bad=1))
    without = arrays_run(dict(cfg, executor="inline"), [clients[0], clients[2]], test)
    assert [(e["client"], e["round"], e["outcome"]) for e in executor.events] == [(1, 1, "dropped")]
    assert got.state.round == 4
    np.testing.assert_allclose(got.state.v, without.state.v, atol=1e-6)
    assert got.summary["final_test_auc"] == pytest.approx(without.summary["final_test_auc"], abs=1e-6)


@pytest.mark.slow  # in CI's slow tier: an fdam process on a private Ray, 12 s
def test_bad_client_input_is_not_retried_and_the_cli_says_it_in_one_line(tmp_path, capsys):
    rc = main(["train", f"out_dir={tmp_path / 'runs'}", "imratio=0.001", "cpus_per_client=0.5"])
    err = capsys.readouterr().err
    assert rc == 2 and "is left with no positives" in err and "(start)" in err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "runs").exists()
    clients, test = gaussian_clients(num_clients=2)
    source = ArraysSource(clients, test)
    source.trains[1] = (source.trains[1][0][:0], source.trains[1][1][:0])
    executor = RayExecutor()
    with pytest.raises(ClientInputError, match=r"client 1 failed in round 0 \(start\).*no training samples"):
        arrays_run(dict(ARRAYS, iterations=2, executor="ray"), clients, test, executor=executor, source=source)
    assert [e["outcome"] for e in executor.events] == ["abort"]


@TRANSPORTS_CLASSIC_FIRST
def test_a_client_that_does_not_answer_in_time_fails_instead_of_hanging(transport):
    clients, test = gaussian_clients(num_clients=2)
    source = SlowClientSource(ArraysSource(clients, test), slow=1, delay_s=30.0)
    config = build_config(dict(ARRAYS, batch_size=4, dataset="arrays", num_clients=2, on_client_failure="abort",
                               transport=transport))
    with RayExecutor() as ex:
        ex.start(ExecutorSetup.for_config(config, ex.section), source)
        ex.fleet.timeout = 2.0  # after start-up, which may be slow on a loaded machine
        state = first_state(ex, config, source)
        t0 = time.monotonic()
        with pytest.raises(ClientError, match="client 1 failed in round 1 \\(local_round\\): no answer within "
                                              "ray_timeout_s=2 s"):
            ex.run_round(state, RoundPlan(1, 1, 2, 0.1, 0), lambda u: None)
        assert time.monotonic() - t0 < 15


# -- placement, devices, threads ------------------------------------------------------------------
def federation_in_bundle_zero(config_values: dict, clients, test) -> dict:
    """A driver running in bundle 0 of a placement group, as a Ray Tune trial does."""
    seen = {}
    ex = RayExecutor()

    def look(rec):
        seen.update(where=ex.client_info(), groups=len(placement_group_table()))

    result = run(build_config(config_values), source=ArraysSource(clients, test), executor=ex, save=False,
                 on_eval=look)
    return {"v": result.state.v, "bundles": ex.bundle_of, **seen}


def test_inside_a_placement_group_the_clients_take_its_bundles_one_to_k():
    clients, test = gaussian_clients(num_clients=2)
    cfg = dict(ARRAYS, algorithm="codasca", iterations=4, dataset="arrays", num_clients=2)
    group = placement_group([{"CPU": 0.5}] * 3)
    ray.get(group.ready(), timeout=60)
    groups_before = len(placement_group_table())
    try:
        strategy = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=0,
                                                    placement_group_capture_child_tasks=True)
        task = ray.remote(federation_in_bundle_zero).options(num_cpus=0.5, scheduling_strategy=strategy)
        got = ray.get(task.remote(dict(cfg, executor="ray"), clients, test), timeout=300)
    finally:
        remove_placement_group(group)
    assert got["bundles"] == {0: 1, 1: 2}
    assert {w["placement_group_id"] for w in got["where"].values()} == {group.id.hex()}
    assert got["groups"] == groups_before  # no group of its own
    want = arrays_run(dict(cfg, executor="inline"), clients, test)
    np.testing.assert_allclose(got["v"], want.state.v, atol=1e-6)


def test_own_group_has_the_chosen_strategy_and_clients_run_int_cpus_threads():
    clients, test = gaussian_clients(num_clients=2)
    config = build_config(dict(ARRAYS, dataset="arrays", num_clients=2, cpus_per_client=2.0,
                               placement_strategy="SPREAD"))
    with RayExecutor() as ex:
        ex.start(ExecutorSetup.for_config(config, ex.section), ArraysSource(clients, test))
        table = placement_group_table(ex.placement_group)
        where = ex.client_info()
    assert table["strategy"] == "SPREAD" and [b["CPU"] for b in table["bundles"].values()] == [2.0, 2.0]
    assert [w["threads"] for w in where.values()] == [2, 2]
    assert all(w["device"] == "cpu" and not w["gpu_ids"] for w in where.values())
    assert no_leftover_groups()


def test_client_device_follows_the_gpus_ray_assigned(monkeypatch):
    fractions = []
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, d: fractions.append((f, d)))
    monkeypatch.setattr(actor_shell.ray, "get_gpu_ids", lambda: ["3"])
    assert actor_shell.actor_device("auto", gpu_share=0.25, memory_cap=True) == torch.device("cuda", 0)
    assert actor_shell.actor_device("cuda", gpu_share=1.0, memory_cap=True) == torch.device("cuda", 0)
    assert actor_shell.actor_device("auto", gpu_share=0.5, memory_cap=False) == torch.device("cuda", 0)
    assert actor_shell.actor_device("cpu", gpu_share=0.5, memory_cap=True) == torch.device("cpu")
    assert fractions == [(0.25, torch.device("cuda", 0))]
    monkeypatch.setattr(actor_shell.ray, "get_gpu_ids", lambda: [])
    assert actor_shell.actor_device("auto", gpu_share=0.0, memory_cap=True) == torch.device("cpu")
    with pytest.raises(ValueError, match="set gpus_per_actor > 0"):
        actor_shell.actor_device("cuda", gpu_share=0.0, memory_cap=True)


@ray.remote
class WorkersProbe(actor_shell.ClientShell):
    """A client host that reports what ``data_workers: auto`` resolves to in it."""

    def auto(self):
        from fdam_ray.data.base import client_cpus, loader_workers

        return client_cpus(), loader_workers("auto")


def test_data_workers_auto_in_an_actor_follows_the_cpus_ray_gave_it():
    probes = [WorkersProbe.options(num_cpus=c).remote(0, [0], threads=1, device="cpu", gpu_share=0.0,
                                                      gpu_memory_cap=False) for c in (0.5, 2)]
    try:
        assert ray.get([p.auto.remote() for p in probes]) == [(0.5, 0), (2.0, 1)]
    finally:
        for p in probes:
            ray.kill(p)


def test_a_group_the_cluster_cannot_hold_is_a_clear_error_not_a_hang(monkeypatch):
    ex = Placement(build_config(dict(ARRAYS, dataset="arrays", num_clients=2, gpus_per_client=1.0)), 1.0)
    with pytest.raises(ValueError, match="no node of the cluster can hold one actor"):
        ex.place(2, local=True)  # a local Ray this process started: nothing will join, fail at once
    t0 = time.monotonic()
    with pytest.raises(ValueError, match=r"no node of the cluster can hold one actor \(\{'CPU': 0.5, 'GPU': 1.0\}; "
                                         r"the largest node has CPU 4, GPU 0\)"):
        ex.place(2, local=False)  # one bundle is larger than any node: Ray could never place it
    assert time.monotonic() - t0 < 2
    # each bundle fits a node but all of them do not fit the cluster: without an autoscaler it cannot grow
    ex = Placement(build_config(dict(ARRAYS, dataset="arrays", num_clients=3, cpus_per_client=2.0)), 1.0)
    with pytest.raises(ValueError, match=r"CPU: 6 needed, 4 in the cluster; 1 live node .*no autoscaler"):
        ex.place(3, local=False)
    # with one it might grow, so wait, but not for ever
    from fdam_ray.executors.ray import compat

    monkeypatch.setattr(compat, "autoscaler_configured", lambda: True)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="was not placed within ray_timeout_s=1 s"):
        ex.place(3, local=False)
    assert time.monotonic() - t0 < 10 and no_leftover_groups()


@pytest.mark.slow
def test_gpus_left_unused_are_pointed_out_with_a_share_to_set(monkeypatch, caplog):
    clients, test = gaussian_clients(4, n=30)
    real = ray.cluster_resources
    monkeypatch.setattr(ray, "cluster_resources", lambda: {**real(), "GPU": 1.0})  # as on a one-GPU machine
    with caplog.at_level(logging.WARNING, logger="fdam_ray.executors.ray.executor"):
        arrays_run(dict(ARRAYS, iterations=2, executor="ray"), clients, test)
    assert "has 1 GPU(s) but gpus_per_actor=0" in caplog.text and "e.g. 0.25 for 4 actors per GPU" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="fdam_ray.executors.ray.executor"):
        arrays_run(dict(ARRAYS, iterations=2, executor="ray", device="cpu"), clients, test)
    assert "GPU(s)" not in caplog.text


# -- sessions and clusters ----------------------------------------------------------------------
def test_a_running_ray_is_reused_and_the_cli_trains_on_it(tmp_path, capsys):
    assert ensure_ray(address="10.255.255.1:6379", cpus_needed=64) is False  # no connection attempted
    rc = main(["train", f"out_dir={tmp_path}", "run_name=r", "num_clients=2", "iterations=20", "eval_every=10",
               "local_steps=5", "model=mlp", "cpus_per_client=0.5", "--address", "10.255.255.1:6379"])
    out = capsys.readouterr().out
    assert rc == 0 and "executor ray" in out
    assert "address: 10.255.255.1:6379" in (tmp_path / "r" / "config.yaml").read_text()


def test_an_address_without_a_cluster_fails_fast_with_what_to_check():
    t0 = time.monotonic()
    with pytest.raises(ClusterConnectionError, match=r"no Ray cluster answers at 127\.0\.0\.1:1"):
        check_cluster_access("127.0.0.1:1")
    with pytest.raises(ClusterConnectionError, match="host:port"):
        check_cluster_access("localhost")
    assert time.monotonic() - t0 < 10


def test_make_source_spec_is_small_and_carries_no_data():
    import pickle

    spec = make_source(build_config(dict(dataset="digits")))
    spec.client_shard(0)  # loads the pool into the driver's copy
    assert len(pickle.dumps(spec)) < 2000


# -- checkpoints and what crosses to the driver ---------------------------------------------
class StopInRound(RayExecutor):
    def __init__(self, at_round: int) -> None:
        super().__init__()
        self.at_round = at_round

    def run_round(self, state, plan, fold):
        if plan.round == self.at_round:
            raise KeyboardInterrupt
        super().run_round(state, plan, fold)


@pytest.mark.fault  # two Ray runs and a resume (benchmarks/fault_tests.py)
def test_a_ray_run_stopped_and_resumed_ends_within_1e6_of_an_uninterrupted_run(tmp_path):
    clients, test = gaussian_clients(num_clients=3, n=50)
    cfg = dict(ARRAYS, algorithm="codasca", batch_size=8, local_steps=3, iterations=30, stage_length=12,
               checkpoint_every=3, executor="ray", out_dir=str(tmp_path), run_name="r", tensorboard=False)
    config = build_config(dict(cfg, dataset="arrays", num_clients=3))
    with pytest.raises(KeyboardInterrupt):
        run(config, source=ArraysSource(clients, test), executor=StopInRound(8), save=True)
    resumed = fdam_ray.resume(tmp_path / "r", source=ArraysSource(clients, test))
    whole = arrays_run(dict(cfg, executor="inline"), clients, test)
    for name in ("v", "alpha", "buffers", "c_v", "c_alpha"):
        np.testing.assert_allclose(getattr(resumed.state, name), getattr(whole.state, name), rtol=0, atol=1e-6,
                                   err_msg=name)
    assert [h["iteration"] for h in resumed.history] == [h["iteration"] for h in whole.history]
    assert "resumed at round 6" in (tmp_path / "r" / "train.log").read_text()


class RecordingFleet(Fleet):
    """Keeps every object an actor returned to the driver."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.returned: list = []

    def each(self, action, submit, actors=None, **kwargs):
        for k, result in super().each(action, submit, actors, **kwargs):
            self.returned.append((action, result))
            yield k, result


class Recording(RayExecutor):
    fleet_type = RecordingFleet

    @property
    def returned(self) -> list:
        return self.fleet.returned


def test_no_training_sample_crosses_from_an_actor_to_the_driver():
    clients, test = gaussian_clients(num_clients=3, n=60)
    client_tests, _ = gaussian_clients(num_clients=3, n=20, seed=5)
    source = ArraysSource(clients, test, client_tests)
    ex = Recording()
    config = build_config(dict(ARRAYS, dataset="arrays", num_clients=3, algorithm="coda", batch_size=8,
                               iterations=8, stage_length=4, executor="ray", eval_on="clients",
                               checkpoint_every=2))
    result = run(config, source=source, executor=ex, save=False)
    state_size = result.state.v.size
    train_rows = [x.tobytes() for x, _ in clients]
    actions = {a for a, _ in ex.returned}
    assert {"start", "local_round", "evaluate", "score_sums"} <= actions
    for action, obj in ex.returned:
        for arr in arrays_in(obj):
            if arr.dtype.kind != "f":
                continue
            assert arr.size <= max(state_size, len(test[1]), 20), (action, arr.shape)
            if arr.size >= 5:
                assert not any(arr.tobytes() in rows for rows in train_rows), action


@pytest.mark.slow
def test_a_local_ray_started_for_a_run_binds_its_dashboard_to_localhost(tmp_path):
    import subprocess
    import sys

    code = ("import ray; from fdam_ray.executors.ray.session import ensure_ray; ensure_ray(address=None, "
            "cpus_needed=1); print(ray._private.worker._global_node.address_info['webui_url']); ray.shutdown()")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180, env=env,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    url = out.stdout.strip().splitlines()[-1]
    assert url.startswith("127.0.0.1:"), url


@pytest.mark.parametrize("eval_on", ["clients", "driver"])
def test_the_driver_never_loads_the_training_pool(eval_on):
    config = build_config(dict(dataset="digits", num_clients=2, model="linear", iterations=4, local_steps=2,
                               eval_every=2, executor="ray", eval_on=eval_on, **HALF))
    source = make_source(config)
    result = run(config, source=source, save=False)
    assert result.history[-1]["test_samples"] == 540  # the whole digits test set was scored
    assert "_pool" not in source.__dict__  # the clients loaded their shards in their own processes


def test_in_memory_arrays_reach_only_their_own_client():
    clients, test = gaussian_clients(num_clients=3)
    source = ArraysSource(clients, test)
    config = build_config(dict(ARRAYS, dataset="arrays", num_clients=3, executor="ray"))
    with RayExecutor() as ex:
        infos = ex.start(ExecutorSetup.for_config(config, ex.section), source)
        for k in range(3):
            part = ray.get(ex.fleet.source_refs[k])
            assert set(part.trains) == {k}
            np.testing.assert_array_equal(part.trains[k][0], clients[k][0])
        assert [i.num_train for i in infos] == [len(y) for _, y in clients]
        # an actor receives the client's section of the config, not the whole config
        assert type(ex.fleet.client_section) is ClientSection and ex.fleet.client_section == ClientSection.of(config)
    digits = make_source(build_config(num_clients=2))
    assert digits.for_client(1) is digits  # a recipe is shared, not copied per client


@TRANSPORTS
@pytest.mark.fault  # in benchmarks/fault_tests.py, not the CI tiers
def test_a_replaced_client_and_why_a_run_stopped_are_in_train_log(transport, tmp_path):
    clients, test = gaussian_clients(3)
    config = build_config(dict(ARRAYS, dataset="arrays", num_clients=3, iterations=8, out_dir=str(tmp_path),
                               run_name="r", tensorboard=False, transport=transport))
    run(config, source=ArraysSource(clients, test), executor=KillDuringRound(victim=1, at_round=2, how="ray.kill"))
    log = (tmp_path / "r" / "train.log").read_text()
    assert "WARNING client 1 failed in round 2 (local_round)" in log and "-> replaced (attempt 1 of 2)" in log
    assert log.index("failed in round 2") < log.index("iteration 8 round 4")  # written as it happened
    with pytest.raises(ClientError):
        run(config.replace(run_name="s", on_client_failure="abort"), source=ArraysSource(clients, test),
            executor=KillDuringRound(victim=0, at_round=2, how="ray.kill"))
    log = (tmp_path / "s" / "train.log").read_text()
    assert "-> abort" in log and "ERROR run stopped: client 0 failed in round 2 (local_round)" in log
