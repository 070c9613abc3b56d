"""Objectives: closed forms, per-task NaN handling, alpha gradient, against NumPy."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.optimize import minimize, minimize_scalar

from fdam_ray.objectives import Objective, closed_form_alpha


def numpy_F(h, y, a, b, alpha, p, kind, m=1.0):
    P, N = (y == 1).astype(float), (y == 0).astype(float)
    base = (1 - p) * (h - a) ** 2 * P + p * (h - b) ** 2 * N
    cross = p * h * N - (1 - p) * h * P
    if kind == "auc_square":
        F = base + 2 * (1 + alpha) * cross - p * (1 - p) * alpha**2
    else:
        F = base + 2 * alpha * (p * (1 - p) * m + cross) - p * (1 - p) * alpha**2
    return F.mean()


def logit(h):
    return np.log(h / (1 - h))


@pytest.fixture
def scored():
    rng = np.random.default_rng(1)
    y = (rng.random(200) < 0.3).astype(np.float64)
    h = np.clip(rng.beta(2, 3, 200) + 0.2 * y, 0.01, 0.99)
    return h, y


@pytest.mark.parametrize("kind", ["auc_square", "auc_margin"])
def test_torch_objective_equals_numpy_formula(kind, scored):
    h, y = scored
    p, a, b, alpha = y.mean(), 0.3, 0.6, 0.2
    obj = Objective(kind, num_tasks=1, margin=0.7)
    obj.set_positive_ratio(p)
    t = lambda x: torch.tensor([x], dtype=torch.float32)
    val = obj(torch.tensor(logit(h), dtype=torch.float32).reshape(-1, 1), torch.tensor(y, dtype=torch.float32),
              t(a), t(b), t(alpha))
    assert float(val) == pytest.approx(numpy_F(h, y, a, b, alpha, p, kind, 0.7), rel=1e-5)


@pytest.mark.parametrize("kind", ["auc_square", "auc_margin"])
def test_closed_form_alpha_is_the_numerical_argmax(kind, scored):
    h, y = scored
    p = y.mean()  # exact when p is the positive fraction of the data
    a, b = 0.1, 0.4
    best = minimize_scalar(lambda al: -numpy_F(h, y, a, b, al, p, kind), bounds=(-5, 5), method="bounded",
                           options={"xatol": 1e-10})
    numeric = max(best.x, 0.0) if kind == "auc_margin" else best.x
    closed = closed_form_alpha(h[y == 1].mean(), h[y == 0].mean(), kind)
    assert float(closed) == pytest.approx(numeric, abs=1e-6)


def test_margin_alpha_is_clipped_at_zero():
    assert float(closed_form_alpha(0.9, 0.1, "auc_margin", margin=0.5)) == 0.0
    assert float(closed_form_alpha(0.9, 0.1, "auc_square")) == pytest.approx(-0.8)


@pytest.mark.parametrize("kind", ["auc_square", "auc_margin"])
def test_optimal_a_and_b_are_the_class_means(kind, scored):
    h, y = scored
    p = y.mean()
    res = minimize(lambda ab: numpy_F(h, y, ab[0], ab[1], 0.3, p, kind), x0=[0.0, 0.0], tol=1e-12)
    np.testing.assert_allclose(res.x, [h[y == 1].mean(), h[y == 0].mean()], atol=1e-5)


def test_alpha_gradient_is_the_exact_gradient_of_the_minibatch_mean(scored):
    h, y = scored
    p = y.mean()
    obj = Objective("auc_margin", num_tasks=1)
    obj.set_positive_ratio(p)
    alpha = torch.tensor([0.25], requires_grad=True)
    loss = obj(torch.tensor(logit(h), dtype=torch.float32), torch.tensor(y, dtype=torch.float32),
               torch.tensor([0.3]), torch.tensor([0.5]), alpha)
    loss.backward()
    P, N = y == 1, y == 0
    closed = np.mean(2 * (p * (1 - p) * 1.0 + p * h * N - (1 - p) * h * P)) - 2 * p * (1 - p) * 0.25
    assert float(alpha.grad) == pytest.approx(closed, rel=1e-5)


@pytest.mark.parametrize("kind", ["auc_square", "auc_margin", "bce"])
def test_multilabel_leaves_missing_labels_out_of_their_task(kind):
    rng = np.random.default_rng(2)
    n, T = 50, 3
    logits = rng.standard_normal((n, T))
    y = (rng.random((n, T)) < 0.4).astype(np.float64)
    y[rng.random((n, T)) < 0.3] = np.nan
    y[:, 2] = np.nan  # a task with no label in the batch adds nothing
    p = np.array([0.3, 0.4, 0.5])
    a, b, al = np.array([0.1, 0.2, 0.3]), np.array([0.5, 0.6, 0.7]), np.array([0.2, 0.1, 0.4])
    obj = Objective(kind, num_tasks=T)
    obj.set_positive_ratio(p)
    f = lambda x: torch.tensor(x, dtype=torch.float32)
    val = float(obj(f(logits), f(y), f(a), f(b), f(al)))
    expected = []
    for t in range(2):
        keep = ~np.isnan(y[:, t])
        h = 1 / (1 + np.exp(-logits[keep, t]))
        if kind == "bce":
            yt = y[keep, t]
            expected.append(np.mean(-(yt * np.log(h) + (1 - yt) * np.log(1 - h))))
        else:
            expected.append(numpy_F(h, y[keep, t], a[t], b[t], al[t], p[t], kind))
    assert val == pytest.approx(np.mean(expected), rel=1e-5)


def test_bad_positive_ratio_is_refused():
    obj = Objective("auc_square", num_tasks=2)
    with pytest.raises(ValueError, match="positive ratio"):
        obj.set_positive_ratio([0.2, 1.0])


def test_a_batch_without_any_label_adds_nothing_instead_of_nan():
    obj = Objective("auc_margin", num_tasks=2)
    obj.set_positive_ratio([0.3, 0.4])
    alpha = torch.zeros(2, requires_grad=True)
    loss = obj(torch.randn(3, 2), torch.full((3, 2), float("nan")), torch.zeros(2), torch.zeros(2), alpha)
    loss.backward()
    assert float(loss.detach()) == 0.0 and torch.all(alpha.grad == 0)
