"""Degenerate cases that pin the math: equalities that must hold between algorithms."""

from __future__ import annotations

import numpy as np
import pytest
from sample_clients import gaussian_clients

import fdam_ray
from fdam_ray.algorithms.drift import ClientControlVariates

BASE = dict(model="mlp", model_width=8, batch_size="full", eval_every=1000, seed=3, lr=0.2, prox_weight=0.01,
            executor="inline")


def same_state(r1, r2, exact=True):
    for name in ("v", "alpha", "buffers"):
        x, y = getattr(r1.state, name), getattr(r2.state, name)
        if exact:
            np.testing.assert_array_equal(x, y, err_msg=name)
        else:
            np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6, err_msg=name)


def test_codasca_with_zero_control_variates_equals_coda_plus(monkeypatch, clients_and_test):
    clients, test = clients_and_test
    cfg = dict(BASE, local_steps=4, iterations=24, stage_length=12)
    plus = fdam_ray.train_arrays(dict(cfg, algorithm="coda_plus"), clients, test)
    sca = fdam_ray.train_arrays(dict(cfg, algorithm="codasca"), clients, test)
    assert np.abs(plus.state.v - sca.state.v).max() > 1e-4  # real control variates change the run
    monkeypatch.setattr(ClientControlVariates, "end", lambda self, flat, steps, lr, change: None)  # c^k stays 0
    forced = fdam_ray.train_arrays(dict(cfg, algorithm="codasca"), clients, test)
    same_state(plus, forced)
    np.testing.assert_array_equal(forced.control_variates[0], 0)


def test_codasca_with_one_round_per_stage_equals_coda_plus(clients_and_test):
    # Control variates are zero at every stage start, so with one round per stage they never act.
    clients, test = clients_and_test
    cfg = dict(BASE, local_steps=6, iterations=24, stage_length=6)
    same_state(fdam_ray.train_arrays(dict(cfg, algorithm="coda_plus"), clients, test),
               fdam_ray.train_arrays(dict(cfg, algorithm="codasca"), clients, test))


def test_coda_plus_with_one_local_step_equals_npa_with_the_same_total_batch():
    # Equal-size shards, full batch: the mean of K client gradients is the gradient of the union,
    # so K clients with I = 1 equal NPA whose (one) machine takes the K x B total batch each step.
    clients, test = gaussian_clients(num_clients=4, n=30)
    cfg = dict(BASE, iterations=8, stage_length=4, positive_ratio=0.3)
    fed = fdam_ray.train_arrays(dict(cfg, algorithm="coda_plus", local_steps=1), clients, test)
    union = [(np.concatenate([c[0] for c in clients]), np.concatenate([c[1] for c in clients]))]
    npa = fdam_ray.train_arrays(dict(cfg, algorithm="npa"), union, test)
    same_state(fed, npa, exact=False)
    assert npa.state.round == fed.state.round == 8  # NPA averages after every step


def test_one_client_with_one_local_step_equals_centralized(clients_and_test):
    clients, test = clients_and_test
    union = [(np.concatenate([c[0] for c in clients]), np.concatenate([c[1] for c in clients]))]
    cfg = dict(BASE, iterations=12, stage_length=6, local_steps=1)
    cen = fdam_ray.train_arrays(dict(cfg, algorithm="centralized"), union, test)
    for algorithm in ("codasca", "coda_plus"):
        same_state(fdam_ray.train_arrays(dict(cfg, algorithm=algorithm, global_lr=1.0), union, test), cen)


def test_centralized_equals_a_plain_pytorch_primal_dual_loop(clients_and_test):
    import torch

    from fdam_ray.models import build_model
    from fdam_ray.objectives import Objective

    clients, test = clients_and_test
    X = torch.from_numpy(np.concatenate([c[0] for c in clients]))
    y = torch.from_numpy(np.concatenate([c[1] for c in clients])).reshape(-1, 1)
    lr, gamma, steps = 0.2, 0.01, 7
    res = fdam_ray.train_arrays(dict(BASE, algorithm="centralized", objective="auc_margin", iterations=steps,
                                     lr=lr, prox_weight=gamma), [(X.numpy(), y.numpy())], test)
    model = build_model("mlp", (X.shape[1],), 1, width=8, seed=BASE["seed"])
    a, b, alpha = (torch.zeros(1, requires_grad=True) for _ in range(3))
    params = [*model.parameters(), a, b]
    ref = [p.detach().clone() for p in params]
    obj = Objective("auc_margin", num_tasks=1)
    obj.set_positive_ratio(float(y.mean()))
    for _ in range(steps):
        loss = obj(model(X), y, a, b, alpha)
        grads = torch.autograd.grad(loss, [*params, alpha])
        with torch.no_grad():
            for p, g, r in zip(params, grads[:-1], ref, strict=True):
                p -= lr * (g + gamma * (p - r))
            alpha += lr * grads[-1]
            alpha.clamp_(min=0)
    flat = torch.cat([p.detach().reshape(-1) for p in params]).numpy()
    np.testing.assert_allclose(res.state.v, flat, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(res.alpha, alpha.detach().numpy(), rtol=1e-5, atol=1e-6)


def test_same_seed_gives_bit_identical_runs_with_minibatches():
    clients, test = gaussian_clients(num_clients=3, n=50)
    cfg = dict(BASE, batch_size=8, local_steps=3, iterations=30, stage_length=15, algorithm="codasca")
    r1 = fdam_ray.train_arrays(cfg, clients, test)
    r2 = fdam_ray.train_arrays(cfg, clients, test)
    same_state(r1, r2)
    np.testing.assert_array_equal(r1.control_variates[0], r2.control_variates[0])
    r3 = fdam_ray.train_arrays(dict(cfg, seed=4), clients, test)
    assert not np.array_equal(r1.state.v, r3.state.v)


@pytest.mark.parametrize("algorithm", ["fedavg", "scaffold"])
def test_bce_baselines_have_no_dual_and_learn(algorithm, clients_and_test):
    clients, test = clients_and_test
    r = fdam_ray.train_arrays(dict(BASE, algorithm=algorithm, iterations=60, local_steps=5, lr=0.5), clients, test)
    assert r.alpha.size == 0 and r.a.size == 0
    assert r.history[-1]["test_auc"] > r.history[0]["test_auc"] + 0.05
