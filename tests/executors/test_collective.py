"""``transport: collective``: the actors all-reduce their partial sums and apply the server step themselves.

Equal to a classic ``fold_order: client`` run to float32 rounding (the all-reduce sums in another order), with
hosted clients and client sampling; the state goes down only when the actors' copy is stale; failures are
recovered as under the other transports; ``reduce: node`` is refused in one line. The state after a run of
rounds is read when used: its key stands for it while unread, it pickles as the plain state, a lost copy is taken
from a member, and a run reads it only where the loop needs it.
"""

from __future__ import annotations

import dataclasses
import pickle

import numpy as np
import pytest
import ray
import raytest
from oracle import assert_matches, run_oracle
from raytest import ray_session
from sample_clients import gaussian_clients
from test_hosted import BASE, assert_same_state, sized_clients, train
from test_oracle import CASES as ORACLE_CASES
from test_oracle import initial_v, uneven_clients
from test_sampling import CASES as SAMPLING_CASES

import fdam_ray
from fdam_ray.assembly.recipe import run
from fdam_ray.checkpoint import load_checkpoint
from fdam_ray.config import ConfigError, build_config
from fdam_ray.core.state import GlobalState
from fdam_ray.data.arrays import ArraysSource
from fdam_ray.executors.ray.executor import RayExecutor
from fdam_ray.executors.ray.transports import REFUSED, transport_for
from fdam_ray.executors.ray.transports.collective_messages import state_key
from fdam_ray.executors.ray.transports.pending import PendingState, key_of

ARRAYS = dict(model="mlp", model_width=8, batch_size="full", eval_every=2, seed=2, lr=0.2, local_steps=2,
              cpus_per_actor=0.5)
FIELDS = ("v", "alpha", "buffers", "counters", "c_v", "c_alpha")


@pytest.fixture(scope="module", autouse=True)
def session():
    with ray_session():
        yield


def arrays_run(cfg: dict, clients, test, executor=None):
    config = build_config(dict(cfg, dataset="arrays", num_clients=len(clients)))
    return run(config, source=ArraysSource(clients, test), executor=executor, save=False)


def assert_same_run(got, want, atol=1e-6):
    for name in FIELDS:
        a, b = getattr(got.state, name), getattr(want.state, name)
        if b is None:
            assert a is None, name
            continue
        np.testing.assert_allclose(a, b, rtol=0, atol=atol, err_msg=name)
    assert [h["test_auc"] for h in got.history] == pytest.approx([h["test_auc"] for h in want.history], abs=1e-4)


@pytest.mark.parametrize("extra", [
    pytest.param(dict(algorithm="codasca", global_lr=1.1), marks=pytest.mark.slow),  # 13 s; hosted stays default
    dict(algorithm="coda_plus", clients_per_actor=2),
    pytest.param(dict(algorithm="codasca", clients_per_round=2, client_weighting="samples"),
                 marks=pytest.mark.slow),  # two Ray runs, 14 s; the oracle test below samples by default
    # gloo on one node (13 s); the default tier reduces over gloo in test_shared_block's fallback case
    pytest.param(dict(algorithm="codasca", collective_backend="gloo"), marks=pytest.mark.slow),
], ids=["codasca", "hosted", "sampled", "gloo"])
def test_a_collective_run_equals_the_classic_run_in_client_order(extra):
    """On one node the actors reduce through shared memory, in rank order: the driver's order of folding the
    actors' sums, so the run is classic's bit for bit; over gloo (the ring's order) to float32 rounding."""
    clients, test = gaussian_clients(num_clients=4)
    cfg = dict(ARRAYS, iterations=12, stage_length=6, executor="ray", **extra)
    classic = arrays_run(dict(cfg, transport="classic", fold_order="client", collective_backend="auto"), clients,
                         test)
    executor = RayExecutor()
    got = arrays_run(dict(cfg, transport="collective"), clients, test, executor=executor)
    assert got.state.round == classic.state.round == 6
    gloo = extra.get("collective_backend") == "gloo"
    assert_same_run(got, classic, atol=1e-6 if gloo else 0.0)
    transport = executor.transport
    assert transport.serves == ("collective", "star") and transport.builds == 1
    assert transport.backend == ("gloo" if gloo else "shm")
    # the state went down in the first round and at the stage start only; the actors kept their copy otherwise
    assert transport.rounds_sent == 2


RAY = dict(executor="ray", cpus_per_actor=0.5, threads_per_actor=1)


@pytest.mark.parametrize("case", [ORACLE_CASES[1], ORACLE_CASES[2], ORACLE_CASES[3], SAMPLING_CASES[1]],
                         ids=["coda-margin-stages", "codasca-stages", "codasca-keep-c", "sampled-weighted"])
def test_collective_runs_match_the_numpy_oracle(case):
    clients, test = uneven_clients()
    cfg = dict(model="linear", batch_size="full", eval_every=1000, seed=0, transport="collective", **RAY, **case)
    result = fdam_ray.train_arrays(cfg, clients, test)
    kwargs = {k: v for k, v in case.items() if k != "algorithm"}
    codasca = case["algorithm"] == "codasca"
    v, alpha, c_v, c_a = run_oracle([(X.astype(np.float64), y) for X, y in clients], initial_v(4), **kwargs,
                                    control_variates=codasca)
    assert_matches(result, v, alpha, *((c_v, c_a) if codasca else ()))
    assert result.state.round == -(-case["iterations"] // case["local_steps"])


@pytest.mark.slow  # two Ray runs, 11 s
def test_hosted_sampled_weighted_rounds_over_stage_changes_equal_classic():
    clients, test = sized_clients()
    cfg = dict(BASE, clients_per_round=3, clients_per_actor=2, **RAY)
    classic = train(dict(cfg, fold_order="client"), clients, test)
    executor = RayExecutor()
    got = train(dict(cfg, transport="collective"), clients, test, executor=executor)
    assert_same_state(got, classic, exact=False)
    assert got.summary["bytes_up"] == classic.summary["bytes_up"]
    assert got.state.round == 6 and executor.transport.builds == 1


def test_reduce_node_is_refused_in_one_line():
    with pytest.raises(ValueError) as info:
        transport_for("collective", "node")
    assert str(info.value) == REFUSED["collective", "node"] and "\n" not in str(info.value)
    assert transport_for("collective", "star").serves == ("collective", "star")
    # the config refuses it first (a run or a sweep stops before it starts anything); inline reads neither field
    with pytest.raises(ConfigError, match=r"^config field 'reduce': 'node' is not allowed \(star: transport="
                       r"collective reduces") as refused:
        build_config(dict(transport="collective", reduce="node"))
    assert "\n" not in str(refused.value)
    assert build_config(dict(transport="collective", reduce="node", executor="inline")).reduce == "node"
    assert build_config(dict(transport="compiled", reduce="node")).reduce == "node"


def test_the_members_server_step_is_the_drivers_bit_for_bit_in_either_set_of_sums():
    from fdam_ray.algorithms import AlgorithmSection, build_algorithm
    from fdam_ray.algorithms.server import PartialSum, ServerStep
    from fdam_ray.core.state import GlobalState

    rng = np.random.default_rng(0)
    n = 5000
    prev = GlobalState(v=rng.standard_normal(n, dtype=np.float32), alpha=np.array([0.3], np.float32),
                       buffers=rng.standard_normal(7, dtype=np.float32), counters=np.array([3, 9]),
                       c_v=rng.standard_normal(n, dtype=np.float32), c_alpha=np.array([0.1], np.float32))
    total = PartialSum(v=rng.standard_normal(n, dtype=np.float32), alpha=np.array([-0.2], np.float32),
                       buffers=rng.standard_normal(7, dtype=np.float32), counters=np.array([4, 2]),
                       c_v=rng.standard_normal(n, dtype=np.float32), c_alpha=np.array([0.05], np.float32),
                       weight=2.75, count=3, bytes_up=10)
    total.v[:3], total.buffers[0] = -0.0, -0.0  # the driver folds into zeros: 0 + (-0) is +0
    algorithm = build_algorithm(AlgorithmSection.of(build_config(dict(algorithm="codasca", global_lr=1.3))))
    for partial_total in (None, 5.0):
        reducer = algorithm.reducer(prev, partial_total=partial_total)
        reducer.fold(total)
        want = reducer.finish(steps=4)
        step = ServerStep(reducer.global_lr, reducer.alpha_nonnegative, reducer.control_variates)
        into = PartialSum.zeros(prev, control_variates=True)
        into.v[:] = np.nan  # stale values of an earlier round
        for got in (step.apply(prev, total, 4, partial_total), step.apply(prev, total, 4, partial_total, into)):
            for name in FIELDS:
                assert getattr(got, name).tobytes() == getattr(want, name).tobytes(), name
            assert (got.round, got.iteration) == (want.round, want.iteration)
        # in place (a run of rounds): the sums a fold makes hold no -0.0, and on those the state is the driver's
        # bits, written into the sums' own buffers
        folded = PartialSum.zeros(prev, control_variates=True)
        folded.merge(total)
        assert not np.signbit(folded.v[:3]).any()
        got = step.apply(prev, folded, 4, partial_total, in_place=True)
        assert got.v is folded.v and got.c_v is folded.c_v
        for name in FIELDS:
            assert getattr(got, name).tobytes() == getattr(want, name).tobytes(), name


def test_nccl_only_when_every_actor_holds_a_gpu_of_its_own_shared_memory_on_one_node_and_the_store_on_the_loopback():
    from types import SimpleNamespace

    from fdam_ray.executors.ray.transports import shared
    from fdam_ray.executors.ray.transports.collective import CollectiveTransport

    assert shared.supported()  # these machines: Linux on x86-64

    def backend(where: dict, choice: str = "auto") -> tuple[str, str]:
        transport = CollectiveTransport.__new__(CollectiveTransport)
        transport.fleet = SimpleNamespace(where_of=where)
        transport.config = SimpleNamespace(collective_backend=choice)
        return transport._backend(sorted(where)), transport._host(sorted(where))

    gpu = lambda node, ids: {"device": "cuda:0", "gpu_ids": ids, "node_id": node}
    cpu = lambda node: {"device": "cpu", "gpu_ids": [], "node_id": node}
    assert backend({0: gpu("n", [0]), 1: gpu("n", [1])}) == ("nccl", "127.0.0.1")
    assert backend({0: gpu("n", [0]), 1: gpu("m", [0])}, "gloo")[0] == "nccl"
    # a shared GPU (NCCL takes one rank per GPU) or a CPU actor: shared memory on one node, the hierarchical
    # all-reduce across nodes (shared memory in each, gloo between them), flat gloo when asked
    assert backend({0: gpu("n", [0]), 1: gpu("n", [0])})[0] == "shm"
    assert backend({0: gpu("n", [0]), 1: gpu("m", [0]), 2: gpu("m", [0])})[0] == "hier"
    assert backend({0: gpu("n", [0]), 1: cpu("n")})[0] == "shm"
    assert backend({0: cpu("n")}) == ("shm", "127.0.0.1")
    assert backend({0: cpu("n"), 1: cpu("n")}, "gloo") == ("gloo", "127.0.0.1")
    assert backend({0: cpu("n"), 1: cpu("m")})[0] == "hier"
    assert backend({0: cpu("n"), 1: cpu("m")}, "gloo")[0] == "gloo"


def test_a_state_key_changes_with_the_stage_and_with_the_values():
    from fdam_ray.core.state import GlobalState
    from fdam_ray.executors.ray.transports.collective_messages import state_key

    v = np.arange(100_000, dtype=np.float32)
    state = GlobalState(v=v, alpha=np.array([0.5], np.float32), buffers=np.zeros(3, np.float32),
                        counters=np.zeros(1, np.int64), round=4, iteration=40)
    key = state_key(state, 2)
    assert state_key(state, 2) == key and state_key(state, 3) != key
    state.alpha[0] = 0.25  # a stage end's new alpha
    assert state_key(state, 2) != key


def _listening(port: int) -> list[str]:
    """The local addresses (hex, as /proc/net/tcp* writes them) of this machine's sockets listening on ``port``."""
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as fh:
            for line in fh.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                address, _, hex_port = local.partition(":")
                if state == "0A" and int(hex_port, 16) == port:
                    out.append(address)
    return out


def test_the_groups_store_listens_on_the_given_address_only():
    """torch's TCPStore server binds every interface; the group's store is handed a socket bound to its host."""
    import torch

    from fdam_ray.executors.ray.transports.group import GroupMember

    member = GroupMember(torch.device("cpu"))
    port = member.open("127.0.0.1", 10.0)
    try:
        assert _listening(port) == ["0100007F"]  # 127.0.0.1, and nothing on 0.0.0.0 or ::
        client = torch.distributed.TCPStore("127.0.0.1", port, None, False)
        client.set("k", "v")
        assert member.store.get("k") == b"v"
        del client
    finally:
        member.leave()
    assert _listening(port) == []  # the store closed the socket it was handed


# -- the state after a run of rounds, read when used (fdam_ray/executors/ray/transports/pending.py) ------------
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


def test_an_unread_state_gives_its_members_key_and_reads_on_first_use():
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


def test_it_pickles_as_the_plain_state_and_a_change_reads_it_first():
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


def test_a_lost_copy_is_taken_from_a_member_that_holds_it_else_one_line(monkeypatch):
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


def test_a_run_reads_the_state_only_where_the_loop_needs_it(monkeypatch, tmp_path):
    reads = []
    fetch = PendingState._fetch

    def counted(self, ref):
        reads.append(self.round)
        return fetch(self, ref)

    monkeypatch.setattr(PendingState, "_fetch", counted)
    pulled = []  # (round, whether its pull to the driver started when the run ended)
    waiting = PendingState.waiting.__func__

    def noted(cls, ref, key, fallback=None, nbytes=None, pull=True):
        pulled.append((int(key[0]), pull))
        return waiting(cls, ref, key, fallback, nbytes, pull)

    monkeypatch.setattr(PendingState, "waiting", classmethod(noted))
    clients, test = gaussian_clients(num_clients=4)
    cfg = dict(model="mlp", model_width=8, batch_size="full", seed=2, lr=0.2, local_steps=2, cpus_per_actor=0.5,
               executor="ray", eval_every=8, iterations=24, stage_length=100, dataset="arrays", num_clients=4,
               algorithm="codasca")

    executor = RayExecutor()
    got = run(build_config(dict(cfg, transport="collective", collective_rounds=2, checkpoint_every=8,
                                out_dir=str(tmp_path), run_name="runs", tensorboard=False)),
              source=ArraysSource(clients, test), executor=executor)
    assert executor.transport.runs == [[r, r + 1] for r in range(1, 12, 2)]
    assert executor.transport.rounds_sent == 1  # the first run only: each next one took the unread state's key
    # the runs ending at rounds 2, 6, 10 (nothing needs the state) and 4 (evaluated by the actors from the lowest
    # rank's object) are not read on the driver; the checkpoint of round 8 is, and the end (round 12)
    assert reads == [8, 12]
    # the pull starts only after runs that end where the driver may read the state (an evaluation, a checkpoint,
    # the end), not after those that end at collective_rounds: those would load the lowest rank's link for nothing
    assert pulled == [(2, False), (4, True), (6, False), (8, True), (10, False), (12, True)]
    # one node: the shared-memory block sums in client order, the in-process run's order
    inline = run(build_config(dict(cfg, executor="inline")), source=ArraysSource(clients, test), save=False)
    for name in FIELDS:
        a, b = getattr(got.state, name), getattr(inline.state, name)
        assert (a is None) == (b is None), name
        if b is not None:
            np.testing.assert_array_equal(a, b, err_msg=name)
    assert [h["iteration"] for h in got.history] == [0, 8, 16, 24]
    assert [h["test_auc"] for h in got.history] == [h["test_auc"] for h in inline.history]
    saved = load_checkpoint(tmp_path / "runs" / "checkpoint.pt").loop.state  # the end's, read to be written
    assert type(saved) is GlobalState
    for name in FIELDS:
        a, b = getattr(saved, name), getattr(got.state, name)
        assert (a is None) == (b is None), name
        if b is not None:
            np.testing.assert_array_equal(a, b, err_msg=name)


# -- round_deadline inside the collective (fdam_ray/executors/ray/transports/collective_deadline.py) --------------
DEADLINE = dict(ARRAYS, batch_size=8, algorithm="codasca", dataset="arrays", num_clients=3, iterations=8,
                eval_every=4, executor="ray", transport="collective", threads_per_actor=1)


@pytest.mark.slow  # three runs, about 14 s; the members' agreement is pinned without Ray in the unit tier
def test_a_deadline_cuts_a_slow_members_steps_records_it_and_replays(tmp_path):
    """Client 2 reads 0.8 s of samples a step; with a 0.6 s deadline its member abandons the round before its
    second step, sits it out (its c^k and sampler as they were) and the others' round folds as a sampled round of
    theirs: recorded (every round without client 2), replayed by the collective bit for bit and by an inline run
    to float32 rounding."""
    clients, test = gaussian_clients(num_clients=3)
    slow = raytest.SlowClientSource(ArraysSource(clients, test), slow=2, delay_s=0.1)
    cfg = dict(DEADLINE, out_dir=str(tmp_path))
    live = run(build_config(dict(cfg, run_name="live", round_deadline=0.6)), source=slow, save=True)
    record = load_checkpoint(live.run_dir / "checkpoint.pt").loop.participation
    assert record == {str(r): [0, 1] for r in range(1, 5)}
    assert [h["participation"] for h in live.history] == ["", "r1=0,1 r2=0,1", "r3=0,1 r4=0,1"]
    assert ("client 2 missed the round deadline 3 rounds in a row (rounds 1-3); its local steps ran past the "
            "deadline" in (live.run_dir / "train.log").read_text())
    replay = dict(cfg, participation_record=str(live.run_dir))
    again = run(build_config(dict(replay, run_name="again")), source=ArraysSource(clients, test), save=False)
    for name in FIELDS:
        a, b = getattr(again.state, name), getattr(live.state, name)
        np.testing.assert_array_equal(a, b, err_msg=name)
    inline = run(build_config(dict(replay, executor="inline", transport="classic", run_name="inline")),
                 source=ArraysSource(clients, test), save=False)
    assert_same_run(inline, live, atol=1e-6)


@pytest.mark.slow  # two Ray runs, about 10 s
def test_too_few_in_time_runs_the_round_again_without_the_deadline():
    """min_clients=3 of 3: every round someone is late, so every member puts its clients back and runs the round
    again without the deadline: the run is the plain one bit for bit (the put-back state is the state before)."""
    clients, test = gaussian_clients(num_clients=3)
    slow = raytest.SlowClientSource(ArraysSource(clients, test), slow=2, delay_s=0.1)
    cut = run(build_config(dict(DEADLINE, round_deadline=0.6, min_clients=3)), source=slow, save=False)
    plain = run(build_config(DEADLINE), source=ArraysSource(clients, test), save=False)
    for name in FIELDS:
        np.testing.assert_array_equal(getattr(cut.state, name), getattr(plain.state, name), err_msg=name)
    assert [h["participation"] for h in cut.history] == ["", "", ""]
