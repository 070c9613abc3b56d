"""Under ``test_scores: histogram`` nothing per sample leaves a Flower site (in-process grid; inline and Ray:
tests/executors/test_counts_only.py): with ``clinical: on`` and a validation split selecting by pAUC, every reply
that reaches the server holds no array or listed value with a dimension of a site's sample count (training,
validation or test part), and each evaluation reply's arrays are the integer counts of the histogram's shape (and
the site's own AUC per task); in the clear and under SecAgg+, where the server gets only their sum. The record
still has the pooled clinical figures, and per site in the clear."""

from __future__ import annotations

import numpy as np
import pytest
from flower_helpers import HAVE_FLOWER, RecordingGrid

pytestmark = pytest.mark.skipif(not HAVE_FLOWER, reason="Flower is not installed (the flower extra)")
if HAVE_FLOWER:
    from fdam_ray.flower import records
    from fdam_ray.flower.client_app import app as client_app
    from fdam_ray.flower.inprocess import server_context
    from fdam_ray.flower.server_app import run_federation

TRAIN, TEST, BINS = (41, 53, 47), 29, 256
CONFIG = dict(algorithm="codasca", model="linear", batch_size=8, seed=3, executor="inline", local_steps=3,
              iterations=12, lr=0.2, global_lr=1.3, prox_weight=0.01, stage_length=9, eval_every=6,
              test_scores="histogram", test_score_bins=BINS, val_fraction=0.25, clinical="on", select_by="val_pauc",
              pauc_min_tpr=0.3)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    rng = np.random.default_rng(2)
    out = tmp_path_factory.mktemp("flower-counts-data")
    for k, (n, shift) in enumerate(zip(TRAIN, (0.0, 0.3, -0.2), strict=True)):
        x = rng.normal(size=(n + TEST, 4)).astype(np.float32) + shift
        y = (x[:, 0] + 0.5 * rng.normal(size=n + TEST) > shift).astype(np.float32)
        np.savez(out / f"site{k}.npz", x=x[:n], y=y[:n], x_test=x[n:], y_test=y[n:])
    return out


def values_of(reply):
    """(name, array) of every array and every listed config value in a reply's content."""
    content = reply.content
    for record in content.array_records.values():
        for name, array in records.numpy_of(record).items():
            yield name, array
    for record in content.config_records.values():
        for name, value in record.items():
            if isinstance(value, (list, tuple, bytes)):
                yield name, np.asarray(list(value))


@pytest.mark.parametrize("secagg", [False, True])
def test_a_sites_replies_hold_counts_only(folder, secagg):
    grid = RecordingGrid(client_app, [{"site": k, "data": str(folder / f"site{k}.npz")} for k in range(3)])
    result = run_federation(grid, server_context(), {**CONFIG, "num_clients": 3, "flower": {"secagg": secagg}})
    evaluations = [r for r in grid.replies if r.metadata.message_type == "evaluate"]
    assert bool(evaluations) != secagg  # under SecAgg+ no site's own evaluation reply reaches the server
    val_sizes = set()
    for reply in evaluations:
        found = records.histogram_of(reply.content)
        assert found is not None and found.counts.dtype.kind in "iu" and found.counts.shape == (1, 2, BINS)
        assert int(found.counts.sum()) == found.samples and (found.counts >= 0).all()
        assert {name for name, _ in values_of(reply)} == {"counts", "task_auc"}
        val_sizes.add(found.samples)
    per_sample = {*TRAIN, TEST, *(round(n * 0.25) for n in TRAIN), *(n - round(n * 0.25) for n in TRAIN)}
    if not secagg:
        assert val_sizes - {TEST} <= per_sample and val_sizes - {TEST}  # the validation parts were asked too
    assert not per_sample & {BINS, 1, 2, result.state.v.size, result.state.alpha.size}  # the test can tell
    assert grid.replies
    for reply in grid.replies:
        for name, array in values_of(reply):
            assert not per_sample & set(array.shape), (reply.metadata.message_type, name, array.shape)
    last = result.history[-1]
    assert {"test_auc_ci_low", "test_pauc", "val_pauc", "val_tpauc"} <= set(last)
    assert ("client_auc_ci_low" in last) != secagg and ("val_client_pauc" in last) != secagg
    assert result.summary["selected_by"] == "val_pauc"
