"""Pooled test AUC from per-site score histograms: no per-sample score or label leaves a site.

A site bins its test scores (the sigmoid of the model's outputs, ``(n, T)``, NaN labels missing) per task and per
class on a bin layout fixed by the number of bins B alone, and sends ``T * 2 * B`` int64 counts. Counts add, so the
driver (or secure aggregation, which sums integer vectors) sums the sites' histograms into the histogram of the
pooled scores, and reads the AUC off it:

    AUC_t = sum_b pos_b * (neg_below_b + neg_b / 2) / (P * N)

with ``pos_b``, ``neg_b`` the counts of bin b, ``neg_below_b`` the negatives of the bins below b, P and N the totals
of task t. Pairs in different bins count by the bins' order, pairs in one bin count 1/2 (as ties do in sklearn).
It is evaluated exactly: the numerator doubled is an integer, and the quotient of two integers is rounded once.

Error bound: the bins are ordered as the scores are (each bin an interval, the map score -> bin non-decreasing), so
a pair in different bins counts as in sklearn's AUC; a pair in one bin counts 1/2 where sklearn counts 0, 1/2 or 1.
Hence |AUC_hist - AUC_exact| <= sum_b pos_b * neg_b / (2 P N) (:func:`binning_error_bound`), and where every bin
holds scores of one value only (scores on the bin centres), the two are equal.

Bin layout (a function of B alone, the same at every site; B even): the union of two grids, B / 2 - 1 edges of
equal width in probability (k / (B / 2)) and B / 2 edges of equal width in logit, ``z = log(s / (1 - s))``, over
(-L, L) with L = 16 (at ``-L + (k + 1/2) * 2L / (B / 2)``, so no edge falls on 1/2 twice); the end bins reach to 0
and to 1. Why both: errors come only from positive-negative pairs that share a bin, i.e. from where the two
classes' scores overlap. A model early in training puts every score within a few thousandths of 1/2 (the default
job's first evaluation: all 540 scores in [0.4903, 0.4956]), where equal widths in logit are 8x coarser than in
probability; a confident model, or a rare task, puts the overlap near 0 or 1 (scores around 1e-3 or 1 - 1e-3),
where equal widths in probability lump everything into the end bins. Each grid alone is worse by one to three
orders of magnitude in one of the two cases (measured in the notes of issue 39); their union is at every score
at most twice as coarse as the finer of the two. L = 16 is about where a float32 sigmoid reaches 1.0 exactly, so
scores past the top edge are mostly ties in float32 already. The edges are computed once in float64 and the
scores placed by ``searchsorted``, so the map is monotone by construction (no rounding of a logit can reorder two
scores).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import numpy as np

from fdam_ray.metrics import mean_auc

DEFAULT_BINS = 2**12
MAX_BINS = 2**20
LOGIT_RANGE = 16.0  # L: the logit grid spans (-L, L)


def _check_bins(bins: int) -> int:
    if (isinstance(bins, bool) or not isinstance(bins, int | np.integer) or not 2 <= bins <= MAX_BINS
            or bins % 2):
        raise ValueError(f"bins={bins!r}: an even integer in [2, {MAX_BINS}] (default {DEFAULT_BINS})")
    return int(bins)


@functools.lru_cache(maxsize=8)
def _edges(bins: int) -> np.ndarray:
    half = bins // 2
    in_probability = np.arange(1, half) / half
    step = 2 * LOGIT_RANGE / (bins - half)
    in_logit = 1.0 / (1.0 + np.exp(LOGIT_RANGE - (np.arange(bins - half) + 0.5) * step))
    edges = np.sort(np.concatenate([in_probability, in_logit]))
    if not np.all(np.diff(edges) > 0):  # never for an even B up to 2**16 (checked): B - 1 edges would not make B bins
        raise ValueError(f"bins={bins}: its two grids share an edge; take a power of two")
    edges.flags.writeable = False
    return edges


def bin_edges(bins: int = DEFAULT_BINS) -> np.ndarray:
    """The B - 1 interior edges (float64, strictly increasing, in probability): bin b holds the scores s with
    ``edges[b - 1] <= s < edges[b]``, bin 0 every s below ``edges[0]``, bin B - 1 every s from ``edges[-1]`` on.
    A function of B only, the same at every site. Read-only."""
    return _edges(_check_bins(bins))


def bin_centres(bins: int = DEFAULT_BINS) -> np.ndarray:
    """A score inside each bin, away from its edges: the midpoint of its two edges (0 and 1 closing the end bins)."""
    edges = np.concatenate(([0.0], bin_edges(bins), [1.0]))
    return (edges[:-1] + edges[1:]) / 2


def bin_index(scores: np.ndarray, bins: int = DEFAULT_BINS) -> np.ndarray:
    """The bin (int64, in [0, B)) of each score; scores are sigmoid outputs in [0, 1]."""
    scores = np.asarray(scores)
    if np.isnan(scores).any():
        raise ValueError("scores hold NaN: a histogram cannot place them (the network's forward made NaN)")
    if scores.size and (scores.min() < 0 or scores.max() > 1):
        raise ValueError(f"scores span [{scores.min()}, {scores.max()}]: sigmoid scores in [0, 1] are binned "
                         "(apply the sigmoid to raw outputs first)")
    return np.searchsorted(bin_edges(bins), scores, side="right").astype(np.int64)


def score_histograms(scores: np.ndarray, labels: np.ndarray, bins: int = DEFAULT_BINS) -> np.ndarray:
    """Per task and class, the counts of the scores in each bin: ``(T, 2, B)`` int64, class 0 the negatives,
    class 1 the positives. ``scores`` and ``labels`` are ``(n, T)`` (or ``(n,)`` for one task) as
    :func:`fdam_ray.metrics.task_aucs` takes them; samples whose label is NaN for a task are left out of it."""
    bins = _check_bins(bins)
    scores = np.asarray(scores)
    scores = scores.reshape(len(scores), -1)
    labels = np.asarray(labels, dtype=np.float64).reshape(scores.shape)
    out = np.zeros((scores.shape[1], 2, bins), dtype=np.int64)
    for t in range(scores.shape[1]):
        keep = ~np.isnan(labels[:, t])
        y = labels[keep, t]
        if not np.isin(y, (0.0, 1.0)).all():
            raise ValueError(f"labels of task {t} hold {sorted(set(y[~np.isin(y, (0.0, 1.0))].tolist()))[:5]}: "
                             "0, 1 or NaN (missing)")
        flat = bin_index(scores[keep, t], bins) + bins * y.astype(np.int64)
        out[t] = np.bincount(flat, minlength=2 * bins).reshape(2, bins)
    return out


def check_histograms(hist: np.ndarray, bins: int | None = None, tasks: int | None = None) -> np.ndarray:
    """``hist`` as ``(T, 2, B)`` int64 counts, or ValueError naming what is wrong (what a driver checks on what a
    site sent before summing it)."""
    arr = np.asarray(hist)
    if arr.ndim != 3 or arr.shape[1] != 2:
        raise ValueError(f"a score histogram has shape (tasks, 2, bins); got {arr.shape}")
    if bins is not None and arr.shape[2] != bins:
        raise ValueError(f"a score histogram has {arr.shape[2]} bins; expected {bins}")
    if tasks is not None and arr.shape[0] != tasks:
        raise ValueError(f"a score histogram has {arr.shape[0]} tasks; expected {tasks}")
    if not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"a score histogram holds integer counts; got dtype {arr.dtype}")
    if arr.size and arr.min() < 0:
        raise ValueError("a score histogram holds a negative count")
    _check_bins(arr.shape[2])
    return arr.astype(np.int64, copy=False)


def sum_histograms(parts: Sequence[np.ndarray]) -> np.ndarray:
    """The sites' histograms summed: the histogram of their pooled scores (all of one shape)."""
    if not parts:
        raise ValueError("no histogram to sum")
    first = check_histograms(parts[0])
    total = first.copy()
    for part in parts[1:]:
        total += check_histograms(part, bins=first.shape[2], tasks=first.shape[0])
    return total


def _class_totals(hist: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return hist[:, 1].sum(axis=1), hist[:, 0].sum(axis=1)


def _doubled_concordance(neg: np.ndarray, pos: np.ndarray, doubled_pairs: int) -> int:
    """``sum_b pos_b * (2 * neg_below_b + neg_b)`` as an exact integer (int64 where it cannot overflow)."""
    if doubled_pairs < 2**62:
        below = np.concatenate(([0], np.cumsum(neg)[:-1]))
        return int(np.dot(pos, 2 * below + neg))
    neg_o, pos_o = neg.astype(object), pos.astype(object)
    below_o = np.concatenate(([0], np.cumsum(neg_o)[:-1]))
    return int(np.dot(pos_o, 2 * below_o + neg_o))


def pooled_auc_from_histograms(hist: np.ndarray) -> np.ndarray:
    """Per task, the AUC of the (summed) histogram ``(T, 2, B)``: float64, NaN where a task lacks a positive or a
    negative (as :func:`fdam_ray.metrics.task_aucs`). The quotient of two exact integers, rounded once."""
    return _per_task(hist, lambda neg, pos, pairs: _doubled_concordance(neg, pos, 2 * pairs) / (2 * pairs))


def pooled_test_auc(hist: np.ndarray) -> float:
    """The pooled test AUC as :mod:`fdam_ray.metrics` reports it: the mean over the tasks whose AUC is defined."""
    return mean_auc(pooled_auc_from_histograms(hist))


def binning_error_bound(hist: np.ndarray) -> np.ndarray:
    """Per task, the most the histogram AUC can differ from the exact AUC of the same scores:
    ``sum_b pos_b * neg_b / (2 P N)``, the share of positive-negative pairs that share a bin, halved (NaN where
    the AUC is)."""
    return _per_task(hist, lambda neg, pos, pairs: int(np.dot(neg.astype(object), pos.astype(object))) / (2 * pairs))


def _per_task(hist: np.ndarray, of: Callable[[np.ndarray, np.ndarray, int], float]) -> np.ndarray:
    """``of(negatives, positives, P * N)`` for each task of a checked histogram with both classes, else NaN."""
    hist = check_histograms(hist)
    num_pos, num_neg = _class_totals(hist)
    out = np.full(hist.shape[0], np.nan)
    for t in range(hist.shape[0]):
        pairs = int(num_pos[t]) * int(num_neg[t])
        if pairs:
            out[t] = of(hist[t, 0], hist[t, 1], pairs)
    return out
