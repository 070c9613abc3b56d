"""``test_scores: histogram`` on the Flower bridge under SecAgg+: the server learns only the SUM of the sites' score
histograms, and that sum is exact (fdam_ray/flower/secagg.py, its histogram round; the Evaluator's pre-summed
histogram in fdam_ray/loop/evaluation.py)."""

from __future__ import annotations

import numpy as np
import pytest
from flower_helpers import HAVE_FLOWER, RecordingGrid

from fdam_ray.core.state import ScoreHistogram

pytestmark = pytest.mark.skipif(not HAVE_FLOWER, reason="Flower is not installed (the flower extra)")
if HAVE_FLOWER:
    from flwr.common.secure_aggregation.quantization import dequantize, quantize

    from fdam_ray.flower import records, secagg
    from fdam_ray.flower.client_app import app as client_app
    from fdam_ray.flower.executor import FlowerExecutor
    from fdam_ray.flower.inprocess import InProcessGrid, server_context
    from fdam_ray.flower.server_app import run_federation

# 3 sites, each with a test split of its own (no global test set: test_auc pools the sites' splits)
HIST = dict(algorithm="codasca", model="linear", batch_size=8, seed=3, executor="inline", local_steps=3,
            iterations=12, lr=0.2, global_lr=1.3, prox_weight=0.01, stage_length=9, eval_every=6,
            test_scores="histogram", test_score_bins=256)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    rng = np.random.default_rng(1)
    out = tmp_path_factory.mktemp("flower-hist-data")
    for k, (n, shift) in enumerate([(30, 0.0), (50, 0.3), (40, -0.2)]):
        x = rng.normal(size=(n + 25, 4)).astype(np.float32) + shift
        y = (x[:, 0] + 0.5 * rng.normal(size=n + 25) > shift).astype(np.float32)
        np.savez(out / f"site{k}.npz", x=x[:n], y=y[:n], x_test=x[n:], y_test=y[n:])
    return out


def run(folder, grid=None, **flower):
    grid = grid or InProcessGrid(client_app, [{"site": k, "data": str(folder / f"site{k}.npz")} for k in range(3)])
    return run_federation(grid, server_context(), {**HIST, "num_clients": 3, "flower": flower})


def test_the_histogram_round_quantisation_is_exact_for_every_count_up_to_its_levels():
    """Flower's own quantise / dequantise of the values a site sends give back each integer count exactly, at
    the extremes (0 and L) and at random counts, for 2..9 sites (the levels halve as the sites pass a power of
    two, so that sites * L stays below the 2**32 modulus: at 2**32 exactly, all sites sending L wraps to 0, as the
    first version of this test found)."""
    assert secagg.histogram_levels(2) == 2**30 and secagg.histogram_levels(3) == secagg.histogram_levels(4) == 2**29
    assert secagg.histogram_levels(5) == 2**28 and secagg.histogram_levels(9) == 2**27
    rng = np.random.default_rng(0)
    clip = secagg.HISTOGRAM_CLIP
    for n in range(2, 10):
        levels = secagg.histogram_levels(n)
        assert n * levels < 2**32 and levels < 2**31  # the sum of the factors (n * L) must not wrap to 0
        counts = rng.integers(0, levels + 1, size=(n, 200))
        counts[:, 0], counts[:, 1] = 0, levels
        sent = [c.astype(np.float64) * (2 * clip / levels) - clip for c in counts]
        q = [quantize([x], clip, levels)[0].astype(np.int64) for x in sent]
        assert all(np.array_equal(qk, ck) for qk, ck in zip(q, counts, strict=True))  # no rounding at all
        total = sum(q) % 2**32  # what the unmasking leaves
        mean = dequantize([total], clip, levels)[0]  # the workflow's steps: dequantise, offset, / (n * L / L)
        mean += -(n - 1) * clip
        mean *= levels / (n * levels)
        back = np.rint((mean * n + n * clip) * (levels / (2 * clip))).astype(np.int64)  # run_secure_histogram's
        assert np.array_equal(back, counts.sum(0))


def test_under_secagg_the_summed_histogram_equals_the_sites_histograms_summed_in_the_clear(folder, monkeypatch):
    """At every evaluation and every refinement pass, the secure sum's counts, samples and NaN count equal the
    sum of the same state's per-site histograms asked in the clear: the Evaluator's input (hence test_auc) is
    exactly the non-SecAgg path's."""
    calls = []
    original = FlowerExecutor.evaluate

    def spy(self, state, split="test", bins=None):
        got = original(self, state, split, bins)
        if bins is not None:
            secure, self.secure_histogram = self.secure_histogram, None
            try:
                clear = original(self, state, split, bins)  # the same state, each site's histogram as it is
            finally:
                self.secure_histogram = secure
            calls.append((bins, got, clear))
        return got

    monkeypatch.setattr(FlowerExecutor, "evaluate", spy)
    result = run(folder, secagg=True)
    assert len(result.history) == 3 and len(calls) > 3  # 3 evaluations, at least one with a second pass
    assert any(b.lo is not None for b, _, _ in calls)
    for bins, got, clear in calls:
        assert len(got) == 1 and got[0].client_id == -1 and got[0].task_auc.size == 0
        assert len(clear) == 3 and all(h.client_id >= 0 for h in clear)
        assert got[0].counts.dtype == np.int64 and got[0].counts.shape == (1, 2, bins.bins)
        assert np.array_equal(got[0].counts, sum(h.counts for h in clear))
        assert got[0].samples == sum(h.samples for h in clear) == 75
        assert got[0].nan_outputs == 0
    for h in result.history:
        assert 0 < h["test_auc"] < 1 and h["test_samples"] == 75 and "client_auc" not in h


def test_under_secagg_no_site_histogram_reaches_the_server(folder, monkeypatch):
    """The server receives no per-site histogram: no ``evaluate`` message is sent, histogram_of is never called,
    every secure reply carries no array, and the Evaluator is handed one pre-summed histogram. Without SecAgg+ the
    same run sends each site's histogram and reports client_auc (unchanged path)."""
    def refuse(content):
        raise AssertionError("a site's histogram reached the server")

    handed = []
    original = FlowerExecutor.evaluate

    def spy(self, state, split="test", bins=None):
        got = original(self, state, split, bins)
        handed.append(got)
        return got

    monkeypatch.setattr(FlowerExecutor, "evaluate", spy)
    clear = run(folder)
    assert all(len(g) == 3 and all(isinstance(h, ScoreHistogram) and h.client_id >= 0 for h in g) for g in handed)
    assert all(set(h["client_auc"]) == {"0", "1", "2"} for h in clear.history)
    handed.clear()
    monkeypatch.setattr(records, "histogram_of", refuse)
    grid = RecordingGrid(client_app, [{"site": k, "data": str(folder / f"site{k}.npz")} for k in range(3)])
    result = run(folder, grid, secagg=True)
    assert "evaluate" not in grid.sent and "train.round" not in grid.sent
    trained = [r for r in grid.replies if r.metadata.message_type == "train"]
    assert trained and all(not len(a) for r in trained for a in r.content.array_records.values())
    assert handed and all(len(g) == 1 and g[0].client_id == -1 and g[0].task_auc.size == 0 for g in handed)
    assert [h["test_samples"] for h in result.history] == [h["test_samples"] for h in clear.history]
    assert all("client_auc" not in h for h in result.history)
