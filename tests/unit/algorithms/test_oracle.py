"""CODA+ and CODASCA against an independent NumPy implementation (linear scorer, full batch).

The rules are those of docs/algorithms.md: the local step (s.2), the round (s.3), the stages (s.5), and
the global positive ratio p of s.1.
"""

from __future__ import annotations

import numpy as np
import pytest
from oracle import assert_matches, objective_grads, pooled_positive_ratio, run_oracle

import fdam_ray
from fdam_ray.models import build_model


def initial_v(d: int, seed: int = 0) -> np.ndarray:
    model = build_model("linear", (d,), 1, seed=seed)
    w = model[1].weight.detach().numpy().ravel()
    b = model[1].bias.detach().numpy()
    return np.r_[w, b, 0.0, 0.0]


BASE = dict(model="linear", batch_size="full", eval_every=1000, seed=0, executor="inline")

CASES = [
    # one round, CODA+, square loss
    dict(algorithm="coda_plus", objective="auc_square", local_steps=5, iterations=5, lr=0.2, prox_weight=0.0),
    # several rounds, CODA+, margin with projection, prox term, stage switch with averaged reference
    dict(algorithm="coda_plus", objective="auc_margin", local_steps=3, iterations=24, lr=0.3, prox_weight=0.05,
         stage_length=9, margin=0.5),
    # CODASCA: control variates, eta_g != 1, prox, margin, stage switch resetting the control variates
    dict(algorithm="codasca", objective="auc_margin", local_steps=4, iterations=32, lr=0.3, global_lr=1.3,
         prox_weight=0.02, stage_length=12, weight_decay=0.01),
    # CODASCA keeping control variates across stages, last-iterate reference, square loss, eta_g < 1
    dict(algorithm="codasca", objective="auc_square", local_steps=3, iterations=21, lr=0.2, global_lr=0.9,
         prox_weight=0.01, stage_length=6, reference_point="last", reset_control_variates=False),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c['algorithm']}-{c['objective']}-{c['iterations']}")
def test_matches_numpy_oracle(case, clients_and_test):
    clients, test = clients_and_test
    cfg = {**BASE, **case}
    result = fdam_ray.train_arrays(cfg, clients, test)
    oracle_kwargs = {k: v for k, v in case.items() if k not in ("algorithm",)}
    v, alpha, c_v, c_a = run_oracle(
        [(X.astype(np.float64), y) for X, y in clients],
        initial_v(clients[0][0].shape[1]),
        control_variates=case["algorithm"] == "codasca",
        **oracle_kwargs,
    )
    codasca = case["algorithm"] == "codasca"
    assert_matches(result, v, alpha, *((c_v, c_a) if codasca else ()))
    assert result.a[0] == pytest.approx(v[-2], rel=1e-5, abs=1e-6)
    if codasca:
        assert np.abs(c_v).max() > 1e-3  # the control variates were really in play
    else:
        assert result.control_variates is None
    assert result.state.round == -(-case["iterations"] // case["local_steps"])


def uneven_clients(seed: int = 1):
    """Clients of different sizes AND prevalences (as Dirichlet splits and chest X-ray sources have)."""
    rng = np.random.default_rng(seed)
    u = rng.standard_normal(4)
    out = []
    for n, n_pos in ((20, 10), (60, 12), (100, 5)):  # ratios 0.5, 0.2, 0.05; pooled 27 / 180 = 0.15
        y = np.r_[np.ones(n_pos), np.zeros(n - n_pos)]
        X = rng.standard_normal((n, 4)) + np.outer(2 * y - 1, u) * 0.8 + rng.standard_normal(4)
        out.append((X.astype(np.float32), y.astype(np.float32)))
    yt = np.r_[np.ones(30), np.zeros(30)]
    Xt = (rng.standard_normal((60, 4)) + np.outer(2 * yt - 1, u) * 0.8).astype(np.float32)
    return out, (Xt, yt.astype(np.float32))


def test_p_is_pooled_over_clients_of_different_sizes_and_prevalences():
    clients, test = uneven_clients()
    pooled = pooled_positive_ratio(clients)
    mean_of_ratios = float(np.mean([y.mean() for _, y in clients]))
    assert pooled == pytest.approx(27 / 180) and abs(pooled - mean_of_ratios) > 0.05  # the two differ here
    case = dict(algorithm="codasca", objective="auc_square", local_steps=3, iterations=9, lr=0.3, prox_weight=0.0)
    result = fdam_ray.train_arrays({**BASE, **case}, clients, test)
    assert result.summary["positive_ratio"] == [pytest.approx(pooled, abs=1e-6)]
    # and the objective every client optimised used that p: the run matches the oracle step by step
    v, alpha, _, _ = run_oracle([(X.astype(np.float64), y) for X, y in clients], initial_v(4),
                                control_variates=True, **{k: v for k, v in case.items() if k != "algorithm"})
    np.testing.assert_allclose(result.state.v, v, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(result.alpha, [alpha], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("algorithm", ["coda_plus", "codasca"])
def test_grad_clip_clips_the_network_gradient_element_wise_and_nothing_else(algorithm, clients_and_test):
    clients, test = clients_and_test
    clip = 0.02
    case = dict(algorithm=algorithm, objective="auc_margin", local_steps=3, iterations=12, lr=0.5, prox_weight=0.01,
                grad_clip=clip)
    data = [(X.astype(np.float64), y) for X, y in clients]
    v0 = initial_v(clients[0][0].shape[1])
    # the clip is active on the network's weights, and a and b (not clipped) have gradients beyond it
    g, _ = objective_grads(v0, 0.0, *data[0], pooled_positive_ratio(data), "auc_margin", 1.0)
    assert np.abs(g[:-2]).max() > clip and np.abs(g[-2:]).max() > clip
    result = fdam_ray.train_arrays({**BASE, **case}, clients, test)
    kwargs = {k: v for k, v in case.items() if k != "algorithm"}
    v, alpha, _, _ = run_oracle(data, v0, control_variates=algorithm == "codasca", **kwargs)
    np.testing.assert_allclose(result.state.v, v, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(result.alpha, [alpha], rtol=1e-5, atol=1e-6)
    unclipped, _, _, _ = run_oracle(data, v0, control_variates=algorithm == "codasca", **{**kwargs, "grad_clip": None})
    assert np.abs(unclipped - v).max() > 1e-3  # the clip changed the run


@pytest.mark.parametrize("algorithm", ["coda_plus", "codasca"])
def test_alpha_is_projected_after_every_local_step_not_only_on_the_server(algorithm, clients_and_test):
    # a small margin and a large lr: the dual step pushes alpha below zero inside a round
    clients, test = clients_and_test
    case = dict(algorithm=algorithm, objective="auc_margin", margin=0.01, lr=1.0, local_steps=8, iterations=48,
                prox_weight=0.0)
    data = [(X.astype(np.float64), y) for X, y in clients]
    v0 = initial_v(clients[0][0].shape[1])
    kwargs = {k: v for k, v in case.items() if k != "algorithm"}
    cv = algorithm == "codasca"
    v, alpha, _, _ = run_oracle(data, v0, control_variates=cv, **kwargs)
    result = fdam_ray.train_arrays({**BASE, **case}, clients, test)
    np.testing.assert_allclose(result.state.v, v, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(result.alpha, [alpha], rtol=1e-5, atol=1e-6)
    projected_on_the_server_only, _, _, _ = run_oracle(data, v0, control_variates=cv, local_projection=False,
                                                       **kwargs)
    assert np.abs(projected_on_the_server_only - v).max() > 1e-3  # the local projection was active
