"""The clinical read-out's degenerate cases in a record (``clinical: on``): a site holding one class has no figure of
its own (null) while the pool's are read; a pooled set without positives has every figure null and one warning
line, never an exception; the same under histograms; and the per-site McClish pAUC of exact scores is sklearn's
``roc_auc_score(max_fpr=...)`` (fdam_ray.loop.evaluation, fdam_ray.scores.clinic)."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from sklearn.metrics import roc_auc_score

from fdam_ray.core.state import Scores
from fdam_ray.loop.evaluation import ClinicalRead, Evaluator
from fdam_ray.scores.histogram import score_histograms

BETA = 0.3


def evaluator(parts, bins=None):
    class Exec:
        def evaluate(self, state, split="test", bins=None):
            if bins is None:
                return parts
            from fdam_ray.core.state import ScoreHistogram
            from fdam_ray.metrics import task_aucs

            return [ScoreHistogram(p.client_id, score_histograms(p.scores, p.labels, bins),
                                   task_aucs(p.scores, p.labels), len(p.labels)) for p in parts]

        def score_test_set(self, state):
            return None

    source = type("Src", (), {"task_names": ("y",), "test_set": lambda self: None})()
    config = ClinicalRead(clinical="on", pauc_max_fpr=BETA, pauc_min_tpr=0.5, operating_points=(0.9,))
    config = type("C", (), {**vars(config), "client_names": ("north", "south", "east")})()
    return Evaluator(type("R", (), {"config": config})(), source, Exec(), histogram_bins=bins)


def site(k, labels, seed):
    labels = np.asarray(labels, np.float32)
    scores = 1 / (1 + np.exp(-np.random.default_rng(seed).normal(2 * labels - 1, 1.5)))  # sigmoid scores
    scores = scores.astype(np.float32)
    return Scores(client_id=k, scores=scores[:, None], labels=labels[:, None])


@pytest.mark.parametrize("bins", [None, 4096])
def test_a_site_of_one_class_has_no_figure_of_its_own_and_the_pool_is_read(bins, caplog):
    parts = [site(0, [1] * 20 + [0] * 30, 1), site(1, [0] * 25, 2), site(2, [1] * 15 + [0] * 15, 3)]
    with caplog.at_level(logging.WARNING):
        out = evaluator(parts, bins)(None)
    assert all(out[f"client_{k}"]["south"] is None for k in ("auc_se", "auc_ci_low", "pauc", "pauc_mcclish",
                                                                "tpauc", "sens_at_spec_0.9", "spec_at_sens_0.9"))
    assert out["client_auc"]["south"] is None and out["client_pauc"]["north"] is not None
    assert out["test_pauc_mcclish"] is not None and out["test_auc_ci_low"] < out["test_auc"]
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(lines) == 1 and "client south's test split has 0 positives and 25 negatives" in lines[0]
    for p, name in ((parts[0], "north"), (parts[2], "east")):  # McClish = sklearn's max_fpr AUC (exact scores)
        want = roc_auc_score(p.labels[:, 0], p.scores[:, 0], max_fpr=BETA)
        assert out["client_pauc_mcclish"][name] == pytest.approx(want, abs=1e-6 if bins is None else 3e-3)


@pytest.mark.parametrize("bins", [None, 4096])
def test_a_pool_without_positives_has_every_figure_null_and_one_line(bins, caplog):
    parts = [site(0, [0] * 20, 1), site(1, [0] * 25, 2), site(2, [0] * 10, 3)]
    with caplog.at_level(logging.WARNING):
        out = evaluator(parts, bins)(None)
    assert np.isnan(out["test_auc"])
    figures = {k: v for k, v in out.items() if k.startswith("test_") and k not in ("test_auc", "test_samples")}
    assert len(figures) == 10 and all(v is None for v in figures.values())
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(lines) == 1 and "0 positives and 55 negatives, so the pooled test AUC is NaN" in lines[0]
