"""Slow links in the hierarchical collective (:mod:`fdam_ray.executors.ray.transports.collective_links`): the
verdicts on hand-made rate matrices, and the leaders' real gloo exchange (processes of their own on the
loopback) with a node out of it (the sum of the others, bit for bit the full exchange's with that node's zeros;
the node out and the control timing a probe) and with one leader whose messages are late (its peers' rates say so)."""

from __future__ import annotations

import datetime
import multiprocessing
import socket
import time

import numpy as np

from fdam_ray.executors.ray.transports.collective_links import (
    LINK_FACTOR,
    LINK_SLACK_S,
    PROBE_BYTES,
    PROBE_EVERY,
    PROBE_SLACK_S,
    Links,
    link_factor,
    probe_fast,
    slow_nodes,
)
from fdam_ray.executors.ray.transports.hierarchy import Leaders, simulate

GB = 125e6  # 1 Gbit/s in bytes a second
MB = 9.3e6  # a chunk: 7M floats over 3 nodes


def _rates(p: int, fast: float, slow_in: dict[int, float] | None = None, slow_out: dict[int, float] | None = None
           ) -> np.ndarray:
    """A rate matrix of ``p`` nodes (rates[i, j]: i received j's chunk), NaN on the diagonal; node n's ingress
    (``slow_in``) or egress (``slow_out``) at a rate of its own."""
    rates = np.full((p, p), fast)
    for n, r in (slow_in or {}).items():
        rates[n, :] = r
    for n, r in (slow_out or {}).items():
        rates[:, n] = np.minimum(rates[:, n], r)
    np.fill_diagonal(rates, np.nan)
    return rates


def test_a_node_whose_ingress_or_egress_is_slow_is_found_and_no_other():
    # netlab shapes ingress: the slow node receives at 100 Mbit/s, sends at the others' pace
    assert slow_nodes(_rates(4, GB / 3, slow_in={3: 12.5e6 / 3}), range(4), 2.0, MB) == [3]
    assert slow_nodes(_rates(4, GB / 3, slow_out={1: 12.5e6 / 3}), range(4), 2.0, MB) == [1]
    assert slow_nodes(_rates(4, GB / 3), range(4), 2.0, MB) == []
    # within the factor: not slow (0.6 of the others' rate, factor 2)
    assert slow_nodes(_rates(4, GB / 3, slow_in={2: 0.6 * GB / 3}), range(4), 2.0, 3 * MB) == []
    assert slow_nodes(_rates(4, GB / 3, slow_in={2: 0.6 * GB / 3}), range(4), 1.5, 3 * MB) == [2]
    # two slow nodes, the slowest first; two nodes: no pair without either, nothing found
    assert slow_nodes(_rates(5, GB, slow_in={1: GB / 4, 3: GB / 8}), range(5), 2.0, 3 * MB) == [3, 1]
    assert slow_nodes(_rates(2, GB, slow_in={1: GB / 100}), range(2), 2.0, MB) == []
    # only the active nodes count: node 3 out (its row and column not measured)
    rates = _rates(4, GB / 2, slow_in={0: GB / 20})
    rates[3, :] = rates[:, 3] = np.nan
    assert slow_nodes(rates, [0, 1, 2], 2.0, MB) == [0]
    # a small state: 3 KB at a tenth of the others' rate is 0.2 ms late, not slow; 30 MB is 2.2 s late
    assert slow_nodes(_rates(4, GB / 3, slow_in={3: GB / 30}), range(4), 2.0, 3e3) == []
    assert slow_nodes(_rates(4, GB / 3, slow_in={3: GB / 30}), range(4), 2.0, 3e7) == [3]
    # the slack's edge: 9.3 MB at a third of 1 Gbit/s takes 0.223 s; at a quarter of that rate 0.67 s more
    late = MB / (MB / (GB / 3) + LINK_SLACK_S)  # the rate that makes the chunk exactly LINK_SLACK_S late
    assert slow_nodes(_rates(4, GB / 3, slow_in={3: late * 0.99}), range(4), 1.1, MB) == [3]
    assert slow_nodes(_rates(4, GB / 3, slow_in={3: late * 1.01}), range(4), 1.1, MB) == []


def test_the_probe_rule_compares_with_the_same_probe_to_the_control():
    mib4 = PROBE_BYTES
    control = mib4 / GB  # 34 ms at 1 Gbit/s
    assert not probe_fast(mib4 / 12.5e6, control, LINK_FACTOR)  # 100 Mbit/s: 0.34 s, stays out
    assert probe_fast(mib4 / (0.9 * GB), control, LINK_FACTOR)  # back at 0.9 Gbit/s
    edge = LINK_FACTOR * control + PROBE_SLACK_S
    assert probe_fast(edge, control, LINK_FACTOR) and not probe_fast(edge + 1e-6, control, LINK_FACTOR)
    assert probe_fast(0.04, 0.001, 2.0)  # a small jitter on a fast loopback is not slow
    assert not probe_fast(float("nan"), control, 2.0) and not probe_fast(0.01, float("nan"), 2.0)


def test_a_links_factor_is_two_or_a_looser_deadlines():
    assert link_factor(None) == LINK_FACTOR == 2.0  # a deadline in seconds
    assert link_factor(1.25) == 2.0  # a tight step deadline does not make even links' jitter slow
    assert link_factor(3.0) == 3.0


def test_a_rounds_links_name_the_nodes_in_and_probe_every_few_rounds():
    assert Links.of(4, [], 8) == Links((0, 1, 2, 3), (), 0)
    assert Links.of(4, [2], PROBE_EVERY * 3) == Links((0, 1, 3), (2,), PROBE_BYTES)
    assert Links.of(4, [2], PROBE_EVERY * 3 + 1).probe == 0
    assert Links.of(3, [1, 2], PROBE_EVERY).probe == 0  # one node in: no control, no probe


def _leader(index: int, count: int, port: int, out: tuple[int, ...], late: int, queue) -> None:
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, count, index == 0, timeout=datetime.timedelta(seconds=30))
    leaders = Leaders(store, "leaders/", index, count, "127.0.0.1", 30.0)
    sums = [np.random.default_rng(5 + i).standard_normal(3001).astype(np.float32) for i in range(count)]
    small = np.zeros(count, np.float64)
    small[index] = 1.0
    leaders.add_rows(small)
    active = [n for n in range(count) if n not in out]
    flat = sums[index].copy()
    if index in out:
        leaders.receive_probe(active[0], 1 << 16)
    else:
        if index == late:
            time.sleep(0.6)
        leaders.all_reduce(flat, active)
        if out and index == active[0]:
            leaders.send_probe([*out, active[1]], 1 << 16)
            leaders.finish_sends()
        elif out and index == active[1]:
            leaders.receive_probe(active[0], 1 << 16)
    queue.put((index, flat, leaders.rates.copy(), leaders.probe_s))
    leaders.close()


def _exchange(count: int, out: tuple[int, ...] = (), late: int = -1) -> dict[int, tuple]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_leader, args=(i, count, port, out, late, queue)) for i in range(count)]
    for proc in procs:
        proc.start()
    got = {i: rest for i, *rest in (queue.get(timeout=60) for _ in range(count))}
    for proc in procs:
        proc.join(timeout=30)
    return got


def test_the_leaders_exchange_without_a_node_out_is_the_full_exchange_with_its_zeros():
    count = 4
    got = _exchange(count, out=(2,))
    sums = [np.random.default_rng(5 + i).standard_normal(3001).astype(np.float32) for i in range(count)]
    with_zeros = simulate([s if i != 2 else np.zeros_like(s) for i, s in enumerate(sums)])
    for i in (0, 1, 3):
        flat, rates, probe = got[i]
        np.testing.assert_array_equal(flat, with_zeros)  # bit for bit: x + 0 = x
        np.testing.assert_array_equal(flat, simulate([sums[0], sums[1], sums[3]]))
        peers = [j for j in (0, 1, 3) if j != i]
        assert np.isfinite(rates[peers]).all() and (rates[peers] > 0).all()
        assert np.isnan(rates[[i, 2]]).all()
        assert (np.isfinite(probe) and probe > 0) if i == 1 else np.isnan(probe)  # node 1: the control
    flat, rates, probe = got[2]
    np.testing.assert_array_equal(flat, sums[2])  # untouched: the node out sums nothing
    assert np.isnan(rates).all() and np.isfinite(probe) and probe > 0


def test_a_leader_whose_messages_are_late_is_found_slow_by_its_peers_rates():
    count = 4
    got = _exchange(count, late=3)
    rates = np.stack([got[i][1] for i in range(count)])
    assert slow_nodes(rates, range(count), LINK_FACTOR, 3001 * 4 / count) == [3]  # 0.6 s late, 1 KB chunks
    sums = [np.random.default_rng(5 + i).standard_normal(3001).astype(np.float32) for i in range(count)]
    for i in range(count):
        np.testing.assert_array_equal(got[i][0], simulate(sums))


class _Group:
    """The flags all-reduce of ``world`` members run one after another: each member's row is kept, and the last
    one to call gets the sum (the test then asks each member again with the sum in hand)."""

    def __init__(self, world: int) -> None:
        self.world, self.rows, self.total = world, {}, None

    def member(self, rank: int):
        group = self

        class Member:
            world, rank = group.world, None

            def all_reduce_flags(self, flags):
                if group.total is None:
                    group.rows[self.rank] = flags.copy()
                    flags[:] = 0
                else:
                    flags[:] = group.total

        m = Member()
        m.rank = rank
        return m


def _agree(reports: list[dict], min_clients: int = 1, factor: float = 2.0):
    """Every member's :func:`agree` over the rows ``reports`` describe (4 nodes of 2 members: ranks 2n, 2n+1)."""
    from fdam_ray.executors.ray.transports.collective_deadline import LinkReport, agree

    world, node_of = len(reports), tuple(r // 2 for r in range(len(reports)))
    group = _Group(world)

    def call(rank):
        rep = reports[rank]
        links = LinkReport(node_of, 4, rep.get("rates"), rep.get("chunk", 0), rep.get("probe", np.nan),
                           rep.get("behind", False), factor)
        return agree(group.member(rank), late=rep.get("late", False), step_s=rep.get("step", 1.0),
                     asked=rep.get("asked", 1), made=rep.get("made", 1), links=links, min_clients=min_clients)

    for rank in range(world):
        call(rank)
    group.total = sum(group.rows.values())
    answers = [call(rank) for rank in range(world)]
    assert all(a == answers[0] for a in answers)  # every member reads the same decision
    return answers[0]


def _reports(rates: np.ndarray, chunk: float = MB, **per_rank) -> list[dict]:
    reports = [{} for _ in range(8)]
    for n in range(4):
        reports[2 * n].update(rates=rates[n], chunk=chunk)  # the node's leader writes the node's row
    for rank, extra in per_rank.items():
        reports[int(rank[1:])].update(extra)
    return reports


def test_the_members_agree_to_leave_a_slow_node_out_only_while_enough_clients_remain():
    rates = _rates(4, GB / 3, slow_in={3: 12.5e6 / 3})
    got = _agree(_reports(rates))
    assert got.out == (3,) and got.late == (6, 7) and got.made == 6 and got.asked == 6
    assert _agree(_reports(rates), min_clients=6).out == (3,)
    kept = _agree(_reports(rates), min_clients=7)  # without node 3 only 6 clients: it stays in, the round waits
    assert kept.out == () and kept.late == () and kept.made == 8
    # a node behind is out whatever its rates; its step time is not in the median
    behind = _agree(_reports(_rates(4, GB / 3), r2={"behind": True, "made": 0, "step": 9.0},
                             r3={"behind": True, "made": 0, "step": 9.0}))
    assert behind.out == (1,) and behind.late == (2, 3) and behind.median_s == 1.0 and behind.made == 6


def test_the_members_read_a_node_outs_probe_against_the_controls():
    rates = _rates(4, GB / 3)
    rates[3, :] = rates[:, 3] = np.nan
    slow = _reports(rates, r6={"behind": True, "made": 0, "probe": PROBE_BYTES / 12.5e6},
                    r7={"behind": True, "made": 0}, r2={"probe": PROBE_BYTES / GB})
    got = _agree(slow)
    assert got.out == (3,) and got.probed == (3,) and got.fast == ()
    slow[6]["probe"] = PROBE_BYTES / (0.8 * GB)
    assert _agree(slow).fast == (3,)
