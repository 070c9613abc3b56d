"""``transport: collective`` across nodes: the hierarchical all-reduce (backend ``hier``) on a Ray cluster.

One cluster for the module (tests/multinode.py: a head and two worker nodes on
this machine). Four actors pinned to nodes of two, one and one members, ranks
interleaved (node order differs from rank order). A collective run equals the
classic ``reduce: node, fold_order: client`` run bit for bit (the same order of
sums), and every member holds the driver's state exactly; with bf16 transfers
the leaders' rule keeps the run within bf16's reach of the classic bf16 run;
a node lost mid-round is named and the run recovers.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import ray
import raytest
from multinode import OBJECT_STORE_BYTES, add_loopback_node, multi_node_cluster
from sample_clients import gaussian_clients

from fdam_ray.assembly.recipe import federate, run
from fdam_ray.checkpoint import load_checkpoint
from fdam_ray.config import build_config
from fdam_ray.data.arrays import ArraysSource
from fdam_ray.executors.ray.executor import RayExecutor
from fdam_ray.executors.ray.transports.collective import CollectiveTransport
from fdam_ray.executors.ray.transports.collective_messages import KEY_STRIDE

SMALL = dict(model="mlp", model_width=8, batch_size="full", seed=2, lr=0.2, local_steps=2, cpus_per_actor=0.5,
             executor="ray", algorithm="codasca", iterations=8, stage_length=4, eval_every=4)
SITES = [{"site_0": 0.01}, {"site_1": 0.01}, {"site_0": 0.01}, {"head": 0.01}]  # nodes of 2, 1 and 1 actors
FLOATS = ("v", "alpha", "buffers", "c_v", "c_alpha")


@pytest.fixture(scope="module")
def cluster():
    with multi_node_cluster(workers=2, cpus_per_worker=2, head_cpus=1) as c:
        yield c


class Collective(RayExecutor):
    """Hands a collective transport the run's transfer precision (the leaders round what crosses between nodes;
    the members hold the exact state, so nothing is rounded on the way down)."""

    def start(self, setup, source):
        infos = super().start(setup, source)
        if isinstance(self.transport, CollectiveTransport) and self.downlink is not None:
            self.transport.transfer = (self.downlink.precision, self.downlink.error_feedback)
            self.downlink = None
        return infos


def arrays_run(clients, test, runner=None, **values):
    config = build_config({**SMALL, "dataset": "arrays", "num_clients": len(clients), **values})
    return run(config, source=ArraysSource(clients, test), executor=runner, save=False)


@pytest.mark.slow  # in CI's slow tier: a multi-node cluster, 8 s to start
def test_across_nodes_a_collective_run_is_the_rank_order_fold_to_rounding_and_the_members_hold_the_drivers_state(
        cluster):
    """Against the inline executor (the rank-order fold, no actors): the node-order sums differ by float32
    rounding only."""
    clients, test = gaussian_clients(num_clients=4)
    inline = arrays_run(clients, test, executor="inline")
    executor = Collective()
    got = arrays_run(clients, test, executor, transport="collective", client_resources=SITES, collective_rounds=1)
    transport = executor.transport
    assert transport.backend == "hier" and transport.builds == 1
    assert len({w["node_id"] for w in executor.where_of.values()}) == 3
    for name in FLOATS:
        a, b = getattr(got.state, name), getattr(inline.state, name)
        if b is not None:
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=name)
    # the state went down in the first round and at the stage start only: in every other round the members'
    # state had the key of the driver's, which on a state this small covers every value (bit for bit)
    assert got.state.v.size <= 4 * KEY_STRIDE and transport.rounds_sent == 2


@pytest.mark.slow  # two Ray runs (a minute); the same order of sums is pinned without Ray in test_collective_hierarchy
def test_across_nodes_a_collective_run_equals_classic_node_reduce_bit_for_bit(cluster):
    clients, test = gaussian_clients(num_clients=4)
    classic = arrays_run(clients, test, transport="classic", reduce="node", fold_order="client",
                         client_resources=SITES)
    executor = Collective()
    got = arrays_run(clients, test, executor, transport="collective", client_resources=SITES)  # runs of rounds
    assert executor.transport.backend == "hier"
    for name in FLOATS:
        assert getattr(got.state, name).tobytes() == getattr(classic.state, name).tobytes(), name


@pytest.mark.slow  # three Ray runs (a minute); the leaders' 16-bit rule runs in the default tier in
# test_collective_hierarchy (members in processes, no Ray)
def test_bf16_between_nodes_stays_within_bf16s_reach_of_the_classic_bf16_run(cluster):
    clients, test = gaussian_clients(num_clients=4)
    values = dict(transfer_precision="bf16", error_feedback=True, client_resources=SITES)
    classic = arrays_run(clients, test, transport="classic", reduce="node", fold_order="client", **values)
    exact = arrays_run(clients, test, transport="classic", reduce="node", fold_order="client",
                       client_resources=SITES)
    executor = Collective()
    got = arrays_run(clients, test, executor, transport="collective", collective_rounds=1, **values)
    assert executor.transport.backend == "hier" and executor.transport.transfer == ("bf16", True)
    assert got.state.v.tobytes() != exact.state.v.tobytes()  # rounded between the nodes
    for name in FLOATS:
        a, b, c = getattr(got.state, name), getattr(classic.state, name), getattr(exact.state, name)
        if c is None or c.size == 0:
            continue
        scale = np.abs(c).max() + 1.0
        # each within a few bf16 roundings (2^-8 relative) of the float32 run, and of each other
        assert np.abs(a - c).max() <= 0.03 * scale, name
        assert np.abs(a - b).max() <= 0.03 * scale, name
    assert executor.transport.rounds_sent == 2  # the members held the driver's state in the other rounds


class RemoveNodeDuringRound(Collective):
    """Removes the worker node of the lowest rank on one, while round ``at_round`` runs."""

    def __init__(self, cluster, at_round: int, delay_s: float = 0.3) -> None:
        super().__init__()
        self.cluster, self.at_round, self.delay_s = cluster, at_round, delay_s
        self.removed: str | None = None
        self.site: int | None = None

    def run_round(self, state, plan, fold, clients=None):
        if plan.round == self.at_round and self.removed is None:
            workers = {n.node_id: site for site, n in self.cluster.sites.items()}
            a = next(a for a in sorted(self.where_of) if self.where_of[a]["node_id"] in workers)
            self.removed = self.where_of[a]["node_id"]
            self.site = workers[self.removed]
            node = self.cluster.sites.pop(self.site)
            threading.Timer(self.delay_s, self.cluster.remove_node, (node,)).start()
        super().run_round(state, plan, fold, clients)


@pytest.mark.fault  # in benchmarks/fault_tests.py, not the CI tiers
def test_a_node_lost_mid_round_is_named_and_the_group_is_rebuilt_over_the_others(cluster, tmp_path):
    from raytest import SlowClientSource

    class SlowEveryClient(SlowClientSource):
        def client_shard(self, client_id: int):
            self.slow = client_id
            return super().client_shard(client_id)

    clients, test = gaussian_clients(num_clients=4, n=60)
    values = dict(iterations=12, eval_every=12, on_client_failure="retry", placement_strategy="SPREAD",
                  local_steps=4, batch_size=20, collective_rounds=1, transport="collective")
    executor = RemoveNodeDuringRound(cluster, at_round=2)
    config = build_config({**SMALL, **values, "dataset": "arrays", "num_clients": 4})
    try:
        result = federate(config, executor=executor, run_dir=tmp_path / "run",
                          source=SlowEveryClient(ArraysSource(clients, test), slow=0, delay_s=0.004))
    finally:
        if executor.site is not None:
            cluster.sites[executor.site] = add_loopback_node(cluster, num_cpus=2,
                                                             resources={f"site_{executor.site}": 1},
                                                             object_store_memory=OBJECT_STORE_BYTES)
            cluster.wait_for_nodes()
    [lost] = executor.lost_nodes
    assert lost["node_id"] == executor.removed and lost["round"] == 2
    alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    assert executor.removed not in alive and all(w["node_id"] in alive for w in executor.where_of.values())
    assert result.state.round == 3 and executor.transport.builds >= 2  # 12 iterations of 4 local steps
    log = (tmp_path / "run" / "train.log").read_text()
    assert f"node {executor.removed}" in log and "was lost in round 2" in log


@pytest.mark.slow  # two multi-node Ray runs, about 40 s
def test_across_nodes_a_deadline_cuts_a_slow_member_and_the_run_replays_bit_for_bit(cluster, tmp_path):
    """Client 1 (alone on its node) reads 0.8 s of samples a step: with a 0.6 s deadline its member sits every
    round out through the hierarchy (zeros into its node's block, its leader still in the exchange); the
    recorded run replayed by the collective over the same nodes is the same run bit for bit."""
    clients, test = gaussian_clients(num_clients=4)
    cfg = {**SMALL, "dataset": "arrays", "num_clients": 4, "batch_size": 8, "transport": "collective",
           "client_resources": SITES, "out_dir": str(tmp_path)}
    slow = raytest.SlowClientSource(ArraysSource(clients, test), slow=1, delay_s=0.1)
    executor = Collective()
    live = run(build_config(dict(cfg, run_name="live", round_deadline=0.6)), source=slow, executor=executor,
               save=True)
    assert executor.transport.backend == "hier"
    assert load_checkpoint(live.run_dir / "checkpoint.pt").loop.participation == {
        str(r): [0, 2, 3] for r in range(1, 5)}
    again = run(build_config(dict(cfg, run_name="again", participation_record=str(live.run_dir))),
                source=ArraysSource(clients, test), executor=Collective(), save=False)
    for name in FLOATS:
        np.testing.assert_array_equal(getattr(again.state, name), getattr(live.state, name), err_msg=name)


@pytest.mark.slow  # two multi-node Ray runs, about 40 s
def test_across_nodes_a_node_behind_a_slow_link_sits_out_rejoins_and_the_run_replays_bit_for_bit(cluster, tmp_path):
    """Rank 0, alone on its node (the node's leader, the group's store), sends its first reduce-scatter 0.6 s late
    and finds its first probe slow (raytest.SlowLinkSource): from round 2 its node sits out of the leaders'
    exchange (its client does not take part), the driver reads the state from rank 1 and sends rank 0 nothing;
    the probe of round 8 finds the link fast, rank 0 says so after the run of rounds 9-10 and is sent the state
    with the next run: its client takes part again from round 11. The recorded run replayed by the collective
    is the same run bit for bit, and the classic node reduce replaying it equals it to float32 rounding."""
    clients, test = gaussian_clients(num_clients=4)
    sites = [{"site_1": 0.01}, {"site_0": 0.01}, {"site_0": 0.01}, {"head": 0.01}]  # rank 0 alone on site_1
    cfg = {**SMALL, "dataset": "arrays", "num_clients": 4, "batch_size": 8, "transport": "collective",
           "client_resources": sites, "out_dir": str(tmp_path), "iterations": 24, "stage_length": 24}
    slow = raytest.SlowLinkSource(ArraysSource(clients, test), 0, delay_s=0.6, exchanges=1, probes=1)
    executor = Collective()
    live = run(build_config(dict(cfg, run_name="live", round_deadline=5.0)), source=slow, executor=executor,
               save=True)
    assert executor.transport.backend == "hier"
    record = load_checkpoint(live.run_dir / "checkpoint.pt").loop.participation
    assert record == {str(r): [1, 2, 3] for r in range(2, 11)}  # the rounds not every client took part in
    assert not executor.transport.behind
    again = run(build_config(dict(cfg, run_name="again", participation_record=str(live.run_dir))),
                source=ArraysSource(clients, test), executor=Collective(), save=False)
    for name in FLOATS:
        np.testing.assert_array_equal(getattr(again.state, name), getattr(live.state, name), err_msg=name)
    classic = run(build_config(dict(cfg, run_name="classic", transport="classic", reduce="node",
                                    participation_record=str(live.run_dir))),
                  source=ArraysSource(clients, test), executor=Collective(), save=False)
    for name in FLOATS:
        np.testing.assert_allclose(getattr(classic.state, name), getattr(live.state, name), rtol=0, atol=1e-6,
                                   err_msg=name)
