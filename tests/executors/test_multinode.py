"""Many nodes: one Ray cluster of a head and three worker nodes on this machine (tests/multinode.py).

One cluster serves the whole module (starting it takes ~25 s); the node-loss
tests remove worker nodes and therefore run after the others (those that need
the removed site again add a node offering it).
"""

from __future__ import annotations

import dataclasses
import threading
import time

import numpy as np
import pytest
import ray
import torch
from image_fixtures import write_image_folder
from multinode import OBJECT_STORE_BYTES, add_loopback_node, multi_node_cluster, node_ids_by_site
from raytest import FoldCounting, SlowClientSource
from sample_clients import gaussian_clients

from fdam_ray.algorithms.drift import DRIFT_CORRECTIONS
from fdam_ray.assembly.recipe import federate, resume, run
from fdam_ray.checkpoint import load_checkpoint
from fdam_ray.config import build_config
from fdam_ray.data import make_source
from fdam_ray.data.arrays import ArraysSource
from fdam_ray.executors.base import ExecutorSetup
from fdam_ray.executors.errors import PlacementError
from fdam_ray.executors.inline import InlineExecutor
from fdam_ray.executors.ray.executor import RayExecutor
from fdam_ray.loop.federation import rebuilt_states

SMALL = dict(model="mlp", model_width=8, batch_size="full", seed=2, lr=0.2, local_steps=2, cpus_per_actor=0.5)


@pytest.fixture(scope="module")
def cluster():
    with multi_node_cluster() as c:
        yield c


def arrays_config(clients, **values):
    return build_config({**SMALL, "dataset": "arrays", "executor": "ray", "num_clients": len(clients), **values})


class Recording(RayExecutor):
    """Keeps where every client ran (read once the clients have started)."""

    def start(self, setup, source):
        infos = super().start(setup, source)
        self.nodes_at_start = {k: w["node_id"] for k, w in self.client_info().items()}
        self.infos = {i.client_id: i for i in infos}
        return infos


# -- placement -----------------------------------------------------------------------------
@pytest.mark.slow  # in CI's slow tier: a multi-node cluster of the module's, 10 s to start
def test_spread_puts_clients_on_distinct_nodes_and_logs_where_each_runs(cluster, tmp_path):
    clients, test = gaussian_clients(num_clients=3)
    executor = Recording()
    config = arrays_config(clients, placement_strategy="SPREAD", iterations=4, eval_every=4)
    federate(config, source=ArraysSource(clients, test), executor=executor, run_dir=tmp_path / "run")
    nodes = executor.nodes_at_start
    assert len(set(nodes.values())) == 3
    log = (tmp_path / "run" / "train.log").read_text()
    ip = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
    for k, node in nodes.items():
        assert f"placement: clients {k} -> actor {k} -> node {node} ({ip[node]})" in log


@pytest.mark.slow
def test_pack_puts_clients_on_as_few_nodes_as_fit(cluster):
    clients, test = gaussian_clients(num_clients=3)
    executor = Recording()
    # 3 x 0.5 CPU fit one worker node (2 CPUs); 4 x 0.75 CPU need two (two per node)
    run(arrays_config(clients, placement_strategy="PACK", iterations=2), source=ArraysSource(clients, test),
        executor=executor, save=False)
    assert len(set(executor.nodes_at_start.values())) == 1
    clients5, test5 = gaussian_clients(num_clients=4)
    executor = Recording()
    run(arrays_config(clients5, placement_strategy="PACK", iterations=2, cpus_per_actor=0.75),
        source=ArraysSource(clients5, test5), executor=executor, save=False)
    assert len(set(executor.nodes_at_start.values())) == 2


# -- clients pinned to their site ------------------------------------------------------------
@pytest.mark.slow  # in CI's slow tier: a multi-node cluster of the module's, 10 s to start
def test_each_client_runs_on_its_site_and_reads_only_its_own_folder(cluster, tmp_path):
    sizes = {0: 6, 1: 9, 2: 12}  # training images per class, so each client's count shows its folder
    for k, n in sizes.items():
        write_image_folder(tmp_path / f"site{k}", train={"a": n, "b": n}, val={"a": 2, "b": 2})
    write_image_folder(tmp_path / "test", train={"a": 3, "b": 3}, val={"a": 5, "b": 5})
    executor = Recording()
    config = build_config(dict(
        dataset="imagefolder", data_root=str(tmp_path / "test"), image_size=8, model="linear", num_clients=3,
        executor="ray", iterations=2, batch_size=4, local_steps=1, cpus_per_actor=0.5, positive_classes=[0],
        client_resources=[{f"site_{k}": 0.01} for k in (2, 0, 1)],
        client_data_roots=[str(tmp_path / f"site{k}") for k in (2, 0, 1)]))
    result = run(config, executor=executor, save=False)
    by_site = node_ids_by_site()
    assert executor.nodes_at_start == {0: by_site["site_2"], 1: by_site["site_0"], 2: by_site["site_1"]}
    # each client holds what a one-client federation over its own folder holds, and the folders differ in size
    alone = {k: len(make_source(dataclasses.replace(config, client_data_roots=None, num_clients=1,
                                                    client_resources=None, data_root=root)).client_shard(0).train)
             for k, root in enumerate(config.client_data_roots)}
    assert {k: i.num_train for k, i in executor.infos.items()} == alone
    assert len(set(alone.values())) == 3
    assert result.state.round == 2 and 0 <= result.summary["final_test_auc"] <= 1


@pytest.mark.slow  # in CI's slow tier: a multi-node cluster of the module's, 10 s to start
def test_a_resource_no_node_offers_is_named_with_the_client_at_once(cluster):
    clients, test = gaussian_clients(num_clients=3)
    config = arrays_config(clients, iterations=2,
                           client_resources=[{"site_0": 0.01}, {"site_7": 0.01}, {"site_1": 0.01}])
    with pytest.raises(PlacementError) as got:
        run(config, source=ArraysSource(clients, test), save=False)
    message = str(got.value)
    assert "client 1" in message and "site_7" in message and "site_0, site_1, site_2" in message
    assert "\n" not in message


# -- per-node reduction ------------------------------------------------------------------------
@pytest.mark.slow
def test_node_reduction_folds_one_sum_per_node_and_ends_where_star_and_inline_end(cluster):
    clients, test = gaussian_clients(num_clients=6)
    values = dict(algorithm="codasca", iterations=8, eval_every=8, positive_ratio=0.3, placement_strategy="PACK")
    got = {}
    for reduce in ("star", "node"):
        executor = FoldCounting()
        got[reduce] = run(arrays_config(clients, reduce=reduce, **values), source=ArraysSource(clients, test),
                          executor=executor, save=False)
        nodes = {w["node_id"] for w in executor.where_of.values()}
        assert len(nodes) >= 2  # 6 x 0.5 CPU do not fit one node
        assert executor.folds == [6 if reduce == "star" else len(nodes)] * 4
    inline = run(arrays_config(clients, executor="inline", **values), source=ArraysSource(clients, test), save=False)
    for name in ("v", "alpha", "buffers", "c_v", "c_alpha"):
        want = getattr(inline.state, name)
        np.testing.assert_allclose(getattr(got["node"].state, name), getattr(got["star"].state, name), atol=1e-6)
        np.testing.assert_allclose(getattr(got["node"].state, name), want, atol=1e-6, err_msg=name)
    assert np.abs(inline.state.c_v).max() > 1e-3


@pytest.mark.slow
def test_compiled_node_reduction_folds_one_sum_per_node_and_equals_classic_node_reduction_bit_for_bit(cluster):
    clients, test = gaussian_clients(num_clients=6)
    values = dict(algorithm="codasca", iterations=8, eval_every=8, positive_ratio=0.3, placement_strategy="PACK",
                  reduce="node", fold_order="client")
    got = {}
    for transport in ("classic", "compiled"):
        executor = FoldCounting()
        got[transport] = run(arrays_config(clients, transport=transport, **values),
                             source=ArraysSource(clients, test), executor=executor, save=False)
        nodes = {w["node_id"] for w in executor.where_of.values()}
        assert len(nodes) >= 2  # 6 x 0.5 CPU do not fit one node
        assert executor.folds == [len(nodes)] * 4
    assert executor.transport.serves == ("compiled", "node") and executor.graph.builds == 1
    for name in ("v", "alpha", "buffers", "c_v", "c_alpha"):
        np.testing.assert_array_equal(getattr(got["compiled"].state, name), getattr(got["classic"].state, name),
                                      err_msg=name)
    assert got["compiled"].summary["bytes_up"] == got["classic"].summary["bytes_up"]


# -- node loss (these remove worker nodes: they run last) ---------------------------------------
class SlowEveryClient(SlowClientSource):
    """Every client reads its training samples through a SleepyDataset (a round takes a while)."""

    def client_shard(self, client_id: int):
        self.slow = client_id
        return super().client_shard(client_id)


class RemoveNodeDuringRound(RayExecutor):
    """Removes the worker node of the first client that runs on one, while round ``at_round`` runs."""

    def __init__(self, cluster, at_round: int, delay_s: float = 0.3) -> None:
        super().__init__()
        self.cluster, self.at_round, self.delay_s = cluster, at_round, delay_s
        self.removed: str | None = None
        self.site: int | None = None
        self.victim: int | None = None

    def victim_actor(self, workers: dict[str, int]) -> int:
        return next(a for a in sorted(self.where_of) if self.where_of[a]["node_id"] in workers)

    def run_round(self, state, plan, fold, clients=None):
        if plan.round == self.at_round and self.removed is None:
            workers = {n.node_id: site for site, n in self.cluster.sites.items()}
            a = self.victim_actor(workers)
            self.victim, self.removed = self.hosted[a][0], self.where_of[a]["node_id"]
            self.site = workers[self.removed]
            node = self.cluster.sites.pop(self.site)
            threading.Timer(self.delay_s, self.cluster.remove_node, (node,)).start()
        super().run_round(state, plan, fold, clients)


class RemoveBusiestNodeDuringRound(RemoveNodeDuringRound):
    """Removes the worker node hosting the most actors (with ``reduce: node`` their sums go through its
    reducer) and counts the partial sums the driver folds in each round."""

    def __init__(self, cluster, at_round: int, delay_s: float = 0.3) -> None:
        super().__init__(cluster, at_round, delay_s)
        self.folds: dict[int, int] = {}
        self.actors_on_removed = 0

    def victim_actor(self, workers: dict[str, int]) -> int:
        count = {n: sum(w["node_id"] == n for w in self.where_of.values()) for n in workers}
        node = max(count, key=count.get)
        self.actors_on_removed = count[node]
        return next(a for a in sorted(self.where_of) if self.where_of[a]["node_id"] == node)

    def run_round(self, state, plan, fold, clients=None):
        self.folds[plan.round] = 0

        def counted(partial):
            self.folds[plan.round] += 1
            fold(partial)

        super().run_round(state, plan, counted, clients)


def add_site_node(cluster, site: int):
    """A fresh worker node offering ``site_<site>`` (where a removed one was), for the tests that follow."""
    cluster.sites[site] = add_loopback_node(cluster, num_cpus=2, resources={f"site_{site}": 1},
                                            object_store_memory=OBJECT_STORE_BYTES)
    cluster.wait_for_nodes()
    return cluster.sites[site]


@pytest.mark.parametrize("transport", ["classic", "compiled"])
@pytest.mark.fault  # in benchmarks/fault_tests.py, not the CI tiers
def test_a_lost_node_s_reducer_and_clients_are_replaced_and_the_run_ends_near_the_undisturbed_one(cluster,
                                                                                                tmp_path,
                                                                                                transport):
    clients, test = gaussian_clients(num_clients=6, n=60)
    values = dict(algorithm="codasca", iterations=24, eval_every=12, positive_ratio=0.3, on_client_failure="retry",
                  placement_strategy="PACK", local_steps=4, batch_size=20, reduce="node")
    undisturbed = run(arrays_config(clients, **dict(values, executor="inline")), save=False,
                      source=SlowEveryClient(ArraysSource(clients, test), slow=0, delay_s=0.0))
    executor = RemoveBusiestNodeDuringRound(cluster, at_round=3)
    try:
        disturbed = federate(arrays_config(clients, **values, transport=transport), executor=executor,
                             run_dir=tmp_path / "run",
                             source=SlowEveryClient(ArraysSource(clients, test), slow=0, delay_s=0.004))
    finally:
        if executor.site is not None:
            add_site_node(cluster, executor.site)
    assert executor.actors_on_removed >= 2  # their sums went through the removed node's reducer
    [lost] = executor.lost_nodes
    assert lost["node_id"] == executor.removed and lost["round"] == 3
    assert len(lost["clients"]) == executor.actors_on_removed
    alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    assert executor.removed not in alive
    assert all(w["node_id"] in alive for w in executor.where_of.values())
    # after the loss the driver still folds one sum per node, grouped by where the replacements run
    nodes_after = len({w["node_id"] for w in executor.where_of.values()})
    assert [executor.folds[r] for r in range(4, 7)] == [nodes_after] * 3
    assert disturbed.state.round == 6
    assert abs(disturbed.summary["final_test_auc"] - undisturbed.summary["final_test_auc"]) <= 0.01
    log = (tmp_path / "run" / "train.log").read_text()
    assert f"node {executor.removed}" in log and "was lost in round 3" in log and "(replacement)" in log
    assert f"the reducer of node {executor.removed} failed in round 3" in log


@pytest.mark.parametrize("transport", ["classic", "compiled"])
@pytest.mark.fault  # in benchmarks/fault_tests.py, not the CI tiers
def test_a_lost_node_s_clients_are_rebuilt_on_the_others_and_the_run_ends_near_the_undisturbed_one(cluster,
                                                                                                  tmp_path,
                                                                                                  transport):
    clients, test = gaussian_clients(num_clients=3, n=60)
    values = dict(algorithm="codasca", iterations=24, eval_every=12, positive_ratio=0.3, on_client_failure="retry",
                  placement_strategy="SPREAD", local_steps=4, batch_size=20)
    undisturbed = run(arrays_config(clients, **dict(values, executor="inline")), save=False,
                      source=SlowEveryClient(ArraysSource(clients, test), slow=0, delay_s=0.0))
    executor = RemoveNodeDuringRound(cluster, at_round=3)
    try:
        disturbed = federate(arrays_config(clients, **values, transport=transport), executor=executor,
                             run_dir=tmp_path / "run",
                             source=SlowEveryClient(ArraysSource(clients, test), slow=0, delay_s=0.004))
    finally:
        if executor.site is not None:
            add_site_node(cluster, executor.site)
    assert executor.removed is not None
    [lost] = executor.lost_nodes
    assert lost["node_id"] == executor.removed and executor.victim in lost["clients"] and lost["round"] == 3
    alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    assert executor.removed not in alive
    assert all(w["node_id"] in alive for w in executor.where_of.values())
    assert disturbed.state.round == 6
    assert abs(disturbed.summary["final_test_auc"] - undisturbed.summary["final_test_auc"]) <= 0.01
    log = (tmp_path / "run" / "train.log").read_text()
    assert f"node {executor.removed}" in log and "was lost in round 3" in log and "(replacement)" in log


@pytest.mark.fault  # in benchmarks/fault_tests.py, not the CI tiers
def test_clients_pinned_to_a_lost_site_stop_the_run_with_a_checkpoint_of_that_round_and_resume_rebuilds_them(
        cluster, tmp_path):
    clients, test = gaussian_clients(num_clients=2, n=60)
    site, node = next(iter(cluster.sites.items()))
    other = next(s for s in node_ids_by_site() if s != f"site_{site}")
    config = arrays_config(clients, algorithm="codasca", iterations=40, local_steps=4, batch_size=20,
                           checkpoint_every=2, client_resources=[{f"site_{site}": 0.01}, {other: 0.01}],
                           ray_timeout_s=1800)
    executor = RemoveNodeDuringRound(cluster, at_round=4)
    run_dir = tmp_path / "run"
    started = time.monotonic()
    with pytest.raises(PlacementError) as got:
        federate(config, executor=executor, run_dir=run_dir,
                 source=SlowEveryClient(ArraysSource(clients, test), slow=0, delay_s=0.004))
    assert time.monotonic() - started < 120  # not ray_timeout_s
    assert executor.removed == node.node_id
    message = str(got.value)
    assert "client 0" in message and f"site_{site}" in message and "\n" not in message
    assert "round 4 did not finish" in message and f"fdam train --resume {run_dir}" in message
    assert "run stopped: " + message in (run_dir / "train.log").read_text()
    # the state round 4 started from (not the periodic checkpoint of round 2), the placed client's own state,
    # the unplaced client marked for a rebuild (not dropped)
    saved = load_checkpoint(run_dir / "checkpoint.pt")
    assert saved.loop.state.round == 3 and saved.loop.position.round == 3
    assert saved.clients[0] == {"client_id": 0, "rebuild": True}
    assert saved.clients[1]["client_id"] == 1 and saved.clients[1]["c_v"] is not None

    new_node = add_site_node(cluster, site)  # the site is back
    resumed = resume(run_dir, source=SlowEveryClient(ArraysSource(clients, test), slow=0, delay_s=0.0))
    assert resumed.state.round == 10 and 0 <= resumed.summary["final_test_auc"] <= 1
    log = (run_dir / "train.log").read_text().split("resumed at round 3")[1]
    assert "client 0 could not be placed when the checkpoint was written" in log
    assert f"placement: clients 0 -> actor 0 -> node {new_node.node_id}" in log
    final = load_checkpoint(run_dir / "checkpoint.pt")
    assert [c["client_id"] for c in final.clients] == [0, 1] and "rebuild" not in final.clients[0]


def test_a_client_marked_for_a_rebuild_resumes_with_the_global_control_variate_and_a_fresh_sampler(tmp_path):
    clients, test = gaussian_clients(num_clients=2, n=60)
    config = arrays_config(clients, executor="inline", algorithm="codasca", iterations=16, local_steps=4,
                           batch_size=20, checkpoint_every=2)
    first = federate(config, source=ArraysSource(clients, test), run_dir=tmp_path / "run")
    payload = load_checkpoint(tmp_path / "run" / "checkpoint.pt")
    own, kept = payload.clients
    payload.clients[0] = {"client_id": 0, "rebuild": True}
    state = first.state
    states = rebuilt_states(payload.clients, state, DRIFT_CORRECTIONS["control_variates"])
    np.testing.assert_array_equal(states[0]["c_v"], state.c_v)
    np.testing.assert_array_equal(states[0]["c_alpha"], state.c_alpha)
    assert states[0]["sampler"] is None and states[1] is kept

    class Restored(InlineExecutor):
        def restore_client_states(self, states):
            super().restore_client_states(states)
            self.after = [(c.control_variate(), c.sampler.get_state()) for c in self.clients]

    executor = Restored()
    fresh = InlineExecutor()
    fresh.start(ExecutorSetup.for_config(config, fresh.section), ArraysSource(clients, test))
    federate(config, source=ArraysSource(clients, test), executor=executor, resume=payload, save=False)
    (c_v, c_alpha), sampler = executor.after[0]
    np.testing.assert_array_equal(c_v, state.c_v)
    np.testing.assert_array_equal(c_alpha, state.c_alpha)
    assert torch.equal(sampler["generator"], fresh.clients[0].sampler.get_state()["generator"])
    assert not torch.equal(sampler["generator"], own["sampler"]["generator"])
    np.testing.assert_array_equal(executor.after[1][0][0], kept["c_v"])


class UnplaceableAt(InlineExecutor):
    """Raises a PlacementError before any client runs round ``at`` (once); with ``states_fail``, reading the
    clients' states for the checkpoint fails too."""

    def __init__(self, at: int, states_fail: bool = False) -> None:
        super().__init__()
        self.at, self.states_fail, self.raised = at, states_fail, False

    def run_round(self, state, plan, fold, clients=None):
        if plan.round == self.at and not self.raised:
            self.raised = True
            raise PlacementError("client 0 cannot be placed: test")
        super().run_round(state, plan, fold, clients)

    def client_states(self):
        if self.raised and self.states_fail:
            raise RuntimeError("an actor died\nwith a traceback")
        return super().client_states()


@pytest.mark.parametrize("at", [3, 5])  # round 5 begins stage 2
def test_a_placement_stop_checkpoints_the_round_s_start_and_a_resume_ends_bit_identical(tmp_path, at):
    clients, test = gaussian_clients(num_clients=2, n=60)
    config = arrays_config(clients, executor="inline", algorithm="codasca", iterations=24, local_steps=2,
                           batch_size=20, stage_length=8, eval_every=100, checkpoint_every=100)
    undisturbed = run(config, source=ArraysSource(clients, test), save=False)
    with pytest.raises(PlacementError) as got:
        federate(config, source=ArraysSource(clients, test), executor=UnplaceableAt(at), run_dir=tmp_path / "run")
    assert f"round {at} did not finish" in str(got.value)
    saved = load_checkpoint(tmp_path / "run" / "checkpoint.pt").loop
    assert saved.state.round == saved.position.round == at - 1
    assert (saved.position.stage, saved.position.stage_rounds) == ((2, 0) if at == 5 else (1, at - 1))
    resumed = resume(tmp_path / "run", source=ArraysSource(clients, test))
    assert resumed.state.round == 12
    for name in ("v", "alpha", "buffers", "c_v", "c_alpha"):
        np.testing.assert_array_equal(getattr(resumed.state, name), getattr(undisturbed.state, name), err_msg=name)


def test_a_placement_stop_whose_checkpoint_cannot_be_written_says_so_and_keeps_the_last_one(tmp_path):
    clients, test = gaussian_clients(num_clients=2, n=60)
    config = arrays_config(clients, executor="inline", iterations=24, local_steps=2, batch_size=20,
                           checkpoint_every=2)
    with pytest.raises(PlacementError) as got:
        federate(config, source=ArraysSource(clients, test), executor=UnplaceableAt(4, states_fail=True),
                 run_dir=tmp_path / "run")
    message = str(got.value)
    assert message.startswith("client 0 cannot be placed: test; round 4 did not finish and its checkpoint could "
                              "not be written (RuntimeError: an actor died)") and "\n" not in message
    assert load_checkpoint(tmp_path / "run" / "checkpoint.pt").loop.state.round == 2
