"""The state after a run of collective rounds is read from the object store when it is used
(fdam_ray/executors/ray/transports/pending.py): its key stands for it while unread, it pickles as the plain state,
a lost copy is taken from a member that holds it, and a run reads it only where the loop needs the state."""

from __future__ import annotations

import dataclasses
import pickle

import numpy as np
import pytest
import ray
from raytest import ray_session
from sample_clients import gaussian_clients

from fdam_ray.assembly.recipe import run
from fdam_ray.checkpoint import load_checkpoint
from fdam_ray.config import build_config
from fdam_ray.core.state import GlobalState
from fdam_ray.data.arrays import ArraysSource
from fdam_ray.executors.ray.executor import RayExecutor
from fdam_ray.executors.ray.transports.collective_messages import state_key
from fdam_ray.executors.ray.transports.pending import PendingState, key_of

FIELDS = ("v", "alpha", "buffers", "counters", "c_v", "c_alpha")


@pytest.fixture(scope="module")
def session():
    with ray_session():
        yield


def a_state(seed: int = 0) -> GlobalState:
    rng = np.random.default_rng(seed)
    return GlobalState(v=rng.standard_normal(5000).astype(np.float32), alpha=np.ones(1, np.float32),
                       buffers=np.zeros(0, np.float32), counters=np.zeros(0, np.int64),
                       c_v=rng.standard_normal(5000).astype(np.float32), c_alpha=np.zeros(1, np.float32),
                       round=7, iteration=21)


def same(a: GlobalState, b: GlobalState) -> None:
    assert (a.round, a.iteration) == (b.round, b.iteration)
    for name in FIELDS:
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)


def test_an_unread_state_gives_its_members_key_and_reads_on_first_use(session):
    state = a_state()
    key = state_key(state, 2)
    pending = PendingState.waiting(ray.put(state), key)
    assert type(pending) is PendingState and (pending.round, pending.iteration) == (7, 21)
    assert PendingState.waiting(ray.put(state), key, nbytes=123).nbytes == 123  # counted without a read
    assert key_of(pending, 2) == key and type(pending) is PendingState  # the members' key: nothing read for it
    assert key_of(pending, 3) == state_key(state, 3) and type(pending) is PendingState  # the stage: the asker's
    np.testing.assert_array_equal(pending.v, state.v)  # the first read of a vector reads them all
    assert type(pending) is GlobalState and not set(vars(pending)) - set(vars(state))  # now a plain state
    same(pending, state)
    assert key_of(pending, 2) == key  # read: computed from the vectors, the same


def test_it_pickles_as_the_plain_state_and_a_change_reads_it_first(session):
    state = a_state(1)
    pending = PendingState.waiting(ray.put(state), state_key(state, 1))
    back = pickle.loads(pickle.dumps(pending))
    assert type(back) is GlobalState
    same(back, state)
    other = PendingState.waiting(ray.put(state), state_key(state, 1))
    other.alpha = np.full(1, 3.0, np.float32)  # a changed vector: read first, the key no longer stands
    assert type(other) is GlobalState and key_of(other, 1) != state_key(state, 1)
    np.testing.assert_array_equal(other.v, state.v)
    replaced = dataclasses.replace(PendingState.waiting(ray.put(state), state_key(state, 1)), round=8)
    assert replaced.round == 8 and type(replaced) is GlobalState
    np.testing.assert_array_equal(replaced.c_v, state.c_v)


def test_a_lost_copy_is_taken_from_a_member_that_holds_it_else_one_line(session, monkeypatch):
    import fdam_ray.executors.ray.transports.pending as P

    state = a_state(2)
    key = state_key(state, 1)
    lost_refs = []
    get = ray.get

    def losing_get(ref, **kw):  # the object gone with the lowest rank's node, as Ray reports it
        if any(ref == r for r in lost_refs):
            raise ray.exceptions.ObjectLostError(ref.hex(), "", "")
        return get(ref, **kw)

    monkeypatch.setattr(P.ray, "get", losing_get)
    asked = []

    def holder(k):
        asked.append(k)
        return state if k == key else None

    lost_refs.append(ray.put(state))
    same(PendingState.waiting(lost_refs[-1], key, holder), state)
    assert asked == [key]
    lost_refs.append(ray.put(state))
    with pytest.raises(RuntimeError, match="the global state after round 7 was lost with the node that held it "
                                           "and no live actor holds it"):
        np.sum(PendingState.waiting(lost_refs[-1], key, lambda k: None).v)
    wrong = dataclasses.replace(state, round=6)
    lost_refs.append(ray.put(state))
    with pytest.raises(RuntimeError, match="is not the state after round 7"):
        np.sum(PendingState.waiting(lost_refs[-1], key, lambda k: wrong).v)


def test_a_run_reads_the_state_only_where_the_loop_needs_it(session, monkeypatch, tmp_path):
    reads = []
    fetch = PendingState._fetch

    def counted(self, ref):
        reads.append(self.round)
        return fetch(self, ref)

    monkeypatch.setattr(PendingState, "_fetch", counted)
    clients, test = gaussian_clients(num_clients=4)
    cfg = dict(model="mlp", model_width=8, batch_size="full", seed=2, lr=0.2, local_steps=2, cpus_per_actor=0.5,
               executor="ray", eval_every=8, iterations=24, stage_length=100, dataset="arrays", num_clients=4,
               algorithm="codasca")

    def go(**kw):
        executor = RayExecutor()
        out = run(build_config(dict(cfg, **kw)), source=ArraysSource(clients, test), executor=executor,
                  save=kw.get("checkpoint_every", 0) > 0)
        return out, executor

    got, executor = go(transport="collective", collective_rounds=2, checkpoint_every=8, out_dir=str(tmp_path),
                       run_name="runs", tensorboard=False)
    assert executor.transport.runs == [[r, r + 1] for r in range(1, 12, 2)]
    assert executor.transport.rounds_sent == 1  # the first run only: each next one took the unread state's key
    # the runs ending at rounds 2, 6, 10 (nothing needs the state) and 4 (evaluated by the actors from the lowest
    # rank's object) are not read on the driver; the checkpoint of round 8 is, and the end (round 12)
    assert reads == [8, 12]
    classic, _ = go(transport="classic", fold_order="client")
    for name in FIELDS:
        a, b = getattr(got.state, name), getattr(classic.state, name)
        assert (a is None) == (b is None), name
        if b is not None:
            np.testing.assert_array_equal(a, b, err_msg=name)  # one node: shared memory sums in client order
    assert [h["iteration"] for h in got.history] == [0, 8, 16, 24]
    assert [h["test_auc"] for h in got.history] == [h["test_auc"] for h in classic.history]
    saved = load_checkpoint(tmp_path / "runs" / "checkpoint.pt").loop.state  # the end's, read to be written
    assert type(saved) is GlobalState
    for name in FIELDS:
        a, b = getattr(saved, name), getattr(got.state, name)
        assert (a is None) == (b is None), name
        if b is not None:
            np.testing.assert_array_equal(a, b, err_msg=name)
