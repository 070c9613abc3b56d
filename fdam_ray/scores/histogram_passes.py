"""The driver's refinement passes of the histogram AUC (:mod:`fdam_ray.scores.histogram`'s docstring).

The driver keeps, per task, the finest partition of the score axis the passes so far resolve, with the pooled
counts of each of its cells (:class:`Pooled`): pass 1's B bins, then after each refined pass the cells of either
pass wherever they tile the same stretch between edges both passes share. Its AUC (pairs in different cells by
their order, pairs in one cell 1/2) is within ``sum_c pos_c neg_c / (2 P N)`` of the exact one, as for one pass:
the cells are intervals, ordered as the scores are. The next pass refines the cells that hold both classes
(:meth:`Pooled.refinement`): only their pairs are off.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from fdam_ray.scores.histogram import (
    MAX_PASSES,
    REFINE_TOLERANCE,
    Binning,
    _doubled_concordance,
    bin_edges,
    check_histograms,
    from_unit,
    to_unit,
)

# A run of cells cut into this many sub-bins or more, all of whose scores fall into one, is not cut again: its scores
# are within 1/64 of its width of one another (equal ones in every case measured). A run cut into fewer (many runs
# share the B bins) is cut again at the next pass, which usually has fewer runs to share them.
STUCK_CUTS = 64


@dataclasses.dataclass(frozen=True)
class Cells:
    """One task's partition: ``edges`` (K - 1 interior edges, strictly increasing: cell c holds the scores s with
    ``edges[c - 1] <= s < edges[c]``) and ``counts`` ``(2, K)`` int64 (negatives, positives). ``final``: no
    further pass is asked for it (a pass disagreed with the counts so far: a site's scores changed or a site was
    missing). ``stuck``: cells not refined again, since the last pass that cut their run into sub-bins found all
    of the run's scores in this one (equal scores, or too close for a pass to tell apart)."""

    edges: np.ndarray
    counts: np.ndarray
    final: bool = False
    stuck: np.ndarray | None = None  # per cell: a pass cut its run and every count of the run fell in this cell

    @property
    def pairs(self) -> int:
        return int(self.counts[1].sum()) * int(self.counts[0].sum())

    def auc(self) -> float:
        """The AUC of the cells (NaN without both classes): the quotient of two exact integers, rounded once."""
        pairs = self.pairs
        return _doubled_concordance(self.counts[0], self.counts[1], 2 * pairs) / (2 * pairs) if pairs else np.nan

    def bound(self) -> float:
        """``sum_c pos_c neg_c / (2 P N)`` (NaN without both classes)."""
        pairs = self.pairs
        shared = int(np.dot(self.counts[0].astype(object), self.counts[1].astype(object)))
        return shared / (2 * pairs) if pairs else np.nan


def _distinct(edges: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The same partition without cells of zero width (between equal edges: empty, their counts, if any, go to the
    cell above)."""
    keep = np.concatenate(([True], np.diff(edges) > 0)) if edges.size else np.ones(0, bool)
    if keep.all():
        return edges, counts
    unique = edges[keep]
    to = np.concatenate(([0], np.searchsorted(unique, edges, side="right")))
    merged = np.zeros((2, unique.size + 1), np.int64)
    for k in (0, 1):
        np.add.at(merged[k], to, counts[k])
    return unique, merged


def _combined(old: Cells, edges: np.ndarray, counts: np.ndarray, ranges: list[tuple[float, float]]) -> Cells:
    """``old`` and a pass's cells of the same scores: between consecutive edges both hold, the tiling (old's cells
    or the pass's) with fewer shared pairs, the pass's on equal ones. Cells of a tiling are cut only at its own edges,
    so every kept cell's counts are known. Where a stretch's class totals differ between the two (the scores are
    not the same), ``old`` unchanged and final."""
    edges, counts = _distinct(np.asarray(edges, np.float64), np.asarray(counts, np.int64))
    common = np.intersect1d(old.edges, edges)
    low_old = np.concatenate(([-np.inf], old.edges))  # each cell's lower edge
    low_new = np.concatenate(([-np.inf], edges))
    seg_old = np.searchsorted(common, low_old, side="right")
    seg_new = np.searchsorted(common, low_new, side="right")
    segments = common.size + 1
    totals = [np.stack([np.bincount(seg, weights=c[k], minlength=segments) for k in (0, 1)])
              for seg, c in ((seg_old, old.counts), (seg_new, counts))]
    if not np.array_equal(totals[0], totals[1]):
        return dataclasses.replace(old, final=True)
    cost_old = np.bincount(seg_old, weights=old.counts[0] * old.counts[1].astype(np.float64), minlength=segments)
    cost_new = np.bincount(seg_new, weights=counts[0] * counts[1].astype(np.float64), minlength=segments)
    take_new = cost_new <= cost_old
    keep_old, keep_new = ~take_new[seg_old], take_new[seg_new]
    low = np.concatenate((low_old[keep_old], low_new[keep_new]))
    order = np.argsort(low, kind="stable")
    cells = np.concatenate((old.counts[:, keep_old], counts[:, keep_new]), axis=1)[:, order]
    was_stuck = np.zeros(old.counts.shape[1], bool) if old.stuck is None else old.stuck
    stuck = np.concatenate((was_stuck[keep_old], _unsplit(low_new, counts, ranges)[keep_new]))[order]
    return Cells(low[order][1:], cells, stuck=stuck)


def _unsplit(low: np.ndarray, counts: np.ndarray, ranges: list[tuple[float, float]]) -> np.ndarray:
    """Per cell of a pass (lower edges ``low``): whether it holds both classes and every count of the range it cuts
    (``ranges``), that range cut into :data:`STUCK_CUTS` cells or more."""
    lo = np.array([r[0] for r in ranges])
    hi = np.array([r[1] for r in ranges])
    at = np.maximum(np.searchsorted(lo, low, side="right") - 1, 0)
    inside = (low >= lo[at]) & (low < hi[at])
    held = counts.sum(axis=0)
    of_range = np.bincount(at[inside], weights=held[inside], minlength=len(lo))
    cuts = np.bincount(at[inside], minlength=len(lo))
    return inside & (held == of_range[at]) & (cuts[at] >= STUCK_CUTS) & (counts[0] > 0) & (counts[1] > 0)


def _ranges(cells: Cells, bins: int, most: int) -> list[tuple[float, float]]:
    """The runs of consecutive cells holding both classes that a finer layout can still split (a cell one or a few
    ulps wide cannot: the scores it holds are equal, or all but), as ``[lo, hi)`` (cell edges; 0 and 1 at the
    ends); at most ``most`` of them, those with the most shared pairs (the earlier on equal ones)."""
    lower = np.concatenate(([0.0], cells.edges))
    upper = np.concatenate((cells.edges, [1.0]))
    units = to_unit(np.stack([lower, upper]), bins)
    middle = from_unit(units.mean(axis=0), bins)
    mixed = (cells.counts[0] > 0) & (cells.counts[1] > 0) & (lower < middle) & (middle < upper)
    if cells.stuck is not None:
        mixed &= ~cells.stuck
    if not mixed.any():
        return []
    flips = np.flatnonzero(np.diff(np.concatenate(([0], mixed.astype(np.int8), [0]))))
    starts, stops = flips[::2], flips[1::2]  # run r: cells starts[r] .. stops[r] - 1
    shared = np.add.reduceat(cells.counts[0] * cells.counts[1].astype(np.float64), starts)
    runs = np.argsort(-shared, kind="stable")[:most] if len(starts) > most else np.arange(len(starts))
    runs.sort()
    return [(float(lower[starts[r]]), float(upper[stops[r] - 1])) for r in runs]


@dataclasses.dataclass(frozen=True)
class Pooled:
    """The pooled counts of every pass so far, per task on the finest partition they resolve (:class:`Cells`)."""

    bins: int
    tasks: tuple[Cells, ...]

    @classmethod
    def first(cls, total: np.ndarray, bins: int) -> Pooled:
        """Pass 1: the summed histogram ``total`` ``(T, 2, B)`` on the fixed layout."""
        total = check_histograms(total, bins=bins)
        return cls(bins, tuple(Cells(*_distinct(bin_edges(bins), total[t])) for t in range(total.shape[0])))

    def aucs(self) -> np.ndarray:
        """Per task, the AUC of its cells (float64, NaN where a task lacks a class)."""
        return np.array([c.auc() for c in self.tasks], dtype=np.float64)

    def bounds(self) -> np.ndarray:
        """Per task, the most :meth:`aucs` can differ from the exact AUC of the pooled scores."""
        return np.array([c.bound() for c in self.tasks], dtype=np.float64)

    def refinement(self, tolerance: float = REFINE_TOLERANCE) -> Binning | None:
        """The next pass's :class:`Binning`: for each task whose bound exceeds ``tolerance``, its runs of cells that
        hold both classes (:func:`_ranges`, at most (B - 1) / 4, so that a run gets three sub-bins or more on
        average), cut into the B bins of :func:`~fdam_ray.scores.histogram.refined_edges`. None where no task
        needs one or none has a run a finer layout can split (equal scores of both classes: no pass can)."""
        bounds = self.bounds()
        most = max(min(1, (self.bins - 1) // 2), (self.bins - 1) // 4)
        ranges = [(_ranges(c, self.bins, most) if b > tolerance and not c.final else [])
                  for c, b in zip(self.tasks, bounds, strict=True)]  # NaN compares False
        if not any(ranges):
            return None
        return Binning.of_ranges(self.bins, ranges)

    def add(self, summed: np.ndarray, binning: Binning) -> Pooled:
        """With the summed histogram ``summed`` of a pass laid out by ``binning`` (its refined tasks; the others
        keep their cells)."""
        summed = check_histograms(summed, bins=self.bins, tasks=len(self.tasks))
        return dataclasses.replace(self, tasks=tuple(
            _combined(c, binning.edges(t), summed[t], binning.ranges(t)) if binning.ranges(t) else c
            for t, c in enumerate(self.tasks)))


def refined_aucs(total: np.ndarray, bins: int, ask: Callable[[Binning], np.ndarray],
                 tolerance: float = REFINE_TOLERANCE, passes: int = MAX_PASSES) -> tuple[np.ndarray, np.ndarray]:
    """Per task the pooled AUC and its bound, from the summed pass-1 histogram ``total`` and at most ``passes`` - 1
    refinements: ``ask(binning)`` returns the sites' histograms of a refined ``binning`` summed (what the driver
    asks of them: ranges of the summed counts, no site's own)."""
    pooled = Pooled.first(total, bins)
    for _ in range(passes - 1):
        again = pooled.refinement(tolerance)
        if again is None:
            break
        pooled = pooled.add(ask(again), again)
    return pooled.aucs(), pooled.bounds()
