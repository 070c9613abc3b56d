"""The pooled test AUC from summed per-site score histograms (fdam_ray/privacy/histogram.py), held to sklearn's
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
from fdam_ray.privacy.histogram import (
    DEFAULT_BINS,
    LOGIT_RANGE,
    REFINE_TOLERANCE,
    Binning,
    bin_centres,
    bin_edges,
    bin_index,
    binning_error_bound,
    check_histograms,
    finer_aucs,
    occupied_range,
    pooled_auc_from_histograms,
    pooled_test_auc,
    refined_edges,
    refinement,
    score_histograms,
    sum_histograms,
)


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


# -- two passes: the driver's refinement over the pooled occupied range ---------------------------------------------

def _band(n: int = 540, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """An untrained model's scores: float32, all in the default job's first-evaluation band [0.4903, 0.4956],
    labels weakly tied to them (AUC about 0.3, as measured there)."""
    rng = np.random.default_rng(seed)
    s = (0.4903 + 0.0053 * rng.random(n)).astype(np.float32)
    y = (rng.random(n) < 0.5 - 40 * (s - 0.493)).astype(np.float64)
    return s, y


def test_refined_edges_are_equal_steps_in_logit_from_lo_to_hi():
    lo, hi, bins = 0.4903, 0.4956, 64
    edges = refined_edges(lo, hi, bins)
    assert edges.shape == (bins - 1,) and edges[0] == lo and edges[-1] == hi and not edges.flags.writeable
    z = np.log(edges / (1 - edges))
    np.testing.assert_allclose(np.diff(z), (math.log(hi / (1 - hi)) - math.log(lo / (1 - lo))) / (bins - 2),
                               rtol=1e-6)
    # the ends of [0, 1] (a pass-1 end bin occupied) become sigmoid(-/+2L): finite logits, every edge inside (0, 1)
    wide = refined_edges(0.0, 1.0, 4096)
    assert wide[0] == pytest.approx(_sigmoid(np.array(-2 * LOGIT_RANGE)), rel=1e-12) and wide[-1] < 1
    assert np.all(np.diff(wide) > 0)
    with pytest.raises(ValueError, match="lo < hi"):
        refined_edges(0.5, 0.5, 64)


def test_a_binning_is_checked_and_names_its_layout_per_task():
    both = Binning(64, (0.25, math.nan), (0.75, math.nan))
    assert both.refined and not Binning(64).refined and not Binning(64, (math.nan,), (math.nan,)).refined
    np.testing.assert_array_equal(both.edges(0), refined_edges(0.25, 0.75, 64))
    assert both.edges(1) is bin_edges(64)  # NaN: the fixed layout
    assert Binning(64, (0.25,), (0.75,)) == Binning(64, (0.25,), (0.75,))  # plain values: compares and hashes
    for lo, hi in [((0.5,), None), ((0.5, 0.1), (0.6,)), ((0.6,), (0.5,)), ((-0.1,), (0.5,)), ((0.5,), (1.5,)),
                   ((math.nan,), (0.5,))]:
        with pytest.raises(ValueError):
            Binning(64, lo, hi)
    with pytest.raises(ValueError):
        Binning(3)
    with pytest.raises(ValueError, match="ranges for 1 tasks"):
        score_histograms(np.full((4, 2), 0.5), np.zeros((4, 2)), Binning(64, (0.25,), (0.75,)))


def test_the_occupied_range_is_the_outer_edges_of_the_lowest_and_highest_counted_bins():
    bins = 16
    edges = np.concatenate(([0.0], bin_edges(bins), [1.0]))
    hist = np.zeros((3, 2, bins), np.int64)
    hist[0, 0, 5], hist[0, 1, 9] = 2, 1  # task 0: bins 5..9
    hist[1, 1, 0], hist[1, 0, bins - 1] = 1, 1  # task 1: both end bins
    lo, hi = occupied_range(hist, bins)
    assert (lo[0], hi[0]) == (edges[5], edges[10]) and (lo[1], hi[1]) == (0.0, 1.0)
    assert np.isnan(lo[2]) and np.isnan(hi[2])  # task 2: no counts
    # every binned score lies in [lo, hi): from real scores
    s, y = _band()
    lo, hi = occupied_range(score_histograms(s, y), DEFAULT_BINS)
    assert lo[0] <= s.min() and s.max() < hi[0] and hi[0] - lo[0] < 0.007


def test_a_second_pass_is_asked_only_for_tasks_whose_bound_exceeds_the_tolerance():
    bins = 16
    apart = np.zeros((1, 2, bins), np.int64)
    apart[0, 0, 3], apart[0, 1, 12] = 5, 5  # no pair shares a bin: bound 0
    assert binning_error_bound(apart)[0] == 0 and refinement(apart, bins) is None
    shared = apart.copy()
    shared[0, 1, 3] = 1  # one pair of 30 in a bin: bound 5 / 60
    two = np.concatenate([apart, shared, np.zeros((1, 2, bins), np.int64)])
    again = refinement(two, bins)
    assert again is not None and again.bins == bins and again.refined
    edges = np.concatenate(([0.0], bin_edges(bins), [1.0]))
    assert math.isnan(again.lo[0]) and math.isnan(again.lo[2])  # within tolerance / no class: the fixed layout
    assert (again.lo[1], again.hi[1]) == (edges[3], edges[13])
    # the tolerance is what decides: a bound just above asks, just below does not
    bound = binning_error_bound(shared)[0]
    assert refinement(shared, bins, tolerance=bound * 1.001) is None and refinement(shared, bins, bound * 0.999)
    assert REFINE_TOLERANCE == 1e-5


def test_evaluation_zero_of_an_untrained_model_is_within_1e4_after_the_second_pass():
    s, y = _band()
    exact = roc_auc_score(y, s)
    sites = np.array_split(np.arange(len(s)), 4)  # four sites; only counts are summed
    first = sum_histograms([score_histograms(s[i], y[i]) for i in sites])
    assert abs(pooled_auc_from_histograms(first)[0] - exact) > 1e-3  # the fixed layout alone misses
    again = refinement(first, DEFAULT_BINS)
    assert again is not None
    second = sum_histograms([score_histograms(s[i], y[i], again) for i in sites])
    np.testing.assert_array_equal(second, score_histograms(s, y, again))  # the sum is the pooled histogram
    assert second[0].sum() == len(s) and second[0, :, 0].sum() == second[0, :, -1].sum() == 0  # outer bins empty
    auc, bound = finer_aucs(first, second)
    assert abs(auc[0] - exact) <= bound[0] + 1e-15 and bound[0] < binning_error_bound(first)[0] / 100
    assert abs(auc[0] - exact) <= 1e-4
    # pass 2 is the pair count over its own bins (the independent oracle)
    idx = np.searchsorted(again.edges(0), s, side="right")
    assert auc[0] == pytest.approx(_pair_count_auc(idx[y == 1], idx[y == 0]), abs=1e-15)


def test_the_finer_pass_is_taken_per_task_and_a_pass_missing_a_site_is_not():
    bins = 16
    first = np.zeros((2, 2, bins), np.int64)
    first[:, 0, 4], first[:, 1, 4], first[:, 1, 6] = 2, 1, 1  # bound 2/8 per task
    second = first.copy()
    second[0, 1, 4], second[0, 1, 5] = 0, 1  # task 0 resolved: bound 0, AUC 1
    second[1, 0, 4], second[1, 0, 3], second[1, 0, 5] = 0, 1, 1  # task 1 resolved: bound 0, AUC 3/4
    auc, bound = finer_aucs(first, second)
    np.testing.assert_array_equal(auc, [1.0, 0.75])
    np.testing.assert_array_equal(bound, [0.0, 0.0])
    worse = first.copy()
    worse[1, 1, 6], worse[1, 1, 4] = 0, 2  # task 1 coarser in pass 2: pass 1 kept
    auc, bound = finer_aucs(first, worse)
    assert auc[1] == pooled_auc_from_histograms(first)[1] and bound[1] == binning_error_bound(first)[1]
    missing = second.copy()
    missing[0, 0, 4] = 1  # a negative fewer in pass 2 (a site missing): pass 1 kept for that task
    auc, _ = finer_aucs(first, missing)
    assert auc[0] == pooled_auc_from_histograms(first)[0] and auc[1] == pooled_auc_from_histograms(second)[1]


def test_a_score_outside_the_range_lands_in_an_outer_bin_and_the_bound_still_holds():
    s, y = _band(200, seed=3)
    again = Binning(DEFAULT_BINS, (float(s.min()) + 1e-4,), (float(s.max()) - 1e-4,))  # too narrow on purpose
    hist = score_histograms(s, y, again)
    assert hist[0, :, 0].sum() == (s < again.lo[0]).sum() > 0 and hist[0, :, -1].sum() == (s >= again.hi[0]).sum()
    assert abs(pooled_auc_from_histograms(hist)[0] - roc_auc_score(y, s)) <= binning_error_bound(hist)[0] + 1e-15


def test_scores_a_few_ulps_apart_are_split_by_further_passes_and_equal_ones_stop_them():
    """An untrained network's scores can differ only in their last float32 bits: pass 2 over the one occupied
    fixed bin still shares bins, pass 3 over pass 2's occupied range splits every distinct value (the AUC is then
    sklearn's, ties of equal scores included), and a range that no longer shrinks asks for no further pass."""
    from fdam_ray.privacy.histogram import MAX_PASSES, Binning, finer_aucs

    rng = np.random.default_rng(3)
    values = np.nextafter(np.float32(0.5), np.float32(1), dtype=np.float32)
    distinct = [np.float32(0.5)]
    for _ in range(7):
        distinct.append(np.nextafter(distinct[-1], np.float32(1)))
    scores = rng.choice(np.array(distinct, dtype=np.float32), size=300)[:, None]
    labels = (rng.random(300) < 0.4 + 0.2 * (scores[:, 0] > values)).astype(np.float64)[:, None]
    want = roc_auc_score(labels[:, 0], scores[:, 0])
    total = score_histograms(scores, labels, DEFAULT_BINS)
    last, laid, passes = total, Binning(DEFAULT_BINS), 1
    auc, bound = pooled_auc_from_histograms(total), binning_error_bound(total)
    assert bound[0] > 1e-2  # every score in one fixed bin
    while passes < MAX_PASSES and (again := refinement(last, laid)) is not None:
        last, laid, passes = score_histograms(scores, labels, again), again, passes + 1
        new_auc, new_bound = finer_aucs(total, last)
        auc, bound = np.where(new_bound <= bound, new_auc, auc), np.minimum(bound, new_bound)
    assert passes >= 3  # pass 2 alone leaves distinct values in one bin
    assert abs(auc[0] - want) < 1e-12  # the remaining shared bins hold equal scores only: sklearn's ties
    assert refinement(last, laid) is None  # equal scores: the range no longer shrinks, no pass 5
