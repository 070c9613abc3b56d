"""The partial-participation rule for control variates, pinned once against a NumPy oracle (docs/algorithms.md s.3,
s.3b; s.8, R6, R7, R10).

Everything here goes through the one place that owns the rule, the drift correction
(:data:`fdam_ray.algorithms.drift.CONTROL_VARIATES`), and through the server's reducer (:func:`server_c`). The oracle is
written out in float64 below: in a round every client was asked to run c = sum_k w_k c^k / sum_k w_k; in a sampled
or late round c <- c + sum_{k in S} w_k (c^k new - c^k old) / T, T the total weight of all K clients of the run
(dropped ones included); a replaced client starts from c^k = c.
"""

from __future__ import annotations

import numpy as np
import pytest

from fdam_ray.algorithms.drift import CONTROL_VARIATES, DRIFT_CORRECTIONS
from fdam_ray.algorithms.server import PartialSum, RoundReducer, server_c
from fdam_ray.core.state import ClientState, ClientUpdate, GlobalState, StepStats, vector_names
from fdam_ray.executors.deadlines import as_sampled_round
from fdam_ray.loop.federation import rebuilt_states

K, N, M = 5, 7, 2  # clients, length of v, length of alpha
NAMES = vector_names()
CONTROL = CONTROL_VARIATES.names
WEIGHTS = {"uniform": None, "samples": np.array([30.0, 10.0, 25.0, 5.0, 40.0])}


# -- the oracle ------------------------------------------------------------------------------------------------
def oracle_full(c_k: list[tuple[np.ndarray, ...]], w: np.ndarray, clients: list[int]) -> list[np.ndarray]:
    """c after a round every (remaining) client ran: their weighted mean."""
    total = sum(w[k] for k in clients)
    return [sum(w[k] * c_k[k][i].astype(np.float64) for k in clients) / total for i in range(len(CONTROL))]


def oracle_partial(c: tuple[np.ndarray, ...], new: dict[int, tuple], old: dict[int, tuple], w: np.ndarray,
                   total: float) -> list[np.ndarray]:
    """c after a sampled or late round of the clients in ``new``: c + sum w_k (new - old) / T."""
    return [c[i].astype(np.float64) + sum(w[k] * (new[k][i].astype(np.float64) - old[k][i]) for k in new) / total
            for i in range(len(CONTROL))]


# -- the round as the server folds it ----------------------------------------------------------------------------
def rng_state(seed: int) -> GlobalState:
    rng = np.random.default_rng(seed)
    return GlobalState(v=rng.normal(size=N).astype(np.float32), alpha=rng.normal(size=M).astype(np.float32),
                       buffers=np.zeros(0, np.float32), counters=np.zeros(0, np.int64),
                       c_v=rng.normal(size=N).astype(np.float32), c_alpha=rng.normal(size=M).astype(np.float32))


def variates(seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [(rng.normal(size=N).astype(np.float32), rng.normal(size=M).astype(np.float32)) for _ in range(K)]


def update(state: GlobalState, k: int, control: tuple[np.ndarray, ...]) -> ClientUpdate:
    vectors = {name: getattr(state, name).copy() for name in NAMES}
    vectors.update(zip(CONTROL, control, strict=True))
    return ClientUpdate.from_vectors(vectors, client_id=k, stats=StepStats(k, 0.0, 1, 1, 0.0))


def weight_of(weights: np.ndarray | None) -> np.ndarray:
    return np.ones(K) if weights is None else weights


def reducer(state: GlobalState, weights: np.ndarray | None, partial_total: float | None = None) -> RoundReducer:
    return RoundReducer(state, global_lr=1.0, alpha_nonnegative=False, control_variates=True, weights=weights,
                        partial_total=partial_total)


def close(got: GlobalState, want: list[np.ndarray]) -> None:
    for name, x in zip(CONTROL, want, strict=True):
        np.testing.assert_allclose(getattr(got, name), x, rtol=1e-5, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("weighting", WEIGHTS)
def test_a_round_every_client_ran_sets_c_to_the_weighted_mean_of_the_c_k(weighting):
    state, new = rng_state(1), variates(2)
    weights = WEIGHTS[weighting]
    red = reducer(state, weights)
    for k in range(K):
        red.fold(update(state, k, new[k]))  # a full round uploads c^k new
    close(red.finish(steps=1), oracle_full(new, weight_of(weights), list(range(K))))


def test_the_server_c_is_the_documented_float32_order():
    """R10: c = fl(S_c * inv) in a full round, fl(fl(S_c * float32(1 / T)) + G_c) in a sampled one."""
    rng = np.random.default_rng(3)
    total, prev = rng.normal(size=N).astype(np.float32), rng.normal(size=N).astype(np.float32)
    inv = np.float32(1.0 / 3.0)
    np.testing.assert_array_equal(server_c(total.copy(), prev, inv, None), total * inv)
    want = (total * np.float32(1.0 / 7.5)) + prev
    np.testing.assert_array_equal(server_c(total.copy(), prev, inv, 7.5), want)
    with pytest.raises(ValueError, match="previous global control variate"):
        server_c(total.copy(), None, inv, 7.5)


def test_without_control_variates_the_rule_finds_nothing_to_do():
    """The rule is every drift correction's (reached through the algorithm's): without control variates a host
    has no changes to send, a late round's sums stay as folded, a kept state stays as it is."""
    none = DRIFT_CORRECTIONS["none"]
    state = GlobalState(np.ones(N, np.float32), np.ones(M, np.float32), np.zeros(0, np.float32),
                        np.zeros(0, np.int64))
    assert none.host_changes([(None, None, None)]) is None
    assert none.total_weight(K, WEIGHTS["samples"]) == CONTROL_VARIATES.total_weight(K, WEIGHTS["samples"])
    red = RoundReducer(state, global_lr=1.0, alpha_nonnegative=False, control_variates=False)
    none.as_sampled(red, [], float(K))
    assert red.partial_total is None
    kept = ClientState(2)
    assert none.zeroed(kept) is kept and kept.control is None
    assert none.replaced(0, state).control is None


@pytest.mark.parametrize("weighting", WEIGHTS)
def test_a_sampled_round_moves_c_by_the_changes_over_the_weight_of_all_clients(weighting):
    state, old, new = rng_state(4), variates(5), variates(6)
    weights = WEIGHTS[weighting]
    w = weight_of(weights)
    sampled = [1, 3]
    total = CONTROL_VARIATES.total_weight(K, weights)
    assert total == float(w.sum())
    red = reducer(state, weights, partial_total=total)
    for k in sampled:  # a sampled client uploads the change of c^k
        red.fold(update(state, k, tuple(CONTROL_VARIATES.change(new[k], old[k]))))
    want = oracle_partial((state.c_v, state.c_alpha), {k: new[k] for k in sampled}, {k: old[k] for k in sampled},
                          w, total)
    close(red.finish(steps=1), want)


def test_under_sampling_c_stays_the_weighted_mean_of_every_clients_c_k():
    """Start from c = the mean of all c^k; after a sampled round c is the mean of the new c^k of the sampled
    clients and the kept c^k of the others (SCAFFOLD's invariant)."""
    weights = WEIGHTS["samples"]
    w = weight_of(weights)
    state, old, new = rng_state(7), variates(8), variates(9)
    state.c_v, state.c_alpha = (x.astype(np.float32) for x in oracle_full(old, w, list(range(K))))
    sampled = [0, 2, 4]
    red = reducer(state, weights, partial_total=CONTROL_VARIATES.total_weight(K, weights))
    for k in sampled:
        red.fold(update(state, k, tuple(CONTROL_VARIATES.change(new[k], old[k]))))
    after = [new[k] if k in sampled else old[k] for k in range(K)]
    close(red.finish(steps=1), oracle_full(after, w, list(range(K))))


class Hosts:
    """An executor whose hosts made a deadline round: each sends the sums of its clients' changes of c^k."""

    def __init__(self, hosts: list[list[int]], new, old, weights) -> None:
        self.sent = [CONTROL_VARIATES.host_changes((new[k], old[k], None if weights is None else weights[k])
                                                   for k in ids) for ids in hosts]

    def round_changes(self, round_index: int):
        return self.sent


@pytest.mark.parametrize("weighting", WEIGHTS)
def test_a_late_client_leaves_c_as_a_client_left_out_of_a_sampled_round(weighting):
    """Every client was asked; client 2 missed the deadline. The round folds the c^k new of those that made it, then
    becomes a sampled round of them: c moves by their changes over T, and the late client's c^k stays as it was."""
    weights = WEIGHTS[weighting]
    w = weight_of(weights)
    state, old, new = rng_state(10), variates(11), variates(12)
    hosts = [[0, 1], [3, 4]]  # client 2's host was late
    red = reducer(state, weights)
    for ids in hosts:
        part = PartialSum.zeros(state, control_variates=True)
        for k in ids:
            part.fold(update(state, k, new[k]), None if weights is None else float(weights[k]))
        red.fold(part)
    total = CONTROL_VARIATES.total_weight(K, weights)
    as_sampled_round(red, Hosts(hosts, new, old, weights), 1, total, CONTROL_VARIATES)
    assert red.partial_total == total
    made = [k for ids in hosts for k in ids]
    close(red.finish(steps=1), oracle_partial((state.c_v, state.c_alpha), {k: new[k] for k in made},
                                              {k: old[k] for k in made}, w, total))


@pytest.mark.parametrize("weight", [None, 3.0])
def test_a_hosts_late_round_sums_are_a_sampled_rounds_partial_sum_bit_for_bit(weight):
    """R9: the changes a host sends after a late round are the values, and the sum, its sampled round's partial sum
    would hold."""
    state, old, new = rng_state(13), variates(14), variates(15)
    part = PartialSum.zeros(state, control_variates=True)
    for k in range(K):
        part.fold(update(state, k, tuple(CONTROL_VARIATES.change(new[k], old[k]))), weight)
    sums = CONTROL_VARIATES.host_changes((new[k], old[k], weight) for k in range(K))
    assert sums is not None
    for name, x in zip(CONTROL, sums, strict=True):
        np.testing.assert_array_equal(x, getattr(part, name), err_msg=name)
    assert CONTROL_VARIATES.host_changes([(None, old[0], None)]) is None  # no control variate: nothing to send
    assert CONTROL_VARIATES.host_changes([]) is None


def test_a_round_without_control_variates_is_left_as_it_is_when_a_client_is_late():
    state = rng_state(16)
    state.c_v = state.c_alpha = None
    red = RoundReducer(state, global_lr=1.0, alpha_nonnegative=False, control_variates=False)

    class Refuses:
        def round_changes(self, round_index):
            raise AssertionError("not asked without control variates")

    as_sampled_round(red, Refuses(), 1, float(K), CONTROL_VARIATES)
    assert red.partial_total is None


@pytest.mark.parametrize("sampled", [False, True])
def test_a_replaced_client_starts_from_the_global_c(sampled):
    """A replaced client's c^k is c before its round: in a sampled round it contributes w_k (c^k new - c) / T,
    in a full round its c^k new."""
    weights = WEIGHTS["samples"]
    w = weight_of(weights)
    state, old, new = rng_state(17), variates(18), variates(19)
    fresh = CONTROL_VARIATES.replaced(3, state)
    assert fresh.client_id == 3 and fresh.sampler is None and fresh.scaler is None and fresh.moments is None
    assert fresh.control is not None
    for name, x in zip(CONTROL, fresh.control, strict=True):
        np.testing.assert_array_equal(x, getattr(state, name))
    old[3] = fresh.control
    if not sampled:
        red = reducer(state, weights)
        for k in range(K):
            red.fold(update(state, k, new[k]))
        close(red.finish(steps=1), oracle_full(new, w, list(range(K))))
        return
    total = CONTROL_VARIATES.total_weight(K, weights)
    red = reducer(state, weights, partial_total=total)
    for k in (1, 3):
        red.fold(update(state, k, tuple(CONTROL_VARIATES.change(new[k], old[k]))))
    want = oracle_partial((state.c_v, state.c_alpha), {k: new[k] for k in (1, 3)}, {k: old[k] for k in (1, 3)},
                          w, total)
    close(red.finish(steps=1), want)


def test_a_resumed_client_marked_for_a_rebuild_is_a_replaced_client():
    state = rng_state(20)
    kept = ClientState(1, (np.ones(N, np.float32), np.ones(M, np.float32)), {"pos": 3})
    states = rebuilt_states([ClientState(0, rebuild=True), kept, None], state, CONTROL_VARIATES)
    assert states[1] is kept and states[2] is None
    assert states[0] is not None and states[0].sampler is None and not states[0].rebuild
    np.testing.assert_array_equal(states[0]["c_v"], state.c_v)
    without = rng_state(21)
    without.c_v = without.c_alpha = None
    assert CONTROL_VARIATES.replaced(0, without).control is None  # no drift correction: nothing to adopt


@pytest.mark.parametrize("weighting", WEIGHTS)
def test_a_dropped_client_leaves_full_rounds_to_the_rest_and_still_counts_in_t(weighting):
    """R7: after client 4 is dropped, a full round's c is the weighted mean over the clients still in the run; a
    sampled round still divides by T of all K clients."""
    weights = WEIGHTS[weighting]
    w = weight_of(weights)
    state, old, new = rng_state(22), variates(23), variates(24)
    remaining = [0, 1, 2, 3]
    red = reducer(state, weights)
    for k in remaining:
        red.fold(update(state, k, new[k]))
    close(red.finish(steps=1), oracle_full(new, w, remaining))
    total = CONTROL_VARIATES.total_weight(K, weights)  # the run's start: the dropped client counts
    assert total == float(w.sum())
    red = reducer(state, weights, partial_total=total)
    for k in (0, 2):
        red.fold(update(state, k, tuple(CONTROL_VARIATES.change(new[k], old[k]))))
    close(red.finish(steps=1), oracle_partial((state.c_v, state.c_alpha), {k: new[k] for k in (0, 2)},
                                              {k: old[k] for k in (0, 2)}, w, total))


@pytest.mark.parametrize("weighting", WEIGHTS)
def test_a_bridge_whose_server_takes_a_full_rounds_mean_gets_the_same_c(weighting):
    """Flower and SecAgg+: the c of a round some sites dropped out of, in float64, then handed to a full round's
    reducer as the value every site that came sends (Flower) or as weight times it (SecAgg+)."""
    weights = WEIGHTS[weighting]
    w = weight_of(weights)
    state, old, new = rng_state(25), variates(26), variates(27)
    came = [0, 2, 3]
    total = CONTROL_VARIATES.total_weight(K, weights)
    want = oracle_partial((state.c_v, state.c_alpha), {k: new[k] for k in came}, {k: old[k] for k in came}, w,
                          total)
    moved = [CONTROL_VARIATES.moved_c(getattr(state, name), [(float(w[k]), CONTROL_VARIATES.change(new[k], old[k])[i])
                                                             for k in came], total)
             for i, name in enumerate(CONTROL)]
    for got, x in zip(moved, want, strict=True):
        assert got.dtype == np.float64
        np.testing.assert_allclose(got, x, rtol=1e-5, atol=1e-6)  # the changes are float32 (R9)
    red = reducer(state, weights)
    for k in came:
        red.fold(update(state, k, tuple(m.astype(np.float32) for m in moved)))
    close(red.finish(steps=1), want)


def test_a_stage_start_zeroes_a_kept_client_state():
    state = ClientState(0, (np.ones(N, np.float32), np.ones(M, np.float32)), None)
    assert CONTROL_VARIATES.zeroed(state) is state
    assert state.control is not None and all(not np.any(c) for c in state.control)
    assert CONTROL_VARIATES.zeroed(ClientState(1)).control is None


# -- the typed client state and its file layout -------------------------------------------------------------------
def test_a_client_state_is_the_files_mapping_in_the_layout_every_checkpoint_has():
    c_v, c_alpha = np.ones(N, np.float32), np.zeros(M, np.float32)
    state = ClientState(2, (c_v, c_alpha), {"pos": 1}, None)
    assert list(state.to_dict()) == ["client_id", "c_v", "c_alpha", "sampler", "scaler"]
    assert state["c_v"] is c_v and state["client_id"] == 2 and "moments" not in state and len(state) == 5
    state.moments, state.transfer_residual = [np.ones(3)], {"v": np.ones(N)}
    assert list(state) == ["client_id", "c_v", "c_alpha", "sampler", "scaler", "moments", "transfer_residual"]
    again = ClientState.from_dict(state.to_dict())
    assert again.client_id == 2 and again.control is not None and again.control[0] is c_v
    assert again.transfer_residual is state.transfer_residual
    assert ClientState.of(again) is again
    plain = ClientState.from_dict({"client_id": 1, "c_v": None, "c_alpha": None, "sampler": None})  # no scaler
    assert plain.control is None and plain.scaler is None and plain.moments is None
    marker = ClientState(0, rebuild=True)
    assert marker == {"client_id": 0, "rebuild": True} and ClientState.from_dict(marker.to_dict()).rebuild
    with pytest.raises(ValueError, match="holds extra, which a client's state does not"):
        ClientState.from_dict({**state.to_dict(), "extra": 1})
