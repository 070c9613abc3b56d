"""``dp_eval: on`` on the Flower bridge under SecAgg+: the driver's release takes the secure sum of the sites'
histograms (the server never sees a site's counts), noises it, and the records hold no per-site AUC, no sample
count, and the test records' epsilon."""

from __future__ import annotations

import numpy as np
import pytest
from flower_helpers import HAVE_FLOWER
from test_flower_hist import HIST, folder, run  # noqa: F401 (folder: the sites' data fixture)

from fdam_ray.metrics import mean_auc
from fdam_ray.privacy import evaluation as private_evaluation
from fdam_ray.privacy.evaluation import eval_epsilon
from fdam_ray.scores.histogram import auc_of_counts

pytestmark = pytest.mark.skipif(not HAVE_FLOWER, reason="Flower is not installed (the flower extra)")


def test_under_secagg_the_noised_secure_sum_is_released(folder, monkeypatch):  # noqa: F811
    seen = []
    release = private_evaluation.PrivateEvaluation.release

    def spy(self, split, counts):
        out = release(self, split, counts)
        seen.append((counts.copy(), out))
        return out

    monkeypatch.setattr(private_evaluation.PrivateEvaluation, "release", spy)
    monkeypatch.setitem(HIST, "test_score_bins", 16)
    monkeypatch.setitem(HIST, "dp_eval", "on")
    monkeypatch.setitem(HIST, "dp_eval_noise", 2.0)
    result = run(folder, secagg=True)
    assert len(result.history) == len(seen) == 3  # one release an evaluation: no refinement pass
    for i, (rec, (counts, out)) in enumerate(zip(result.history, seen, strict=True)):
        assert counts.sum() == 75 and counts.dtype == np.int64  # the secure sum of the 3 sites' 25 test records
        assert rec["test_auc"] == mean_auc(auc_of_counts(out))
        assert "client_auc" not in rec and "test_samples" not in rec
        assert rec["dp_eval_epsilon"] == pytest.approx(eval_epsilon(2.0, 1, i + 1, 1e-5), rel=1e-12)
