"""AUC on pooled scores: scores are pooled first, then one AUC per task (never a mean of client AUCs)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def task_aucs(scores: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """AUC of every task over its labelled samples; NaN where a task lacks a positive or a negative."""
    from sklearn.metrics import roc_auc_score  # here, not at import: scikit-learn takes a second or more to load,
    # and every Ray worker and site process imports this module (through the histograms) without calling it

    scores = np.asarray(scores).reshape(len(scores), -1)
    labels = np.asarray(labels).reshape(scores.shape)
    out = np.full(scores.shape[1], np.nan)
    for t in range(scores.shape[1]):
        keep = ~np.isnan(labels[:, t])
        y = labels[keep, t]
        if 0 < y.sum() < len(y):
            out[t] = roc_auc_score(y, scores[keep, t])
    return out


def mean_auc(aucs: np.ndarray) -> float:
    """Mean over the tasks whose AUC is defined (NaN if none is)."""
    aucs = np.asarray(aucs, dtype=np.float64)
    return float(np.nanmean(aucs)) if np.any(~np.isnan(aucs)) else float("nan")


def pooled(parts: Sequence[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """Concatenate (scores, labels) pairs from several clients."""
    return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])
