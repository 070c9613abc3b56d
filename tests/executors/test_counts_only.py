"""Under ``test_scores: histogram`` nothing per sample leaves a site, in the inline and the Ray executor (Flower:
tests/flower/test_flower_counts_only.py): with ``clinical: on`` and a validation split selecting by pAUC, every
object a client hands back (inline: each Client method's return; Ray: each object an actor returns to the driver)
holds no score (no :class:`Scores`), its evaluations are integer count arrays of the histogram's shape summing to
the site's samples, and no array anywhere in them has a dimension of a site's sample count (training, validation or
test part); the record still has the pooled and per-site clinical figures, read off those counts."""

from __future__ import annotations

import numpy as np
import pytest
from sample_clients import arrays_in, gaussian_clients

from fdam_ray.assembly.recipe import run
from fdam_ray.clients.client import Client
from fdam_ray.config import build_config
from fdam_ray.core.state import ScoreHistogram, Scores
from fdam_ray.data.arrays import ArraysSource

TRAIN, TEST, BINS = 61, 23, 256  # per site; no model vector, bin count or task count has these lengths
CONFIG = dict(model="linear", batch_size=8, eval_every=4, seed=2, lr=0.2, local_steps=2, iterations=12,
              stage_length=6, algorithm="codasca", val_fraction=0.25, clinical="on", select_by="val_pauc",
              pauc_min_tpr=0.3, test_scores="histogram", test_score_bins=BINS, tensorboard=False)


def objects(obj):
    """Every object inside a nested result (dataclasses, dicts, lists): to find a Scores anywhere."""
    yield obj
    if isinstance(obj, (list, tuple)):
        for v in obj:
            yield from objects(v)
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from objects(v)
    elif hasattr(obj, "__dataclass_fields__"):
        for f in obj.__dataclass_fields__:
            yield from objects(getattr(obj, f))


def check_counts_only(returned: list[tuple[str, object]], result) -> None:
    histograms = [o for _, r in returned for o in objects(r) if isinstance(o, ScoreHistogram)]
    assert histograms, "no histogram came back"
    assert not [a for a, r in returned if any(isinstance(o, Scores) for o in objects(r))]
    for h in histograms:  # integer counts of the bins' shape, summing to the site's samples of that split
        assert h.counts.dtype.kind in "iu" and h.counts.shape == (1, 2, BINS) and (h.counts >= 0).all()
        assert int(h.counts.sum()) == h.samples and np.asarray(h.task_auc).shape == (1,)
    val_sizes = {h.samples for h in histograms} - {TEST}
    assert len(val_sizes) >= 1  # the validation parts were asked too
    per_sample = {TRAIN, TEST, *val_sizes, *(TRAIN - v for v in val_sizes)}
    assert not per_sample & {BINS, 1, 2, result.state.v.size, result.state.alpha.size}  # the test can tell
    for action, r in returned:
        for arr in arrays_in(r):
            assert not per_sample & set(arr.shape), (action, arr.shape)
    last = result.history[-1]
    assert {"test_auc_ci_low", "test_pauc", "val_pauc", "val_tpauc"} <= set(last)
    assert set(last["client_auc_ci_low"]) == set(last["val_client_pauc"]) == {"0", "1", "2"}
    assert result.summary["selected_by"] == "val_pauc"


def data():
    clients, _ = gaussian_clients(num_clients=3, n=TRAIN)
    tests, _ = gaussian_clients(num_clients=3, n=TEST, seed=5)
    return ArraysSource(clients, None, tests)


def test_inline_clients_hand_back_counts_only(monkeypatch):
    returned: list[tuple[str, object]] = []
    depth = [0]  # a client's own calls of its methods (score_histogram scores its samples) stay inside it
    for name in ("local_round", "evaluate", "score_histogram", "score_sums", "info", "get_state",
                 "control_variate"):
        method = getattr(Client, name)

        def spy(self, *args, _method=method, _name=name, **kwargs):
            depth[0] += 1
            try:
                out = _method(self, *args, **kwargs)
            finally:
                depth[0] -= 1
            if depth[0] == 0:
                returned.append((_name, out))
            return out

        monkeypatch.setattr(Client, name, spy)
    config = build_config(dict(CONFIG, dataset="arrays", num_clients=3, executor="inline"))
    result = run(config, source=data(), save=False)
    assert {"local_round", "score_histogram"} <= {a for a, _ in returned}
    assert "evaluate" not in {a for a, _ in returned}  # the scores' path is never taken from outside a client
    check_counts_only(returned, result)


from test_ray_executor import Recording  # noqa: E402 (the Ray executor that keeps what actors returned)


@pytest.mark.slow  # in CI's slow tier: a Ray session of its own, 12 s
def test_ray_actors_return_counts_only():
    from raytest import ray_session

    config = build_config(dict(CONFIG, dataset="arrays", num_clients=3, executor="ray", cpus_per_actor=0.5))
    ex = Recording()
    with ray_session():
        result = run(config, source=data(), executor=ex, save=False)
    returned = ex.fleet.returned
    assert {"local_round", "evaluate"} <= {a for a, _ in returned}
    check_counts_only(returned, result)
