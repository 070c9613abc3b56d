"""Federated runs of the pAUC objectives: every round starts with the count pass of the sites' training scores,
the normaliser the sites get is the one NumPy computes from those counts (and within its bin-width bound of the
exact one over all sites' scores), the driver never holds a per-sample score, and two Ray actors give the inline
run's model exactly."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import fdam_ray.pauc as pauc
from fdam_ray.assembly.recipe import run
from fdam_ray.config import build_config
from fdam_ray.core.state import ScoreHistogram
from fdam_ray.scores.histogram import bin_edges

BASE = dict(dataset="synthetic", model="mlp", model_width=16, num_clients=4, samples_per_client=200, batch_size=16,
            algorithm="codasca", local_steps=3, iterations=30, stage_length=15, eval_every=15, seed=3,
            executor="inline", clients_per_actor=2, tensorboard=False, objective="pauc_one_way",
            pauc_temperature=0.1)


def pauc_run(**kw):
    return run(build_config(dict(BASE, **kw)), save=False)


@pytest.fixture(scope="module")
def inline():
    """The inline run, with every count pass: the clients, the state it scored and what the sites were sent."""
    passes: list[dict] = []
    original = pauc.refresh

    def keep(executor, state, p, objective, temperature):
        sent: list[np.ndarray] = []
        configure = executor.configure
        got: list = []
        evaluate = executor.evaluate

        def evaluated(*a, **k):
            got.extend(evaluate(*a, **k))
            return got

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(executor, "configure", lambda v: (sent.append(np.asarray(v).copy()), configure(v))[1])
            mp.setattr(executor, "evaluate", evaluated)
            out = original(executor, state, p, objective, temperature)
        passes.append({"state": state.v.copy(), "sent": sent, "parts": list(got), "clients": executor.clients})
        return out

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pauc, "refresh", keep)
        result = pauc_run()
    return result, passes


def test_every_round_starts_with_a_count_pass_and_only_counts_cross(inline):
    result, passes = inline
    rounds = result.history[-1]["round"]
    assert rounds == 10 and len(passes) == rounds
    for one in passes:
        assert len(one["parts"]) == 4 and all(isinstance(h, ScoreHistogram) for h in one["parts"])
        assert all(h.counts.dtype == np.int64 and h.counts.shape == (1, 2, 4096) for h in one["parts"])
        assert len(one["sent"]) == 1 and one["sent"][0].shape == (3,)  # p, log Z, log Z+
    first, last = passes[0]["sent"][0], passes[-1]["sent"][0]
    assert first[0] == last[0] and first[1] != last[1]  # p fixed, the normaliser follows the model


def test_one_round_normaliser_by_numpy_from_the_sites_scores(inline):
    """Round 5: score every site's training shard with the state the pass scored (the test's own placement of the
    scores on the layout's edges), pool them, and compute log Z both from the pooled bins and exactly; the driver
    sent the first to the sites, and it is within half the widest occupied bin over lambda of the second."""
    _, passes = inline
    one = passes[4]
    lam = BASE["pauc_temperature"]
    clients = one["clients"]
    scores, labels = [], []
    for c in clients:
        with torch.no_grad():
            c.replica.flat.v.copy_(torch.from_numpy(one["state"]))
        scores.append(c.replica.score(c.train)[:, 0].astype(np.float64))
        labels.append(c.train.y.cpu().numpy().reshape(-1))
    s, y = np.concatenate(scores), np.concatenate(labels)
    neg = s[y == 0]
    edges = np.concatenate(([0.0], bin_edges(4096), [1.0]))
    where = np.clip(np.searchsorted(edges, neg, side="right") - 1, 0, 4095)
    n = np.bincount(where, minlength=4096).astype(np.float64)
    assert np.array_equal(n, sum(h.counts[0, 0] for h in one["parts"]))
    centres = (edges[:-1] + edges[1:]) / 2
    from_bins = np.log(np.sum(n * np.exp(centres / lam)) / n.sum())
    exact = np.log(np.mean(np.exp(neg / lam)))
    sent = one["sent"][0][1]
    assert sent == pytest.approx(from_bins, abs=1e-12)
    widest = np.max(np.diff(edges)[n > 0]) / 2
    assert abs(sent - exact) <= widest / lam + 1e-12
    assert abs(sent - exact) <= 1 / (4096 * lam)


def test_the_default_objective_asks_no_count_pass(monkeypatch):
    calls = []
    monkeypatch.setattr(pauc, "refresh", lambda *a: calls.append(a))
    pauc_run(objective="auc_margin", iterations=9)
    assert calls == []


def test_two_way_runs_and_a_task_without_positives_is_refused_in_one_line(monkeypatch):
    result = pauc_run(objective="pauc_two_way")
    assert np.isfinite(result.state.v).all() and result.history[-1]["test_auc"] > result.history[0]["test_auc"]
    counts = np.zeros((1, 2, 4096), np.int64)
    counts[0, 0, 3] = 5  # negatives only, at every site

    class NegativesOnly:
        active_clients = 1

        def evaluate(self, state, split, bins):
            assert split == "train" and bins.bins == 4096
            return [ScoreHistogram(0, counts, np.full(1, np.nan), 5)]

        def configure(self, values):
            raise AssertionError("a refused pass configures nothing")

    with pytest.raises(ValueError, match=r"^objective pauc_two_way: a task has no positive training sample"):
        pauc.refresh(NegativesOnly(), result.state, np.array([0.3]), "pauc_two_way", 0.1)


@pytest.mark.slow  # in CI's slow tier: a Ray session, 10 s
def test_two_ray_actors_train_the_inline_runs_model_exactly(inline):
    from raytest import ray_session

    result, _ = inline
    with ray_session():
        remote = pauc_run(executor="ray", cpus_per_actor=0.5)
    np.testing.assert_array_equal(remote.state.v, result.state.v)
    np.testing.assert_array_equal(remote.state.alpha, result.state.alpha)
    assert [h["test_auc"] for h in remote.history] == [h["test_auc"] for h in result.history]


@pytest.mark.slow  # in CI's slow tier: a Ray session, 8 s
def test_the_collective_transport_takes_one_count_pass_per_run_of_rounds(monkeypatch):
    """Rounds the actors run back to back share the normaliser of the pass before them: fewer passes than rounds,
    one at least per run (a run ends at an evaluation, a stage start or collective_rounds)."""
    from raytest import ray_session

    states: list[int] = []
    original = pauc.refresh

    def keep(executor, state, *rest):
        states.append(state.round)
        return original(executor, state, *rest)

    monkeypatch.setattr(pauc, "refresh", keep)
    with ray_session():
        result = pauc_run(executor="ray", cpus_per_actor=0.5, transport="collective", collective_rounds=4)
    rounds = result.history[-1]["round"]
    assert rounds == 10 and 3 <= len(states) < rounds and states[0] == 0
    assert states == sorted(set(states))  # each pass from the state a run of rounds starts at
    assert np.isfinite(result.state.v).all() and result.history[-1]["test_auc"] > result.history[0]["test_auc"]
