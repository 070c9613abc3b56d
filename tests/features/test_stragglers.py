"""Straggler-tolerant rounds (fdam_ray.executors.deadlines): a deadline no client misses changes nothing, a late
client sits the round out as a sampled-out one does, a recorded run replays (and matches the NumPy oracle given
its sets)."""

from __future__ import annotations

import logging
import time

import numpy as np
import pytest
import raytest
from oracle import assert_matches, run_oracle
from sample_clients import gaussian_clients
from test_oracle import initial_v, uneven_clients

import fdam_ray
from fdam_ray.assembly.recipe import run
from fdam_ray.checkpoint import load_checkpoint, save_checkpoint
from fdam_ray.config import ConfigError, build_config
from fdam_ray.core.state import RoundPlan
from fdam_ray.data.arrays import ArraysSource
from fdam_ray.executors.base import ExecutorSetup
from fdam_ray.executors.deadlines import Deadline, MissedRounds, read_record
from fdam_ray.executors.ray.executor import RayExecutor
from fdam_ray.executors.transfer import RESIDUAL_KEY

SMALL = dict(model="mlp", model_width=8, batch_size="full", eval_every=1000, seed=2, lr=0.2, local_steps=2,
             cpus_per_actor=0.5, threads_per_actor=1, fold_order="client")


# -- without Ray -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fields, match", [
    (dict(round_deadline=0), r"'round_deadline': 0 is not allowed \(seconds > 0"),
    (dict(round_deadline="0.5x"), r"'round_deadline': '0.5x' is not allowed"),
    (dict(round_deadline="soon"), r"'round_deadline': 'soon' is not allowed"),
    (dict(min_clients=5, num_clients=4), r"'min_clients': 5 is not allowed \(at most num_clients = 4\)"),
    (dict(min_clients=3, clients_per_round=2), r"'min_clients': 3 .*at most clients_per_round = 2"),
    (dict(min_clients=0), r"'min_clients': 0 is not allowed"),
    (dict(round_deadline=5, executor="inline"), r"null with executor=inline"),
    (dict(round_deadline=5, transport="compiled"), r"null with transport=compiled"),
    (dict(round_deadline="2x", transport="collective", dp="client", dp_clip=1.0, dp_noise_multiplier=1.0),
     r"null with transport=collective and dp=client"),
    (dict(round_deadline=5, participation_record="runs/x"), r"null with participation_record"),
])
def test_bad_values_are_one_line_errors(fields, match):
    with pytest.raises(ConfigError, match=match) as info:
        build_config(fields)
    assert "\n" not in str(info.value)


def test_deadline_values_and_the_median_rule():
    assert build_config(dict(round_deadline="30")).round_deadline == 30.0
    assert build_config(dict(round_deadline="1.5X")).round_deadline == "1.5x"
    fixed = Deadline.of(build_config(dict(round_deadline=4, min_clients=2)))
    assert fixed == Deadline(4.0, None, 2) and fixed.due([], 3) == 4.0
    median = Deadline.of(build_config(dict(round_deadline="2x")))
    assert median.due([0.5], 3) is None  # the median of 3 actors is known once 2 have reported
    assert median.due([0.5, 0.25], 3) == pytest.approx(1.0)
    assert median.due([0.25], 2) == pytest.approx(0.5)  # the lower median


def test_a_client_that_misses_n_rounds_in_a_row_is_named_once(caplog):
    missed = MissedRounds(3)
    with caplog.at_level(logging.WARNING, logger="fdam_ray.executors.deadlines"):
        for r in range(1, 6):
            missed.round(r, [0, 1, 2], [0, 2])
        missed.round(6, [0, 1, 2], [0, 1, 2])
        missed.round(7, [0, 1, 2], [0, 2])
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["client 1 missed the round deadline 3 rounds in a row (rounds 1-3); it keeps being asked each "
                     "round"]


def _recorded_run(tmp_path, cfg, clients, test, record):
    """A saved inline run whose checkpoint then holds ``record`` as its recorded sets: the record to replay."""
    first = fdam_ray.train_arrays(dict(cfg, out_dir=str(tmp_path), run_name="rec"), clients, test, save=True)
    path = first.run_dir / "checkpoint.pt"
    checkpoint = load_checkpoint(path)
    checkpoint.loop.participation = {str(r): ks for r, ks in record.items()}
    save_checkpoint(path, checkpoint)
    return first.run_dir


@pytest.mark.parametrize("algorithm", ["codasca", "coda_plus"])
def test_a_replayed_record_equals_the_numpy_oracle_given_the_same_sets(tmp_path, algorithm):
    clients, test = uneven_clients()
    case = dict(objective="auc_margin", local_steps=3, iterations=15, lr=0.3, prox_weight=0.02, stage_length=9,
                client_weighting="samples")
    cfg = dict(model="linear", batch_size="full", eval_every=1000, seed=0, executor="inline", algorithm=algorithm,
               **case)
    record = {1: [0, 2], 2: [1], 4: [0, 1]}  # rounds 3 and 5 ran every client
    run_dir = _recorded_run(tmp_path, cfg, clients, test, record)
    assert read_record(str(run_dir)) == record
    replay = fdam_ray.train_arrays(dict(cfg, participation_record=str(run_dir)), clients, test)
    v, alpha, c_v, c_a = run_oracle([(X.astype(np.float64), y) for X, y in clients], initial_v(4, 0),
                                    control_variates=algorithm == "codasca", participants=record, **case)
    assert_matches(replay, v, alpha, *((c_v, c_a) if algorithm == "codasca" else ()))
    v_all, *_ = run_oracle([(X.astype(np.float64), y) for X, y in clients], initial_v(4, 0),
                           control_variates=algorithm == "codasca", **case)
    assert np.abs(v - v_all).max() > 1e-3  # the forced sets made a difference
    assert "r1=0,2 r2=1 r4=0,1" in replay.history[-1]["participation"]


def test_a_checkpoint_keeps_the_record_and_older_ones_read_without(tmp_path):
    clients, test = gaussian_clients(num_clients=2)
    cfg = dict(model="linear", batch_size="full", eval_every=1000, seed=0, executor="inline", iterations=4,
               local_steps=2)
    run_dir = _recorded_run(tmp_path, cfg, clients, test, {2: [1]})
    assert load_checkpoint(run_dir / "checkpoint.pt").loop.participation == {"2": [1]}
    plain = fdam_ray.train_arrays(dict(cfg, out_dir=str(tmp_path), run_name="plain"), clients, test, save=True)
    assert load_checkpoint(plain.run_dir / "checkpoint.pt").loop.participation == {}
    with pytest.raises(ValueError, match=r"^config field 'participation_record': .* holds no record to replay"):
        read_record(str(tmp_path / "nowhere"))


def test_a_resumed_replay_equals_the_uninterrupted_one(tmp_path):
    clients, test = uneven_clients()
    cfg = dict(model="linear", batch_size="full", eval_every=1000, seed=0, executor="inline", algorithm="codasca",
               local_steps=3, iterations=18, lr=0.3, stage_length=9, checkpoint_every=1)
    record_dir = _recorded_run(tmp_path, cfg, clients, test, {2: [0, 2], 5: [1]})
    cfg = dict(cfg, participation_record=str(record_dir), out_dir=str(tmp_path))
    whole = fdam_ray.train_arrays(cfg, clients, test)
    config = build_config(dict(cfg, dataset="arrays", num_clients=3, iterations=9, run_name="half"))
    run(config, source=ArraysSource(clients, test), save=True)
    resumed = fdam_ray.resume(tmp_path / "half", {"iterations": 18}, source=ArraysSource(clients, test))
    for name in ("v", "alpha", "c_v", "c_alpha"):
        np.testing.assert_array_equal(getattr(resumed.state, name), getattr(whole.state, name), err_msg=name)
    assert load_checkpoint(tmp_path / "half" / "checkpoint.pt").loop.participation == {"2": [0, 2], "5": [1]}


# -- on Ray -------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ray_session():
    with raytest.ray_session(num_cpus=4):
        yield


# (rounded sums are merged on a node differently from star's: each reduce is its own case; about 13 s each)
@pytest.mark.parametrize("reduce", [pytest.param("star", marks=pytest.mark.slow),  # 8 s each
                                    pytest.param("node", marks=pytest.mark.slow)])
@pytest.mark.parametrize("transfer", [{}, pytest.param(dict(transfer_precision="bf16", error_feedback=True),
                                                      marks=pytest.mark.slow)])
def test_a_deadline_no_client_misses_changes_nothing_bit_for_bit(ray_session, transfer, reduce):
    clients, test = gaussian_clients(num_clients=3)
    cfg = dict(SMALL, algorithm="codasca", iterations=6, executor="ray", **transfer)
    plain = fdam_ray.train_arrays(dict(cfg, reduce=reduce), clients, test)
    timed = fdam_ray.train_arrays(dict(cfg, round_deadline=600, reduce=reduce), clients, test)
    for name in ("v", "alpha", "buffers", "c_v", "c_alpha"):
        np.testing.assert_array_equal(getattr(timed.state, name), getattr(plain.state, name))
    assert timed.history[-1]["participation"] == ""


@pytest.mark.parametrize("reduce, transfer", [pytest.param("star", {}, marks=pytest.mark.slow),  # 14 s each
                                               pytest.param("node", {}, marks=pytest.mark.slow),
                                               pytest.param("star", dict(transfer_precision="bf16",
                                                                         error_feedback=True),
                                                            marks=pytest.mark.slow)])
def test_a_late_client_sits_the_round_out_as_a_sampled_out_one_and_comes_back(ray_session, reduce, transfer):
    clients, test = gaussian_clients(num_clients=3)
    source = raytest.SlowClientSource(ArraysSource(clients, test), slow=1, delay_s=0.3)
    config = build_config(dict(SMALL, batch_size=8, algorithm="codasca", dataset="arrays", num_clients=3,
                               executor="ray", round_deadline=2.0, reduce=reduce, **transfer))
    with RayExecutor() as ex:
        ex.start(ExecutorSetup.for_config(config, ex.section), source)
        state = raytest.first_state(ex, config, source)
        before = ex.client_states()
        folded: list[int] = []

        def fold(partial):
            folded.extend(s.client_id for s in partial.stats)

        t0 = time.monotonic()
        ex.run_round(state, RoundPlan(1, 1, 2, 0.1, 0, partial=True), fold)
        took = time.monotonic() - t0
        assert folded == [0, 2] and list(ex.late) == [1]
        if reduce == "star":  # (reduce=node starts the node's reducer in its first round: seconds here)
            assert took < 2.0 + 1.5  # the deadline, not the slow client's 4.8 s
        after = ex.client_states()  # queued behind the late call and its roll-back
        np.testing.assert_array_equal(after[1]["c_v"], before[1]["c_v"])  # as a client not sampled
        assert after[1]["sampler"]["stream"]["pos"] == before[1]["sampler"]["stream"]["pos"]
        assert not np.array_equal(after[0]["c_v"], before[0]["c_v"])  # those that made it moved
        if transfer:  # error feedback: the discarded upload's rounding residual is not kept, the others' are
            assert RESIDUAL_KEY not in before[1] and RESIDUAL_KEY not in after[1]
            assert set(after[0][RESIDUAL_KEY]) >= {"v", "alpha"}
        # ready for the next round without a restart: with min_clients=3 the round waits for it
        ex.deadline = Deadline(2.0, None, 3)
        folded.clear()
        ex.run_round(state, RoundPlan(2, 1, 2, 0.1, 2, partial=True), fold)
        assert sorted(folded) == [0, 1, 2] and not ex.late
        assert not ex.events  # nothing was replaced


def test_a_run_with_a_straggler_records_its_sets_warns_and_replays(ray_session, tmp_path, caplog):
    clients, test = gaussian_clients(num_clients=3)
    source = raytest.SlowClientSource(ArraysSource(clients, test), slow=2, delay_s=0.1)
    cfg = dict(SMALL, batch_size=8, algorithm="codasca", dataset="arrays", num_clients=3, iterations=8,
               eval_every=4, out_dir=str(tmp_path), run_name="live")
    with caplog.at_level(logging.WARNING, logger="fdam_ray"):
        live = run(build_config(dict(cfg, executor="ray", round_deadline=0.6)), source=source, save=True)
    record = load_checkpoint(live.run_dir / "checkpoint.pt").loop.participation
    assert set(record) == {"1", "2", "3", "4"} and all(ks == [0, 1] for ks in record.values())
    assert [h["participation"] for h in live.history] == ["", "r1=0,1 r2=0,1", "r3=0,1 r4=0,1"]
    assert "client 2 missed the round deadline 3 rounds in a row (rounds 1-3); its call ended after the" in caplog.text
    assert "missed the round deadline" in (live.run_dir / "train.log").read_text()
    # replayed from its record (inline, no straggler, no deadline): the same run
    replay = run(build_config(dict(cfg, executor="inline", run_name="replay",
                                   participation_record=str(live.run_dir))),
                 source=ArraysSource(clients, test), save=False)
    for name in ("v", "alpha", "buffers", "c_v", "c_alpha"):  # inline folds in client order, as fold_order=client
        np.testing.assert_array_equal(getattr(replay.state, name), getattr(live.state, name), err_msg=name)
