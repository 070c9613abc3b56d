"""The clinical read-out (fdam_ray/scores/clinic.py) against independent oracles: DeLong's variance from the
placement values computed pair by pair, sklearn's McClish-standardised pAUC and ROC curve, closed forms of the
two-way pAUC, a hand example of the operating points, the histogram counts of 10^4 spread scores, degenerate sets."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from sklearn.metrics import roc_auc_score, roc_curve

from fdam_ray.scores import clinic
from fdam_ray.scores.histogram import score_histograms
from fdam_ray.scores.histogram_passes import Pooled


def delong_by_pairs(scores: np.ndarray, labels: np.ndarray) -> tuple[float, float]:
    """DeLong et al. 1988 from the definition: psi(x, y) = 1, 1/2, 0 for x >, =, < y over every (positive,
    negative) pair; V10 per positive, V01 per negative; Var = S10 / m + S01 / n."""
    x, y = scores[labels == 1], scores[labels == 0]
    psi = (x[:, None] > y[None, :]) + 0.5 * (x[:, None] == y[None, :])
    auc = psi.mean()
    v10, v01 = psi.mean(axis=1), psi.mean(axis=0)
    s10 = ((v10 - auc) ** 2).sum() / (len(x) - 1)
    s01 = ((v01 - auc) ** 2).sum() / (len(y) - 1)
    return float(auc), float(s10 / len(x) + s01 / len(y))


def sample(n: int, seed: int, *, shift: float = 1.0, decimals: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    labels = (rng.random(n) < 0.3).astype(np.float64)
    scores = 1 / (1 + np.exp(-rng.normal(shift * labels, 1.0)))
    return (np.round(scores, decimals) if decimals else scores), labels


@pytest.mark.parametrize("decimals", [None, 2, 1])  # no ties, some, many
def test_delong_at_exact_resolution_is_the_pairwise_definition(decimals):
    scores, labels = sample(400, 1, decimals=decimals)
    auc, var = clinic.delong(clinic.exact_counts(scores, labels))
    want_auc, want_var = delong_by_pairs(scores, labels)
    assert auc[0] == pytest.approx(want_auc, abs=1e-12) and auc[0] == pytest.approx(roc_auc_score(labels, scores))
    assert var[0] == pytest.approx(want_var, rel=1e-10)


def test_the_intervals():
    scores, labels = sample(300, 2)
    counts = clinic.exact_counts(scores, labels)
    auc, var = clinic.delong(counts)
    low, high = clinic.interval(auc, var)
    se = np.sqrt(var)
    assert low[0] == pytest.approx(auc[0] - 1.959964 * se[0]) and high[0] == pytest.approx(auc[0] + 1.959964 * se[0])
    l_low, l_high = clinic.interval(auc, var, logit=True)
    logit = np.log(auc / (1 - auc))
    half = 1.959964 * se / (auc * (1 - auc))
    assert l_low == pytest.approx(1 / (1 + np.exp(-(logit - half)))) and l_low < auc < l_high
    # near 1 the Wald interval leaves [0, 1], the logit one does not
    a, v = np.array([0.995, 1.0]), np.array([0.004**2, 0.0])
    _, w_high = clinic.interval(a, v)
    g_low, g_high = clinic.interval(a, v, logit=True)
    assert w_high[0] > 1 and 0 < g_low[0] < 0.995 < g_high[0] < 1 and g_low[1] == g_high[1] == 1.0


@pytest.mark.parametrize("beta", [0.01, 0.05, 0.1, 0.3, 0.77])
@pytest.mark.parametrize("decimals", [None, 2])
def test_pauc_mcclish_is_sklearns_max_fpr(beta, decimals):
    scores, labels = sample(600, 3, shift=0.8, decimals=decimals)
    raw, mcclish = clinic.pauc(clinic.exact_counts(scores, labels), beta)
    assert mcclish[0] == pytest.approx(roc_auc_score(labels, scores, max_fpr=beta), abs=1e-12)
    fpr, tpr, _ = roc_curve(labels, scores)  # raw: the trapezoid under sklearn's curve up to beta (interpolated)
    x = np.append(fpr[fpr <= beta], beta)
    y = np.append(tpr[fpr <= beta], np.interp(beta, fpr, tpr))
    assert raw[0] == pytest.approx(np.trapezoid(y, x), abs=1e-12)


def test_pauc_at_beta_one_is_the_auc():
    scores, labels = sample(200, 4)
    raw, mcclish = clinic.pauc(clinic.exact_counts(scores, labels), 1.0)
    assert raw[0] == pytest.approx(roc_auc_score(labels, scores)) == mcclish[0]


@pytest.mark.parametrize(("alpha", "beta"), [(0.5, 0.2), (0.9, 0.1), (0.0, 0.3), (0.3, 0.6)])
def test_two_way_pauc_closed_forms(alpha, beta):
    perfect = np.array([[[5, 3, 0, 0], [0, 0, 4, 2]]], np.float64)  # every positive above every negative
    assert clinic.two_way_pauc(perfect, alpha, beta)[0] == pytest.approx(beta * (1 - alpha))
    chance = np.array([[[3, 1, 2, 5, 4], [6, 2, 4, 10, 8]]], np.float64)  # every bin 1:2: the ROC is the diagonal
    assert clinic.two_way_pauc(chance, alpha, beta)[0] == pytest.approx(max(beta - alpha, 0) ** 2 / 2)
    worst = perfect[:, ::-1]  # every negative above every positive: the curve is 0 until FPR 1
    assert clinic.two_way_pauc(worst, alpha, beta)[0] == 0.0


def test_two_way_with_alpha_zero_is_the_one_way_raw():
    scores, labels = sample(500, 5)
    counts = clinic.exact_counts(scores, labels)
    assert clinic.two_way_pauc(counts, 0.0, 0.2)[0] == pytest.approx(clinic.pauc(counts, 0.2)[0][0], abs=1e-14)


def test_operating_points_by_hand():
    # scores 0.1 .. 0.9 (bins from the bottom); negatives: 4 at 0.1, 3 at 0.3, 2 at 0.5, 1 at 0.9; positives: 1 at
    # 0.3, 1 at 0.5, 3 at 0.7, 5 at 0.9.  Thresholds from the top: (FPR, TPR) = (0, 0), (0.1, 0.5), (0.1, 0.8),
    # (0.3, 0.9), (0.6, 1.0), (1, 1).
    counts = np.array([[[4, 3, 2, 0, 1], [0, 1, 1, 3, 5]]], np.float64)
    fpr, tpr = clinic.roc_points(counts)
    assert fpr[0] == pytest.approx([0, 0.1, 0.1, 0.3, 0.6, 1]) and tpr[0] == pytest.approx([0, .5, .8, .9, 1, 1])
    assert clinic.sensitivity_at_specificity(counts, 0.9)[0] == pytest.approx(0.8)
    assert clinic.sensitivity_at_specificity(counts, 0.95)[0] == 0.0
    assert clinic.sensitivity_at_specificity(counts, 0.7)[0] == pytest.approx(0.9)
    assert clinic.specificity_at_sensitivity(counts, 0.9)[0] == pytest.approx(0.7)
    assert clinic.specificity_at_sensitivity(counts, 0.95)[0] == pytest.approx(0.4)
    assert clinic.specificity_at_sensitivity(counts, 0.5)[0] == pytest.approx(0.9)


def test_histogram_counts_match_the_exact_figures_on_spread_scores():
    """10^4 scores over (0, 1): pass 1 of 4096 bins, then the refinement passes the driver asks (Pooled)."""
    scores, labels = sample(10_000, 6, shift=1.5)
    exact = clinic.read_out(clinic.exact_counts(scores, labels), min_tpr=0.5)
    first = clinic.read_out(score_histograms(scores, labels, 4096), min_tpr=0.5)
    pooled = Pooled.first(score_histograms(scores, labels, 4096), 4096)
    for _ in range(7):
        again = pooled.refinement()
        if again is None:
            break
        pooled = pooled.add(score_histograms(scores, labels, again), again)
    refined = clinic.read_out(clinic.padded([c.counts for c in pooled.tasks]), min_tpr=0.5)
    for got, tol in ((first, 1e-3), (refined, 1e-5)):
        assert abs(got["auc_se"][0] / exact["auc_se"][0] - 1) < tol * 10
        for key in ("auc", "auc_ci_low", "auc_ci_high", "auc_ci_logit_low", "pauc", "pauc_mcclish", "tpauc"):
            assert got[key][0] == pytest.approx(exact[key][0], abs=tol), key
        for key in ("sens_at_spec_0.9", "spec_at_sens_0.95"):  # a threshold at a bin edge: off by a bin's samples
            assert got[key][0] == pytest.approx(exact[key][0], abs=2e-3), key


def test_vectorised_over_tasks_with_missing_labels():
    s1, l1 = sample(300, 7)
    s2, l2 = sample(300, 8, shift=0.3, decimals=2)
    l2[::7] = np.nan
    both = clinic.read_out(clinic.exact_counts(np.stack([s1, s2], 1), np.stack([l1, l2], 1)), min_tpr=0.2)
    for t, (s, lab) in enumerate(((s1, l1), (s2, l2))):
        keep = ~np.isnan(lab)
        alone = clinic.read_out(clinic.exact_counts(s[keep], lab[keep]), min_tpr=0.2)
        for key, value in alone.items():
            assert both[key][t] == pytest.approx(value[0], abs=1e-12), key


def test_degenerate_sets_are_nan(caplog):
    one_class = np.array([[[0, 0, 0], [2, 3, 1]], [[1, 0, 0], [0, 0, 1]]], np.float64)  # task 1: one of each
    out = clinic.read_out(one_class, min_tpr=0.5)
    assert all(np.isnan(v[0]) for v in out.values())
    assert out["auc"][1] == 1.0 and np.isnan(out["auc_se"][1])  # DeLong's S10, S01 need two of each class
    with caplog.at_level(logging.WARNING):
        raw, mcclish = clinic.pauc(np.array([[[1, 2], [2, 1]]], np.float64), 1.5)
        two = clinic.two_way_pauc(np.array([[[1, 2], [2, 1]]], np.float64), 0.5, 0.0)
    assert np.isnan(raw[0]) and np.isnan(mcclish[0]) and np.isnan(two[0])
    assert len(caplog.records) == 2 and "outside (0, 1]" in caplog.records[0].getMessage()
    assert clinic.set_fields(out) ["pauc"] == pytest.approx(out["pauc"][1])  # the mean over the tasks that have one
