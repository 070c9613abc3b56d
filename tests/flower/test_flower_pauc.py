"""The pAUC objective on the Flower bridge: each round's count pass of the sites' training scores reaches the
server as counts (under SecAgg+ as their secure sum only, equal to the sites' counts summed in the clear), and the
secure run trains the clear run's model (up to SecAgg+'s quantisation of the updates)."""

from __future__ import annotations

import numpy as np
import pytest
from flower_helpers import HAVE_FLOWER

import fdam_ray.pauc as pauc

pytestmark = pytest.mark.skipif(not HAVE_FLOWER, reason="Flower is not installed (the flower extra)")
if HAVE_FLOWER:
    from fdam_ray.flower.client_app import app as client_app
    from fdam_ray.flower.inprocess import InProcessGrid, server_context
    from fdam_ray.flower.server_app import run_federation

ORIGINAL = pauc.refresh
PAUC = dict(algorithm="codasca", model="linear", batch_size=8, seed=3, executor="inline", local_steps=3,
            iterations=12, lr=0.2, stage_length=9, eval_every=6, objective="pauc_one_way", pauc_temperature=0.1)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    rng = np.random.default_rng(1)
    out = tmp_path_factory.mktemp("flower-pauc-data")
    for k, (n, shift) in enumerate([(30, 0.0), (50, 0.3), (40, -0.2)]):
        x = rng.normal(size=(n + 25, 4)).astype(np.float32) + shift
        y = (x[:, 0] + 0.5 * rng.normal(size=n + 25) > shift).astype(np.float32)
        np.savez(out / f"site{k}.npz", x=x[:n], y=y[:n], x_test=x[n:], y_test=y[n:])
    return out


def flower_run(folder, monkeypatch, **flower):
    passes = []
    original = ORIGINAL

    def keep(executor, state, p, objective, temperature):
        evaluate = executor.evaluate

        def seen(*a, **k):
            got = evaluate(*a, **k)
            secure, executor.secure_histogram = executor.secure_histogram, None
            try:  # the same state's per-site counts, asked in the clear
                passes.append((got, evaluate(*a, **k) if secure is not None else got))
            finally:
                executor.secure_histogram = secure
            return got

        monkeypatch.setattr(executor, "evaluate", seen)
        try:
            return original(executor, state, p, objective, temperature)
        finally:
            monkeypatch.setattr(executor, "evaluate", evaluate)

    monkeypatch.setattr(pauc, "refresh", keep)
    grid = InProcessGrid(client_app, [{"site": k, "data": str(folder / f"site{k}.npz")} for k in range(3)])
    result = run_federation(grid, server_context(), {**PAUC, "num_clients": 3, "flower": flower})
    return result, passes


def test_the_count_pass_runs_every_round_and_under_secagg_only_its_sum_arrives(folder, monkeypatch):
    clear, clear_passes = flower_run(folder, monkeypatch)
    rounds = clear.history[-1]["round"]
    assert len(clear_passes) == rounds == 4
    assert all(len(g) == 3 and all(h.client_id >= 0 and h.samples in (30, 50, 40) for h in g)
               for g, _ in clear_passes)
    secure, secure_passes = flower_run(folder, monkeypatch, secagg=True)
    assert len(secure_passes) == rounds
    for summed, parts in secure_passes:
        assert len(summed) == 1 and summed[0].client_id == -1 and summed[0].samples == 120
        assert np.array_equal(summed[0].counts, sum(h.counts for h in parts))
    np.testing.assert_allclose(secure.state.v, clear.state.v, rtol=0, atol=1e-4)  # SecAgg+ quantises updates


def test_a_site_without_a_test_split_still_sends_its_training_counts(folder, monkeypatch, tmp_path):
    """The count pass asks every site (the evaluation only those with a test split of their own)."""
    with np.load(folder / "site2.npz") as npz:
        np.savez(tmp_path / "site2.npz", x=npz["x"], y=npz["y"])
    for k in (0, 1):
        (tmp_path / f"site{k}.npz").write_bytes((folder / f"site{k}.npz").read_bytes())
    result, passes = flower_run(tmp_path, monkeypatch)
    assert len(passes) == result.history[-1]["round"] == 4
    assert all(sorted(h.samples for h in got) == [30, 40, 50] for got, _ in passes)
    assert all(h["test_samples"] == 50 for h in result.history)  # sites 0 and 1's test splits only
