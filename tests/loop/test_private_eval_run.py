"""``dp_eval: on`` runs end to end (inline executor): every record's AUCs are read off the released (noised, clipped)
counts of the pooled ones, no per-site AUC is recorded, the test and validation accountants count one release per
evaluation (the analytic Gaussian of that many), the model choice is made on the noised val_auc, the training is the
same run bit for bit, and a resume continues the accountant and the draws."""

from __future__ import annotations

import numpy as np
import pytest

from fdam_ray.assembly.recipe import resume, run
from fdam_ray.config import build_config
from fdam_ray.metrics import mean_auc
from fdam_ray.privacy import evaluation as private_evaluation
from fdam_ray.privacy.evaluation import eval_epsilon
from fdam_ray.scores.histogram import auc_of_counts

BASE = dict(dataset="synthetic", model="mlp", model_width=16, num_clients=4, samples_per_client=200, batch_size=16,
            algorithm="coda_plus", local_steps=3, iterations=30, stage_length=30, eval_every=10, seed=3,
            executor="inline", tensorboard=False, test_scores="histogram", test_score_bins=256)
PRIVATE = dict(dp_eval="on", dp_eval_noise=4.0, dp_noise_seed=11)
EVALUATION_KEYS = {"test_auc", "test_samples", "client_auc", "val_auc", "val_samples", "val_client_auc",
                   "dp_eval_epsilon", "dp_eval_delta", "dp_eval_val_epsilon"}


def spied(monkeypatch):
    """Every release: (split, the summed counts it got, the counts it returned)."""
    seen: list[tuple[str, np.ndarray, np.ndarray]] = []
    release = private_evaluation.PrivateEvaluation.release

    def spy(self, split, counts):
        out = release(self, split, counts)
        seen.append((split, counts.copy(), out))
        return out

    monkeypatch.setattr(private_evaluation.PrivateEvaluation, "release", spy)
    return seen


def test_records_are_read_off_the_released_counts_only(monkeypatch):
    seen = spied(monkeypatch)
    exact = run(build_config(dict(BASE, val_fraction=0.25)), save=False)
    result = run(build_config(dict(BASE, val_fraction=0.25, **PRIVATE)), save=False)
    assert len(result.history) == 4 and [s for s, _, _ in seen] == ["test", "val"] * 4
    for i, (rec, plain) in enumerate(zip(result.history, exact.history, strict=True)):
        (_, test_in, test_out), (_, val_in, val_out) = seen[2 * i], seen[2 * i + 1]
        assert test_in.sum() == plain["test_samples"] and val_in.sum() == plain["val_samples"]  # the whole pools
        assert rec["test_auc"] == mean_auc(auc_of_counts(test_out))
        assert rec["val_auc"] == mean_auc(auc_of_counts(val_out))
        assert "test_samples" not in rec and "val_samples" not in rec
        assert "client_auc" in plain and "client_auc" not in rec and "val_client_auc" not in rec
        assert rec["dp_eval_epsilon"] == pytest.approx(eval_epsilon(4.0, 1, i + 1, 1e-5), rel=1e-12)
        assert rec["dp_eval_val_epsilon"] == rec["dp_eval_epsilon"]  # one release of each per evaluation
        assert rec["dp_eval_delta"] == 1e-5
        assert rec["test_auc"] != plain["test_auc"]  # noised
    best = int(np.argmax([h["val_auc"] for h in result.history]))
    assert result.summary["best_val_auc"] == result.history[best]["val_auc"]  # chosen on the noised val_auc
    assert result.summary["dp_eval_epsilon"] == result.history[-1]["dp_eval_epsilon"]
    assert result.summary["dp_eval_releases"] == {"test": 4, "val": 4}
    assert "dp_epsilon" not in result.summary  # dp: off: no training guarantee claimed


def test_the_training_is_the_same_and_both_epsilons_are_reported():
    dp = dict(dp="client", dp_noise_multiplier=1.0, positive_ratio=0.5, dp_noise_seed=11)
    plain = run(build_config(dict(BASE, **dp)), save=False)
    private = run(build_config(dict(BASE, **dp, dp_eval="on", dp_eval_noise=4.0)), save=False)
    for name in ("v", "alpha", "buffers"):
        assert np.array_equal(getattr(plain.state, name), getattr(private.state, name))
    for a, b in zip(plain.history, private.history, strict=True):
        assert {k: v for k, v in a.items() if k not in EVALUATION_KEYS | {"wall_s", "samples_per_s"}} == \
               {k: v for k, v in b.items() if k not in EVALUATION_KEYS | {"wall_s", "samples_per_s"}}
        assert b["dp_epsilon"] == a["dp_epsilon"] and "dp_eval_epsilon" in b
    assert private.summary["dp_epsilon"] == plain.summary["dp_epsilon"]
    assert private.summary["dp_eval_epsilon"] == pytest.approx(eval_epsilon(4.0, 1, 4, 1e-5), rel=1e-12)


def test_a_resume_continues_the_accountant_and_the_draws(tmp_path):
    whole = run(build_config(dict(BASE, iterations=60, **PRIVATE)), save=False)
    first = run(build_config(dict(BASE, **PRIVATE, out_dir=str(tmp_path), run_name="r")))
    assert len(first.history) == 4
    resumed = resume(tmp_path / "r", {"iterations": 60})
    assert [h["iteration"] for h in resumed.history] == [h["iteration"] for h in whole.history]
    for a, b in zip(whole.history, resumed.history, strict=True):
        assert b["dp_eval_epsilon"] == a["dp_eval_epsilon"]
        assert b["test_auc"] == a["test_auc"]  # release i draws the same noise, resumed or not
    assert resumed.summary["dp_eval_releases"]["test"] == len(whole.history)
