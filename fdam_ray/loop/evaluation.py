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
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

import numpy as np

from fdam_ray.data import AnySplit, DataSource
from fdam_ray.executors import Executor
from fdam_ray.features.sites import client_label
from fdam_ray.loop.client import Replica
from fdam_ray.loop.state import GlobalState, Scores
from fdam_ray.metrics import mean_auc, pooled, task_aucs
from fdam_ray.models import model_name
from fdam_ray.settings.sections import Section, fail, setting, shared

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ValidationSection(Section):
    """The validation split and what selects on it."""

    name = "validation"

    val_fraction: float = setting(0.0, "Share of each client's training shard held out as its validation part "
                                  "(seeded, stratified by label; a dataset's own validation split where it has "
                                  "one); best_*, best_model.pt and Tune's default metric then select on val_auc and "
                                  "the test set is only reported; 0 = no validation, selection on test_auc.",
                                  check=(lambda v: 0 <= v < 1, "in [0, 1)"))
    augment: bool = shared()
    chestxray_val_split: str = shared()

    def check(self) -> None:
        if self.val_fraction > 0 and self.augment:
            raise fail("val_fraction", self.val_fraction, "0 with augment=true: the validation part is cut from "
                       "training data, whose images are augmented; set augment=false or val_fraction=0")
        if self.val_fraction == 0 and self.chestxray_val_split == "official":
            raise fail("chestxray_val_split", self.chestxray_val_split, "holdout unless val_fraction > 0: the "
                       "official validation split is kept out of training only to validate on")


class Evaluator:
    """Scores the global model; the driver loads the global test set only if the clients do not score it.

    ``warn_one_class``: warn on the first evaluation about test sets of one class (off where the caller has
    already, as :func:`fdam_ray.train_arrays` does before the run). ``validation``: score the clients'
    validation parts too (``val_fraction`` > 0).
    """

    def __init__(self, replica: Replica, source: DataSource, executor: Executor, *,
                 warn_one_class: bool = True, validation: bool = False) -> None:
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

    def _score_test(self, state: GlobalState) -> dict:
        parts = self.executor.evaluate(state)
        s = self.executor.score_test_set(state)
        if s is None:
            test = self._driver_test_set()
            if test is not None:
                s = self.replica.scores_of(state, test)
        for p in [*parts, *([s] if s is not None else [])]:
            self._check_outputs(p)
        if s is not None:
            scores, labels = s.scores, s.labels
        elif parts:
            scores, labels = pooled([(p.scores, p.labels) for p in parts])
        else:
            raise ValueError("the dataset has neither a test set nor client test splits")
        if self._warn_one_class:
            self._warn_one_class = False
            self._warn_if_one_class(("the test set" if s is not None else "the pooled test set (the clients' test "
                                     "splits)", labels, "the pooled test AUC"), parts, "test split", "AUC")
        return self._aucs("test", scores, labels, parts)

    def _score_validation(self, state: GlobalState) -> dict:
        """``val_auc`` (pooled over the clients' validation parts), ``val_samples``, ``val_task_auc`` and
        ``val_client_auc``."""
        parts = self.executor.evaluate(state, split="val")
        for p in parts:
            self._check_outputs(p, "validation part")
        if not parts:
            raise ValueError("val_fraction > 0 but no client has a validation part")
        scores, labels = pooled([(p.scores, p.labels) for p in parts])
        if self._warn_one_class_val:
            self._warn_one_class_val = False
            self._warn_if_one_class(("the pooled validation set", labels, "val_auc"), parts, "validation part",
                                    "val AUC")
        return self._aucs("val", scores, labels, parts)

    def _warn_if_one_class(self, pooled_set: tuple[str, np.ndarray, str], parts: Sequence[Scores], part: str,
                           auc: str) -> None:
        """One warning naming every set (the pooled one, then each client's ``part``) whose labels hold one class
        for a task, so that its AUC is NaN."""
        sets = [pooled_set] + [(f"client {self._label(p)}'s {part}", p.labels, f"client {self._label(p)}'s {auc}")
                               for p in parts]
        problems = one_class_problems(sets, self.task_names)
        if problems:
            log.warning("%s (an AUC needs positives and negatives)", "; ".join(problems))

    def _aucs(self, prefix: str, scores: np.ndarray, labels: np.ndarray, parts: Sequence[Scores]) -> dict:
        """``<prefix>_auc`` (pooled), ``<prefix>_samples``, and where there are several tasks or client parts
        ``<prefix>_task_auc`` and the per-client AUCs (``client_auc`` for the test splits)."""
        aucs = task_aucs(scores, labels)
        out: dict = {f"{prefix}_auc": mean_auc(aucs), f"{prefix}_samples": len(labels)}
        if len(aucs) > 1:
            task_key = "task_auc" if prefix == "test" else f"{prefix}_task_auc"
            out[task_key] = {name: _num(a) for name, a in zip(self.task_names, aucs, strict=True)}
        if parts:
            client_key = "client_auc" if prefix == "test" else f"{prefix}_client_auc"
            out[client_key] = {self._label(p): _num(mean_auc(task_aucs(p.scores, p.labels))) for p in parts}
        return out

    def _label(self, scores: Scores) -> str:
        """The client that scored ``scores``, as shown (its name, else its index): the key of its AUC."""
        return client_label(scores.client_id, self.replica.config.client_names)

    def _check_outputs(self, scores: Scores, part: str = "test split") -> None:
        """Refuse NaN outputs of the network (an AUC cannot rank them), naming the model and the samples."""
        bad = np.isnan(scores.scores).any(axis=tuple(range(1, scores.scores.ndim)))
        if not bad.any():
            return
        where = "the test set" if scores.client_id < 0 else f"client {self._label(scores)}'s {part}"
        raise ValueError(f"model {model_name(self.replica.config.model)!r}: its outputs were NaN for "
                         f"{int(bad.sum())} of {len(bad)} samples of {where} (first: sample "
                         f"{int(np.argmax(bad))}) while its weights are finite: its forward makes NaN (log or sqrt "
                         "of a negative, 0/0, inf - inf); fix the network's forward")


def one_class_problems(sets: Sequence[tuple[str, np.ndarray, str]], task_names: Sequence[str]) -> list[str]:
    """For each ``(name, labels (n, T), what its AUC is called)`` whose labels hold one class only for a task:
    a phrase saying so and that its AUC is NaN."""
    problems = []
    for name, labels, what in sets:
        labels = np.asarray(labels, dtype=np.float64).reshape(len(labels), -1)
        for t, task in enumerate(task_names):
            column = labels[:, t][~np.isnan(labels[:, t])]
            positives = int(column.sum())
            negatives = len(column) - positives
            if positives == 0 or negatives == 0:
                if len(task_names) > 1:  # a multi-task AUC is the mean over the tasks that have one
                    problems.append(f"{name} has {positives} positives and {negatives} negatives for task "
                                    f"'{task}', so its AUC for that task is NaN")
                else:
                    problems.append(f"{name} has {positives} positives and {negatives} negatives, so {what} is NaN")
    return problems


def _num(x: float) -> float | None:
    return None if np.isnan(x) else round(float(x), 6)
