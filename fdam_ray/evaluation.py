"""Evaluation of the global model: pooled test AUC, per-task AUC, per-client AUC (docs/algorithms.md s.6).

The test AUC is computed once over pooled scores: the global test set scored on
the driver (or in slices on the clients, when the executor offers it), or,
when a dataset has no global test set, the union of the clients' own test
splits. Per-client AUC is reported for clients that hold a
test split of their own.
"""

from __future__ import annotations

import numpy as np

from fdam_ray.client import Replica
from fdam_ray.data import AnySplit, DataSource
from fdam_ray.executors import Executor
from fdam_ray.metrics import mean_auc, pooled, task_aucs
from fdam_ray.state import GlobalState


class Evaluator:
    """Scores the global model; the driver loads the global test set only if the clients do not score it."""

    def __init__(self, replica: Replica, source: DataSource, executor: Executor) -> None:
        self.replica = replica
        self.source = source
        self.task_names = source.task_names
        self.executor = executor
        self._test_loaded = False
        self._test: AnySplit | None = None

    def _driver_test_set(self) -> AnySplit | None:
        if not self._test_loaded:
            self._test, self._test_loaded = self.source.test_set(), True
        return self._test

    def __call__(self, state: GlobalState) -> dict:
        parts = self.executor.evaluate(state)
        s = self.executor.score_test_set(state)
        if s is None:
            test = self._driver_test_set()
            if test is not None:
                s = self.replica.scores_of(state, test)
        if s is not None:
            scores, labels = s.scores, s.labels
        elif parts:
            scores, labels = pooled([(p.scores, p.labels) for p in parts])
        else:
            raise ValueError("the dataset has neither a test set nor client test splits")
        aucs = task_aucs(scores, labels)
        out: dict = {"test_auc": mean_auc(aucs), "test_samples": len(labels)}
        if len(aucs) > 1:
            out["task_auc"] = {name: _num(a) for name, a in zip(self.task_names, aucs, strict=True)}
        if parts:
            out["client_auc"] = {str(p.client_id): _num(mean_auc(task_aucs(p.scores, p.labels))) for p in parts}
        return out


def _num(x: float) -> float | None:
    return None if np.isnan(x) else round(float(x), 6)
