"""CODA+ and CODASCA against an independent NumPy implementation (linear scorer, full batch)."""

from __future__ import annotations

import numpy as np
import pytest
from oracle import run_oracle

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
    np.testing.assert_allclose(result.state.v, v, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(result.alpha, [alpha], rtol=1e-5, atol=1e-6)
    assert result.a[0] == pytest.approx(v[-2], rel=1e-5, abs=1e-6)
    if case["algorithm"] == "codasca":
        np.testing.assert_allclose(result.control_variates[0], c_v, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(result.control_variates[1], [c_a], rtol=1e-4, atol=1e-5)
        assert np.abs(c_v).max() > 1e-3  # the control variates were really in play
    else:
        assert result.control_variates is None
    assert result.state.round == -(-case["iterations"] // case["local_steps"])
