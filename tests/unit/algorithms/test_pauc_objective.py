"""The pAUC objectives (fdam_ray/pauc.py) against a NumPy re-implementation: the KL-DRO weights, F, its gradient,
the limits in lambda, and the histogram normaliser against the exact one within its bin-width bound."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fdam_ray.objectives import Objective, auc_objective
from fdam_ray.pauc import (
    configure_vector,
    exact_log_normalisers,
    log_normalisers,
    normaliser_bound,
    pauc_objective,
)
from fdam_ray.scores.histogram import bin_edges, score_histograms


def numpy_f(h, y, p, a, b, alpha, m, lam, log_neg, log_pos, two_way):
    """F of the module docstring, one task, by hand: weights exp(+-h/lam - log Z) on each class."""
    pos, neg = (y == 1).astype(float), (y == 0).astype(float)
    w_neg = neg * np.exp(h / lam - log_neg)
    w_pos = pos * np.exp(-h / lam - log_pos) if two_way else pos
    q = p * (1 - p)
    per = (1 - p) * w_pos * (h - a) ** 2 + p * w_neg * (h - b) ** 2
    per += 2 * alpha * (q * m + p * w_neg * h - (1 - p) * w_pos * h) - q * alpha**2
    return per.mean(), w_neg, w_pos


@pytest.mark.parametrize("name", ["pauc_one_way", "pauc_two_way"])
def test_the_objective_and_its_gradient_are_the_numpy_ones(name):
    rng = np.random.default_rng(0)
    h = rng.uniform(0, 1, 40)
    y = (rng.uniform(size=40) < 0.3).astype(float)
    p, a, b, alpha, m, lam = 0.3, 0.7, 0.2, 0.4, 1.0, 0.1
    log_neg, log_pos = 3.1, -4.2
    want, w_neg, w_pos = numpy_f(h, y, p, a, b, alpha, m, lam, log_neg, log_pos, name == "pauc_two_way")
    ht = torch.tensor(h[:, None], dtype=torch.float64, requires_grad=True)
    got = pauc_objective(name, ht, torch.tensor(y[:, None]), torch.tensor([p], dtype=torch.float64),
                         torch.tensor([a], dtype=torch.float64), torch.tensor([b], dtype=torch.float64),
                         torch.tensor([alpha], dtype=torch.float64), margin=m, temperature=lam,
                         log_norms=torch.tensor([[log_neg, log_pos]], dtype=torch.float64))
    assert float(got.detach()) == pytest.approx(want, rel=1e-12)
    got.backward()
    # the weights are constants of the step: dF/dh = 2 (1-p) w_i (h-a - alpha) P + 2 p w_j (h-b + alpha) N, over n
    grad = (2 * (1 - p) * w_pos * (h - a - alpha) + 2 * p * w_neg * (h - b + alpha)) / len(h)
    np.testing.assert_allclose(ht.grad.numpy()[:, 0], grad, rtol=1e-10)


def test_a_high_scoring_negative_is_pushed_down_harder_than_under_auc_m():
    """Gradient direction on a toy: two negatives (0.2 and 0.8), one positive. Under AUC-M their gradients differ
    by (h - b) alone; under pauc_one_way the 0.8 negative's is exp(0.6 / lambda) times larger again."""
    h0 = torch.tensor([[0.2], [0.8], [0.6]], dtype=torch.float64)
    y = torch.tensor([[0.0], [0.0], [1.0]], dtype=torch.float64)
    args = [torch.tensor([v], dtype=torch.float64) for v in (0.5, 0.6, 0.4, 0.5)]  # p, a, b, alpha
    grads = {}
    for name in ("auc_margin", "pauc_one_way"):
        h = h0.clone().requires_grad_(True)
        if name == "auc_margin":
            auc_objective(name, h, y, *args, margin=1.0).backward()
        else:
            pauc_objective(name, h, y, *args, margin=1.0, temperature=0.1, log_norms=None).backward()
        grads[name] = h.grad[:, 0].numpy()
    assert np.all(grads["pauc_one_way"][:2] > 0)  # descent lowers both negatives' scores
    ratio = (grads["pauc_one_way"][1] / grads["pauc_one_way"][0]) / (grads["auc_margin"][1] / grads["auc_margin"][0])
    assert ratio == pytest.approx(np.exp(0.6 / 0.1), rel=1e-9)


def test_a_large_temperature_gives_back_auc_m_and_a_tiny_one_the_hardest_negative():
    rng = np.random.default_rng(1)
    h = torch.tensor(rng.uniform(0, 1, (64, 1)))
    y = torch.tensor((rng.uniform(size=(64, 1)) < 0.4).astype(float))
    args = [torch.tensor([v], dtype=torch.float64) for v in (0.4, 0.7, 0.2, 0.3)]
    norms = torch.tensor(exact_log_normalisers(h.numpy(), y.numpy(), 1e6))
    got = pauc_objective("pauc_two_way", h, y, *args, margin=1.0, temperature=1e6, log_norms=norms)
    assert float(got) == pytest.approx(float(auc_objective("auc_margin", h, y, *args, margin=1.0)), rel=1e-5)
    # lambda -> 0: the weights' mean over the negatives stays 1, all of it on the highest-scoring one
    neg = (y[:, 0] == 0).numpy()
    for lam in (1e-2, 1e-3):
        norms = torch.tensor(exact_log_normalisers(h.numpy(), y.numpy(), lam))
        from fdam_ray.pauc import tilted

        w = tilted(h, (y == 0).to(h.dtype), 1.0, lam, norms[:, 0])[:, 0].numpy()
        assert w[neg].mean() == pytest.approx(1.0, rel=1e-9)
    top = np.flatnonzero(neg)[np.argmax(h.numpy()[neg, 0])]
    assert w[top] / neg.sum() == pytest.approx(1.0, abs=1e-6)


def test_without_a_global_normaliser_the_batch_weights_average_one_per_class():
    rng = np.random.default_rng(2)
    h = torch.tensor(rng.uniform(0, 1, (30, 2)))
    y = torch.tensor((rng.uniform(size=(30, 2)) < 0.5).astype(float))
    y[0, 1] = float("nan")
    from fdam_ray.pauc import tilted

    for k, sign in ((0, 1.0), (1, -1.0)):
        member = (y == k).to(h.dtype)
        w = tilted(h, member, sign, 0.05, None).numpy()
        for t in range(2):
            sel = member[:, t].numpy() > 0
            assert w[sel, t].mean() == pytest.approx(1.0, rel=1e-9) and np.all(w[~sel, t] == 0)


@pytest.mark.parametrize("bins", [64, 4096])
@pytest.mark.parametrize("lam", [0.02, 0.1, 1.0])
def test_the_histogram_normaliser_is_within_its_bin_width_bound_of_the_exact_one(bins, lam):
    rng = np.random.default_rng(bins)
    scores = np.concatenate([rng.beta(2, 8, 500), rng.beta(8, 2, 200), [0.0, 1.0, 0.5]])[:, None]
    labels = np.concatenate([np.zeros(500), np.ones(200), [0, 1, 0]])[:, None]
    counts = score_histograms(scores, labels, bins)
    got, exact = log_normalisers(counts, lam), exact_log_normalisers(scores, labels, lam)
    bound = normaliser_bound(counts, lam)
    assert np.all(np.abs(got - exact) <= bound + 1e-12)
    assert np.all(bound <= 1.0 / (bins * lam) + 1e-15)  # the layout's bins are at most 2 / B wide
    # an independent placement: NumPy's own histogram on the layout's edges, logsumexp by hand
    edges = np.concatenate(([0.0], bin_edges(bins), [1.0 + 1e-12]))
    centres = (edges[:-1] + np.minimum(edges[1:], 1.0)) / 2
    for k, sign in ((0, 1.0), (1, -1.0)):
        n, _ = np.histogram(scores[labels[:, 0] == k, 0], bins=edges)
        assert np.array_equal(n, counts[0, k])
        want = np.log(np.sum(n * np.exp(sign * centres / lam)) / n.sum())
        assert got[0, k] == pytest.approx(want, rel=1e-9, abs=1e-9)


def test_the_objective_takes_p_and_then_its_normalisers_from_one_vector():
    obj = Objective("pauc_two_way", num_tasks=2, temperature=0.2)
    assert obj.alpha_nonnegative and obj.has_auxiliary and obj.aux_size == 2
    obj.configure(np.array([0.3, 0.4]))
    assert obj.log_norms is None and obj.p.tolist() == pytest.approx([0.3, 0.4])
    obj.configure(configure_vector([0.3, 0.4], np.array([[1.0, -2.0], [3.0, -4.0]])))
    assert obj.p.tolist() == pytest.approx([0.3, 0.4])
    assert obj.log_norms.tolist() == [[1.0, -2.0], [3.0, -4.0]]
    with pytest.raises(ValueError, match="pauc_temperature: 0"):
        Objective("pauc_one_way", num_tasks=1, temperature=0)
    with pytest.raises(ValueError, match="positive ratio p"):
        Objective("auc_margin", num_tasks=2).configure(np.zeros(6) + 0.5)  # 3T values only under pAUC


@pytest.mark.parametrize(("given", "words"), [
    ({"objective": "pauc_one_way", "dp": "client"}, "'objective': 'pauc_one_way' is not allowed (not with dp: client"),
    ({"objective": "pauc_two_way", "algorithm": "coda"}, "'objective': 'pauc_two_way' is not allowed (algorithm "
                                                         "'coda' takes one of auc_square, auc_margin)"),
    ({"objective": "pauc_one_way", "pauc_temperature": -1.0}, "'pauc_temperature': -1.0 is not allowed (> 0)"),
])
def test_a_config_the_objectives_cannot_run_is_refused_in_one_line_naming_the_field(given, words):
    from fdam_ray.config import build_config

    with pytest.raises(ValueError, match="config field") as refused:
        build_config(given)
    assert words in str(refused.value) and "\n" not in str(refused.value)


def test_the_algorithms_build_the_pauc_objective_with_its_temperature_and_alpha_kept_nonnegative():
    from fdam_ray.algorithms import build_algorithm
    from fdam_ray.config import build_config

    for name in ("codasca", "coda_plus", "npa", "centralized"):
        algorithm = build_algorithm(build_config({"algorithm": name, "objective": "pauc_two_way",
                                                  "pauc_temperature": 0.3}))
        objective = algorithm.objective(2)
        assert objective.name == "pauc_two_way" and objective.temperature == pytest.approx(0.3)
        assert algorithm.server_step() is None or algorithm.server_step().alpha_nonnegative


@pytest.mark.parametrize("two_way", [False, True])
def test_the_public_loss_is_the_objective_with_the_batch_or_a_given_normaliser(two_way):
    from fdam_ray.losses import PartialAUCLoss
    from fdam_ray.pauc import tilted

    rng = np.random.default_rng(3)
    h = torch.tensor(rng.uniform(0.01, 0.99, (50, 1)), dtype=torch.float32)
    y = torch.tensor((rng.uniform(size=(50, 1)) < 0.3).astype(np.float32))
    loss = PartialAUCLoss(temperature=0.2, two_way=two_way, imratio=0.3)
    with torch.no_grad():
        loss.a.fill_(0.6), loss.b.fill_(0.3), loss.alpha.fill_(0.2)
    hn, yn = h.double().numpy()[:, 0], y.numpy()[:, 0]
    batch = exact_log_normalisers(hn, yn, 0.2)[0]  # the batch's own: the same as tilted's by-batch Z
    assert float(tilted(h.double(), (y == 0).double(), 1.0, 0.2, None)[yn == 0].mean()) == pytest.approx(1.0)
    want, _, _ = numpy_f(hn, yn, 0.3, 0.6, 0.3, 0.2, 1.0, 0.2, batch[0], batch[1], two_way)
    assert float(loss(h, y).detach()) == pytest.approx(want, rel=1e-5)
    loss.set_log_normalisers([[1.5, -2.5]])
    want, _, _ = numpy_f(hn, yn, 0.3, 0.6, 0.3, 0.2, 1.0, 0.2, 1.5, -2.5, two_way)
    assert float(loss(h, y).detach()) == pytest.approx(want, rel=1e-5)
    with pytest.raises(ValueError, match="temperature: 0"):
        PartialAUCLoss(temperature=0)
