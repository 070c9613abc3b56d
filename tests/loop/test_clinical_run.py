"""``clinical: on`` runs end to end (inline executor, clients' own test splits): every record adds the read-out of
the pooled test scores (exact: the figures of the pooled scores; histogram: of the refined cells, within their
resolution; dp_eval: of the released noised counts, no per-site figure), the training and the AUCs are the
clinical: off run's, whose records hold no new key; summary.json's final_* and the progress line show the interval."""

from __future__ import annotations

import numpy as np
import pytest

from fdam_ray.assembly.recipe import run
from fdam_ray.config import build_config
from fdam_ray.outputs.progress import evaluation_fields
from fdam_ray.privacy import evaluation as private_evaluation
from fdam_ray.scores import clinic

BASE = dict(dataset="synthetic", model="mlp", model_width=16, num_clients=4, samples_per_client=200, batch_size=16,
            algorithm="coda_plus", local_steps=3, iterations=30, stage_length=30, eval_every=10, seed=3,
            executor="inline", tensorboard=False)
CLINICAL = dict(clinical="on", pauc_max_fpr=0.2, pauc_min_tpr=0.5, operating_points=[0.8, 0.9])
POOLED = ("test_auc_se", "test_auc_ci_low", "test_auc_ci_high", "test_auc_ci_logit_low", "test_auc_ci_logit_high",
          "test_pauc", "test_pauc_mcclish", "test_tpauc", "test_sens_at_spec_0.8", "test_spec_at_sens_0.8",
          "test_sens_at_spec_0.9", "test_spec_at_sens_0.9")


def new_keys(rec: dict, plain: dict) -> set[str]:
    return set(rec) - set(plain)


@pytest.fixture(scope="module")
def plain():
    return run(build_config(BASE), save=False)


def test_exact_scores(plain):
    result = run(build_config(dict(BASE, **CLINICAL)), save=False)
    assert len(result.history) == len(plain.history) == 4
    for rec, off in zip(result.history, plain.history, strict=True):
        assert not any(k.startswith(("test_auc_", "test_pauc", "test_sens", "client_auc_", "client_pauc"))
                       for k in off)  # clinical: off adds nothing
        assert {k: rec[k] for k in off if k not in ("wall_s", "samples_per_s")} == {
            k: v for k, v in off.items() if k not in ("wall_s", "samples_per_s")}
        assert set(POOLED) <= new_keys(rec, off)
        low, high = rec["test_auc_ci_low"], rec["test_auc_ci_high"]
        assert low < rec["test_auc"] < high and high - low == pytest.approx(2 * 1.959964 * rec["test_auc_se"], abs=4e-6)
        assert 0 <= rec["test_auc_ci_logit_low"] < rec["test_auc"] < rec["test_auc_ci_logit_high"] <= 1
        assert set(rec["client_auc_ci_low"]) == set(rec["client_auc"]) == set(rec["client_pauc_mcclish"])
        for site, auc in rec["client_auc"].items():  # a site's interval holds its own (exact) AUC
            assert rec["client_auc_ci_low"][site] <= auc <= rec["client_auc_ci_high"][site]
    last = result.history[-1]
    assert {f"final_{k}": last[k] for k in POOLED} == {k: v for k, v in result.summary.items()
                                                         if k.startswith("final_test_") and k != "final_test_auc"}
    assert not any(k.startswith("final_test_") and k != "final_test_auc" for k in plain.summary)
    shown = [text for _, text in evaluation_fields(last) if text.startswith("test AUC")]
    low, high = last["test_auc_ci_logit_low"], last["test_auc_ci_logit_high"]
    assert shown == [f"test AUC {last['test_auc']:.4f} [{low:.4f}, {high:.4f}]"]
    off = plain.history[-1]
    shown = [text for _, text in evaluation_fields(off) if text.startswith("test AUC")]
    assert shown == [f"test AUC {off['test_auc']:.4f}"]


def test_histogram_scores(plain):
    exact = run(build_config(dict(BASE, **CLINICAL)), save=False)
    result = run(build_config(dict(BASE, **CLINICAL, test_scores="histogram")), save=False)
    for rec, ref in zip(result.history, exact.history, strict=True):
        assert set(POOLED) <= set(rec) and set(rec["client_auc_se"]) == set(ref["client_auc_se"])
        assert rec["test_auc_se"] == pytest.approx(ref["test_auc_se"], rel=2e-2)
        for key in ("test_auc_ci_low", "test_auc_ci_high", "test_pauc_mcclish", "test_tpauc"):
            assert rec[key] == pytest.approx(ref[key], abs=2e-3), key


def test_private_evaluation_reads_the_released_counts(monkeypatch):
    seen: list[np.ndarray] = []
    release = private_evaluation.PrivateEvaluation.release

    def spy(self, split, counts):
        out = release(self, split, counts)
        seen.append(np.asarray(out, np.float64))
        return out

    monkeypatch.setattr(private_evaluation.PrivateEvaluation, "release", spy)
    result = run(build_config(dict(BASE, **CLINICAL, test_scores="histogram", test_score_bins=256, dp_eval="on",
                                   dp_eval_noise=4.0, dp_noise_seed=11)), save=False)
    for rec, released in zip(result.history, seen, strict=True):
        assert not any(k.startswith("client_") for k in rec)  # no site's own figure
        want = clinic.set_fields(clinic.read_out(released, max_fpr=0.2, min_tpr=0.5, points=(0.8, 0.9)))
        assert {f"test_{k}": v for k, v in want.items()} == {k: rec[k] for k in POOLED}


def test_several_tasks_and_sites_with_a_stand_in_executor():
    """Two tasks, two sites sending their scores: pooled means over the tasks, every figure per task, the SE and
    intervals per task only, per-site figures from each site's own scores."""
    from fdam_ray.core.state import Scores
    from fdam_ray.loop.evaluation import ClinicalRead, Evaluator

    rng = np.random.default_rng(4)

    def site(k: int) -> Scores:
        labels = rng.integers(0, 2, (150, 2)).astype(np.float32)
        labels[::9, 1] = np.nan
        scores = np.clip(rng.normal(0.4 + 0.2 * np.nan_to_num(labels), 0.15), 0, 1).astype(np.float32)
        return Scores(client_id=k, scores=scores, labels=labels)

    parts = [site(0), site(1)]

    class Exec:
        def evaluate(self, state, split="test", bins=None):
            return parts

        def score_test_set(self, state):
            return None

    source = type("Src", (), {"task_names": ("a", "b"), "test_set": lambda self: None})()
    config = ClinicalRead(clinical="on", pauc_max_fpr=0.3, pauc_min_tpr=None, operating_points=(0.9,))
    config = type("C", (), {**vars(config), "client_names": ("north", "south")})()
    out = Evaluator(type("R", (), {"config": config})(), source, Exec(), warn_one_class=False)(None)
    scores = np.concatenate([p.scores for p in parts])
    labels = np.concatenate([p.labels for p in parts])
    figures = clinic.read_out(clinic.exact_counts(scores, labels), max_fpr=0.3, points=(0.9,))
    assert "test_auc_se" not in out and "test_auc_ci_low" not in out and "test_tpauc" not in out
    assert out["test_pauc_mcclish"] == round(float(figures["pauc_mcclish"].mean()), 6)
    assert out["test_sens_at_spec_0.9"] == round(float(figures["sens_at_spec_0.9"].mean()), 6)
    assert out["task_auc_ci_low"] == {t: round(float(x), 6) for t, x in zip("ab", figures["auc_ci_low"], strict=True)}
    assert out["task_auc_se"]["b"] == round(float(figures["auc_se"][1]), 6)
    assert set(out["client_pauc_mcclish"]) == {"north", "south"} and "client_auc_se" not in out
    south = clinic.read_out(clinic.exact_counts(parts[1].scores, parts[1].labels), max_fpr=0.3, points=(0.9,))
    assert out["client_pauc_mcclish"]["south"] == round(float(south["pauc_mcclish"].mean()), 6)
