"""The server step against a NumPy oracle, and averaging of every float tensor of a real model."""

from __future__ import annotations

import numpy as np
import pytest

from fdam_ray.algorithms.server import RoundReducer
from fdam_ray.config import build_config
from fdam_ray.core.state import ClientUpdate, GlobalState, RoundPlan, StepStats
from fdam_ray.data import DataSection
from fdam_ray.data.digits import DigitsSource
from fdam_ray.executors.base import ExecutorSetup
from fdam_ray.executors.inline import InlineExecutor


def random_state(rng, n=7, m=2, nb=3, cv=True):
    return GlobalState(
        v=rng.standard_normal(n).astype(np.float32), alpha=rng.random(m).astype(np.float32),
        buffers=rng.random(nb).astype(np.float32), counters=np.array([3, 5]),
        c_v=rng.standard_normal(n).astype(np.float32) if cv else None,
        c_alpha=rng.standard_normal(m).astype(np.float32) if cv else None, round=4, iteration=40)


def random_update(rng, k, prev):
    return ClientUpdate(
        prev.v + rng.standard_normal(prev.v.size).astype(np.float32),
        (prev.alpha + rng.standard_normal(prev.alpha.size)).astype(np.float32),
        rng.random(prev.buffers.size).astype(np.float32), prev.counters + rng.integers(0, 9, 2),
        rng.standard_normal(prev.v.size).astype(np.float32), rng.standard_normal(prev.alpha.size).astype(np.float32),
        client_id=k, stats=StepStats(k, 0.0, 10, 100, 0.0))


@pytest.mark.parametrize("global_lr", [1.0, 1.3, 0.9])
@pytest.mark.parametrize("nonneg", [False, True])
def test_reducer_matches_numpy(global_lr, nonneg):
    rng = np.random.default_rng(0)
    prev = random_state(rng)
    ups = [random_update(rng, k, prev) for k in range(5)]
    red = RoundReducer(prev, global_lr=global_lr, alpha_nonnegative=nonneg, control_variates=True)
    for u in ups:
        red.fold(u)
    new = red.finish(steps=10)
    mean = lambda name: np.mean([getattr(u, name) for u in ups], axis=0, dtype=np.float64)
    np.testing.assert_allclose(new.v, prev.v + global_lr * (mean("v") - prev.v), rtol=1e-5, atol=1e-6)
    alpha = prev.alpha + global_lr * (mean("alpha") - prev.alpha)
    np.testing.assert_allclose(new.alpha, np.maximum(alpha, 0) if nonneg else alpha, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(new.buffers, mean("buffers"), rtol=1e-6)  # plain mean, no extrapolation
    np.testing.assert_array_equal(new.counters, np.max([u.counters for u in ups], axis=0))
    np.testing.assert_allclose(new.c_v, mean("c_v"), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(new.c_alpha, mean("c_alpha"), rtol=1e-5, atol=1e-6)
    assert (new.round, new.iteration) == (5, 50)
    assert red.bytes_up == sum(u.nbytes for u in ups)
    if global_lr == 1.0:  # eta_g = 1 is exactly plain averaging
        np.testing.assert_array_equal(new.v, (np.sum([u.v for u in ups], axis=0, dtype=np.float32)
                                              * np.float32(1 / 5)))


def test_a_real_round_averages_batchnorm_statistics_and_counters():
    cfg = build_config(model="cnn", model_width=4, batch_size=16, num_clients=3, algorithm="codasca")
    ex = InlineExecutor()
    ex.start(ExecutorSetup.for_config(cfg, ex.section), DigitsSource(DataSection.of(cfg)))
    from fdam_ray.clients.client import Replica, resolve_device

    replica = Replica(cfg, DigitsSource(DataSection.of(cfg)), device=resolve_device("cpu"))
    state = replica.flat.initial_state()
    state.c_v, state.c_alpha = np.zeros_like(state.v), np.zeros_like(state.alpha)
    ex.configure(np.array([0.1]))
    ex.begin_stage(state.v.copy(), True)
    updates = []
    red = RoundReducer(state, global_lr=1.5, alpha_nonnegative=False, control_variates=True)

    def fold(u):
        updates.append(u)
        red.fold(u)

    ex.run_round(state, RoundPlan(round=1, stage=1, steps=3, lr=0.1, iteration=0), fold)
    new = red.finish(steps=3)
    assert state.buffers.size > 0 and len({u.buffers.tobytes() for u in updates}) == 3  # clients differ
    np.testing.assert_allclose(new.buffers, np.mean([u.buffers for u in updates], axis=0), rtol=1e-6)
    assert np.all(new.counters == 3)  # num_batches_tracked after 3 steps
    np.testing.assert_allclose(new.v, state.v + 1.5 * (np.mean([u.v for u in updates], axis=0) - state.v),
                               rtol=1e-4, atol=1e-6)


FIELDS = ("v", "alpha", "buffers", "counters", "c_v", "c_alpha")


def _negative_zeros(update: ClientUpdate) -> ClientUpdate:
    """The update with -0.0 in the first two places of every float vector (what a lazy fold must turn into +0.0)."""
    for name in ("v", "alpha", "buffers", "c_v", "c_alpha"):
        getattr(update, name)[:2] = -0.0
    return update


@pytest.mark.parametrize("flat", [False, True])
@pytest.mark.parametrize("weights", [None, [2.0, 0.5, 3.0]])
def test_a_lazily_reset_partial_sum_folds_and_merges_to_the_bits_of_one_filled_with_zeros(flat, weights):
    from fdam_ray.algorithms.server import PartialSum

    rng = np.random.default_rng(3)
    prev = random_state(rng, n=40, m=2, nb=5)
    ups = [_negative_zeros(random_update(rng, k, prev)) for k in range(3)]
    want = PartialSum.zeros(prev, control_variates=True)
    got = PartialSum.zeros(prev, control_variates=True, flat=flat)
    for name in FIELDS:
        getattr(got, name)[...] = 7  # an earlier round's sums: not zeroed by a lazy reset, never read
    got.reset(lazy=True)
    for k, u in enumerate(ups):
        w = None if weights is None else weights[k]
        want.fold(u, w)
        got.fold(u, w)
    for name in FIELDS:
        assert getattr(got, name).tobytes() == getattr(want, name).tobytes(), name
    assert not any((np.signbit(x) & (x == 0)).any() for x in got.vectors().values() if x is not None)
    assert (got.weight, got.count, got.bytes_up) == (want.weight, want.count, want.bytes_up)

    merged = PartialSum.zeros(prev, control_variates=True, flat=flat)  # merge as the first thing after a lazy reset
    for name in FIELDS:
        getattr(merged, name)[...] = 7
    merged.reset(lazy=True).merge(want)
    for name in FIELDS:
        assert getattr(merged, name).tobytes() == (getattr(want, name) + np.zeros((), getattr(want, name).dtype)
                                                   ).tobytes(), name
    assert merged.weight == want.weight and merged.count == 3


def test_a_lazily_reset_partial_sum_is_zeros_once_settled_and_cannot_travel_before():
    import pickle

    from fdam_ray.algorithms.server import PartialSum

    rng = np.random.default_rng(4)
    prev = random_state(rng)
    sums = PartialSum.zeros(prev, control_variates=True)
    sums.fold(random_update(rng, 0, prev))
    sums.reset(lazy=True)
    with pytest.raises(RuntimeError, match="settle"):
        pickle.dumps(sums)
    sums.settle()
    for name in FIELDS:
        assert not getattr(sums, name).any(), name
    assert pickle.loads(pickle.dumps(sums)).count == 0
    sums.fold(random_update(rng, 1, prev))  # settled: an ordinary fold into zeros
    assert sums.count == 1


def test_a_flat_partial_sum_is_one_buffer_in_declaration_order_and_travels_once():
    import pickle

    from fdam_ray.algorithms.server import PartialSum

    rng = np.random.default_rng(5)
    prev = random_state(rng, n=10_000)
    sums = PartialSum.zeros(prev, control_variates=True, flat=True)
    flat = sums.flat
    assert flat is not None and flat.size == 2 * 10_000 + 2 * 2 + 3  # v, alpha, buffers, c_v, c_alpha
    at = 0
    for name in ("v", "alpha", "buffers", "c_v", "c_alpha"):
        x = getattr(sums, name)
        assert x.base is flat and x.ctypes.data == flat.ctypes.data + 4 * at, name
        at += x.size
    assert sums.counters.dtype == np.int64 and not np.shares_memory(sums.counters, flat)
    sums.fold(random_update(rng, 0, prev))
    back = pickle.loads(pickle.dumps(sums))
    assert len(pickle.dumps(sums)) < 1.2 * flat.nbytes  # the views travel, the buffer behind them does not again
    assert back.flat is None
    for name in FIELDS:
        assert getattr(back, name).tobytes() == getattr(sums, name).tobytes(), name
    no_cv = PartialSum.zeros(random_state(rng, cv=False), control_variates=False, flat=True)
    assert no_cv.c_v is None and no_cv.flat is not None and no_cv.flat.size == 7 + 2 + 3
