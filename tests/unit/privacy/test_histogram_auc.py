"""The pooled test AUC from summed per-site score histograms (fdam_ray/scores/histogram.py), held to sklearn's
roc_auc_score and to an independent NumPy pair count: exact where scores sit on bin centres, within the stated
bound |AUC_hist - AUC_exact| <= sum_b pos_b neg_b / (2 P N) elsewhere, and the sites' sum equal to the pooled
histogram."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from sklearn.metrics import roc_auc_score

from fdam_ray.metrics import mean_auc, task_aucs
from fdam_ray.scores.histogram import (
    DEFAULT_BINS,
    LOGIT_RANGE,
    MAX_PASSES,
    REFINE_TOLERANCE,
    Binning,
    bin_centres,
    bin_edges,
    bin_index,
    binning_error_bound,
    check_histograms,
    pooled_auc_from_histograms,
    pooled_test_auc,
    refined_edges,
    score_histograms,
    sum_histograms,
)
from fdam_ray.scores.histogram_passes import Pooled


def _sigmoid(z: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-z))


def _pair_count_auc(bin_of_pos: np.ndarray, bin_of_neg: np.ndarray) -> float:
    """An independent oracle: every positive-negative pair compared by bin, a shared bin counting 1/2."""
    diff = bin_of_pos[:, None] - bin_of_neg[None, :]
    return float(((diff > 0).sum() + 0.5 * (diff == 0).sum()) / diff.size)


# --- the layout -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bins", [2, 6, 2**12, 2**16])
def test_the_layout_is_a_probability_grid_and_a_logit_grid_and_a_function_of_the_bin_count_alone(bins):
    edges = bin_edges(bins)
    assert edges.shape == (bins - 1,) and edges.dtype == np.float64
    assert np.all(np.diff(edges) > 0)
    half = bins // 2
    logit_grid = _sigmoid(-LOGIT_RANGE + (np.arange(half) + 0.5) * 2 * LOGIT_RANGE / half)
    expected = np.sort(np.concatenate([np.arange(1, half) / half, logit_grid]))
    np.testing.assert_allclose(edges, expected, rtol=1e-12, atol=0)
    assert np.array_equal(edges, bin_edges(bins))  # what every site computes
    assert not edges.flags.writeable
    centres = bin_centres(bins)
    assert np.array_equal(bin_index(centres, bins), np.arange(bins))
    assert np.array_equal(bin_index(edges, bins), np.arange(1, bins))  # an edge opens its bin


def test_the_bins_are_at_most_twice_as_wide_as_the_finer_grid_alone():
    bins = DEFAULT_BINS
    edges = np.concatenate(([0.0], bin_edges(bins), [1.0]))
    mid = (edges[:-1] + edges[1:]) / 2
    width = np.diff(edges)
    in_probability = 1.0 / bins  # each grid alone with all B bins
    in_logit = 2 * LOGIT_RANGE / bins * mid * (1 - mid)  # d sigmoid / dz = s (1 - s)
    inner = slice(1, -1)  # the end bins are open towards 0 and 1
    assert np.all(width[inner] <= 2.05 * np.minimum(in_probability, in_logit)[inner])
    assert width[bins // 2] < 1.2 * 2 / bins  # around 1/2 the probability grid's spacing, 8x under the logit's
    assert width[1] < 1e-8  # near 0 the logit grid's: a probability grid alone would have one bin up to 1/2048


def test_scores_at_zero_one_and_past_the_clipped_range_land_in_the_end_bins():
    b = DEFAULT_BINS
    far = np.array([0.0, _sigmoid(-40.0), _sigmoid(-LOGIT_RANGE) / 2, _sigmoid(LOGIT_RANGE) + 1e-9, 1.0 - 1e-12, 1.0])
    assert bin_index(far, b).tolist() == [0, 0, 0, b - 1, b - 1, b - 1]
    assert bin_index(np.float32([0.5]), b).tolist() == [b // 2]  # 1/2 is the edge opening the upper half


def test_the_bin_of_a_score_never_decreases_as_the_score_grows():
    rng = np.random.default_rng(3)
    s = np.sort(np.concatenate([rng.random(20000), _sigmoid(rng.normal(0, 12, 20000))]))
    assert np.all(np.diff(bin_index(s)) >= 0)
    s32 = np.sort(s.astype(np.float32))
    assert np.all(np.diff(bin_index(s32)) >= 0)


@pytest.mark.parametrize("bad", [1, 1.5, True, 5, 2**20 + 2, "4096"])
def test_a_bin_count_odd_or_outside_two_to_two_to_the_twenty_is_refused(bad):
    with pytest.raises(ValueError, match="bins="):
        bin_edges(bad)


def test_scores_that_are_not_sigmoid_outputs_are_refused():
    with pytest.raises(ValueError, match="apply the sigmoid"):
        score_histograms(np.array([[-2.0], [3.0]]), np.array([[0.0], [1.0]]))
    with pytest.raises(ValueError, match="NaN"):
        score_histograms(np.array([[np.nan], [0.3]]), np.array([[0.0], [1.0]]))
    with pytest.raises(ValueError, match="0, 1 or NaN"):
        score_histograms(np.array([[0.2], [0.3]]), np.array([[0.0], [2.0]]))


# --- (a) exact where every score sits on a bin centre -----------------------------------------------------------


@pytest.mark.parametrize("bins", [16, 2**12, 2**16])
def test_scores_on_bin_centres_give_sklearns_auc_exactly_ties_included(bins):
    rng = np.random.default_rng(bins)
    n, t = 3000, 3
    which = rng.integers(0, bins, (n, t))
    which[:, 2] = rng.integers(bins // 2 - 3, bins // 2 + 3, n)  # task 2: a handful of values, many ties
    scores = bin_centres(bins)[which]
    labels = (rng.random((n, t)) < np.array([0.1, 0.5, 0.3])).astype(np.float64)
    labels[rng.random((n, t)) < 0.2] = np.nan
    hist = score_histograms(scores, labels, bins)
    got = pooled_auc_from_histograms(hist)
    expected = task_aucs(scores, labels)
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-15)
    assert pooled_test_auc(hist) == pytest.approx(mean_auc(expected), abs=1e-15)


def test_the_auc_is_the_exact_fraction_of_pairs():
    # positives in bins 0, 2, 2, 3; negatives in bins 1, 2, 2: of the 12 pairs, the positive of bin 0 is below all 3
    # (0), those of bin 2 are above 1 and tie 2 each (2 * (1 + 2/2)), that of bin 3 is above all 3 -> 7 / 12
    hist = np.zeros((1, 2, 4), dtype=np.int64)
    hist[0, 1] = [1, 0, 2, 1]
    hist[0, 0] = [0, 1, 2, 0]
    assert pooled_auc_from_histograms(hist)[0] == 7 / 12
    assert pooled_auc_from_histograms(hist)[0] == _pair_count_auc(np.array([0, 2, 2, 3]), np.array([1, 2, 2]))
    assert binning_error_bound(hist)[0] == 4 / (2 * 12)


def test_counts_too_large_for_int64_products_stay_exact():
    big = 3 * 10**9  # P * N * 2 passes 2**63: the sum runs in Python integers
    hist = np.zeros((1, 2, 4), dtype=np.int64)
    hist[0, 0] = [big, 1, 0, 0]
    hist[0, 1] = [0, 1, big, 0]
    p = n = big + 1
    numerator2 = 1 * 2 * big + 1 * 1 + big * 2 * (big + 1)  # bin 1: 2 * big below + 1 shared; bin 2: all below
    assert pooled_auc_from_histograms(hist)[0] == numerator2 / (2 * p * n)


# --- (b) ties and extremes --------------------------------------------------------------------------------------


def test_all_scores_equal_give_one_half():
    labels = np.array([0, 1, 0, 1, 1, 0, 0], dtype=np.float64)
    for value in (0.0, 0.3, 1.0):
        hist = score_histograms(np.full(7, value), labels)
        assert pooled_auc_from_histograms(hist)[0] == 0.5 == roc_auc_score(labels, np.full(7, value))
        assert binning_error_bound(hist)[0] == 0.5


def test_scores_at_zero_and_one_and_past_the_clipped_range_match_sklearn():
    scores = np.array([0.0, 0.0, 1e-30, _sigmoid(-20.0), 0.5, 1.0 - 1e-9, 1.0, 1.0, 1.0])
    labels = np.array([0, 1, 0, 1, 0, 1, 0, 1, 1], dtype=np.float64)
    hist = score_histograms(scores, labels)
    exact = roc_auc_score(labels, scores)
    got = pooled_auc_from_histograms(hist)[0]
    # the four scores under sigmoid(-L) share bin 0 (pairs 1e-30 vs sigmoid(-20) and the two zeros vs them),
    # the four scores over sigmoid(L) share the top bin: only those pairs may differ from sklearn
    assert abs(got - exact) <= binning_error_bound(hist)[0]
    pos_bins, neg_bins = bin_index(scores[labels == 1]), bin_index(scores[labels == 0])
    assert got == _pair_count_auc(pos_bins, neg_bins)


def test_a_task_with_one_class_is_nan_and_left_out_of_the_mean_as_metrics_does():
    rng = np.random.default_rng(5)
    scores = rng.random((40, 3))
    labels = (rng.random((40, 3)) < 0.4).astype(np.float64)
    labels[:, 1] = np.where(rng.random(40) < 0.5, np.nan, 1.0)  # task 1: positives only
    labels[:, 2] = np.nan  # task 2: no label at all
    hist = score_histograms(scores, labels)
    aucs = pooled_auc_from_histograms(hist)
    assert math.isnan(aucs[1]) and math.isnan(aucs[2])
    assert np.isnan(task_aucs(scores, labels)[1:]).all()
    assert pooled_test_auc(hist) == aucs[0]
    assert hist[2].sum() == 0 and hist[1, 0].sum() == 0 and hist[1, 1].sum() == np.sum(labels[:, 1] == 1)
    assert math.isnan(pooled_test_auc(np.zeros((2, 2, 8), dtype=np.int64)))


def test_samples_without_a_label_for_a_task_are_left_out_of_that_task_only():
    scores = np.array([[0.9, 0.1], [0.2, 0.8], [0.6, 0.4]])
    labels = np.array([[1, np.nan], [0, 1], [np.nan, 0]], dtype=np.float64)
    hist = score_histograms(scores, labels)
    assert hist[:, 1].sum(axis=1).tolist() == [1, 1] and hist[:, 0].sum(axis=1).tolist() == [1, 1]
    assert hist[0, 1, bin_index(np.array([0.9]))[0]] == 1 and hist[1, 0, bin_index(np.array([0.4]))[0]] == 1
    assert pooled_auc_from_histograms(hist).tolist() == [1.0, 1.0]


def test_one_task_scores_as_a_vector_are_one_task():
    scores, labels = np.array([0.1, 0.7, 0.4]), np.array([0.0, 1.0, 1.0])
    assert score_histograms(scores, labels).shape == (1, 2, DEFAULT_BINS)
    assert pooled_test_auc(score_histograms(scores, labels)) == 1.0


# --- (c) continuous scores: within the bound --------------------------------------------------------------------


def _realistic(rng: np.random.Generator, n: int, t: int) -> tuple[np.ndarray, np.ndarray]:
    """float32 sigmoid scores of logits that separate the classes by task-dependent amounts, imbalanced labels."""
    labels = (rng.random((n, t)) < np.linspace(0.05, 0.5, t)).astype(np.float64)
    shift = np.linspace(0.5, 6.0, t)
    logits = rng.normal(0, np.linspace(1.0, 4.0, t), (n, t)) + np.where(labels == 1, shift, -shift)
    labels[rng.random((n, t)) < 0.1] = np.nan
    return _sigmoid(logits).astype(np.float32), labels


@pytest.mark.parametrize("bins", [64, 2**12, 2**16])
def test_continuous_scores_stay_within_the_shared_bin_bound(bins):
    rng = np.random.default_rng(11)
    scores, labels = _realistic(rng, 4000, 5)
    hist = score_histograms(scores, labels, bins)
    got, bound, exact = pooled_auc_from_histograms(hist), binning_error_bound(hist), task_aucs(scores, labels)
    assert np.all(np.abs(got - exact) <= bound + 1e-15)
    if bins == 64:
        assert np.any(np.abs(got - exact) > 0)  # the bound is not met trivially by an exact answer
    for t in range(scores.shape[1]):  # the histogram AUC is the pair count by bin, recomputed pair by pair
        keep = ~np.isnan(labels[:, t])
        s, y = scores[keep, t], labels[keep, t]
        assert got[t] == pytest.approx(_pair_count_auc(bin_index(s[y == 1], bins), bin_index(s[y == 0], bins)),
                                       abs=1e-12)


def test_finer_bins_bring_the_auc_closer_and_the_default_within_a_ten_thousandth():
    rng = np.random.default_rng(12)
    scores, labels = _realistic(rng, 20000, 4)
    exact = task_aucs(scores, labels)
    bounds = [binning_error_bound(score_histograms(scores, labels, 2**k)) for k in (8, 12, 16)]
    assert np.all(bounds[0] > bounds[1]) and np.all(bounds[1] > bounds[2])
    errors = np.abs(pooled_auc_from_histograms(score_histograms(scores, labels)) - exact)
    assert errors.max() < 1e-4


# --- (d) sites' histograms add up to the pooled one -------------------------------------------------------------


def test_the_sum_of_the_sites_histograms_is_the_histogram_of_the_pooled_scores():
    rng = np.random.default_rng(21)
    scores, labels = _realistic(rng, 3000, 3)
    cuts = [0, 100, 1100, 1105, 3000]  # uneven sites, one of five samples
    parts = [score_histograms(scores[a:b], labels[a:b]) for a, b in itertools.pairwise(cuts)]
    total = sum_histograms(parts)
    pooled = score_histograms(scores, labels)
    assert total.dtype == np.int64 and np.array_equal(total, pooled)
    assert np.array_equal(pooled_auc_from_histograms(total), pooled_auc_from_histograms(pooled))
    np.testing.assert_allclose(pooled_auc_from_histograms(total), task_aucs(scores, labels),
                               atol=float(np.max(binning_error_bound(total))))
    assert not np.array_equal(parts[0], total)  # the parts differ from their sum (the test is not vacuous)


def test_a_site_histogram_of_the_wrong_shape_or_kind_is_refused():
    good = np.zeros((2, 2, 16), dtype=np.int64)
    with pytest.raises(ValueError, match="16 bins; expected 32"):
        check_histograms(good, bins=32)
    with pytest.raises(ValueError, match="expected 3"):
        sum_histograms([np.zeros((3, 2, 16), dtype=np.int64), good])
    with pytest.raises(ValueError, match="shape"):
        check_histograms(np.zeros((2, 3, 16), dtype=np.int64))
    with pytest.raises(ValueError, match="integer"):
        check_histograms(good.astype(np.float64))
    with pytest.raises(ValueError, match="negative"):
        check_histograms(good - 1)
    with pytest.raises(ValueError, match="no histogram"):
        sum_histograms([])


# -- refinement passes: the driver cuts the pooled cells that hold both classes ----------------------------------

def _passes(s: np.ndarray, y: np.ndarray, bins: int = DEFAULT_BINS, most: int = MAX_PASSES) -> list[Pooled]:
    """The driver's passes over the scores ``s`` (labels ``y``) as sites send them: the pooled cells after each."""
    pooled = [Pooled.first(score_histograms(s, y, bins), bins)]
    while len(pooled) < most and (again := pooled[-1].refinement()) is not None:
        pooled.append(pooled[-1].add(score_histograms(s, y, again), again))
    return pooled


def test_a_refined_layout_cuts_only_its_ranges_and_is_monotone():
    edges = refined_edges([(0.2, 0.3), (0.6, 0.61)], 64)
    assert edges.shape == (63,) and np.all(np.diff(edges) >= 0)
    assert edges[0] == 0.2 and edges[-1] == 0.61 and 0.3 in edges and 0.6 in edges  # 3 outer bins
    assert Binning.of_ranges(64, [[(0.2, 0.3), (0.6, 0.61)], []]).ranges(1) == []
    with pytest.raises(ValueError):
        refined_edges([(0.3, 0.2)], 64)


def test_the_ranges_are_the_runs_of_cells_holding_both_classes():
    bins = 16
    hist = np.zeros((1, 2, bins), np.int64)
    hist[0, 0, [2, 3, 4, 9]] = 1
    hist[0, 1, [3, 4, 7, 9]] = 1  # mixed: 3, 4 (one run) and 9
    again = Pooled.first(hist, bins).refinement()
    edges = np.concatenate(([0.0], bin_edges(bins), [1.0]))
    assert again is not None and again.ranges(0) == [(edges[3], edges[5]), (edges[9], edges[10])]


@pytest.mark.parametrize("seed", range(3))
def test_scores_spread_over_zero_one_are_within_1e5_after_the_passes(seed):
    rng = np.random.default_rng(seed)
    y = (rng.random(10**4) < 0.5).astype(float)
    s = _sigmoid(rng.normal(0.0, 2.0, y.size) + y).astype(np.float32)  # two normals in logit, overlapping
    pooled = _passes(s, y)
    want = roc_auc_score(y, s)
    assert pooled[0].bounds()[0] > 1e-4  # one pass: 2e-4
    assert abs(pooled[-1].aucs()[0] - want) <= pooled[-1].bounds()[0] <= REFINE_TOLERANCE
    assert all(b.bounds()[0] <= a.bounds()[0] for a, b in itertools.pairwise(pooled))


def test_an_untrained_models_band_is_within_1e5():
    rng = np.random.default_rng(0)
    y = (rng.random(540) < 0.5).astype(float)
    s = (0.4903 + 0.0053 * rng.random(540) + 0.0005 * y).astype(np.float32)
    pooled = _passes(s, y)
    assert len(pooled) >= 2 and abs(pooled[-1].aucs()[0] - roc_auc_score(y, s)) <= pooled[-1].bounds()[0] <= 1e-5


def test_equal_scores_of_both_classes_stop_the_passes_and_keep_their_bound():
    rng = np.random.default_rng(1)
    y = (rng.random(2000) < 0.5).astype(float)
    s = np.where(rng.random(2000) < 0.3, 0.5, 0.49 + 0.02 * rng.random(2000)).astype(np.float32)
    pooled = _passes(s, y, most=50)
    assert len(pooled) < MAX_PASSES and pooled[-1].refinement() is None  # stopped, not cut off
    tied = s == np.float32(0.5)
    pairs = (y == 1).sum() * (y == 0).sum()
    share = (y[tied] == 1).sum() * (y[tied] == 0).sum() / (2 * pairs)
    assert share <= pooled[-1].bounds()[0] < share + 1e-5  # the ties' share, honestly: no pass can split them
    assert abs(pooled[-1].aucs()[0] - roc_auc_score(y, s)) <= pooled[-1].bounds()[0]


@pytest.mark.parametrize("seed", range(20))
def test_the_bound_holds_at_every_pass(seed):
    rng = np.random.default_rng(seed)
    n, bins = int(rng.integers(20, 3000)), int(rng.choice([4, 16, 256, 4096]))
    y = (rng.random(n) < rng.uniform(0.05, 0.95)).astype(float)
    y[:2] = (0, 1)
    z = rng.normal(0, rng.uniform(0.01, 5), n) + y * rng.uniform(0, 2)
    s = _sigmoid(z).astype(rng.choice([np.float32, np.float64]))
    if seed % 3 == 0:
        s[rng.random(n) < 0.2] = s[0]  # ties across classes
    want = roc_auc_score(y, s)
    for pooled in _passes(s, y, bins):
        assert abs(pooled.aucs()[0] - want) <= pooled.bounds()[0] + 1e-12


def test_a_pass_whose_counts_disagree_is_not_combined():
    rng = np.random.default_rng(2)
    y = (rng.random(500) < 0.5).astype(float)
    s = (0.49 + 0.02 * rng.random(500)).astype(np.float32)
    first = Pooled.first(score_histograms(s, y), DEFAULT_BINS)
    again = first.refinement()
    assert again is not None
    missing = first.add(score_histograms(s[:400], y[:400], again), again)  # a site missing from pass 2
    assert missing.tasks[0].final and missing.refinement() is None
    np.testing.assert_array_equal(missing.aucs(), first.aucs())
