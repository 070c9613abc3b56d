"""The driver loop: CODA's alpha round, metrics, bytes, multi-label and per-client AUC."""

from __future__ import annotations

import numpy as np
import pytest
from sample_clients import gaussian_clients

import fdam_ray
from fdam_ray.metrics import task_aucs
from fdam_ray.objectives import closed_form_alpha

BASE = dict(model="linear", batch_size="full", eval_every=5, seed=0, lr=0.3, executor="inline")


@pytest.mark.parametrize("objective", ["auc_square", "auc_margin"])
def test_coda_sets_alpha_to_its_closed_form_at_stage_end(objective, clients_and_test):
    clients, test = clients_and_test
    # one stage switch at iteration 6, which is also where the run ends... so stop right after it
    # CODA+ up to the stage switch at iteration 6; CODA runs one more round after it
    cfg = dict(BASE, algorithm="coda", objective=objective, local_steps=3, stage_length=6, iterations=7)
    plain = fdam_ray.train_arrays(dict(cfg, algorithm="coda_plus", iterations=6), clients, test)
    import torch

    from fdam_ray.models import build_model

    # alpha after the stage-1 rounds of CODA = closed form from v at that point
    model = build_model("linear", (clients[0][0].shape[1],), 1, seed=0)
    n_w = sum(p.numel() for p in model.parameters())
    torch.nn.utils.vector_to_parameters(torch.from_numpy(plain.state.v[:n_w]), model.parameters())
    with torch.no_grad():
        h = [torch.sigmoid(model(torch.from_numpy(X))).numpy().ravel() for X, _ in clients]
    ys = [y for _, y in clients]
    pos = np.concatenate([hk[yk == 1] for hk, yk in zip(h, ys, strict=True)])
    neg = np.concatenate([hk[yk == 0] for hk, yk in zip(h, ys, strict=True)])
    expected = closed_form_alpha(pos.mean(), neg.mean(), objective)

    from fdam_ray.loop.federation import Federation

    seen = {}
    orig = Federation._end_stage

    def spy(self, loop):
        orig(self, loop)
        seen["alpha"] = loop.state.alpha.copy()
        seen["v"] = loop.state.v.copy()

    Federation._end_stage = spy
    try:
        coda = fdam_ray.train_arrays(cfg, clients, test)
    finally:
        Federation._end_stage = orig
    np.testing.assert_array_equal(seen["v"], plain.state.v)  # same path up to the switch
    np.testing.assert_allclose(seen["alpha"], np.atleast_1d(expected), rtol=1e-5, atol=1e-6)
    assert coda.state.iteration == 7


def test_history_has_the_metrics_a_run_reports(clients_and_test):
    clients, test = clients_and_test
    r = fdam_ray.train_arrays(dict(BASE, algorithm="codasca", local_steps=2, iterations=10), clients, test)
    rec = r.history[-1]
    for key in ("iteration", "round", "stage", "lr", "train_loss", "test_auc", "bytes_up", "bytes_down",
                "wall_s", "samples_per_s"):
        assert key in rec
    assert [h["iteration"] for h in r.history] == [0, 6, 10]  # every eval_every=5, at round ends, and the end
    assert rec["round"] == 5
    assert r.summary["final_test_auc"] == rec["test_auc"]


def test_codasca_moves_twice_the_bytes_of_coda_plus(clients_and_test):
    clients, test = clients_and_test
    cfg = dict(BASE, local_steps=2, iterations=10)
    plus = fdam_ray.train_arrays(dict(cfg, algorithm="coda_plus"), clients, test).summary
    sca = fdam_ray.train_arrays(dict(cfg, algorithm="codasca"), clients, test).summary
    assert sca["bytes_up"] == pytest.approx(2 * plus["bytes_up"], rel=0.05)
    assert sca["bytes_down"] > 1.8 * plus["bytes_down"]
    n = clients[0][0].shape[1] + 3  # w, w0, a, b
    assert plus["bytes_up"] == 5 * 3 * (n + 1) * 4  # 5 rounds x 3 clients x (v + alpha) float32


def test_pooled_auc_is_one_auc_over_all_scores_not_a_mean_of_client_aucs():
    clients, _ = gaussian_clients(num_clients=3, n=60, shift=2.0)
    client_tests = [gaussian_clients(num_clients=3, n=60, seed=9, shift=2.0)[0][k] for k in range(3)]
    r = fdam_ray.train_arrays(dict(BASE, algorithm="coda_plus", iterations=4, local_steps=2), clients, None,
                              client_tests=client_tests)
    rec = r.history[-1]
    assert set(rec["client_auc"]) == {"0", "1", "2"}
    # recompute both from the final model
    import torch

    from fdam_ray.models import build_model

    model = build_model("linear", (5,), 1)
    model.load_state_dict(r.model_state)
    with torch.no_grad():
        s = [torch.sigmoid(model(torch.from_numpy(X))).numpy() for X, _ in client_tests]
    pooled = task_aucs(np.concatenate(s), np.concatenate([y for _, y in client_tests]))[0]
    per = [task_aucs(sk, y)[0] for sk, (_, y) in zip(s, client_tests, strict=True)]
    assert rec["test_auc"] == pytest.approx(pooled, abs=1e-6)
    assert [rec["client_auc"][str(k)] for k in range(3)] == pytest.approx(per, abs=1e-5)
    assert abs(pooled - np.mean(per)) > 1e-4  # the two differ here, so the test tells them apart


def test_multilabel_run_reports_per_task_auc_and_skips_missing_labels():
    rng = np.random.default_rng(0)

    def make(n):
        X = rng.standard_normal((n, 6)).astype(np.float32)
        Y = np.stack([(X[:, 0] > 0.8), (X[:, 1] > 0.5), (X[:, 2] + X[:, 3] > 1)], 1).astype(np.float32)
        Y[rng.random(Y.shape) < 0.2] = np.nan
        return X, Y

    clients = [make(80) for _ in range(3)]
    clients[2][1][:, 1] = np.nan  # one client has no label for task 1 at all
    r = fdam_ray.train_arrays(dict(BASE, algorithm="codasca", objective="auc_margin", iterations=60, local_steps=5,
                                   lr=0.5, prox_weight=0.0), clients, make(300))
    rec = r.history[-1]
    assert set(rec["task_auc"]) == {"task0", "task1", "task2"}
    assert all(v > 0.8 for v in rec["task_auc"].values())
    assert r.alpha.shape == (3,) and r.a.shape == (3,)
    assert np.all(r.alpha >= 0)


def test_divergence_stops_the_run_with_the_round(clients_and_test):
    clients, test = clients_and_test
    bad = [(X * 1e30, y) for X, y in clients]
    with pytest.raises(fdam_ray.DivergenceError, match="round 1"):
        fdam_ray.train_arrays(dict(BASE, algorithm="fedavg", iterations=4, local_steps=2, lr=1e30), bad, test)


def test_deterministic_asks_torch_for_deterministic_kernels(clients_and_test):
    import torch

    clients, test = clients_and_test
    before = torch.are_deterministic_algorithms_enabled()
    try:
        fdam_ray.train_arrays(dict(BASE, algorithm="coda_plus", iterations=2, local_steps=1, deterministic=True,
                                   executor="inline"), clients, test)
        assert torch.are_deterministic_algorithms_enabled()
    finally:
        torch.use_deterministic_algorithms(before)


def test_the_finiteness_check_is_exact_even_when_a_sum_overflows():
    import torch

    from fdam_ray.clients.inputs import all_finite

    big = torch.full((8,), 3e38)  # finite values whose float32 sum overflows
    assert not torch.isfinite(big.sum()) and all_finite([big, torch.zeros(0)])
    for bad in (float("nan"), float("inf"), -float("inf")):
        small, large = torch.ones(5), big.clone()
        small[2] = large[1] = bad
        assert not all_finite([torch.ones(3), small]) and not all_finite([large])
