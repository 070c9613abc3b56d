"""Evaluation of the global model: pooled test AUC, per-task AUC, per-client AUC (docs/algorithms.md s.6);
with ``val_fraction`` > 0 the same on the clients' validation parts, which model selection then uses.

The test AUC is computed once over pooled scores: the global test set scored on
the driver (or in slices on the clients, when the executor offers it), or,
when a dataset has no global test set, the union of the clients' own test
splits. Per-client AUC is reported for clients that hold a
test split of their own.

Two things a user's own model or data can do wrong show here, each in one
line: a network whose outputs are NaN (its weights are finite, the federation
checks them every round) is refused, naming the model; a test set holding one
class only for a task gets a warning on the first evaluation, since its AUC is
NaN.

Validation (:class:`ValidationSection`): each client holds out a seeded,
label-stratified share of its training shard (or uses its dataset's own
validation split). Every evaluation then scores the validation parts as well
(``val_auc`` pooled over them, ``val_client_auc`` per client, ``val_task_auc``
per task) and the test set as before; the run's selection (``best_*`` of the
summary, ``best_model.pt``, Tune's default metric) uses ``val_auc`` and never
the test set.

Histograms (``test_scores: histogram``, ``histogram_bins`` = B): the clients
send :class:`~fdam_ray.core.state.ScoreHistogram` records instead of scores
(per-class counts of their scores in B fixed intervals and their own AUC per
task); the driver sums the counts and reads the pooled AUC off the sum
(:mod:`fdam_ray.scores.histogram`), within the binning bound of the exact
one. Where that bound exceeds ``REFINE_TOLERANCE`` for a task (an untrained
model, all its scores near 1/2), the driver asks the clients for further
histograms of B bins that cut the summed counts' bins holding both classes
(:func:`~fdam_ray.scores.histogram_passes.refined_aucs`: ranges from all
clients' counts summed, no client's own), at most ``MAX_PASSES`` passes, and
reads the AUC off every pass's counts together. ``client_auc``
is each client's own AUC, exact. Under Flower's SecAgg+ (``flower.secagg: true``) the executor returns ONE
pre-summed histogram (client_id ``SUMMED`` = -1, no per-client AUC: :func:`presummed`): its counts are the
exact sum of the sites' counts, so ``test_auc`` is the same, and ``client_auc`` is absent from the record (no
site's own AUC reaches the server). The global test set is the driver's own data
(scored here, or in slices by the Ray executor's actors, the driver's
workers): it is scored exactly in both modes.

Every split's pooled counts pass the plug's evaluation hook (:meth:`~fdam_ray.loop.plug.Plug.evaluation`) before
an AUC is read off them. The plug that does nothing releases them unchanged (the above, bit for bit); private
evaluation (``dp_eval: on``, :mod:`fdam_ray.privacy.evaluation`) releases them noised, and then the AUCs (pooled,
per task) and the one-class warning come from the noised counts only (``<split>_samples`` is not recorded): the
driver's own test set is binned too (:attr:`~fdam_ray.loop.plug.Plug.counts_only`), no refinement pass is asked
and no per-site AUC is recorded.

Clinical read-out (``clinical: on``, :mod:`fdam_ray.scores.clinic`): the test record adds the AUC's DeLong SE and
95 % intervals, the one- and two-way pAUC and the operating points, read off the pooled counts the AUC came from
(exact scores: one bin per distinct score; histograms: the finest cells of the refinement passes, replayed from
the passes' summed counts; a plug's released counts, never the raw ones), and per site (``client_<figure>``) off
each site's own scores or first-pass histogram where per-site AUCs are recorded; the validation record likewise
(``val_<figure>``, ``val_client_<figure>``), which ``select_by: val_pauc`` selects on.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

import numpy as np

from fdam_ray.clients.client import Replica
from fdam_ray.core.state import GlobalState, ScoreHistogram, Scores
from fdam_ray.data import AnySplit, DataSource
from fdam_ray.executors import Executor
from fdam_ray.features.sites import client_label
from fdam_ray.loop.plug import NO_PLUG, Plug, Released
from fdam_ray.metrics import mean_auc, pooled, task_aucs
from fdam_ray.models import model_name
from fdam_ray.scores import clinic
from fdam_ray.scores.histogram import (
    Binning,
    auc_of_counts,
    check_histograms,
    score_histograms,
    sum_histograms,
)
from fdam_ray.scores.histogram_passes import Pooled, refined_aucs
from fdam_ray.settings.coercion import register_kind
from fdam_ray.settings.sections import Section, fail, setting, shared, warn_once

log = logging.getLogger(__name__)

Part = Scores | ScoreHistogram  # what a client sends of one part of its data
SUMMED = -1  # client_id of a histogram already summed over the sites (SecAgg+): no client's own part


def presummed(part: Part) -> bool:
    """Whether ``part`` is the sites' histograms summed before the driver sees them (SecAgg+), not one client's."""
    return isinstance(part, ScoreHistogram) and part.client_id == SUMMED


def _fractions(name: str, value: object) -> tuple[float, ...]:
    """``operating_points``: a list of numbers in (0, 1)."""
    if (not isinstance(value, (list, tuple)) or not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                                        and 0 < v < 1 for v in value)):
        raise fail(name, value, "a list of numbers in (0, 1)")
    return tuple(float(v) for v in value)


register_kind("fraction_list", _fractions)
SELECT_BY = ("val_auc", "val_pauc", "val_tpauc")  # what may select the best evaluation (select_by)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ValidationSection(Section):
    """The validation split and what selects on it; what an evaluation reports beyond the AUC (clinical)."""

    name = "validation"

    val_fraction: float = setting(0.0, "Share of each client's training shard held out as its validation part "
                                  "(seeded, stratified by label; a dataset's own validation split where it has "
                                  "one); best_* and best_model.pt then select on select_by (val_auc), Tune's default "
                                  "metric on val_auc, and the test set is only reported; 0 = no validation, "
                                  "selection on test_auc.", check=(lambda v: 0 <= v < 1, "in [0, 1)"))
    clinical: str = setting("off", "on = every evaluation record adds the clinical read-out of the test set and of the "
                            "validation parts (val_<figure>), pooled and per site where sites' figures are kept: the "
                            "AUC's DeLong SE and 95% interval (Wald and logit), the pAUC at FPR <= pauc_max_fpr (raw "
                            "and McClish), the two-way pAUC (pauc_min_tpr) and the sensitivity/specificity at "
                            "operating_points; docs/algorithms.md s.6.", choices=("off", "on"), resume=True)
    pauc_max_fpr: float = setting(0.1, "clinical: on: beta, the largest false positive rate of the partial AUC.",
                                  check=(lambda v: 0 < v <= 1, "in (0, 1]"), resume=True)
    pauc_min_tpr: float | None = setting(None, "clinical: on: alpha, the smallest true positive rate of the two-way "
                                         "partial AUC (TPR >= alpha, FPR <= pauc_max_fpr); null = not reported.",
                                         check=(lambda v: 0 <= v < 1, "in [0, 1)"), resume=True)
    operating_points: tuple[float, ...] = setting(
        (0.9, 0.95), "clinical: on: the specificities at which the sensitivity is reported (test_sens_at_spec_<s>) "
        "and the sensitivities at which the specificity is (test_spec_at_sens_<s>).", kind="fraction_list",
        resume=True)
    select_by: str = setting("val_auc", "With val_fraction > 0, the validation figure that selects the run's best "
                             "evaluation (best_*, best_model.pt): val_auc, val_pauc (pAUC at FPR <= pauc_max_fpr) or "
                             "val_tpauc (two-way pAUC, needs pauc_min_tpr); the pAUCs need clinical: on.",
                             choices=SELECT_BY)
    augment: bool = shared()
    chestxray_val_split: str = shared()

    def check(self) -> None:
        if self.select_by != "val_auc" and (self.val_fraction == 0 or self.clinical == "off"):
            raise fail("select_by", self.select_by, "val_auc unless val_fraction > 0 and clinical: on: a pAUC "
                       "selects on the validation parts' clinical read-out")
        if self.select_by == "val_tpauc" and self.pauc_min_tpr is None:
            raise fail("select_by", self.select_by, "val_auc or val_pauc while pauc_min_tpr is null (the two-way "
                       "pAUC needs it)")
        if self.val_fraction > 0 and self.augment:
            raise fail("val_fraction", self.val_fraction, "0 with augment=true: the validation part is cut from "
                       "training data, whose images are augmented; set augment=false or val_fraction=0")
        if self.val_fraction == 0 and self.chestxray_val_split == "official":
            raise fail("chestxray_val_split", self.chestxray_val_split, "holdout unless val_fraction > 0: the "
                       "official validation split is kept out of training only to validate on")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ClinicalRead(Section):
    """The clinical read-out's fields (:class:`ValidationSection` declares them) as the :class:`Evaluator` reads
    them off its replica's config."""

    clinical: str = shared()
    pauc_max_fpr: float = shared()
    pauc_min_tpr: float | None = shared()
    operating_points: tuple[float, ...] = shared()


class Evaluator:
    """Scores the global model; the driver loads the global test set only if the clients do not score it.

    ``warn_one_class``: warn on the first evaluation about test sets of one class (off where the caller has
    already, as :func:`fdam_ray.train_arrays` does before the run). ``validation``: score the clients'
    validation parts too (``val_fraction`` > 0). ``histogram_bins``: B under ``test_scores: histogram`` (the
    clients send score histograms of B bins, this module's docstring), None: they send their scores. ``plug``:
    whose evaluation hook releases the pooled counts (the default releases them unchanged).
    """

    def __init__(self, replica: Replica, source: DataSource, executor: Executor, *,
                 warn_one_class: bool = True, validation: bool = False, histogram_bins: int | None = None,
                 plug: Plug = NO_PLUG) -> None:
        self.bins = histogram_bins
        self.plug = plug
        self._per_site = True  # whether the last pooled split's per-site AUCs may be recorded (the plug's say)
        self._counts: np.ndarray | None = None  # the last pooled split's counts (T, 2, K) for the clinical read-out
        try:
            section: ClinicalRead | None = ClinicalRead.of(replica.config)
        except AttributeError:  # a stand-in replica whose config lacks the clinical fields: the read-out is off
            section = None
        self.clinical = section if section is not None and section.clinical == "on" else None
        self.replica = replica
        self.source = source
        self.task_names = source.task_names
        self.executor = executor
        self.validation = validation
        self._test_loaded = False
        self._test: AnySplit | None = None
        self._warn_one_class = warn_one_class and not getattr(source, "one_class_warned", False)
        self._warn_one_class_val = validation

    def _driver_test_set(self) -> AnySplit | None:
        if not self._test_loaded:
            self._test, self._test_loaded = self.source.test_set(), True
        return self._test

    def __call__(self, state: GlobalState) -> dict:
        out = self._score_test(state)
        if self.validation:
            out.update(self._score_validation(state))
        return out

    def _parts(self, state: GlobalState, split: str) -> Sequence[Part]:
        """What the clients send of ``split``: their scores, or (``histogram_bins``) their histograms."""
        if self.bins is not None:
            return self.executor.evaluate(state, split=split, bins=Binning(self.bins))
        return self.executor.evaluate(state) if split == "test" else self.executor.evaluate(state, split="val")

    def _score_test(self, state: GlobalState) -> dict:
        parts = self._parts(state, "test")
        s = self.executor.score_test_set(state)
        if s is None:
            test = self._driver_test_set()
            if test is not None:
                s = self.replica.scores_of(state, test)
        for p in [*parts, *([s] if s is not None else [])]:
            self._check_outputs(p)
        if s is None and not parts:
            raise ValueError("the dataset has neither a test set nor client test splits")
        aucs, samples, counts = self._pooled(s, parts, state, "test")
        if not self._per_site:  # the plug releases the pooled counts only: no site's own figure
            parts = []
        if self._warn_one_class:
            self._warn_one_class = False
            self._warn_if_one_class(("the test set" if s is not None else "the pooled test set (the clients' test "
                                     "splits)", counts, "the pooled test AUC"), parts, "test split", "AUC")
        out = self._aucs("test", aucs, samples, parts)
        if self.clinical is not None:
            out.update(self._clinical_fields(parts))
        return out

    def _clinical_fields(self, parts: Sequence[Part], split: str = "test") -> dict:
        """The clinical read-out (``clinical: on``) of ``split``'s pooled counts and of each site's own part (its
        scores, exact; or its pass-1 histogram of B bins): :func:`~fdam_ray.scores.clinic.record_fields`."""
        cfg = self.clinical
        if cfg is None or self._counts is None:
            return {}
        sites = {self._label(p): _part_counts(p) for p in parts if not presummed(p)}
        return clinic.record_fields(self._counts, sites, split=split, task_names=self.task_names,
                                    max_fpr=cfg.pauc_max_fpr, min_tpr=cfg.pauc_min_tpr, points=cfg.operating_points)

    def _pooled(self, own: Scores | None, parts: Sequence[Part], state: GlobalState,
                split: str) -> tuple[np.ndarray, int | None, tuple]:
        """The pooled AUC per task, the samples and the per-class counts (for the one-class warning) of ``own``
        (the driver's global test set, exact) or else of the clients' parts: pooled scores, or summed
        histograms (refined by further passes over ``split`` of ``state`` where pass 1's bound is too wide)."""
        self._per_site = True
        if self.plug.counts_only and self.bins is None:  # config refuses it (dp_eval needs test_scores: histogram)
            raise ValueError("a plug releasing counts only needs test_scores: histogram (histogram_bins)")
        if own is not None and self.plug.counts_only and self.bins is not None:
            return self._released(split, score_histograms(own.scores, own.labels, self.bins), None)
        if own is not None:
            if self.bins is not None:
                warn_once(log, "test_scores: histogram acts on the clients' test splits; this dataset's test set is "
                          "the driver's own, scored exactly (no site sends scores for it); set dp_eval: on to release "
                          "it as noised counts, or keep test_scores: exact")
            self._counts = clinic.exact_counts(own.scores, own.labels) if self.clinical is not None else None
            return task_aucs(own.scores, own.labels), len(own.labels), class_counts(own.labels)
        if self.bins is None:
            scores, labels = pooled([(p.scores, p.labels) for p in parts if isinstance(p, Scores)])
            self._counts = clinic.exact_counts(scores, labels) if self.clinical is not None else None
            return task_aucs(scores, labels), len(labels), class_counts(labels)
        hists = [p for p in parts if isinstance(p, ScoreHistogram)]
        total = self._summed(hists)
        if self.plug.counts_only:
            return self._released(split, total, None)
        released = self.plug.evaluation(split, total)
        if not released.refine or released.counts is not total:
            return self._released(split, total, released)

        def ask(again: Binning) -> np.ndarray:  # a refined pass: the clients' histograms of ``again``, summed
            finer = [p for p in self.executor.evaluate(state, split=split, bins=again)
                     if isinstance(p, ScoreHistogram)]
            for p in finer:
                self._check_outputs(p, "validation part" if split == "val" else "test split")
            return self._summed(finer)

        passes: list[tuple[Binning, np.ndarray]] = []

        def kept(again: Binning) -> np.ndarray:
            passes.append((again, ask(again)))
            return passes[-1][1]

        aucs, _ = refined_aucs(total, self.bins, kept)
        if self.clinical is not None:  # the finest cells the passes resolve, the passes' counts laid as refined_aucs
            cells = Pooled.first(total, self.bins)
            for again, summed in passes:
                cells = cells.add(summed, again)
            self._counts = clinic.padded([c.counts for c in cells.tasks])
        return aucs, sum(h.samples for h in hists), (total[:, 1].sum(-1), total[:, 0].sum(-1))

    def _released(self, split: str, total: np.ndarray,
                  released: Released | None) -> tuple[np.ndarray, int | None, tuple]:
        """:meth:`_pooled`'s triple read off what the plug releases of ``split``'s summed counts ``total`` (asked
        here when ``released`` is None): the AUCs, no sample count (None: the clipped noised counts' total is biased
        up by the empty bins, so none is recorded) and the per-class totals, nothing else of ``total``."""
        released = self.plug.evaluation(split, total) if released is None else released
        self._per_site = released.per_site
        counts = np.asarray(released.counts, dtype=np.float64)
        self._counts = counts  # the clinical read-out too comes from what the plug releases, never from ``total``
        positives, negatives = counts[:, 1].sum(-1), counts[:, 0].sum(-1)
        return auc_of_counts(counts), None, (np.rint(positives), np.rint(negatives))

    def _summed(self, hists: Sequence[ScoreHistogram]) -> np.ndarray:
        """The clients' histograms, each checked (B bins, one per task), summed."""
        tasks = len(self.task_names)
        return sum_histograms([check_histograms(h.counts, bins=self.bins, tasks=tasks) for h in hists])

    def _score_validation(self, state: GlobalState) -> dict:
        """``val_auc`` (pooled over the clients' validation parts), ``val_samples``, ``val_task_auc`` and
        ``val_client_auc``; with ``clinical: on`` the read-out as ``val_<figure>``, ``val_task_<figure>`` and
        ``val_client_<figure>``."""
        parts = self._parts(state, "val")
        for p in parts:
            self._check_outputs(p, "validation part")
        if not parts:
            raise ValueError("val_fraction > 0 but no client has a validation part")
        aucs, samples, counts = self._pooled(None, parts, state, "val")
        if not self._per_site:
            parts = []
        if self._warn_one_class_val:
            self._warn_one_class_val = False
            self._warn_if_one_class(("the pooled validation set", counts, "val_auc"), parts, "validation part",
                                    "val AUC")
        out = self._aucs("val", aucs, samples, parts)
        if self.clinical is not None:
            out.update(self._clinical_fields(parts, "val"))
        return out

    def _warn_if_one_class(self, pooled_set: tuple[str, tuple, str], parts: Sequence[Part], part: str,
                           auc: str) -> None:
        """One warning naming every set (the pooled one, then each client's ``part``) whose labels hold one class
        for a task, so that its AUC is NaN."""
        sets = [pooled_set] + [(f"client {self._label(p)}'s {part}", _counts_of(p), f"client {self._label(p)}'s "
                                f"{auc}") for p in parts if not presummed(p)]
        problems = one_class_lines(sets, self.task_names)
        if problems:
            log.warning("%s (an AUC needs positives and negatives)", "; ".join(problems))

    def _aucs(self, prefix: str, aucs: np.ndarray, samples: int | None, parts: Sequence[Part]) -> dict:
        """``<prefix>_auc`` (pooled, from the AUC per task ``aucs``), ``<prefix>_samples`` (unless None), and where
        there are several tasks or client parts ``<prefix>_task_auc`` and the per-client AUCs (``client_auc`` for the
        test splits)."""
        out: dict = {f"{prefix}_auc": mean_auc(aucs)}
        if samples is not None:
            out[f"{prefix}_samples"] = samples
        if len(aucs) > 1:
            task_key = "task_auc" if prefix == "test" else f"{prefix}_task_auc"
            out[task_key] = {name: _num(a) for name, a in zip(self.task_names, aucs, strict=True)}
        parts = [p for p in parts if not presummed(p)]  # a pre-summed histogram has no client's AUC
        if parts:
            client_key = "client_auc" if prefix == "test" else f"{prefix}_client_auc"
            out[client_key] = {self._label(p): _num(mean_auc(_client_aucs(p))) for p in parts}
        return out

    def _label(self, scores: Part) -> str:
        """The client that scored ``scores``, as shown (its name, else its index): the key of its AUC."""
        return client_label(scores.client_id, self.replica.config.client_names)

    def _check_outputs(self, scores: Part, part: str = "test split") -> None:
        """Refuse NaN outputs of the network (an AUC cannot rank them), naming the model and the samples."""
        where = "the test set" if scores.client_id < 0 else f"client {self._label(scores)}'s {part}"
        if presummed(scores):
            where = f"the sites' {part}s (summed)"
        if isinstance(scores, ScoreHistogram):  # the client counted them; which samples stays at the client
            if scores.nan_outputs:
                raise ValueError(self._nan_refusal(f"{scores.nan_outputs} of {scores.samples} samples of {where}"))
            return
        bad = np.isnan(scores.scores).any(axis=tuple(range(1, scores.scores.ndim)))
        if bad.any():
            raise ValueError(self._nan_refusal(f"{int(bad.sum())} of {len(bad)} samples of {where} (first: sample "
                                               f"{int(np.argmax(bad))})"))

    def _nan_refusal(self, samples: str) -> str:
        return (f"model {model_name(self.replica.config.model)!r}: its outputs were NaN for {samples} while its "
                "weights are finite: its forward makes NaN (log or sqrt of a negative, 0/0, inf - inf); fix the "
                "network's forward")


def class_counts(labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per task, the positives and the negatives among ``labels`` (n, T) (NaN = missing)."""
    labels = np.asarray(labels, dtype=np.float64).reshape(len(labels), -1)
    labelled = ~np.isnan(labels)
    positives = np.where(labelled, labels, 0).sum(0).astype(np.int64)
    return positives, labelled.sum(0) - positives


def _counts_of(part: Part) -> tuple[np.ndarray, np.ndarray]:
    if isinstance(part, ScoreHistogram):
        return part.counts[:, 1].sum(-1), part.counts[:, 0].sum(-1)
    return class_counts(part.labels)


def _part_counts(part: Part) -> np.ndarray:
    """A site's own counts ``(T, 2, K)``: of its scores, one bin per distinct score; or its histogram's."""
    return np.asarray(part.counts, np.float64) if isinstance(part, ScoreHistogram) else clinic.exact_counts(
        part.scores, part.labels)


def _client_aucs(part: Part) -> np.ndarray:
    """A client's AUC per task: computed here from its scores, or by the client itself (histograms)."""
    return np.asarray(part.task_auc) if isinstance(part, ScoreHistogram) else task_aucs(part.scores, part.labels)


def one_class_problems(sets: Sequence[tuple[str, np.ndarray, str]], task_names: Sequence[str]) -> list[str]:
    """For each ``(name, labels (n, T), what its AUC is called)`` whose labels hold one class only for a task:
    a phrase saying so and that its AUC is NaN."""
    return one_class_lines([(name, class_counts(labels), what) for name, labels, what in sets], task_names)


def one_class_lines(sets: Sequence[tuple[str, tuple, str]], task_names: Sequence[str]) -> list[str]:
    """:func:`one_class_problems` of sets given as ``(name, (positives (T,), negatives (T,)), what)``."""
    problems = []
    for name, (pos, neg), what in sets:
        for t, task in enumerate(task_names):
            positives, negatives = int(pos[t]), int(neg[t])
            if positives == 0 or negatives == 0:
                if len(task_names) > 1:  # a multi-task AUC is the mean over the tasks that have one
                    problems.append(f"{name} has {positives} positives and {negatives} negatives for task "
                                    f"'{task}', so its AUC for that task is NaN")
                else:
                    problems.append(f"{name} has {positives} positives and {negatives} negatives, so {what} is NaN")
    return problems


def _num(x: float) -> float | None:
    return None if np.isnan(x) else round(float(x), 6)
