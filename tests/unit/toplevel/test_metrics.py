"""Test AUC over tasks (docs/algorithms.md s.6): one AUC per task over its labelled samples, the mean over the
tasks whose AUC is defined."""

from __future__ import annotations

import math

import numpy as np
import pytest
from sklearn.metrics import roc_auc_score

import fdam_ray
from fdam_ray.metrics import mean_auc, task_aucs


def test_mean_auc_leaves_out_undefined_tasks():
    assert mean_auc(np.array([0.8, np.nan, 0.6])) == pytest.approx(0.7)
    assert math.isnan(mean_auc(np.array([np.nan, np.nan])))


def test_task_auc_uses_only_the_samples_labelled_for_the_task():
    rng = np.random.default_rng(0)
    scores = rng.random((50, 2))
    labels = (rng.random((50, 2)) < 0.4).astype(float)
    labels[rng.random((50, 2)) < 0.3] = np.nan
    labels[:, 1] = np.where(np.isnan(labels[:, 1]), np.nan, 0.0)  # task 1: no positive among its labels
    aucs = task_aucs(scores, labels)
    keep = ~np.isnan(labels[:, 0])
    assert aucs[0] == pytest.approx(roc_auc_score(labels[keep, 0], scores[keep, 0]))
    assert math.isnan(aucs[1])


def test_a_run_whose_test_set_lacks_a_class_for_one_task_reports_the_others_mean():
    rng = np.random.default_rng(1)

    def make(n):
        X = rng.standard_normal((n, 4)).astype(np.float32)
        Y = np.stack([X[:, 0] > 0.5, X[:, 1] > 0.0, X[:, 2] > 0.3], 1).astype(np.float32)
        return X, Y

    clients = [make(60) for _ in range(2)]
    Xt, Yt = make(120)
    Yt[:, 2] = 0.0  # no positive for task 2 in the test set: its AUC is undefined
    r = fdam_ray.train_arrays(dict(model="linear", batch_size="full", algorithm="coda_plus", objective="auc_square",
                                   iterations=6, local_steps=3, lr=0.3, eval_every=6, executor="inline"),
                              clients, (Xt, Yt))
    rec = r.history[-1]
    assert rec["task_auc"]["task2"] is None
    defined = [rec["task_auc"]["task0"], rec["task_auc"]["task1"]]
    assert rec["test_auc"] == pytest.approx(np.mean(defined), abs=1e-6)
