"""The arithmetic of the hierarchical all-reduce (``transport: collective`` across nodes), without Ray.

Who is where (nodes in order of their lowest rank), the chunks each leader owns,
the order of the sums (a node's members in rank order, then the nodes in node
order: a classic ``reduce: node, fold_order: client`` fold, bit for bit), the
bytes on each node's link, and the 16-bit rule (a node's difference from W_n M
rounded with its residual, the chunk's sum rounded once more) against an
independent NumPy rounding; the leaders' real gloo exchange, in processes of
its own, against the same recomputation.
"""

from __future__ import annotations

import datetime
import itertools
import multiprocessing
import socket

import numpy as np
import pytest

from fdam_ray.core.state import GlobalState
from fdam_ray.executors.ray.transports.hierarchy import (
    Leaders,
    Place,
    chunk_length,
    master_times,
    named_peer,
    node_groups,
    padded,
    parse,
    simulate,
    slice_of,
    spec,
    wire_bytes,
)


def _bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> bf16 -> float32, round to nearest, ties to even, in NumPy bit operations (finite values)."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return (rounded << 16).astype(np.uint32).view(np.float32)


def _sums(sizes=(1001, 1001, 1001), seed=0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(n).astype(np.float32) * 10 for n in sizes]


def test_nodes_are_ordered_by_their_lowest_rank_and_members_by_rank():
    where = [("b", "127.0.0.3"), ("a", "127.0.0.2"), ("b", "127.0.0.3"), ("c", "127.0.0.4"), ("a", "127.0.0.2")]
    assert node_groups([n for n, _ in where]) == [[0, 2], [1, 4], [3]]
    places = [Place.of(r, where) for r in range(5)]
    assert [(p.node, p.rank, p.size) for p in places] == [(0, 0, 2), (1, 0, 2), (0, 1, 2), (2, 0, 1), (1, 1, 2)]
    assert [p.leader for p in places] == [True, True, False, True, False]
    assert places[0].addresses == ("127.0.0.3", "127.0.0.2", "127.0.0.4") and places[0].nodes == 3


@pytest.mark.parametrize(("n", "p"), [(1001, 3), (12, 4), (2, 3), (1, 2)])
def test_chunks_cover_the_state_and_the_sum_is_the_node_order_fold_bit_for_bit(n, p):
    rows = padded(np.arange(n, dtype=np.float32), p)
    assert rows.shape == (p, chunk_length(n, p)) and rows.reshape(-1)[:n].tolist() == list(range(n))
    assert not rows.reshape(-1)[n:].any()
    sums = _sums([n] * p, seed=n)
    want = sums[0].copy()
    for s in sums[1:]:  # the driver's fold of classic reduce: node, fold_order: client: fl(fl(N0 + N1) + N2)
        want = want + s
    np.testing.assert_array_equal(simulate(sums), want)
    # a node's members take contiguous slices of its block in rank order
    cuts = [slice_of(n, r, p) for r in range(p)]
    assert cuts[0][0] == 0 and cuts[-1][1] == n and all(a[1] == b[0] for a, b in itertools.pairwise(cuts))


def test_each_link_carries_two_p_minus_one_over_p_of_a_state_each_way():
    n = 1_000_000
    for p in (2, 3, 4, 8):
        assert wire_bytes(n, p) == 2 * (p - 1) * 4 * chunk_length(n, p)
        assert abs(wire_bytes(n, p) - 2 * (p - 1) / p * 4 * n) <= 2 * (p - 1) * 4
        assert wire_bytes(n, p, "bf16") * 2 == wire_bytes(n, p)
    assert wire_bytes(n, 1) == 0


def test_the_backend_spec_carries_the_precision_and_error_feedback():
    assert spec("fp32", False) == "hier" and parse("hier") == ("fp32", False)
    assert parse(spec("bf16", True)) == ("bf16", True) and parse(spec("fp16", False)) == ("fp16", False)


def _state(n_v=7, control=True) -> GlobalState:
    rng = np.random.default_rng(1)
    v = rng.standard_normal(n_v).astype(np.float32)
    alpha = rng.standard_normal(1).astype(np.float32)
    vectors = dict(v=v, alpha=alpha, buffers=np.zeros(0, np.float32), counters=np.zeros(0, np.int64))
    if control:
        vectors.update(c_v=rng.standard_normal(n_v).astype(np.float32),
                       c_alpha=rng.standard_normal(1).astype(np.float32))
    return GlobalState.from_vectors(vectors, round=3, iteration=6)


def test_w_times_the_master_follows_the_classic_rule():
    state = _state()
    layout = [("v", 7), ("alpha", 1), ("buffers", 0), ("c_v", 7), ("c_alpha", 1)]
    full = master_times(state, layout, 3.0, sampled=False)
    np.testing.assert_array_equal(full[:7], state.v * np.float32(3.0))
    np.testing.assert_array_equal(full[8:15], state.c_v * np.float32(3.0))
    assert np.array_equal(master_times(state, layout, 1.0, sampled=False)[:7], state.v)  # W = 1: M itself
    sampled = master_times(state, layout, 3.0, sampled=True)
    np.testing.assert_array_equal(sampled[:8], full[:8])
    assert not sampled[8:].any()  # the control variates' changes of a sampled round: nothing subtracted


def test_16_bit_rounds_each_nodes_difference_then_each_chunks_sum_once_more():
    """An independent recomputation (NumPy bit rounding): q_n = bf16(S_n - W_n M + e_n), the chunks' sums of
    decoded differences in node order rounded once more, plus W M; the residuals are d - decode(q)."""
    p, n = 3, 1001
    sums = _sums([n] * p, seed=5)
    m = np.random.default_rng(6).standard_normal(n).astype(np.float32)
    weights = [2.0, 1.0, 4.0]
    refs = [m * np.float32(w) if w != 1 else m for w in weights]
    total_ref = m * np.float32(sum(weights))
    residuals = [np.random.default_rng(7 + i).standard_normal(n).astype(np.float32) * 1e-3 for i in range(p)]
    kept = [r.copy() for r in residuals]
    got = simulate(sums, "bf16", refs, total_ref, residuals)
    diffs = [(s - r) + e for s, r, e in zip(sums, refs, kept, strict=True)]
    decoded = [_bf16(d) for d in diffs]
    chunk = decoded[0] + decoded[1]
    chunk = chunk + decoded[2]
    np.testing.assert_array_equal(got, _bf16(chunk) + total_ref)
    for e, d, q in zip(residuals, diffs, decoded, strict=True):
        np.testing.assert_array_equal(e, d - q)
    # bounded: each rounding moves a value by at most 2^-8 of it (bf16 keeps 8 significant bits)
    exact = sum(s.astype(np.float64) for s in sums) + sum(e.astype(np.float64) for e in kept)
    bound = 2.0 ** -8 * (sum(np.abs(d) for d in diffs) + np.abs(chunk)) + 1e-5 * np.abs(exact) + 1e-5
    assert np.all(np.abs(got - exact) <= bound)


def test_error_feedback_keeps_the_sum_of_what_each_node_sent_within_one_rounding():
    """Over many rounds a node's decoded uploads plus its last residual are its true differences' sum."""
    n, rounds = 257, 40
    rng = np.random.default_rng(3)
    residual = np.zeros(n, np.float32)
    sent, true = np.zeros(n, np.float64), np.zeros(n, np.float64)
    for _ in range(rounds):
        d = rng.standard_normal(n).astype(np.float32)
        got = simulate([d], "bf16", [np.zeros(n, np.float32)], np.zeros(n, np.float32), [residual])
        sent += _bf16(got)  # one node: the re-rounding of an already 16-bit value changes nothing
        true += d
    np.testing.assert_allclose(sent + residual, true, rtol=0, atol=1e-4)
    assert np.abs(residual).max() < 2.0 ** -7 * 4


def test_a_broken_exchange_names_the_node_when_its_address_tells_it():
    place = Place.of(0, [("a", "127.0.0.2"), ("b", "127.0.0.3"), ("c", "127.0.0.4")])
    why = "[pair.cc:561] Connection closed by peer [127.0.0.3]:21724. This is typically caused by a crash"
    assert named_peer(why, place).startswith("the exchange with node 127.0.0.3 broke")
    same = Place.of(0, [("a", "127.0.0.1"), ("b", "127.0.0.1")])
    assert "127.0.0.1, 127.0.0.1" in named_peer(why.replace("127.0.0.3", "127.0.0.1"), same)


def _leader(index: int, count: int, port: int, precision: str, queue) -> None:
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, count, index == 0, timeout=datetime.timedelta(seconds=30))
    leaders = Leaders(store, "leaders/", index, count, "127.0.0.1", 30.0)
    sums = _sums([1001] * count, seed=11)
    small = np.zeros(count, np.float64)
    small[index] = index + 1.5
    rows = leaders.add_rows(small)
    if precision == "fp32":
        flat = sums[index].copy()
        leaders.all_reduce(flat)
        queue.put((index, rows, flat))
    else:
        from fdam_ray.executors.ray.transports.hierarchy import node_difference

        bits = node_difference(sums[index], np.zeros(1001, np.float32), precision, None)
        queue.put((index, rows, leaders.all_reduce16(bits, precision)))
    leaders.close()


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_leaders_gloo_exchange_computes_what_the_recomputation_does(precision):
    """Three processes, a real gloo group on the loopback: every leader ends with the node-order sum."""
    count = 3
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("fork")  # the children inherit the imports (spawn re-imports torch)
    queue = ctx.Queue()
    procs = [ctx.Process(target=_leader, args=(i, count, port, precision, queue)) for i in range(count)]
    for proc in procs:
        proc.start()
    got = dict((i, (rows, flat)) for i, rows, flat in (queue.get(timeout=60) for _ in range(count)))
    for proc in procs:
        proc.join(timeout=30)
    sums = _sums([1001] * count, seed=11)
    zeros = [np.zeros(1001, np.float32)] * count
    if precision == "fp32":
        want = simulate(sums)
    else:
        from fdam_ray.executors.ray.transports.hierarchy import owner_sum

        patterns = [(_bf16(s).view(np.uint32) >> 16).astype(np.uint16) for s in sums]  # each node's upload
        sent = np.stack([padded(q, count) for q in patterns])
        want = np.concatenate([owner_sum(sent[:, j], precision) for j in range(count)])[:1001]
        decoded = (want.astype(np.uint32) << 16).view(np.float32)
        np.testing.assert_array_equal(simulate(sums, "bf16", zeros, zeros[0]), decoded)
    for rows, flat in got.values():
        np.testing.assert_array_equal(rows, [1.5, 2.5, 3.5])
        np.testing.assert_array_equal(flat, want)
