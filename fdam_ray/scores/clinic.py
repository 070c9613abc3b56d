"""The clinical read-out of an evaluation from per-class bin counts (``clinical: on``; docs/algorithms.md s.6).

Everything is read off counts ``(T, 2, K)`` (per task: negatives, positives in K bins ordered as the scores are;
ties within a bin count 1/2): the summed score histograms of ``test_scores: histogram`` (after the refinement
passes, the finest cells they resolve), or, from exact scores, one bin per distinct score
(:func:`exact_counts`), where every figure is the exact one (DeLong et al. 1988 with ties as 1/2):

- AUC = (1/(PN)) sum_j p_j (N_{<j} + n_j / 2).
- DeLong's variance from the placement values at bin resolution: a positive in bin j has
  V10_j = (N_{<j} + n_j / 2) / N, a negative V01_j = (P_{>j} + p_j / 2) / P;
  Var = S10 / P + S01 / N with S10 = sum_j p_j (V10_j - AUC)^2 / (P - 1), S01 likewise over the negatives. The 95 %
  interval: Wald (AUC +- 1.96 SE) and on the logit scale (stays inside [0, 1]).
- ROC points at the bins' lower edges, from the top: FPR = N_{>=j} / N, TPR = P_{>=j} / P, linear in between.
- One-way pAUC(FPR <= beta): the area under that curve over [0, beta] (interpolated at beta), raw and McClish's
  standardisation 1/2 (1 + (pAUC - beta^2/2) / (beta - beta^2/2)) (what ``roc_auc_score(max_fpr=beta)`` returns).
- Two-way pAUC(TPR >= alpha, FPR <= beta): the area between the curve and TPR = alpha over FPR in [0, beta] where the
  curve is above alpha (Yang et al. 2019); a perfect classifier has beta (1 - alpha).
- Sensitivity at specificity s: the highest TPR among the points with FPR <= 1 - s (the lowest threshold that keeps
  the specificity); specificity at sensitivity s: the highest 1 - FPR among the points with TPR >= s.

A task without both classes (two of each for the variance), or a beta outside (0, 1], gives NaN and one warning
line, never an exception.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import numpy as np

log = logging.getLogger(__name__)

Z95 = 1.959963984540054  # the standard normal's 97.5 % quantile


def exact_counts(scores: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """``(T, 2, K)`` counts with one bin per distinct score of each task (its labelled samples; NaN labels are
    missing), K the most distinct scores of any task; the tasks with fewer are padded with empty bins at the top."""
    scores = np.asarray(scores, dtype=np.float64).reshape(len(scores), -1)
    labels = np.asarray(labels, dtype=np.float64).reshape(scores.shape)
    per_task = []
    for t in range(scores.shape[1]):
        keep = ~np.isnan(labels[:, t])
        values, at = np.unique(scores[keep, t], return_inverse=True)
        y = labels[keep, t] > 0.5
        counts = np.zeros((2, len(values)), np.float64)
        np.add.at(counts[1], at[y], 1.0)
        np.add.at(counts[0], at[~y], 1.0)
        per_task.append(counts)
    return padded(per_task)


def padded(per_task: Sequence[np.ndarray]) -> np.ndarray:
    """Per-task counts ``(2, K_t)`` stacked into ``(T, 2, max K_t)`` (empty bins added at the top: they change
    nothing)."""
    most = max((c.shape[1] for c in per_task), default=0)
    out = np.zeros((len(per_task), 2, max(most, 1)), np.float64)
    for t, c in enumerate(per_task):
        out[t, :, : c.shape[1]] = c
    return out


def _totals(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    counts = np.asarray(counts, dtype=np.float64)
    if counts.ndim != 3 or counts.shape[1] != 2:
        raise ValueError(f"counts of shape {counts.shape}: (tasks, 2, bins) expected")
    n, p = counts[:, 0], counts[:, 1]
    return n, p, n.sum(-1), p.sum(-1)


def delong(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per task the AUC and DeLong's variance of it (NaN where a task lacks a class; the variance needs two of
    each)."""
    n, p, neg, pos = _totals(counts)
    with np.errstate(invalid="ignore", divide="ignore"):
        below = np.cumsum(n, -1) - n  # N_{<j}
        above = p.sum(-1, keepdims=True) - np.cumsum(p, -1)  # P_{>j}
        v10 = (below + n / 2) / neg[:, None]
        v01 = (above + p / 2) / pos[:, None]
        auc = (p * v10).sum(-1) / pos
        s10 = (p * (v10 - auc[:, None]) ** 2).sum(-1) / (pos - 1)
        s01 = (n * (v01 - auc[:, None]) ** 2).sum(-1) / (neg - 1)
        var = s10 / pos + s01 / neg
    auc = np.where((pos > 0) & (neg > 0), auc, np.nan)
    var = np.where((pos > 1) & (neg > 1), var, np.nan)
    return auc, var


def interval(auc: np.ndarray, var: np.ndarray, *, logit: bool = False,
             z: float = Z95) -> tuple[np.ndarray, np.ndarray]:
    """The two-sided interval (95 % by default): AUC +- z SE (Wald), or with ``logit`` on the logit scale,
    logit(AUC) +- z SE / (AUC (1 - AUC)) mapped back (inside [0, 1]; AUC 0 or 1 gives the point)."""
    auc, se = np.asarray(auc, np.float64), np.sqrt(np.asarray(var, np.float64))
    if not logit:
        return auc - z * se, auc + z * se
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        inner = (auc > 0) & (auc < 1)
        centre = np.log(auc / (1 - auc))
        half = z * se / (auc * (1 - auc))
        low = np.where(inner, 1 / (1 + np.exp(-(centre - half))), auc)
        high = np.where(inner, 1 / (1 + np.exp(-(centre + half))), auc)
    return low, high


def roc_points(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per task the ROC points ``(T, K + 1)`` (FPR, TPR) at the bins' lower edges from the top bin down, starting
    at (0, 0) and ending at (1, 1) (NaN where a task lacks a class)."""
    n, p, neg, pos = _totals(counts)
    zero = np.zeros((n.shape[0], 1))
    with np.errstate(invalid="ignore", divide="ignore"):
        fpr = np.concatenate([zero, np.cumsum(n[:, ::-1], -1)], -1) / neg[:, None]
        tpr = np.concatenate([zero, np.cumsum(p[:, ::-1], -1)], -1) / pos[:, None]
    return fpr, tpr


def _area_above(fpr: np.ndarray, tpr: np.ndarray, beta: float, floor: float) -> np.ndarray:
    """Per task the integral over FPR in [0, beta] of max(ROC - floor, 0), the ROC linear between its points."""
    x0, x1, y0, y1 = fpr[:, :-1], fpr[:, 1:], tpr[:, :-1], tpr[:, 1:]
    with np.errstate(invalid="ignore", divide="ignore"):
        a, b = np.minimum(x0, beta), np.minimum(x1, beta)
        width = b - a
        slope = np.where(x1 > x0, (y1 - y0) / np.where(x1 > x0, x1 - x0, 1), 0.0)
        fa = y0 + slope * (a - x0) - floor
        fb = y0 + slope * (b - x0) - floor
        crossing = np.maximum(fa, fb) ** 2 / (2 * np.abs(fb - fa))
        part = np.where((fa >= 0) & (fb >= 0), (fa + fb) / 2,
                        np.where((fa <= 0) & (fb <= 0), 0.0, crossing))
        area = np.where(width > 0, width * part, 0.0).sum(-1)
    return np.where(np.isnan(fpr).any(-1) | np.isnan(tpr).any(-1), np.nan, area)


def _beta_ok(beta: float, what: str) -> bool:
    if not 0 < beta <= 1:
        log.warning("%s: max FPR beta=%r is outside (0, 1], so the partial AUC is NaN", what, beta)
        return False
    return True


def pauc(counts: np.ndarray, beta: float) -> tuple[np.ndarray, np.ndarray]:
    """Per task the one-way pAUC(FPR <= ``beta``), raw (in [0, beta]) and McClish-standardised (1/2 = chance,
    1 = perfect)."""
    nan = np.full(np.asarray(counts).shape[0], np.nan)
    if not _beta_ok(beta, "pauc"):
        return nan, nan.copy()
    raw = _area_above(*roc_points(counts), beta, 0.0)
    least = beta**2 / 2
    mcclish = 0.5 * (1 + (raw - least) / (beta - least)) if beta > least else raw  # beta = 1: the AUC itself
    return raw, mcclish


def two_way_pauc(counts: np.ndarray, alpha: float, beta: float) -> np.ndarray:
    """Per task the two-way pAUC(TPR >= ``alpha``, FPR <= ``beta``): the area of the curve inside that box."""
    if not _beta_ok(beta, "two-way pauc") or not 0 <= alpha < 1:
        if 0 < beta <= 1:
            log.warning("two-way pauc: min TPR alpha=%r is outside [0, 1), so it is NaN", alpha)
        return np.full(np.asarray(counts).shape[0], np.nan)
    return _area_above(*roc_points(counts), beta, alpha)


def sensitivity_at_specificity(counts: np.ndarray, specificity: float) -> np.ndarray:
    """Per task the highest TPR of the ROC points with FPR <= 1 - ``specificity`` (no interpolation: a threshold
    between bins is not one the counts can place)."""
    fpr, tpr = roc_points(counts)
    with np.errstate(invalid="ignore"):
        ok = fpr <= 1 - specificity + 1e-12
        out = np.where(ok, tpr, -np.inf).max(-1)
    return np.where(np.isnan(fpr).any(-1) | np.isnan(tpr).any(-1), np.nan, out)


def specificity_at_sensitivity(counts: np.ndarray, sensitivity: float) -> np.ndarray:
    """Per task the highest 1 - FPR of the ROC points with TPR >= ``sensitivity``."""
    fpr, tpr = roc_points(counts)
    with np.errstate(invalid="ignore"):
        ok = tpr >= sensitivity - 1e-12
        out = np.where(ok, 1 - fpr, -np.inf).max(-1)
    return np.where(np.isnan(fpr).any(-1) | np.isnan(tpr).any(-1), np.nan, out)


def read_out(counts: np.ndarray, *, max_fpr: float = 0.1, min_tpr: float | None = None,
             points: Sequence[float] = (0.9, 0.95)) -> dict[str, np.ndarray]:
    """Every figure per task ``(T,)``: auc, auc_se, auc_ci_low/high (Wald), auc_ci_logit_low/high, pauc,
    pauc_mcclish, tpauc (with ``min_tpr``), sens_at_spec_<s> and spec_at_sens_<s> for each s of ``points``."""
    auc, var = delong(counts)
    low, high = interval(auc, var)
    low_l, high_l = interval(auc, var, logit=True)
    raw, mcclish = pauc(counts, max_fpr)
    out = {"auc": auc, "auc_se": np.sqrt(var), "auc_ci_low": low, "auc_ci_high": high, "auc_ci_logit_low": low_l,
           "auc_ci_logit_high": high_l, "pauc": raw, "pauc_mcclish": mcclish}
    if min_tpr is not None:
        out["tpauc"] = two_way_pauc(counts, min_tpr, max_fpr)
    for s in points:
        out[f"sens_at_spec_{s:g}"] = sensitivity_at_specificity(counts, s)
        out[f"spec_at_sens_{s:g}"] = specificity_at_sensitivity(counts, s)
    return out


# Figures whose mean over the tasks a record reports for several tasks (as test_auc is the mean of the tasks' AUCs);
# the AUC's SE and interval are one task's (the tasks' AUCs share samples, their covariance is not in the counts).
_MEANS = ("pauc", "pauc_mcclish", "tpauc", "sens_at_spec_", "spec_at_sens_")


# The pooled test figures of a record (``clinical: on``), which summary.json repeats as ``final_<key>`` (and as
# ``best_<key>``, the selected evaluation's).
CLINICAL_KEYS = ("test_auc_se", "test_auc_ci_", "test_pauc", "test_tpauc", "test_sens_at_spec_", "test_spec_at_sens_")
# summary.json's clinical fields: the final and the selected evaluation's pooled test figures, and with select_by:
# val_pauc or val_tpauc the selecting figure's best and final value.
SUMMARY_PREFIXES = (*(f"{when}_{k}" for when in ("final", "best") for k in CLINICAL_KEYS), "best_val_pauc",
                    "final_val_pauc", "best_val_tpauc", "final_val_tpauc")


def set_fields(figures: dict[str, np.ndarray]) -> dict[str, float | None]:
    """One set's scalars of :func:`read_out`'s ``figures`` (rounded to 6 digits, None for NaN), the AUC itself
    left out: every figure for one task; for several, the mean over the tasks of the pAUCs and operating points."""
    tasks = len(figures["auc"])
    out: dict[str, float | None] = {}
    for key, values in figures.items():
        if key == "auc" or (tasks > 1 and not key.startswith(_MEANS)):
            continue
        defined = values[~np.isnan(values)]
        out[key] = round(float(defined.mean()), 6) if defined.size else None
    return out


def record_fields(pooled: np.ndarray, sites: Mapping[str, np.ndarray], *, split: str, task_names: Sequence[str],
                  max_fpr: float, min_tpr: float | None, points: Sequence[float]) -> dict:
    """A record's clinical fields of one split (``test`` or ``val``) from its pooled counts and each site's own
    (``sites``: name -> counts ``(T, 2, K)``): ``<split>_<figure>`` pooled (:func:`set_fields`), per task
    ``task_<figure>`` (test) or ``val_task_<figure>`` where there are several tasks (the AUC itself left out: it has
    its own field), per site ``client_<figure>`` or ``val_client_<figure>``, as ``task_auc`` and ``client_auc`` are
    named."""
    def read(counts: np.ndarray) -> dict[str, np.ndarray]:
        return read_out(counts, max_fpr=max_fpr, min_tpr=min_tpr, points=points)

    head = "" if split == "test" else f"{split}_"
    figures = read(pooled)
    out: dict = {f"{split}_{k}": v for k, v in set_fields(figures).items()}
    if len(task_names) > 1:
        out.update({f"{head}task_{k}": {t: _num(x) for t, x in zip(task_names, v, strict=True)}
                    for k, v in figures.items() if k != "auc"})
    per_site = {site: set_fields(read(counts)) for site, counts in sites.items()}
    for key in next(iter(per_site.values()), {}):
        out[f"{head}client_{key}"] = {site: values[key] for site, values in per_site.items()}
    return out


def _num(x: float) -> float | None:
    return None if np.isnan(x) else round(float(x), 6)
