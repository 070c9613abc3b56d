"""The device block of ``transport: collective`` (members that share one device), on CPU tensors shared as torch
shares them (file names in shared memory), members in separate processes as actors are, or in threads.

The sums are the rank-order fold bit for bit (the shared-memory block's and the driver's order), a result stays
whole over the next reduce, the members' slices cover the state exactly for uneven sizes, and a dead, late,
departed or absent member ends every wait within its bound with a clear error. On a machine with CUDA the same
sums are checked on the GPU.
"""

from __future__ import annotations

import datetime
import itertools
import json
import multiprocessing
import os
import queue
import threading
import time
from collections.abc import Callable

import numpy as np
import pytest
import torch
import torch.distributed as dist

from fdam_ray.executors.ray.transports import shared
from fdam_ray.executors.ray.transports.device_block import (
    DeviceBlock,
    DeviceBlockBroken,
    device_block_usable,
    device_identity,
    export_tensor,
    import_tensor,
    slice_of,
)
from fdam_ray.executors.ray.transports.group import GroupMember

pytestmark = pytest.mark.skipif(not shared.supported(), reason="the device block's barrier needs Linux on x86-64")

N = 1003  # not a multiple of the worlds below: the members' slices differ in length
WORLD = 3
ROUNDS = 4  # the last member dies at the start of the last round


def _store(port: int = 0) -> dist.TCPStore:
    timeout = datetime.timedelta(seconds=10)
    if port:
        return dist.TCPStore("127.0.0.1", port, None, False, timeout=timeout)
    return dist.TCPStore("127.0.0.1", 0, None, True, timeout=timeout, wait_for_workers=False)


def _partial(rank: int, round_index: int, n: int = N) -> np.ndarray:
    """Member ``rank``'s partial sum of a round: magnitudes from 1e-3 to 1e3, so the order of adding matters."""
    rng = np.random.default_rng([rank, round_index])
    return (rng.standard_normal(n) * 10.0 ** rng.integers(-3, 4, n)).astype(np.float32)


def _fold(parts: list[np.ndarray]) -> np.ndarray:
    """The members' sums added in rank order in float32 (one member: its sum + 0)."""
    if len(parts) == 1:
        return parts[0] + np.float32(0)
    out = parts[0] + parts[1]
    for p in parts[2:]:
        out += p
    return out


def _member(rank: int, world: int, port: int, device: str, die_at: int, out) -> None:
    """One member in its own process: ``ROUNDS`` reduces (round 1 folds straight into its slot); reports each
    result, whether the previous result was still whole, and a broken wait with the time it took."""
    torch.set_num_threads(1)  # a forked member never enters the parent's thread pool
    block = DeviceBlock()
    waited_from = time.monotonic()
    try:
        block.open(_store(port), rank, world, N, device, prefix="block/1", timeout_s=5.0)
        last: tuple[torch.Tensor, bytes] | None = None
        for r in range(ROUNDS):
            if r == die_at and rank == world - 1:
                out.close()
                out.join_thread()  # what it reported is sent
                os._exit(3)  # a member that dies without a word
            mine = torch.from_numpy(_partial(rank, r)).to(device)
            if r == 1:
                block.slot.copy_(mine)
                mine = block.slot
            waited_from = time.monotonic()
            result = block.reduce(mine)
            kept = last is None or last[0].cpu().numpy().tobytes() == last[1]
            got = result.cpu().numpy().tobytes()
            out.put((rank, r, got, kept))
            last = (result, got)
    except DeviceBlockBroken as exc:
        out.put((rank, "broken", str(exc), time.monotonic() - waited_from))
    block.close()


def _run_members(world: int, device: str, die_at: int) -> tuple[list[tuple], list[int | None]]:
    store = _store()
    ctx = multiprocessing.get_context("fork")  # starts in milliseconds (a spawned member imports torch again)
    out = ctx.Queue()
    procs = [ctx.Process(target=_member, args=(r, world, store.port, device, die_at, out)) for r in range(world)]
    for p in procs:
        p.start()
    got = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and (any(p.is_alive() for p in procs) or not out.empty()):
        try:  # read while they run: a member ends only once what it put is sent
            got.append(out.get(timeout=0.1))
        except queue.Empty:
            pass
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
    return got, [p.exitcode for p in procs]


@pytest.fixture(scope="module")
def three_members() -> tuple[list[tuple], list[int | None]]:
    """Three member processes on the CPU: three rounds, then the last one dies."""
    return _run_members(WORLD, "cpu", die_at=ROUNDS - 1)


def test_sums_equal_the_rank_order_fold_bit_for_bit(three_members):
    got, _ = three_members
    results = {(m[0], m[1]): m[2] for m in got if m[1] != "broken"}
    assert set(results) == {(rank, r) for rank in range(WORLD) for r in range(ROUNDS - 1)}
    for r in range(ROUNDS - 1):
        parts = [_partial(rank, r) for rank in range(WORLD)]
        expected = _fold(parts)
        assert not np.array_equal(expected, _fold(parts[::-1]))  # the order is visible in the bits
        for rank in range(WORLD):
            assert np.frombuffer(results[rank, r], dtype=np.float32).tobytes() == expected.tobytes()


def test_a_result_stays_whole_over_the_next_reduce(three_members):
    got, _ = three_members
    assert all(m[3] for m in got if m[1] != "broken")


def test_a_dead_member_ends_the_others_wait_with_a_clear_error(three_members):
    got, codes = three_members
    broken = {m[0]: m for m in got if m[1] == "broken"}
    assert set(broken) == {0, 1} and codes == [0, 0, 3]
    for _, _, why, waited in broken.values():
        assert f"member {WORLD - 1} of the group" in why and "died" in why
        assert waited < 2.0  # found by its process check, well within the 5 s timeout


def test_slices_cover_the_state_exactly_for_uneven_sizes():
    assert [slice_of(7, 3, r) for r in range(3)] == [(0, 3), (3, 5), (5, 7)]
    member = GroupMember(torch.device("cpu"))
    for n in (0, 1, 2, 5, 7, 1003):
        for world in range(1, 6):
            spans = [slice_of(n, world, r) for r in range(world)]
            assert spans[0][0] == 0 and spans[-1][1] == n
            assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))
            member.world = world
            assert spans == [member.my_slice(n, r) for r in range(world)]  # the collective group's split
            lengths = [b - a for a, b in spans]
            assert max(lengths) - min(lengths) <= 1 and lengths == sorted(lengths, reverse=True)


def _threads(world: int, n: int, body: Callable[[DeviceBlock, int], object], timeout_s: float = 5.0,
             opens: int | None = None) -> dict[int, object]:
    """``world`` members in threads of this process (the first ``opens`` of them open the block), each running
    ``body``; what each returned or raised."""
    master = _store()
    done: dict[int, object] = {}

    def run(rank: int) -> None:
        block = DeviceBlock()
        try:
            block.open(_store(master.port), rank, world, n, "cpu", prefix="t", timeout_s=timeout_s)
            done[rank] = body(block, rank)
        except DeviceBlockBroken as exc:
            done[rank] = exc

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world if opens is None else opens)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    return done


@pytest.mark.parametrize(("world", "n"), [(1, 5), (2, 1), (2, 0), (4, 7)])
def test_small_and_uneven_states_in_threads(world, n):
    def body(block: DeviceBlock, rank: int) -> bytes:
        return block.reduce(torch.from_numpy(_partial(rank, 0, n))).numpy().tobytes()

    done = _threads(world, n, body)
    expected = _fold([_partial(r, 0, n) for r in range(world)]).tobytes()
    assert done == dict.fromkeys(range(world), expected)


def test_a_late_member_ends_the_wait_at_the_timeout():
    def body(block: DeviceBlock, rank: int) -> float | None:
        if rank == 1:
            return None  # joined, never reduces
        t0 = time.monotonic()
        block.reduce(torch.ones(4))
        return time.monotonic() - t0

    t0 = time.monotonic()
    done = _threads(2, 4, body, timeout_s=0.3)
    assert isinstance(done[0], DeviceBlockBroken) and "members 1 of the group did not reach" in str(done[0])
    assert time.monotonic() - t0 < 3.0


def test_a_member_that_leaves_releases_the_others():
    def body(block: DeviceBlock, rank: int) -> None:
        if rank == 1:
            time.sleep(0.1)
            block.close()
            return
        block.reduce(torch.ones(4))

    done = _threads(2, 4, body, timeout_s=10.0)
    assert isinstance(done[0], DeviceBlockBroken) and "left the group's device block" in str(done[0])


def test_a_member_that_never_opens_ends_the_open_at_the_timeout():
    done = _threads(2, 4, lambda block, rank: None, timeout_s=0.3, opens=1)
    assert isinstance(done[0], DeviceBlockBroken) and "member 1 of the group did not publish" in str(done[0])


def test_a_handle_maps_the_same_memory_and_is_plain_json():
    t = torch.zeros(6)
    handle = export_tensor(t)
    assert set(json.loads(handle)) == {"cpu"}
    other = import_tensor(handle)
    other[2] = 7.0
    t[4] = -1.0
    assert t.tolist() == other.tolist() == [0, 0, 7, 0, -1, 0]


def test_usable_only_on_one_cuda_device_or_a_forced_cpu():
    cpu = device_identity(torch.device("cpu"))
    assert not device_block_usable([cpu, cpu])
    assert device_block_usable([cpu, cpu], allow_cpu=True)
    assert not device_block_usable([cpu, "cpu/elsewhere"], allow_cpu=True)
    assert not device_block_usable([], allow_cpu=True)
    gpu = "cuda/GPU-0000"
    assert device_block_usable([gpu, gpu]) == torch.cuda.is_available()
    assert not device_block_usable([gpu, "cuda/GPU-0001"])
    assert device_block_usable([gpu, gpu], cuda_available=True) == shared.supported()  # a driver without a GPU
    assert not device_block_usable([gpu, gpu], cuda_available=False)
    assert not device_block_usable([gpu, cpu], allow_cpu=True, cuda_available=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_sums_on_one_gpu_equal_the_rank_order_fold_bit_for_bit():
    got, codes = _run_members(2, "cuda", die_at=-1)
    assert codes == [0, 0]
    results = {(m[0], m[1]): m[2] for m in got}
    for r in range(ROUNDS):
        expected = _fold([_partial(rank, r) for rank in range(2)]).tobytes()
        assert results[0, r] == results[1, r] == expected
    assert all(m[3] for m in got)
