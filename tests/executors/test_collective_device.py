"""``collective_backend: device`` through :class:`GroupMember`, in processes without Ray: the members' partial
sums go through the device block (:mod:`~fdam_ray.executors.ray.transports.device_block`; CUDA IPC handles on a
shared GPU, here the same code path on host tensors), the small row over gloo, and every member holds the
driver's rank-order fold bit for bit, in place (a run of rounds) and copied."""

from __future__ import annotations

import multiprocessing

import numpy as np
import pytest
import torch
from test_shared_block import STEP, _driver_rounds, _state, reduce_round

from fdam_ray.executors.ray.transports import shared
from fdam_ray.executors.ray.transports.group import GroupMember

pytestmark = pytest.mark.skipif(not shared.supported(), reason="device blocks' counters need x86-64 Linux")

WORLD, ROUNDS = 3, 3


def _member(rank: int, port: int, in_place: bool, out) -> None:
    torch.set_num_threads(1)
    member = GroupMember(torch.device("cpu"))
    if rank == 0:
        port = member.open("127.0.0.1", 30)
        out.put(("port", port))
    member.join("127.0.0.1", port, rank, WORLD, "device", 20.0, STEP)
    state, got = _state(0), []
    for r in range(ROUNDS):
        share = reduce_round(member, rank, r, state, in_place)
        if share.broken:
            got.append(("broken", share.broken))
            break
        state = member.held
        got.append(("state", {k: None if x is None else np.array(x) for k, x in state.vectors().items()}))
    used = member.device_block is not None and member.block is None
    member.leave()
    out.put((rank, got, used))


@pytest.mark.parametrize("in_place", [True, False], ids=["in-place", "copied"])
def test_members_reducing_through_the_device_block_hold_the_rank_order_fold_bit_for_bit(in_place):
    ctx = multiprocessing.get_context("fork")  # the children inherit torch: no import per member
    out = ctx.Queue()
    procs = [ctx.Process(target=_member, args=(0, 0, in_place, out))]
    procs[0].start()
    kind, port = out.get(timeout=60)
    assert kind == "port"
    procs += [ctx.Process(target=_member, args=(r, port, in_place, out)) for r in range(1, WORLD)]
    for p in procs[1:]:
        p.start()
    results = {}
    for _ in range(WORLD):
        rank, got, used = out.get(timeout=60)
        results[rank] = (got, used)
    for p in procs:
        p.join(timeout=30)
    want = _driver_rounds(WORLD, ROUNDS)
    for rank, (got, used) in results.items():
        assert used, "the sums did not go through the device block"
        assert [g[0] for g in got] == ["state"] * ROUNDS, got[-1]
        for r, (_, vectors) in enumerate(got):
            for name, x in want[r].vectors().items():
                assert vectors[name].tobytes() == x.tobytes(), (rank, r, name)
