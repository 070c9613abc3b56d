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

Two passes (:class:`Binning`, :func:`refinement`): a fixed layout cannot resolve every score distribution; an
untrained model puts all its scores in a band ~0.005 wide around 1/2, about 10 bins of the default layout (1.1e-2
off the exact AUC on the default job). So the driver reads the bound of the summed pass-1 histogram and, where it
exceeds :data:`REFINE_TOLERANCE` for a task, asks the sites for a second histogram of the same B bins, laid over
the range of that task's occupied pass-1 bins only: ``[lo, hi)``, the lower edge of the lowest occupied bin and the
upper edge of the highest, cut into B - 2 bins of equal width in logit, plus the two outer bins ``[0, lo)`` and
``[hi, 1]`` (empty unless a site's scores changed between the calls, or the range reached a pass-1 end bin). The
range is an aggregate over all sites: it reveals the pooled score range at pass-1 bin resolution, which the summed
pass-1 histogram already showed; no site's own range and no single score is asked for or sent. Each task's AUC is
read off the pass whose bound is smaller (both are within their own bound of the exact AUC, so taking the smaller
never loses; pass 2 is the finer one except for ranges much wider than the band the probability grid resolves).
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
MAX_PASSES = 4  # pass 1 and at most three refinements (each narrows a task's range to its occupied bins)
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


def refined_edges(lo: float, hi: float, bins: int) -> np.ndarray:
    """Pass 2's B - 1 interior edges for one task: ``lo``, B - 3 edges of equal width in logit, ``hi``; the bins
    are ``[0, lo)``, B - 2 bins over ``[lo, hi)``, ``[hi, 1]``. ``lo`` and ``hi`` are pass-1 edges (or 0 and 1, taken
    as ``sigmoid(-2L)`` and ``sigmoid(2L)``: the end bins of pass 1 reach to 0 and 1, whose logits are infinite).
    Non-decreasing (two edges may coincide in float64 in a range of one ulp's order: the bin between is then empty,
    and the map stays monotone)."""
    bins = _check_bins(bins)
    lo, hi = max(float(lo), _FAR), min(float(hi), 1.0 - _FAR)
    if not lo < hi:
        raise ValueError(f"refined range [{lo}, {hi}): lo < hi within [0, 1]")
    z = np.linspace(math.log(lo / (1 - lo)), math.log(hi / (1 - hi)), bins - 1)
    edges = 1.0 / (1.0 + np.exp(-z))
    edges[0], edges[-1] = lo, hi
    edges = np.maximum.accumulate(np.clip(edges, lo, hi))
    edges.flags.writeable = False
    return edges


@dataclasses.dataclass(frozen=True)
class Binning:
    """Which bins a site counts its scores in: the fixed layout of ``bins`` bins (``lo``/``hi`` None: pass 1), or
    per task t with finite ``lo[t] < hi[t]`` the layout :func:`refined_edges` (pass 2; NaN: the fixed layout for
    that task). Built by the driver from the summed pass-1 histogram (:func:`refinement`); every executor carries
    it to the sites unchanged. Floats in tuples so that it compares, hashes and travels as plain values."""

    bins: int = DEFAULT_BINS
    lo: tuple[float, ...] | None = None
    hi: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        _check_bins(self.bins)
        if (self.lo is None) != (self.hi is None) or (self.lo is not None and len(self.lo) != len(self.hi or ())):
            raise ValueError(f"Binning lo={self.lo} hi={self.hi}: both None or one value per task each")
        for lo, hi in zip(self.lo or (), self.hi or (), strict=True):
            if not (math.isnan(lo) and math.isnan(hi)) and not 0 <= lo < hi <= 1:
                raise ValueError(f"Binning range [{lo}, {hi}): 0 <= lo < hi <= 1, or both NaN (the fixed layout)")

    @property
    def refined(self) -> bool:
        """Whether some task has a refined layout (pass 2)."""
        return self.lo is not None and any(not math.isnan(v) for v in self.lo)

    def edges(self, task: int) -> np.ndarray:
        """Task ``task``'s B - 1 interior edges."""
        if self.lo is None or self.hi is None:
            return bin_edges(self.bins)
        if task >= len(self.lo):
            raise ValueError(f"Binning has ranges for {len(self.lo)} tasks; task {task} asked")
        if math.isnan(self.lo[task]):
            return bin_edges(self.bins)
        return refined_edges(self.lo[task], self.hi[task], self.bins)


def binning_of(spec: int | Binning) -> Binning:
    """``spec`` as a :class:`Binning` (an int B: the fixed layout of B bins)."""
    return spec if isinstance(spec, Binning) else Binning(_check_bins(spec))


def occupied_range(hist: np.ndarray, binning: int | Binning) -> tuple[np.ndarray, np.ndarray]:
    """Per task, the lower edge of the lowest and the upper edge of the highest bin of ``hist`` (laid out by
    ``binning``) holding a count (0 and 1 close the end bins; NaN for a task without counts). Every binned score of
    the task lies in ``[lo, hi)`` (or at ``hi`` = 1)."""
    hist, binning = check_histograms(hist), binning_of(binning)
    lo, hi = np.full(hist.shape[0], np.nan), np.full(hist.shape[0], np.nan)
    for t in range(hist.shape[0]):
        occupied = np.flatnonzero(hist[t].sum(axis=0))
        if occupied.size:
            edges = np.concatenate(([0.0], binning.edges(t), [1.0]))
            lo[t], hi[t] = edges[occupied[0]], edges[occupied[-1] + 1]
    return lo, hi


def refinement(total: np.ndarray, binning: int | Binning, tolerance: float = REFINE_TOLERANCE) -> Binning | None:
    """The next pass's :class:`Binning` the driver asks for after summing a pass (``total``, laid out by
    ``binning``: the fixed layout of B bins for pass 1): for each task whose :func:`binning_error_bound` exceeds
    ``tolerance``, its occupied range; None if no task needs it (NaN bounds, tasks lacking a class, never do) or if
    no wanted task's range is narrower than the one it was counted in (scores that share a float value: further
    passes cannot split them). A range of one bin is refined as well: its scores are then spread over B - 2
    bins."""
    binning = binning_of(binning)
    bound = binning_error_bound(total)
    wanted = bound > tolerance  # NaN compares False
    if not wanted.any():
        return None
    lo, hi = occupied_range(total, binning)
    if binning.lo is not None:  # a refined pass: go on only where the occupied range shrank
        was_lo = np.array(binning.lo, dtype=np.float64)
        was_hi = np.array(binning.hi, dtype=np.float64)
        wanted &= ~((lo <= was_lo) & (hi >= was_hi))
        if not wanted.any():
            return None
    lo, hi = np.where(wanted, lo, np.nan), np.where(wanted, hi, np.nan)
    return Binning(binning.bins, tuple(float(v) for v in lo), tuple(float(v) for v in hi))


def finer_aucs(first: np.ndarray, second: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per task, the AUC of the pass (summed histograms ``first``, ``second`` of the same scores) with the smaller
    :func:`binning_error_bound`, and that bound; ties go to ``second`` (for a task not refined it equals ``first``).
    A task whose class totals differ between the passes (a client missing from one) keeps ``first``."""
    first, second = check_histograms(first), check_histograms(second, bins=first.shape[2], tasks=first.shape[0])
    auc1, auc2 = pooled_auc_from_histograms(first), pooled_auc_from_histograms(second)
    bound1, bound2 = binning_error_bound(first), binning_error_bound(second)
    same = (first.sum(axis=2) == second.sum(axis=2)).all(axis=1)
    take_first = (bound1 < bound2) | ~same  # NaN (a task lacking a class): both AUCs are NaN
    return np.where(take_first, auc1, auc2), np.where(take_first, bound1, bound2)


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
