"""The hierarchical all-reduce of ``transport: collective`` (backend ``hier``) in processes, without Ray.

Members in processes of their own, told apart into nodes by the node id each one
publishes (patched here: every process is on this machine): a block per node, the
nodes' leaders exchanging over gloo. The states are the driver's bit for bit when
it folds each node's members in rank order and then the nodes in node order (the
order of classic ``reduce: node, fold_order: client``), in place and copied;
16-bit transfers follow the leaders' rule (checked against the NumPy
recomputation of :func:`~fdam_ray.executors.ray.transports.hierarchy.simulate`);
a member that dies on one node releases every member of every node.
"""

from __future__ import annotations

import multiprocessing
import os
import time

import numpy as np
import pytest
import torch
from test_shared_block import STEP, _leftovers, _state, _update, reduce_round

from fdam_ray.algorithms.server import PartialSum, RoundReducer
from fdam_ray.core.state import GlobalState
from fdam_ray.executors.ray.transports import group, shared
from fdam_ray.executors.ray.transports.collective_sums import layout
from fdam_ray.executors.ray.transports.group import GroupMember
from fdam_ray.executors.ray.transports.hierarchy import master_times, node_groups, simulate

pytestmark = pytest.mark.skipif(not shared.supported(), reason="shared-memory blocks need Linux on x86-64")

NODES = ["a", "b", "a", "c", "b"]  # rank -> node: nodes of 2, 2 and 1 members, ranks interleaved


def _member(rank: int, port: int, rounds: int, in_place: bool, backend: str, out, die_at: int) -> None:
    torch.set_num_threads(1)
    group._where = lambda: f"{NODES[rank]} 127.0.0.1"  # type: ignore[attr-defined]
    member = GroupMember(torch.device("cpu"))
    if rank == 0:
        port = member.open("127.0.0.1", 30)
        out.put(("port", port))
    member.join("127.0.0.1", port, rank, len(NODES), backend, 5.0, STEP)
    state = _state(0)
    got: list = []
    last = time.monotonic()
    for r in range(rounds):
        if r == die_at and rank == 3:  # the one-member node's only member
            os._exit(3)
        share = reduce_round(member, rank, r, state, in_place)
        if share.broken:
            got.append(("broken", share.broken, time.monotonic() - last))
            break
        last = time.monotonic()
        state = member.held
        got.append(("state", {k: None if x is None else np.array(x) for k, x in state.vectors().items()},
                    share.count))
    where = None if member.nodes is None else (member.nodes.place.node, member.nodes.leaders is not None)
    member.leave()
    out.put((rank, got, where))


def _run(rounds: int, *, in_place: bool = True, backend: str = "hier", die_at: int = -1) -> dict[int, list]:
    ctx = multiprocessing.get_context("fork")  # the children inherit the imports
    out = ctx.Queue()
    procs = [ctx.Process(target=_member, args=(0, 0, rounds, in_place, backend, out, die_at))]
    procs[0].start()
    kind, port = out.get(timeout=60)
    assert kind == "port"
    procs += [ctx.Process(target=_member, args=(r, port, rounds, in_place, backend, out, die_at))
              for r in range(1, len(NODES))]
    for p in procs[1:]:
        p.start()
    results: dict[int, list] = {}
    alive = len(NODES) - (1 if die_at >= 0 else 0)
    for _ in range(alive):
        rank, got, where = out.get(timeout=60)
        results[rank] = got
        results[-1 - rank] = where  # the member's node and whether it leads it
    for p in procs:
        p.join(timeout=30)
    return results


def _node_sums(r: int, state: GlobalState) -> list[PartialSum]:
    """Round ``r``'s sums of each node (its members in rank order), the nodes in node order."""
    sums = []
    for ranks in node_groups(NODES):
        total = _update(ranks[0], r, state)
        for rank in ranks[1:]:
            total.merge(_update(rank, r, state))
        sums.append(total)
    return sums


def _driver_rounds(rounds: int, precision: str = "fp32") -> list[GlobalState]:
    """The rounds on the driver: the nodes' sums folded in node order (fp32), or the leaders' 16-bit rule
    recomputed in one process; then the server step."""
    state, out = _state(0), []
    residuals = None
    for r in range(rounds):
        reducer = RoundReducer(state, global_lr=STEP.global_lr, alpha_nonnegative=STEP.alpha_nonnegative,
                               control_variates=STEP.control_variates)
        sums = _node_sums(r, state)
        if precision == "fp32":
            for s in sums:
                reducer.fold(s)
        else:
            order = layout(state)
            flats = [np.concatenate([getattr(s, name).reshape(-1) for name, _ in order]) for s in sums]
            weights = [s.weight for s in sums]
            total_weight = sum(weights)
            residuals = residuals or [np.zeros(flats[0].size, np.float32) for _ in sums]
            got = simulate(flats, precision, [master_times(state, order, w, False) for w in weights],
                           master_times(state, order, total_weight, False), residuals)
            whole = sums[0]
            for s in sums[1:]:
                whole.merge(s)  # counters, weight and counts; the vectors are replaced below
            at = 0
            for name, n in order:
                getattr(whole, name).reshape(-1)[:] = got[at:at + n]
                at += n
            reducer.fold(whole)
        state = reducer.finish(steps=3)
        out.append(state)
    return out


@pytest.mark.parametrize("in_place", [True, False], ids=["in-place", "copied"])
def test_members_on_three_nodes_hold_the_node_order_fold_bit_for_bit(in_place):
    before = _leftovers()
    rounds = 3
    results = _run(rounds, in_place=in_place)
    want = _driver_rounds(rounds)
    # nodes in order of their lowest rank, each led by it
    assert [results[-1 - rank] for rank in range(len(NODES))] == [(0, True), (1, True), (0, False), (2, True),
                                                                     (1, False)]
    for rank in range(len(NODES)):
        got = results[rank]
        assert [g[0] for g in got] == ["state"] * rounds, got[-1][:2]
        for r, (_, vectors, count) in enumerate(got):
            assert count == len(NODES)
            for name, x in want[r].vectors().items():
                assert vectors[name].tobytes() == x.tobytes(), (rank, r, name)
    assert _leftovers() == before


def test_bf16_between_nodes_follows_the_leaders_rule_with_error_feedback():
    rounds = 3
    results = _run(rounds, backend="hier/bf16/ef")
    want = _driver_rounds(rounds, "bf16")
    exact = _driver_rounds(rounds)
    assert want[0].v.tobytes() != exact[0].v.tobytes()  # the rounding shows
    for rank in range(len(NODES)):
        got = results[rank]
        assert [g[0] for g in got] == ["state"] * rounds
        for r, (_, vectors, _) in enumerate(got):
            for name in ("v", "alpha", "buffers", "c_v", "c_alpha"):
                np.testing.assert_allclose(vectors[name], getattr(want[r], name), rtol=1e-6, atol=1e-6,
                                           err_msg=f"{rank} {r} {name}")
                # and within bf16's reach of the float32 run (8 significant bits, two roundings)
                np.testing.assert_allclose(vectors[name], getattr(exact[r], name), rtol=0.05, atol=0.05)
        assert all(got[-1][1][k].tobytes() == results[0][-1][1][k].tobytes() for k in ("v", "c_v"))


def test_a_member_that_dies_on_one_node_releases_every_node():
    results = _run(4, die_at=1)
    for rank in (0, 1, 2, 4):
        got = results[rank]
        assert [g[0] for g in got] == ["state", "broken"], got
        assert got[-1][2] < 8.0, got[-1]
    why = {rank: results[rank][-1][1] for rank in (0, 1, 2, 4)}
    assert all(w.startswith("the exchange between the nodes 127.0.0.1, 127.0.0.1, 127.0.0.1 broke") for rank, w
               in why.items() if rank in (0, 1)), why  # the leaders (every node on one address here)
    assert "a member left" in why[2] and "a member left" in why[4], why  # the others, released through the block
