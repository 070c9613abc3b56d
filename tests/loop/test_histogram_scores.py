"""``test_scores: histogram`` runs end to end: a run whose clients send score histograms trains the same model, its
``client_auc`` are the exact run's and its pooled ``test_auc`` is within the binning bound of the exact one at every
evaluation (the bound of the cells the driver read it from: the fixed layout, or every pass's counts together,
further passes asked only where the first pass's bound exceeds the tolerance); two Ray actors give the
inline run's records exactly."""

from __future__ import annotations

import numpy as np
import pytest

import fdam_ray.loop.evaluation as evaluation
from fdam_ray.assembly.recipe import run
from fdam_ray.config import build_config
from fdam_ray.scores.histogram import REFINE_TOLERANCE, binning_error_bound

# Clients with test splits of their own (synthetic: no global test set), so the clients score the test set.
BASE = dict(dataset="synthetic", model="mlp", model_width=16, num_clients=4, samples_per_client=200, batch_size=16,
            algorithm="codasca", local_steps=3, iterations=60, stage_length=30, eval_every=10, seed=3,
            executor="inline", clients_per_actor=2, tensorboard=False)
SHOWN = ("test_auc", "test_samples", "client_auc")  # what histograms change (or must not)
# |histogram - exact| measured on this short job at B = 4096 (a model of 60 iterations, 400 test samples, one pair
# 1.25e-5): at most 5.25e-4 with the fixed layout alone, at most 1.0e-4 (8 pairs, evaluation 3) with the second
# pass (notes of issue 39); the bound that holds for any run is binning_error_bound's of the pass read.
DOCUMENTED = 1.1e-4


def scored_run(**kw):
    return run(build_config(dict(BASE, **kw)), save=False)


@pytest.fixture(scope="module")
def exact():
    return scored_run()


@pytest.fixture(scope="module")
def histogram():
    """The histogram run, with per evaluation the summed pass-1 histogram, and the bound of the pass the driver read
    its AUC from (None where it asked no second pass)."""
    sums: list[np.ndarray] = []
    chosen: list[np.ndarray | None] = []
    passes = evaluation.refined_aucs

    def keep(total: np.ndarray, bins: int, ask) -> tuple[np.ndarray, np.ndarray]:
        sums.append(total.copy())
        asked: list = []
        aucs, bound = passes(total, bins, lambda b: asked.append(b) or ask(b))
        chosen.append(bound if asked else None)
        return aucs, bound

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(evaluation, "refined_aucs", keep)
        result = scored_run(test_scores="histogram")
    return result, (sums, chosen)


def test_the_model_and_everything_but_the_pooled_auc_are_the_exact_runs(exact, histogram):
    result, _ = histogram
    for name in ("v", "alpha", "buffers", "c_v", "c_alpha"):
        np.testing.assert_array_equal(getattr(result.state, name), getattr(exact.state, name), err_msg=name)
    assert len(result.history) == len(exact.history) == 7
    for got, want in zip(result.history, exact.history, strict=True):
        assert got["client_auc"] == want["client_auc"] and len(got["client_auc"]) == 4
        assert got["test_samples"] == want["test_samples"] == 400
        same = {k: v for k, v in got.items() if k not in (*SHOWN, "wall_s", "samples_per_s")}
        assert same == {k: v for k, v in want.items() if k not in (*SHOWN, "wall_s", "samples_per_s")}


def test_the_pooled_auc_is_within_the_bound_of_its_histogram_at_every_evaluation(exact, histogram):
    result, (sums, chosen) = histogram
    assert len(sums) == len(chosen) == len(result.history)
    diffs = []
    for got, want, total, bound in zip(result.history, exact.history, sums, chosen, strict=True):
        assert total.shape == (1, 2, 4096) and int(total.sum()) == 400
        first = binning_error_bound(total)[0]
        assert (bound is not None) == (first > REFINE_TOLERANCE)  # pass 2 asked exactly when pass 1 is too coarse
        read = first if bound is None else bound[0]
        assert read <= first
        diff = abs(got["test_auc"] - want["test_auc"])
        assert diff <= read + 1e-6  # (records keep 6 decimals)
        diffs.append(diff)
    assert max(diffs) <= DOCUMENTED  # every evaluation, the untrained model's included
    assert any(b is not None for b in chosen)


@pytest.mark.slow  # in CI's slow tier: a Ray session of its own, 11 s
def test_two_ray_actors_send_the_inline_runs_histograms_exactly(histogram):
    from raytest import ray_session

    result, _ = histogram
    with ray_session():
        remote = scored_run(test_scores="histogram", executor="ray", cpus_per_actor=0.5)
    for got, want in zip(remote.history, result.history, strict=True):
        assert {k: got[k] for k in SHOWN} == {k: want[k] for k in SHOWN}
    np.testing.assert_array_equal(remote.state.v, result.state.v)


def test_with_validation_parts_only_test_auc_and_val_auc_differ_each_within_its_bound():
    """Every evaluation reads two pooled AUCs off histograms (test, then validation); each is within the bound of
    the pass it was read from, and every other record field is the exact run's."""
    bounds: list[float] = []
    passes = evaluation.refined_aucs

    def keep(total: np.ndarray, bins: int, ask) -> tuple[np.ndarray, np.ndarray]:
        aucs, bound = passes(total, bins, ask)
        assert bound[0] <= binning_error_bound(total)[0]
        bounds.append(float(bound[0]))  # of every pass's counts together
        return aucs, bound

    exact = scored_run(val_fraction=0.25, iterations=30)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(evaluation, "refined_aucs", keep)
        result = scored_run(val_fraction=0.25, iterations=30, test_scores="histogram")
    assert len(bounds) == 2 * len(result.history) == 2 * len(exact.history) == 8
    differ = ("test_auc", "val_auc", "wall_s", "samples_per_s")
    for i, (got, want) in enumerate(zip(result.history, exact.history, strict=True)):
        assert {k: v for k, v in got.items() if k not in differ} == {k: v for k, v in want.items() if k not in differ}
        assert abs(got["test_auc"] - want["test_auc"]) <= bounds[2 * i] + 1e-6
        assert abs(got["val_auc"] - want["val_auc"]) <= bounds[2 * i + 1] + 1e-6
