"""``test_scores: histogram`` without Ray: the config fields, what a client sends (:meth:`Client.score_histogram`),
what crosses from the inline executor, and the driver's pooled AUC from the summed counts (Evaluator)."""

from __future__ import annotations

import dataclasses
import logging
import math

import numpy as np
import pytest
import torch
from sklearn.metrics import roc_auc_score

from fdam_ray.clients.client import Client, ClientSection, Replica
from fdam_ray.config import ConfigError, build_config
from fdam_ray.core.state import GlobalState, ScoreHistogram, Scores
from fdam_ray.data import make_source
from fdam_ray.data.arrays import ArraysSource
from fdam_ray.executors.base import ExecutorSetup
from fdam_ray.executors.inline import InlineExecutor
from fdam_ray.loop.evaluation import Evaluator, one_class_lines, one_class_problems
from fdam_ray.privacy.section import PrivacySection
from fdam_ray.scores.histogram import (
    MAX_PASSES,
    Binning,
    bin_edges,
    binning_error_bound,
    pooled_auc_from_histograms,
    sum_histograms,
)
from fdam_ray.scores.histogram_passes import Pooled

CPU = torch.device("cpu")
TASKS = 3


def multitask_source(seed: int = 0) -> ArraysSource:
    """Three clients of 3-task data with missing labels (NaN), each with a test split of its own (no global test
    set): the clients' test splits together are the test set."""
    rng = np.random.default_rng(seed)
    u = rng.standard_normal((6, TASKS))

    def pair(n: int, missing: float) -> tuple[np.ndarray, np.ndarray]:
        x = rng.standard_normal((n, 6)).astype(np.float32)
        y = (x @ u + 0.8 * rng.standard_normal((n, TASKS)) > 0.4).astype(np.float32)
        y[rng.random((n, TASKS)) < missing] = np.nan
        return x, y

    return ArraysSource([pair(60, 0.0) for _ in range(3)], None, [pair(n, 0.15) for n in (90, 41, 7)])


def config_of(**kw):
    return build_config(dict(dataset="arrays", num_clients=3, model="mlp", model_width=8, batch_size=16,
                             executor="inline", tensorboard=False, **kw))


@pytest.fixture(scope="module")
def started():
    """An inline executor on :func:`multitask_source` and a global state that scores the samples apart (the
    initial one moved by a seeded perturbation)."""
    config = config_of(test_scores="histogram")
    source = multitask_source()
    executor = InlineExecutor()
    executor.start(ExecutorSetup.for_config(config), source)
    replica = Replica(ClientSection.of(config), source, device=CPU)
    state = replica.flat.initial_state()
    state.v = (state.v + 0.5 * np.random.default_rng(1).standard_normal(state.v.shape)).astype(np.float32)
    yield config, source, executor, replica, state
    executor.shutdown()


# -- the config ---------------------------------------------------------------------------------------------------

def test_the_fields_default_to_exact_and_give_bins_only_with_histogram():
    assert PrivacySection.of(config_of()).histogram_bins is None
    assert PrivacySection.of(config_of(test_scores="histogram")).histogram_bins == 4096
    assert PrivacySection.of(config_of(test_scores="histogram", test_score_bins=2)).histogram_bins == 2
    assert PrivacySection.of(config_of(test_scores="histogram", test_score_bins=2**20)).histogram_bins == 2**20


@pytest.mark.parametrize("bins", [0, 3, 4097, 2**20 + 2, -4, True])
def test_bins_that_are_not_an_even_integer_in_range_are_refused(bins):
    with pytest.raises(ConfigError, match="test_score_bins"):
        config_of(test_scores="histogram", test_score_bins=bins)


def test_bins_set_while_scores_are_exact_are_refused_and_an_unknown_mode_too():
    with pytest.raises(ConfigError, match=r"test_score_bins.*while test_scores = exact"):
        config_of(test_score_bins=1024)
    with pytest.raises(ConfigError, match="test_scores"):
        config_of(test_scores="noisy")


def test_both_fields_may_change_on_resume():
    fields = {f.name: f for f in dataclasses.fields(PrivacySection)}
    assert fields["test_scores"].metadata["fdam_ray.setting"].resume
    assert fields["test_score_bins"].metadata["fdam_ray.setting"].resume


# -- what a client sends ------------------------------------------------------------------------------------------

def test_a_clients_histogram_is_the_numpy_count_of_its_scores_and_its_auc_is_sklearns(started):
    config, source, _, _, state = started
    client = Client(ClientSection.of(config), source, 0, device=CPU)
    bins = 64
    sent = client.score_histogram(state, "test", bins)
    scores = client.evaluate(state)
    assert sent is not None and scores is not None
    edges = bin_edges(bins)
    for t in range(TASKS):  # an independent count: np.histogram over [0, edges..., 1] per class
        keep = ~np.isnan(scores.labels[:, t])
        s, y = scores.scores[keep, t].astype(np.float64), scores.labels[keep, t]
        for c in (0, 1):
            idx = np.searchsorted(edges, s[y == c], side="right")
            np.testing.assert_array_equal(sent.counts[t, c], np.bincount(idx, minlength=bins))
        assert sent.task_auc[t] == roc_auc_score(y, s.astype(np.float32))
    assert sent.samples == len(scores.labels) == 90 and sent.nan_outputs == 0
    assert sent.counts.dtype == np.int64 and sent.counts.sum() == int((~np.isnan(scores.labels)).sum())


def test_what_crosses_from_the_clients_holds_no_per_sample_array(started):
    _, _, executor, _, state = started
    first = executor.evaluate(state, split="test", bins=Binning(256))
    again = Pooled.first(sum_histograms([h.counts for h in first]), 256).refinement()
    assert again is not None and again.refined  # pass 2: the driver's ranges per task, from the summed counts
    second = executor.evaluate(state, split="test", bins=again)
    for got in (first, second):
        assert [type(h) for h in got] == [ScoreHistogram] * 3
        assert [h.client_id for h in got] == [0, 1, 2] and [h.samples for h in got] == [90, 41, 7]
        for h in got:
            for field in dataclasses.fields(h):
                value = getattr(h, field.name)
                if isinstance(value, np.ndarray):  # only the counts (T, 2, B) and the AUC per task (T,)
                    assert value.shape in ((TASKS, 2, 256), (TASKS,)), field.name
                else:
                    assert isinstance(value, int), field.name
    for a, b in zip(first, second, strict=True):  # the same samples, counted in other bins; the same own AUCs
        np.testing.assert_array_equal(a.counts.sum(-1), b.counts.sum(-1))
        np.testing.assert_array_equal(a.task_auc, b.task_auc)
    exact = executor.evaluate(state)  # without bins: the scores, as before
    assert [type(s) for s in exact] == [Scores] * 3


# -- the driver ---------------------------------------------------------------------------------------------------

class Recording:
    """The executor's evaluate calls as made (the rest goes to the inline executor)."""

    def __init__(self, inner: InlineExecutor) -> None:
        self.inner, self.calls = inner, []

    def evaluate(self, *args, **kwargs):
        self.calls.append((args[1:], kwargs))
        return self.inner.evaluate(*args, **kwargs)

    def score_test_set(self, state: GlobalState) -> None:
        return None


def driver_passes(executor, state, bins: int) -> tuple[list[Binning], np.ndarray, np.ndarray]:
    """The driver's passes recomputed: pass 1 on the fixed layout, then each cutting the cells that hold both
    classes while the bound is too wide; (the binnings asked, the AUC and bound per task of every pass together)."""
    total = sum_histograms([h.counts for h in executor.evaluate(state, bins=Binning(bins))])
    asked, pooled = [Binning(bins)], Pooled.first(total, bins)
    while len(asked) < MAX_PASSES and (again := pooled.refinement()) is not None:
        asked.append(again)
        pooled = pooled.add(sum_histograms([h.counts for h in executor.evaluate(state, bins=again)]), again)
    return asked, pooled.aucs(), pooled.bounds()


@pytest.mark.parametrize("bins", [16, 4096])
def test_the_pooled_auc_is_within_the_bound_and_the_client_aucs_are_the_exact_ones(started, bins):
    _, source, executor, replica, state = started
    exact_calls, hist_calls = Recording(executor), Recording(executor)
    exact = Evaluator(replica, source, exact_calls)(state)  # type: ignore[arg-type]
    hist = Evaluator(replica, source, hist_calls, histogram_bins=bins)(state)  # type: ignore[arg-type]
    assert exact_calls.calls == [((), {})]  # exact: called as before the histograms existed
    assert hist["client_auc"] == exact["client_auc"] and hist["test_samples"] == exact["test_samples"] == 138
    total = sum_histograms([h.counts for h in executor.evaluate(state, bins=Binning(bins))])
    asked, _, bound = driver_passes(executor, state, bins)
    assert repr(hist_calls.calls) == repr([((), {"split": "test", "bins": b}) for b in asked])  # (NaN ranges)
    assert np.all(bound <= binning_error_bound(total))
    for name in exact["task_auc"]:
        t = list(exact["task_auc"]).index(name)
        assert abs(hist["task_auc"][name] - exact["task_auc"][name]) <= bound[t] + 1e-6  # (6 decimals kept)
    assert abs(hist["test_auc"] - exact["test_auc"]) <= bound.mean() + 1e-12
    if bins == 16:
        assert hist["test_auc"] != exact["test_auc"]  # coarse bins: the bound is not met trivially
    scores = executor.evaluate(state)
    labels = np.concatenate([s.labels for s in scores])
    pooled = np.concatenate([s.scores for s in scores])
    want = np.mean([roc_auc_score(labels[~np.isnan(labels[:, t]), t], pooled[~np.isnan(labels[:, t]), t])
                    for t in range(TASKS)])
    assert exact["test_auc"] == pytest.approx(want, abs=1e-15)


def test_validation_parts_are_sent_as_histograms_too():
    config = config_of(test_scores="histogram", val_fraction=0.3, augment=False)
    source = multitask_source(seed=4)
    executor = InlineExecutor()
    executor.start(ExecutorSetup.for_config(config), source)
    try:
        replica = Replica(ClientSection.of(config), source, device=CPU)
        state = replica.flat.initial_state()
        recorded = Recording(executor)
        exact = Evaluator(replica, source, executor, validation=True)(state)
        hist = Evaluator(replica, source, recorded, validation=True, histogram_bins=2**16)(state)  # type: ignore
    finally:
        executor.shutdown()
    val = [kw for _, kw in recorded.calls if kw["split"] == "val"]
    assert val[0] == {"split": "val", "bins": Binning(2**16)} and all(kw["bins"].refined for kw in val[1:])
    assert hist["val_client_auc"] == exact["val_client_auc"] and hist["val_samples"] == exact["val_samples"] > 0
    assert abs(hist["val_auc"] - exact["val_auc"]) < 1e-3


class Sends:
    """An executor whose clients send the given records (on every pass), recording the bins asked for."""

    def __init__(self, parts: list) -> None:
        self.parts, self.asked = parts, []

    def evaluate(self, state, split="test", bins=None):
        self.asked.append(bins)
        return self.parts

    def score_test_set(self, state):
        return None


def histogram(client_id: int, positives: list[int], negatives: list[int], nan: int = 0) -> ScoreHistogram:
    counts = np.zeros((1, 2, 4), np.int64)
    counts[0, 1], counts[0, 0] = positives, negatives
    return ScoreHistogram(client_id, counts, np.array([np.nan]), int(counts.sum()) + nan, nan)


def test_the_driver_sums_the_clients_counts_into_the_closed_form_auc():
    config = build_config(dict(dataset="synthetic", model="mlp", num_clients=2, executor="inline"))
    source = make_source(config)
    replica = Replica(ClientSection.of(config), source, device=CPU)
    parts = [histogram(0, [0, 1, 0, 1], [1, 0, 1, 0]), histogram(1, [0, 0, 1, 0], [0, 1, 0, 0])]
    out = Evaluator(replica, source, Sends(parts), histogram_bins=4)(replica.flat.initial_state())  # type: ignore
    # pooled: positives in bins 1, 2, 3; negatives in bins 0, 1, 2. Pairs (pos, neg) by bins: (1,0) 1, (1,1) 1/2,
    # (1,2) 0; (2,0) 1, (2,1) 1, (2,2) 1/2; (3,·) 3 -> 7 of 9.
    assert out["test_auc"] == 7 / 9 and out["test_samples"] == 6
    assert out["client_auc"] == {"0": None, "1": None}  # the clients' own AUCs, as sent (NaN here)


def test_a_client_with_nan_outputs_is_refused_naming_the_model():
    config = build_config(dict(dataset="synthetic", model="mlp", num_clients=2, executor="inline"))
    source = make_source(config)
    replica = Replica(ClientSection.of(config), source, device=CPU)
    parts = [histogram(0, [0, 1, 0, 1], [1, 0, 1, 0]), histogram(1, [0, 0, 0, 0], [0, 0, 0, 0], nan=5)]
    with pytest.raises(ValueError, match=r"model 'mlp': its outputs were NaN for 5 of 5 samples of client 1's test "
                                         r"split while its weights are finite"):
        Evaluator(replica, source, Sends(parts), histogram_bins=4)(replica.flat.initial_state())  # type: ignore


def test_a_client_with_nan_outputs_sends_no_counts(started):
    config, source, _, _, state = started
    client = Client(ClientSection.of(config), source, 2, device=CPU)
    nan_state = dataclasses.replace(state, v=np.full_like(state.v, np.nan))
    sent = client.score_histogram(nan_state, "test", 8)
    assert sent is not None and sent.nan_outputs == sent.samples == 7
    assert not sent.counts.any() and np.isnan(sent.task_auc).all()


def test_one_class_sets_are_found_from_counts_as_from_labels(caplog):
    labels = np.array([[1, 0, np.nan], [1, np.nan, 0], [1, 0, 0]], dtype=np.float32)
    names = ("a", "b", "c")
    from_labels = one_class_problems([("set", labels, "its AUC")], names)
    counts = (np.array([3, 0, 0]), np.array([0, 2, 2]))
    assert one_class_lines([("set", counts, "its AUC")], names) == from_labels and len(from_labels) == 3
    config = build_config(dict(dataset="synthetic", model="mlp", num_clients=2, executor="inline"))
    source = make_source(config)
    replica = Replica(ClientSection.of(config), source, device=CPU)
    parts = [histogram(0, [0, 1, 0, 1], [0, 0, 0, 0]), histogram(1, [0, 0, 1, 0], [0, 1, 0, 0])]
    with caplog.at_level(logging.WARNING):
        Evaluator(replica, source, Sends(parts), histogram_bins=4)(replica.flat.initial_state())  # type: ignore
    assert "client 0's test split has 2 positives and 0 negatives, so client 0's AUC is NaN" in caplog.text
    assert "pooled test set" not in caplog.text  # the sum holds both classes


# -- the second pass ----------------------------------------------------------------------------------------------

def test_the_driver_asks_a_second_pass_only_when_the_first_ones_bound_exceeds_the_tolerance():
    config = build_config(dict(dataset="synthetic", model="mlp", num_clients=2, executor="inline"))
    source = make_source(config)
    replica = Replica(ClientSection.of(config), source, device=CPU)
    apart = Sends([histogram(0, [0, 0, 1, 1], [1, 1, 0, 0]), histogram(1, [0, 0, 0, 1], [1, 0, 0, 0])])
    out = Evaluator(replica, source, apart, histogram_bins=4)(replica.flat.initial_state())  # type: ignore
    assert apart.asked == [Binning(4)] and out["test_auc"] == 1.0  # bound 0: one pass
    shared = Sends([histogram(0, [0, 1, 0, 1], [1, 0, 1, 0]), histogram(1, [0, 0, 1, 0], [0, 1, 0, 0])])
    out = Evaluator(replica, source, shared, histogram_bins=4)(replica.flat.initial_state())  # type: ignore
    edges = np.concatenate(([0.0], bin_edges(4), [1.0]))
    assert shared.asked[:2] == [Binning(4), Binning(4, (edges[1], math.nan), (edges[3], math.nan))]  # bins 1, 2 mixed
    assert out["test_auc"] == 7 / 9  # every pass sent the same counts here (all in bin 1 or 2 of the next)


def test_an_untrained_models_band_of_scores_is_read_far_closer_after_the_second_pass(started):
    """Evaluation 0: every score within a few hundredths of 1/2. With 138 test samples one positive-negative pair
    weighs up to 3e-4 here, so 1e-4 cannot be asked of this small set (test_histogram_auc holds a 540-sample band
    to it); what is asked: the driver takes the second pass, its AUC is within the bound of the pass it chose, and
    that bound and the error are well below pass 1's."""
    _, source, executor, replica, _ = started
    state = replica.flat.initial_state()
    state.v = (0.5 * state.v + 0.03 * np.random.default_rng(5).standard_normal(state.v.shape)).astype(np.float32)
    scores = executor.evaluate(state)
    pooled, labels = np.concatenate([s.scores for s in scores]), np.concatenate([s.labels for s in scores])
    assert np.ptp(pooled, axis=0).max() < 0.03 and abs(float(np.median(pooled)) - 0.5) < 0.05  # a band near 1/2
    recorded = Recording(executor)
    exact = Evaluator(replica, source, executor)(state)
    hist = Evaluator(replica, source, recorded, histogram_bins=4096)(state)  # type: ignore[arg-type]
    asked, auc, bound = driver_passes(executor, state, 4096)
    assert len(recorded.calls) == len(asked) >= 2 and recorded.calls[1][1]["bins"].refined
    first = sum_histograms([h.counts for h in executor.evaluate(state, bins=Binning(4096))])
    want = np.array([roc_auc_score(labels[~np.isnan(labels[:, t]), t], pooled[~np.isnan(labels[:, t]), t])
                     for t in range(TASKS)])
    assert np.all(np.abs(auc - want) <= bound + 1e-15)
    assert np.all(bound < binning_error_bound(first) / 2)
    one_pass = np.abs(pooled_auc_from_histograms(first) - want)
    assert one_pass.max() > 1e-3 and np.abs(auc - want).max() < one_pass.max() / 3
    assert abs(hist["test_auc"] - float(np.mean(auc))) < 1e-15 and hist["client_auc"] == exact["client_auc"]


def test_a_binning_travels_through_a_flower_header_unchanged():
    records = pytest.importorskip("fdam_ray.flower.records")
    for sent in (Binning(4096), Binning(64, (0.25, float("nan")), (0.75, float("nan")))):
        header = records.binning_header(sent)
        got = records.binning_of_header(records.config(header))
        assert got.bins == sent.bins and set(header) <= {"bins", "bins_lo", "bins_hi"}
        np.testing.assert_array_equal(np.array(got.lo, dtype=float) if got.lo else [],
                                      np.array(sent.lo, dtype=float) if sent.lo else [])
        np.testing.assert_array_equal(np.array(got.hi, dtype=float) if got.hi else [],
                                      np.array(sent.hi, dtype=float) if sent.hi else [])
