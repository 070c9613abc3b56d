"""The shared-memory all-reduce of ``transport: collective`` (backend ``shm``): members in separate processes,
as the actors of one node are.

The sums are the rank-order sums bit for bit (the driver's fold order), the server step finished slice by slice
equals the driver's, a barrier neither lets a member through early nor misses a wake, a dead or departed member
or a late one ends every wait within its bound, a /dev/shm without room falls back to gloo, and nothing is left
in /dev/shm.
"""

from __future__ import annotations

import multiprocessing
import os
import socket
import time

import numpy as np
import pytest
import torch

from fdam_ray.algorithms.server import PartialSum, RoundReducer, ServerStep
from fdam_ray.core.state import GlobalState, RoundPlan
from fdam_ray.executors.ray.transports import shared
from fdam_ray.executors.ray.transports.group import GroupMember
from fdam_ray.executors.ray.transports.shared import SharedBlock, SharedBroken

pytestmark = pytest.mark.skipif(not shared.supported(), reason="shared-memory blocks need Linux on x86-64")

N = 1003  # v's length: not a multiple of the worlds below, so the members' slices differ in length
STEP = ServerStep(global_lr=1.3, alpha_nonnegative=True, control_variates=True)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _state(seed: int) -> GlobalState:
    rng = np.random.default_rng(seed)
    f = lambda n: rng.standard_normal(n).astype(np.float32)
    return GlobalState(v=f(N), alpha=f(2), buffers=f(5), counters=np.arange(3, dtype=np.int64), c_v=f(N),
                       c_alpha=f(2), round=4, iteration=40)


def _update(rank: int, round_index: int, like: GlobalState) -> PartialSum:
    """Member ``rank``'s partial sum of round ``round_index``: weight rank + 1, values from a seed."""
    rng = np.random.default_rng([rank, round_index])
    part = PartialSum.zeros(like, control_variates=True)
    for name in ("v", "alpha", "buffers", "c_v", "c_alpha"):
        x = getattr(part, name)
        x[:] = rng.standard_normal(x.shape).astype(np.float32) * np.float32(rank + 1)
    part.counters[:] = rng.integers(0, 50, part.counters.shape)
    part.weight, part.count, part.bytes_up = float(rank + 1), 1, 100 * (rank + 1)
    return part


def in_place_partial(member: GroupMember, state: GlobalState, mine: PartialSum) -> PartialSum:
    """``mine`` folded as a run of rounds folds it: into the member's slot of the block where it has one (the
    fold writes straight there), else into a partial sum whose vectors are views of one buffer."""
    slot = member.run_partial(state)
    if slot is not None:
        slot.reset()
        slot.merge(mine)
        return slot
    flat = PartialSum.zeros(state, control_variates=True, flat=True)
    flat.merge(mine)
    return flat


def reduce_round(member: GroupMember, rank: int, r: int, state: GlobalState, in_place: bool):
    """Member ``rank``'s round ``r`` from ``state``: its update (folded as a run of rounds folds it when
    ``in_place``), all-reduced with the group's; the member's share."""
    mine = _update(rank, r, state)
    if in_place:
        mine = in_place_partial(member, state, mine)
    plan = RoundPlan(round=state.round + 1, stage=1, steps=3, lr=0.1, iteration=state.iteration)
    return member.reduce(mine, state, plan, None, "", in_place=in_place)


def _member(rank: int, world: int, port: int, rounds: int, in_place: bool, backend: str, out, die_at: int,
            no_room: bool) -> None:
    torch.set_num_threads(1)
    if no_room:  # /dev/shm without room for the block: the lowest rank cannot make it
        def refuse(*args, **kwargs):
            raise OSError(28, "No space left on device")

        SharedBlock.create = staticmethod(refuse)  # type: ignore[method-assign]
    member = GroupMember(torch.device("cpu"))
    if rank == 0:
        port = member.open("127.0.0.1", 30)
        out.put(("port", port))
    member.join("127.0.0.1", port, rank, world, backend, 60.0, STEP)  # spawned members import torch: slow when busy
    state = _state(0)
    got: list = []
    last = time.monotonic()
    for r in range(rounds):
        if r == die_at and rank == world - 1:
            os._exit(3)  # a member that dies without a word
        share = reduce_round(member, rank, r, state, in_place)
        if share.broken:
            got.append(("broken", share.broken, time.monotonic() - last))
            break
        last = time.monotonic()
        state = member.held
        got.append(("state", {k: None if x is None else np.array(x) for k, x in state.vectors().items()},
                    share.count, share.bytes_up))
    out.put((rank, got, member.block is not None))


def _run(world: int, rounds: int, *, in_place: bool = True, backend: str = "shm", die_at: int = -1,
         no_room: bool = False) -> dict[int, list]:
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_member, args=(0, world, 0, rounds, in_place, backend, out, die_at, no_room))]
    procs[0].start()
    kind, port = out.get(timeout=120)
    assert kind == "port"
    procs += [ctx.Process(target=_member, args=(r, world, port, rounds, in_place, backend, out, die_at, no_room))
              for r in range(1, world)]
    for p in procs[1:]:
        p.start()
    results: dict[int, list] = {}
    alive = world - (1 if die_at >= 0 else 0)
    while len(results) < alive:
        rank, got, has_block = out.get(timeout=120)
        results[rank] = [got, has_block]
    for p in procs:
        p.join(timeout=30)
    return results


def _driver_rounds(world: int, rounds: int) -> list[GlobalState]:
    """The same rounds on the driver: the members' sums folded in rank order, then the server step."""
    state, out = _state(0), []
    for r in range(rounds):
        reducer = RoundReducer(state, global_lr=STEP.global_lr, alpha_nonnegative=STEP.alpha_nonnegative,
                               control_variates=STEP.control_variates)
        for rank in range(world):
            reducer.fold(_update(rank, r, state))
        state = reducer.finish(steps=3)
        out.append(state)
    return out


def _leftovers() -> set[str]:
    return {name for name in os.listdir(shared.SHM_DIR) if name.startswith("fdam-ray-")}


@pytest.mark.parametrize("world,in_place", [
    (3, True),
    pytest.param(3, False, marks=pytest.mark.slow),  # spawned members importing torch: 7 s each case
    pytest.param(1, True, marks=pytest.mark.slow),
], ids=["3-in-place", "3-copied", "1"])
def test_members_hold_the_drivers_states_bit_for_bit(world, in_place):
    before = _leftovers()
    rounds = 4
    results = _run(world, rounds, in_place=in_place)
    want = _driver_rounds(world, rounds)
    for rank in range(world):
        got, has_block = results[rank]
        assert has_block and len(got) == rounds, got[-1][:2]
        for r, (kind, vectors, count, bytes_up) in enumerate(got):
            assert kind == "state" and count == world and bytes_up == sum(100 * (k + 1) for k in range(world))
            for name, x in want[r].vectors().items():
                assert vectors[name].tobytes() == x.tobytes(), (rank, r, name)
    assert _leftovers() == before  # the block's file and FIFOs were unlinked once every member held them


@pytest.mark.parametrize("die_at", [2, pytest.param(0, marks=pytest.mark.slow)], ids=["in-a-run", "before-the-block"])
def test_a_member_that_dies_releases_the_others_within_the_check_interval(die_at):
    """Mid-run (the others wait in the block) or before its first reduce (the others wait in the block's
    set-up): they are released, and the block's names are gone from /dev/shm either way."""
    before = _leftovers()
    results = _run(3, 6, die_at=die_at)
    for rank in (0, 1):
        got = results[rank][0]
        assert [g[0] for g in got] == ["state"] * die_at + ["broken"]
        waited = got[-1][2]
        assert waited < 2.0 if die_at else waited < 8.0, waited  # in the block: long before the timeout (5 s)
    if die_at:
        assert any("member 2 of the group" in results[rank][0][-1][1] for rank in (0, 1))
    assert _leftovers() == before


def test_no_room_in_dev_shm_falls_back_to_gloo_with_the_same_states_to_rounding():
    results = _run(2, 3, no_room=True)
    want = _driver_rounds(2, 3)
    for rank in range(2):
        got, has_block = results[rank]
        assert not has_block and [g[0] for g in got] == ["state"] * 3
        for r, (_, vectors, _, _) in enumerate(got):
            np.testing.assert_allclose(vectors["v"], want[r].v, rtol=1e-6, atol=1e-6)


def test_a_late_member_ends_the_wait_at_the_timeout_and_a_broken_mark_releases_at_once(tmp_path, monkeypatch):
    monkeypatch.setattr(shared, "SHM_DIR", str(tmp_path))
    path = SharedBlock.create(2, 4, 8)
    a = SharedBlock(path, 0, 2, 4, 8, timeout_s=0.3)
    b = SharedBlock(path, 1, 2, 4, 8, timeout_s=5.0)
    a.connect()
    b.connect()
    SharedBlock.unlink(path, 2)
    assert os.listdir(tmp_path) == []
    t0 = time.monotonic()
    with pytest.raises(SharedBroken, match=r"members 1 of the group did not reach the barrier in 0.3 s"):
        a.barrier()  # b never arrives (same process: its pid is alive)
    assert 0.3 <= time.monotonic() - t0 < 1.0
    b.barrier()  # a reached this one before it gave up
    t0 = time.monotonic()
    with pytest.raises(SharedBroken, match="a member left"):
        b.barrier()  # a never reaches this one, and it marked the block broken on its way out
    assert time.monotonic() - t0 < 0.5


def test_a_barrier_waits_for_every_member_and_sums_in_rank_order(tmp_path, monkeypatch):
    monkeypatch.setattr(shared, "SHM_DIR", str(tmp_path))
    world, n = 3, 10
    path = SharedBlock.create(world, 2, n)
    blocks = [SharedBlock(path, r, world, 2, n, timeout_s=5.0) for r in range(world)]
    for b in blocks:
        b.connect()
    # one member alone is not let through: it waits for the others (here: times out, no member arrived)
    blocks[0].timeout_s = 0.2
    with pytest.raises(SharedBroken):
        blocks[0].barrier()
    # rank-order sums, slice by slice: (s0 + s1) + s2, as the driver folds
    vals = [np.float32(1e8), np.float32(1.0), np.float32(-1e8)]
    for r, b in enumerate(blocks):
        b.slot[:] = vals[r]
        b.put_row(np.array([r + 1.0, 0.0]))
    out = blocks[0].results[0]
    blocks[0].reduce_slice(out, 0, 4)
    blocks[1].reduce_slice(out, 4, n)
    assert (out == (vals[0] + vals[1]) + vals[2]).all() and out[0] == 0.0  # not 1.0: the order is kept
    assert blocks[2].sum_rows().tolist() == [6.0, 0.0]
    # a round writes the result buffer its start state does not live in (each member its own mapping)
    b = blocks[1]
    assert np.may_share_memory(b.result_for(b.results[0][2:5]), b.results[1])
    assert np.may_share_memory(b.result_for(b.results[1]), b.results[0])
    assert np.may_share_memory(b.result_for(np.zeros(3, np.float32)), b.results[0])
