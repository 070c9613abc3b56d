"""``select_by: val_pauc`` (and ``val_tpauc``): the best evaluation is the one of the highest validation pAUC, read
off the validation parts' clinical read-out (``clinical: on`` adds ``val_<figure>``, ``val_client_<figure>``), not of
the highest val_auc; refused in one line without a validation split or with clinical off (fdam_ray.loop.summary,
fdam_ray.loop.evaluation)."""

from __future__ import annotations

import logging
import math

import numpy as np
import pytest
from sklearn.metrics import roc_auc_score

from fdam_ray.algorithms.stages import init_server_state
from fdam_ray.assembly.recipe import run
from fdam_ray.checkpoint import LoopState
from fdam_ray.cli import _summary as printed
from fdam_ray.config import ConfigError, build_config
from fdam_ray.core.state import GlobalState, Scores
from fdam_ray.loop.evaluation import ClinicalRead, Evaluator
from fdam_ray.loop.summary import keep_best, run_summary, selected_evaluation
from fdam_ray.scores import clinic

BASE = dict(dataset="synthetic", model="mlp", model_width=16, num_clients=3, samples_per_client=160, batch_size=16,
            algorithm="codasca", local_steps=3, iterations=60, stage_length=21, eval_every=3, seed=1, lr=1.0,
            executor="inline", tensorboard=False, val_fraction=0.3)
# On this job the two selections differ (measured: val_auc picks evaluation 20 of 21, val_pauc evaluation 16).
PAUC = dict(clinical="on", pauc_max_fpr=0.2, select_by="val_pauc")


def _loop(records, by):
    state = GlobalState(v=np.zeros(3, np.float32), alpha=np.zeros(1, np.float32), buffers=np.zeros(0, np.float32),
                        counters=np.zeros(0, np.int64))
    loop = LoopState(server=init_server_state(state))
    for rec in records:
        keep_best(loop, rec, by)
        loop.history.append(rec)
    return loop


def _summary(records, by):
    loop = _loop(records, by)
    best = selected_evaluation(loop, validation=True, by=by)
    return run_summary(loop, best, algorithm="codasca", validation=True, started=0.0,
                       positive_ratio=np.array([0.5]), client_names=None, by=by), loop


RECORDS = [{"iteration": 0, "test_auc": 0.5, "val_auc": 0.6, "val_pauc": 0.01, "test_pauc": 0.02},
           {"iteration": 10, "test_auc": 0.7, "val_auc": 0.9, "val_pauc": 0.03, "test_pauc": 0.04},
           {"iteration": 20, "test_auc": 0.8, "val_auc": 0.7, "val_pauc": 0.05, "test_pauc": 0.06},
           {"iteration": 30, "test_auc": 0.6, "val_auc": 0.8, "val_pauc": 0.05, "test_pauc": 0.03}]


def test_the_highest_validation_pauc_is_selected_not_the_highest_val_auc(caplog):
    by_auc, _ = _summary(RECORDS, "val_auc")
    assert by_auc["best_iteration"] == 10 and by_auc["selected_by"] == "val_auc" and "best_val_pauc" not in by_auc
    with caplog.at_level(logging.WARNING, logger="fdam_ray.loop.summary"):
        summary, loop = _summary(RECORDS, "val_pauc")
    assert summary["selected_by"] == "val_pauc" and summary["best_iteration"] == 20  # the first of the tied two
    assert summary["best_val_pauc"] == 0.05 and summary["final_val_pauc"] == 0.05
    assert summary["best_test_auc"] == 0.8 and summary["best_val_auc"] == 0.7 and summary["best_test_pauc"] == 0.06
    assert loop.best_val_auc == 0.05 and loop.best_val_iteration == 20  # the checkpoint keeps the selecting figure
    tied = [r.getMessage() for r in caplog.records if "tied" in r.getMessage()]
    assert len(tied) == 1 and "best validation pAUC 0.05 " in tied[0] and "iterations 20, 30" in tied[0]
    assert "selected by val_pauc 0.0500: test 0.8000 at iteration 20" in printed(
        dict(summary, final_test_auc=0.6, rounds=3, iterations=30, bytes_up=0, bytes_down=0, wall_s=1.0,
             samples_per_s=1.0))


def test_a_pauc_never_defined_selects_nothing_and_says_so(caplog):
    records = [dict(r, val_pauc=None) for r in RECORDS]  # a record holds null for an undefined figure
    with caplog.at_level(logging.WARNING, logger="fdam_ray.loop.summary"):
        summary, _ = _summary(records, "val_pauc")
    assert summary["selected_by"] == "last" and summary["best_iteration"] == 30
    assert "validation pAUC" in summary["selection"] and "\n" not in summary["selection"]
    assert "none selected" in printed(dict(summary, final_test_auc=0.6, rounds=3, iterations=30, bytes_up=0,
                                           bytes_down=0, wall_s=1.0, samples_per_s=1.0))


@pytest.mark.parametrize(("fields", "field", "says"), [
    (dict(val_fraction=0.0, clinical="on", select_by="val_pauc"), "select_by", "val_fraction > 0 and clinical: on"),
    (dict(clinical="off", select_by="val_pauc"), "select_by", "val_fraction > 0 and clinical: on"),
    (dict(clinical="off", select_by="val_tpauc", pauc_min_tpr=0.5), "select_by", "val_fraction > 0 and clinical"),
    (dict(clinical="on", select_by="val_tpauc"), "select_by", "pauc_min_tpr is null"),
    (dict(clinical="on", select_by="test_pauc"), "select_by", "val_auc"),
    (dict(clinical="on", pauc_max_fpr=0.0), "pauc_max_fpr", "(0, 1]"),
    (dict(clinical="on", pauc_max_fpr=1.5), "pauc_max_fpr", "(0, 1]"),
    (dict(clinical="on", pauc_min_tpr=1.0), "pauc_min_tpr", "[0, 1)"),
    (dict(clinical="on", operating_points=[0.9, 1.0]), "operating_points", "(0, 1)"),
])
def test_refusals_are_one_line_naming_the_field(fields, field, says):
    with pytest.raises(ConfigError) as err:
        build_config(dict(BASE, **fields))
    text = str(err.value)
    assert "\n" not in text and says in text and text.startswith(f"config field '{field}'")


def test_the_validation_read_out_is_the_pooled_validation_scores_and_each_sites():
    """A stand-in executor whose two sites send their scores: ``val_<figure>`` is the read-out of the pooled
    validation scores (its McClish pAUC sklearn's max_fpr AUC), ``val_client_<figure>`` each site's own."""
    rng = np.random.default_rng(7)

    def site(k, n):
        labels = rng.integers(0, 2, n).astype(np.float32)
        return Scores(client_id=k, scores=rng.normal(labels, 1.0).astype(np.float32)[:, None],
                      labels=labels[:, None])

    test, val = [site(0, 90), site(1, 70)], [site(0, 40), site(1, 60)]

    class Exec:
        def evaluate(self, state, split="test", bins=None):
            return val if split == "val" else test

        def score_test_set(self, state):
            return None

    source = type("Src", (), {"task_names": ("y",), "test_set": lambda self: None})()
    config = ClinicalRead(clinical="on", pauc_max_fpr=0.25, pauc_min_tpr=0.4, operating_points=(0.8,))
    config = type("C", (), {**vars(config), "client_names": None})()
    out = Evaluator(type("R", (), {"config": config})(), source, Exec(), warn_one_class=False, validation=True)(None)
    scores = np.concatenate([p.scores for p in val])
    labels = np.concatenate([p.labels for p in val])
    assert out["val_pauc_mcclish"] == pytest.approx(roc_auc_score(labels[:, 0], scores[:, 0], max_fpr=0.25),
                                                    abs=1e-6)
    want = clinic.set_fields(clinic.read_out(clinic.exact_counts(scores, labels), max_fpr=0.25, min_tpr=0.4,
                                             points=(0.8,)))
    assert {k: out[f"val_{k}"] for k in want} == want
    assert out["val_auc_ci_low"] < out["val_auc"] < out["val_auc_ci_high"]
    one = clinic.set_fields(clinic.read_out(clinic.exact_counts(val[1].scores, val[1].labels), max_fpr=0.25,
                                            min_tpr=0.4, points=(0.8,)))
    assert {k: out[f"val_client_{k}"]["1"] for k in one} == one
    assert out["val_client_tpauc"].keys() == {"0", "1"}
    assert out["test_pauc"] != out["val_pauc"]  # the test read-out is the test parts'


@pytest.fixture(scope="module")
def by_pauc():
    return run(build_config(dict(BASE, **PAUC)), save=False)


def test_a_run_selects_the_evaluation_of_the_highest_validation_pauc(by_pauc):
    history = by_pauc.history
    assert all({"val_pauc", "val_pauc_mcclish", "val_auc_ci_low", "val_client_pauc", "test_pauc"} <= set(h)
               for h in history)
    values = [h["val_pauc"] for h in history]
    first_best = int(np.argmax(values))  # argmax: the first of equal ones
    summary = by_pauc.summary
    assert summary["selected_by"] == "val_pauc" and summary["best_iteration"] == history[first_best]["iteration"]
    assert summary["best_val_pauc"] == max(values) and summary["final_val_pauc"] == values[-1]
    assert summary["best_test_pauc"] == history[first_best]["test_pauc"]
    by_auc = run(build_config(dict(BASE, **dict(PAUC, select_by="val_auc"))), save=False)
    assert [h["val_pauc"] for h in by_auc.history] == values  # the same training, another selection
    by_val_auc = int(np.nanargmax([h["val_auc"] for h in history]))
    assert by_auc.summary["best_iteration"] == history[by_val_auc]["iteration"] != summary["best_iteration"]
    assert all(math.isfinite(v) for v in values)


def test_under_histograms_the_validation_read_out_is_within_the_bins_of_the_exact_one(by_pauc):
    hist = run(build_config(dict(BASE, **PAUC, test_scores="histogram")), save=False)
    for rec, ref in zip(hist.history, by_pauc.history, strict=True):
        assert rec["val_pauc_mcclish"] == pytest.approx(ref["val_pauc_mcclish"], abs=2e-3)
        assert rec["val_auc_se"] == pytest.approx(ref["val_auc_se"], rel=2e-2)
        assert rec["val_client_pauc"].keys() == ref["val_client_pauc"].keys()
    assert hist.summary["selected_by"] == "val_pauc"


def test_a_resumed_run_keeps_the_pauc_selection_and_refuses_another_select_by(tmp_path, monkeypatch):
    from interrupted import crash_in_round

    from fdam_ray.assembly.recipe import resume
    from fdam_ray.checkpoint import load_checkpoint

    def saved(folder):
        return dict(BASE, **PAUC, out_dir=str(tmp_path / folder), run_name="run", checkpoint_every=2)

    full = run(build_config(saved("a")))
    with crash_in_round(monkeypatch, 19):  # after the selected evaluation: the checkpoint must carry it
        run(build_config(saved("b")))
    kept = load_checkpoint(tmp_path / "b" / "run" / "checkpoint.pt").loop
    assert kept.best_val_iteration == full.summary["best_iteration"] < 19 * 3
    assert kept.best_val_auc == full.summary["best_val_pauc"]  # the selecting figure's best value
    with pytest.raises(ConfigError, match="select_by"):
        resume(tmp_path / "b" / "run", {"select_by": "val_auc"})
    resumed = resume(tmp_path / "b" / "run")
    for key in ("selected_by", "best_iteration", "best_val_pauc", "best_test_pauc", "final_val_pauc"):
        assert resumed.summary[key] == full.summary[key], key
    assert (resumed.run_dir / "best_model.pt").read_bytes() == (full.run_dir / "best_model.pt").read_bytes()


def test_under_private_evaluation_the_validation_read_out_is_the_released_counts_and_no_sites(monkeypatch):
    from fdam_ray.privacy import evaluation as private_evaluation

    seen: list[tuple[str, np.ndarray]] = []
    release = private_evaluation.PrivateEvaluation.release

    def spy(self, split, counts):
        out = release(self, split, counts)
        seen.append((split, np.asarray(out, np.float64)))
        return out

    monkeypatch.setattr(private_evaluation.PrivateEvaluation, "release", spy)
    result = run(build_config(dict(BASE, **PAUC, iterations=12, test_scores="histogram", test_score_bins=256,
                                   dp_eval="on", dp_eval_noise=4.0, dp_noise_seed=11)), save=False)
    released = [counts for split, counts in seen if split == "val"]
    assert len(released) == len(result.history)
    for rec, counts in zip(result.history, released, strict=True):
        assert not any(k.startswith(("client_", "val_client_")) for k in rec)  # no site's own figure
        want = clinic.set_fields(clinic.read_out(counts, max_fpr=0.2, min_tpr=None, points=(0.9, 0.95)))
        assert {k: rec[f"val_{k}"] for k in want} == want
    assert result.summary["selected_by"] == "val_pauc"
