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
orders of magnitude in one of the two cases (at 4096 bins, the default job's first evaluation: 9.8e-2 off with the
logit grid alone, 2.6e-3 with probability alone; a 1 % task scored near 0: 1.5e-6 and 3.6e-2); their union is
at every score at most twice as coarse as the finer of the two. L = 16 is about where a float32 sigmoid reaches
1.0 exactly, so scores past the top edge are mostly ties in float32 already. The edges are computed once in
float64 and the scores placed by ``searchsorted``, so the map is monotone by construction (no rounding of a logit
can reorder two scores).

Refinement passes (:class:`Binning`, :mod:`fdam_ray.scores.histogram_passes`): a fixed layout cannot resolve
every score distribution (an untrained model puts all its scores in about 10 bins around 1/2; 10^4 scores spread
over (0, 1) share bins with a partner of the other class in 2e-4 of the pairs). Only positive-negative pairs that
share a bin are off, so where the bound of the summed counts exceeds :data:`REFINE_TOLERANCE` for a task, the
driver asks the sites for another histogram of the same B bins (per task) laid over the runs of adjacent cells that
hold both classes: each run ``[lo, hi)`` cut into sub-bins of one resolution (:func:`refined_edges`), everything
else in one coarse outer bin per gap between runs (ordered, so the map stays monotone). The driver keeps every
pass's counts and reads the AUC off the finest cells they resolve together (between edges two passes share, the
cells of the pass with fewer shared pairs), with the bound of those cells; the next pass cuts the cells that still
hold both classes, until the bound is within the tolerance, :data:`MAX_PASSES` passes, or no cell can be cut
(equal scores of both classes: their share stays in the reported bound). What a site is asked is the runs' ends:
the pooled histogram's mixed-cell ranges at the previous pass's resolution, computed from the summed counts only
(no site's own range, no single score, nothing a site did not contribute to); where a pass would go beyond
(B - 1) / 4 runs, the ones holding the most shared pairs. The sub-bin count of each run follows from the runs'
ends and B alone, so sites and driver compute the same layout.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence

import numpy as np

from fdam_ray.metrics import mean_auc

DEFAULT_BINS = 2**12
MAX_BINS = 2**20
LOGIT_RANGE = 16.0  # L: the logit grid spans (-L, L)
# A second pass is asked for a task when pass 1's bound exceeds this: one tenth of the 1e-4 the pooled AUC is held
# to, since the bound is a worst case that the actual error reaches only when every shared-bin pair is ordered one
# way (an untrained model's scores come close to that). Below it, pass 2's cost (one more scoring of every test
# split, one more message) buys nothing visible in an AUC rounded to 6 digits.
REFINE_TOLERANCE = 1e-5
MAX_PASSES = 8  # pass 1 and at most seven refinements (each cuts the cells that hold both classes; about halves the
# bound where those cells outnumber B / 2: 10^4 scores spread over (0, 1) need six passes at B = 4096)
_FAR = 1.0 / (1.0 + math.exp(2 * LOGIT_RANGE))  # where pass 2 puts a range's end at 0 (1 - it at 1): sigmoid(-2L)


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
    return _place(scores, bin_edges(bins))


def _ends(bins: int) -> np.ndarray:
    """The logits of the B + 1 bin ends of the fixed layout, the end bins closed at -2L and 2L."""
    edges = bin_edges(bins)
    return np.concatenate(([-2 * LOGIT_RANGE], np.log(edges / (1 - edges)), [2 * LOGIT_RANGE]))


def to_unit(scores: np.ndarray, bins: int) -> np.ndarray:
    """The place of each score in units of the fixed layout's bins: b + f for a score in bin b, f in [0, 1] its
    share of the bin's width in logit (the end bins from ``sigmoid(-2L)`` and to ``sigmoid(2L)``; scores beyond
    them at 0 and B). Non-decreasing in the score; :func:`from_unit` inverts it."""
    ends = _ends(bins)
    x = np.clip(np.asarray(scores, dtype=np.float64), _FAR, 1 - _FAR)
    z = np.log(x / (1 - x))
    b = np.clip(np.searchsorted(ends, z, side="right") - 1, 0, bins - 1)
    return b + np.clip((z - ends[b]) / (ends[b + 1] - ends[b]), 0.0, 1.0)


def from_unit(units: np.ndarray, bins: int) -> np.ndarray:
    """The score at each place of :func:`to_unit` (float64, non-decreasing)."""
    ends = _ends(bins)
    u = np.clip(np.asarray(units, dtype=np.float64), 0, bins)
    b = np.minimum(np.floor(u).astype(np.int64), bins - 1)
    z = ends[b] + (u - b) * (ends[b + 1] - ends[b])
    return 1.0 / (1.0 + np.exp(-z))


def refined_edges(ranges: Sequence[tuple[float, float]], bins: int) -> np.ndarray:
    """A refined pass's B - 1 interior edges for one task with the m disjoint ranges ``[lo_i, hi_i)`` (increasing):
    the m + 1 outer bins ``[0, lo_1)``, ``[hi_1, lo_2)``, ..., ``[hi_m, 1]`` and the B - m - 1 others over the
    ranges, range i cut into n_i >= 1 sub-bins of equal width in units of the fixed layout's bins (:func:`to_unit`),
    n_i by the ranges' widths in those units (largest remainders, earlier ranges first on equal ones). So every
    range gets the same resolution, a function of B and the ranges alone. Non-decreasing (two edges may coincide in
    float64 in a range of an ulp's order: the bin between is then empty, and the map stays monotone)."""
    bins = _check_bins(bins)
    lo = np.array([r[0] for r in ranges], dtype=np.float64)
    hi = np.array([r[1] for r in ranges], dtype=np.float64)
    m = len(lo)
    if not m or 2 * m + 1 > bins or not (np.all((0 <= lo) & (lo < hi) & (hi <= 1)) and np.all(hi[:-1] <= lo[1:])):
        raise ValueError(f"refined ranges {list(zip(lo.tolist(), hi.tolist(), strict=True))[:4]}...: 1 to "
                         f"{(bins - 1) // 2} disjoint increasing ranges 0 <= lo < hi <= 1 for {bins} bins")
    u_lo, u_hi = to_unit(lo, bins), to_unit(hi, bins)
    width = np.maximum(u_hi - u_lo, 0.0)
    spare = bins - 2 * m - 1  # sub-bins beyond one per range
    share = width / width.sum() * spare if width.sum() > 0 else np.full(m, spare / m)
    n = np.floor(share).astype(np.int64)
    n[np.argsort(-(share - n), kind="stable")[: spare - int(n.sum())]] += 1
    n += 1
    parts = []
    for i in range(m):
        inner = from_unit(u_lo[i] + (u_hi[i] - u_lo[i]) * np.arange(1, n[i]) / n[i], bins)
        parts.append(np.concatenate(([lo[i]], np.clip(inner, lo[i], hi[i]), [hi[i]])))
    edges = np.maximum.accumulate(np.concatenate(parts))
    edges.flags.writeable = False
    return edges


def _ranges_of(lo: tuple[float, ...], hi: tuple[float, ...]) -> list[list[tuple[float, float]]]:
    """Per task its refined ranges, from :class:`Binning`'s flat ``lo``/``hi`` (each task's closed by NaN)."""
    out: list[list[tuple[float, float]]] = [[]]
    for a, b in zip(lo, hi, strict=True):
        if math.isnan(a) != math.isnan(b):
            raise ValueError(f"Binning lo={a} hi={b}: both NaN (a task's end) or both a range's ends")
        if math.isnan(a):
            out.append([])
        else:
            out[-1].append((a, b))
    return out[:-1] if not out[-1] else out


@dataclasses.dataclass(frozen=True)
class Binning:
    """Which bins a site counts its scores in: the fixed layout of ``bins`` bins (``lo``/``hi`` None: pass 1), or
    per task the layout :func:`refined_edges` of its ranges. ``lo``/``hi``: the ranges' lower and upper ends, task
    after task, each task's closed by a NaN in both (a task with no range, or past the last one given: the fixed
    layout). Built by the driver from the summed counts of the passes so far
    (:func:`fdam_ray.scores.histogram_passes.refined_aucs`); every executor carries it to the sites unchanged.
    Floats in tuples so that it compares, hashes and travels as plain values."""

    bins: int = DEFAULT_BINS
    lo: tuple[float, ...] | None = None
    hi: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        _check_bins(self.bins)
        if (self.lo is None) != (self.hi is None) or (self.lo is not None and len(self.lo) != len(self.hi or ())):
            raise ValueError(f"Binning lo={self.lo} hi={self.hi}: both None or of one length")
        for ranges in _ranges_of(self.lo or (), self.hi or ()):
            if ranges:
                refined_edges(ranges, self.bins)  # raises on ranges that are not disjoint, increasing, in [0, 1]

    @classmethod
    def of_ranges(cls, bins: int, ranges: Sequence[Sequence[tuple[float, float]]]) -> Binning:
        """The layout with ``ranges[t]`` refined for task t (an empty list: the fixed layout)."""
        lo = tuple(v for task in ranges for v in (*(float(r[0]) for r in task), math.nan))
        hi = tuple(v for task in ranges for v in (*(float(r[1]) for r in task), math.nan))
        return cls(bins, lo, hi)

    def ranges(self, task: int) -> list[tuple[float, float]]:
        """Task ``task``'s refined ranges (empty: the fixed layout)."""
        per_task = _ranges_of(self.lo or (), self.hi or ())
        return per_task[task] if task < len(per_task) else []

    @property
    def refined(self) -> bool:
        """Whether some task has a refined layout."""
        return self.lo is not None and any(not math.isnan(v) for v in self.lo)

    def edges(self, task: int) -> np.ndarray:
        """Task ``task``'s B - 1 interior edges."""
        ranges = self.ranges(task)
        return refined_edges(ranges, self.bins) if ranges else bin_edges(self.bins)


def binning_of(spec: int | Binning) -> Binning:
    """``spec`` as a :class:`Binning` (an int B: the fixed layout of B bins)."""
    return spec if isinstance(spec, Binning) else Binning(_check_bins(spec))


def _place(scores: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """The bin of each score among ``edges`` (interior edges, non-decreasing)."""
    scores = np.asarray(scores)
    if np.isnan(scores).any():
        raise ValueError("scores hold NaN: a histogram cannot place them (the network's forward made NaN)")
    if scores.size and (scores.min() < 0 or scores.max() > 1):
        raise ValueError(f"scores span [{scores.min()}, {scores.max()}]: sigmoid scores in [0, 1] are binned "
                         "(apply the sigmoid to raw outputs first)")
    return np.searchsorted(edges, scores, side="right").astype(np.int64)


def score_histograms(scores: np.ndarray, labels: np.ndarray, bins: int | Binning = DEFAULT_BINS) -> np.ndarray:
    """Per task and class, the counts of the scores in each bin: ``(T, 2, B)`` int64, class 0 the negatives,
    class 1 the positives. ``scores`` and ``labels`` are ``(n, T)`` (or ``(n,)`` for one task) as
    :func:`fdam_ray.metrics.task_aucs` takes them; samples whose label is NaN for a task are left out of it.
    ``bins``: B (the fixed layout) or a :class:`Binning` (pass 2: per task its refined layout)."""
    binning = binning_of(bins)
    bins = binning.bins
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
        flat = _place(scores[keep, t], binning.edges(t)) + bins * y.astype(np.int64)
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


def auc_of_counts(counts: np.ndarray) -> np.ndarray:
    """Per task, the AUC of real-valued counts ``(T, 2, B)`` >= 0 (noised ones, clipped at 0:
    :mod:`fdam_ray.privacy.evaluation`) by the same rule, ``sum_b pos_b (neg_below_b + neg_b / 2) / (P N)`` with P, N
    their sums, in float64; NaN where P or N is 0. On integer counts it equals
    :func:`pooled_auc_from_histograms` to rounding."""
    counts = np.asarray(counts, dtype=np.float64)
    if counts.ndim != 3 or counts.shape[1] != 2 or (counts.size and counts.min() < 0):
        raise ValueError(f"counts of shape {counts.shape}: (tasks, 2, bins), every count >= 0")
    neg, pos = counts[:, 0], counts[:, 1]
    below = np.cumsum(neg, axis=1) - neg
    pairs = pos.sum(axis=1) * neg.sum(axis=1)
    concordant = (pos * (below + neg / 2)).sum(axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(pairs > 0, concordant / np.where(pairs > 0, pairs, 1.0), np.nan)


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
