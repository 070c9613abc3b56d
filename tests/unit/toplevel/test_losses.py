"""The public AUC losses and the primal-dual optimiser: closed forms by hand in NumPy, the federation's own
objective and local step, and (when it is importable) LibAUC 2.x's AUCMLoss / PESG where their definitions
agree."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fdam_ray.algorithms.drift import DRIFT_CORRECTIONS
from fdam_ray.algorithms.local import LocalSolver
from fdam_ray.core.flat import FlatModel
from fdam_ray.features.precision import Precision
from fdam_ray.losses import AUCMLoss, AUCSquareLoss, positive_ratio
from fdam_ray.objectives import Objective
from fdam_ray.optim import PrimalDualSGD

H = np.array([0.9, 0.2, 0.7, 0.4, 0.1, 0.8, 0.3, 0.6])
Y = np.array([1, 0, 1, 0, 0, 1, 0, 0])
A, B, ALPHA, P, M = 0.3, -0.2, 0.5, 0.3, 0.8


def numpy_loss(kind, h, y, p, a, b, alpha, m=1.0):
    """F of docs/algorithms.md s.1 averaged over the labelled samples, and its gradients in h, a, b, alpha."""
    pos, neg = (y == 1).astype(float), (y == 0).astype(float)
    n = len(h)
    per = (1 - p) * (h - a) ** 2 * pos + p * (h - b) ** 2 * neg
    cross = p * h * neg - (1 - p) * h * pos
    dcross = p * neg - (1 - p) * pos
    if kind == "square":
        per = per + 2 * (1 + alpha) * cross
        dh_dual, dalpha = 2 * (1 + alpha) * dcross, 2 * cross - 2 * p * (1 - p) * alpha
    else:
        per = per + 2 * alpha * (p * (1 - p) * m + cross)
        dh_dual, dalpha = 2 * alpha * dcross, 2 * (p * (1 - p) * m + cross) - 2 * p * (1 - p) * alpha
    per = per - p * (1 - p) * alpha**2
    dh = (2 * (1 - p) * (h - a) * pos + 2 * p * (h - b) * neg + dh_dual) / n
    return (per.mean(), dh, (-2 * (1 - p) * (h - a) * pos).sum() / n, (-2 * p * (h - b) * neg).sum() / n,
            dalpha.mean())


def set_aux(loss, a, b, alpha):
    with torch.no_grad():
        loss.a.fill_(a)
        loss.b.fill_(b)
        loss.alpha.fill_(alpha)


@pytest.mark.parametrize("cls,kind", [(AUCSquareLoss, "square"), (AUCMLoss, "margin")])
def test_loss_and_its_gradients_equal_the_closed_form(cls, kind):
    loss = cls(imratio=P, margin=M)
    set_aux(loss, A, B, ALPHA)
    h = torch.tensor(H, dtype=torch.float64, requires_grad=True)
    value = loss(h.float(), torch.tensor(Y))
    value.backward()
    want, dh, da, db, dalpha = numpy_loss(kind, H, Y, P, A, B, ALPHA, M)
    np.testing.assert_allclose(value.item(), want, rtol=1e-6)
    np.testing.assert_allclose(h.grad.numpy(), dh, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose([loss.a.grad.item(), loss.b.grad.item(), loss.alpha.grad.item()], [da, db, dalpha],
                               rtol=1e-5, atol=1e-7)


def test_multi_label_leaves_out_minus_one_and_nan_per_task_and_tasks_without_labels():
    h = np.stack([H, H[::-1], H * 0.5], 1)
    y = np.stack([Y, Y[::-1], Y], 1).astype(float)
    y[[0, 3], 0] = -1
    y[[2, 5], 1] = np.nan
    y[:, 2] = -1  # task 2 has no label in this batch: it adds nothing
    p = np.array([0.3, 0.4, 0.5])
    loss = AUCMLoss(num_tasks=3, imratio=p)
    set_aux(loss, A, B, ALPHA)
    got = loss(torch.tensor(h, dtype=torch.float32), torch.tensor(y)).item()
    tasks = []
    for t in range(2):
        keep = ~np.isnan(y[:, t]) & (y[:, t] != -1)
        tasks.append(numpy_loss("margin", h[keep, t], y[keep, t], p[t], A, B, ALPHA)[0])
    np.testing.assert_allclose(got, np.mean(tasks), rtol=1e-6)


def test_the_public_loss_is_the_federations_objective_to_the_bit():
    torch.manual_seed(0)
    logits, labels = torch.randn(20, 2), (torch.rand(20, 2) < 0.3).float()
    labels[3, 1] = float("nan")
    for cls, name in ((AUCSquareLoss, "auc_square"), (AUCMLoss, "auc_margin")):
        loss = cls(num_tasks=2, imratio=[0.2, 0.35], margin=0.7, from_logits=True)
        with torch.no_grad():
            loss.a.copy_(torch.tensor([0.1, -0.3]))
            loss.alpha.copy_(torch.tensor([0.4, 0.2]))
        objective = Objective(name, num_tasks=2, margin=0.7)
        objective.set_positive_ratio([0.2, 0.35])
        assert torch.equal(loss(logits, labels), objective(logits, labels, loss.a, loss.b, loss.alpha))


def test_p_estimated_from_every_batch_seen_in_training_mode_only():
    loss = AUCMLoss()
    loss(torch.rand(4), torch.tensor([1, 0, 0, 0]))
    loss(torch.rand(5), torch.tensor([1, 1, 0, -1, 0]))
    assert loss.p.item() == pytest.approx((3 + 1) / (8 + 2))
    loss.eval()
    loss(torch.rand(3), torch.tensor([1, 1, 1]))
    assert loss.p.item() == pytest.approx(0.4)
    np.testing.assert_allclose(positive_ratio([[1, 0], [0, -1], [1, 1], [0, 0]], num_tasks=2), [0.5, 1 / 3])


@pytest.mark.parametrize("make,words", [
    (lambda: AUCMLoss(imratio=1.0), "imratio"),
    (lambda: AUCMLoss(margin=0), "margin"),
    (lambda: AUCMLoss()(torch.rand(2), torch.tensor([1, 2])), "is not 0, 1"),
    (lambda: AUCMLoss(num_tasks=2)(torch.rand(4, 3), torch.zeros(4, 3)), "num_tasks=2"),
    (lambda: PrimalDualSGD([torch.zeros(1, requires_grad=True)], AUCMLoss(), lr=0), "lr"),
    (lambda: PrimalDualSGD([torch.zeros(1, requires_grad=True)], AUCMLoss(), lr=0.1, momentum=1), "momentum"),
])
def test_bad_arguments_are_one_line_errors(make, words):
    with pytest.raises(ValueError, match=words) as info:
        make()
    assert "\n" not in str(info.value)


def linear_problem(seed=0, n=12, d=5):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g)
    y = torch.tensor([1, 0, 0, 1, 0, 0, 0, 1, 0, 0, 1, 0][:n], dtype=torch.float32)
    model = torch.nn.Linear(d, 1)
    with torch.no_grad():
        model.weight.copy_(torch.randn(1, d, generator=g) * 0.3)
        model.bias.zero_()
    return model, x, y


def test_one_step_with_prox_decay_and_clip_is_the_closed_form_step():
    model, x, y = linear_problem()
    loss = AUCMLoss(imratio=0.3, from_logits=True)
    set_aux(loss, 0.2, -0.1, 0.3)
    lr, gamma, wd, clip = 0.5, 0.01, 0.001, 0.05
    opt = PrimalDualSGD(model.parameters(), loss, lr=lr, prox_weight=gamma, weight_decay=wd, grad_clip=clip)
    w0 = model.weight.detach().clone()
    loss(model(x), y).backward()
    g_w, g_a, g_alpha = model.weight.grad.clone(), loss.a.grad.clone(), loss.alpha.grad.clone()
    opt.step()
    # v_ref = v_0 in stage 1, so the proximal term is 0 at the first step: only the clip and wd act
    np.testing.assert_allclose(model.weight.detach(), w0 - lr * (g_w.clamp(-clip, clip) + wd * w0), rtol=1e-6)
    np.testing.assert_allclose(loss.a.item(), 0.2 - lr * (g_a.item() + wd * 0.2), rtol=1e-6)  # a, b not clipped
    np.testing.assert_allclose(loss.alpha.item(), max(0.0, 0.3 + lr * g_alpha.item()), rtol=1e-6)
    w1 = model.weight.detach().clone()
    opt.zero_grad()
    loss(model(x), y).backward()
    g2 = model.weight.grad.clone()
    opt.step()
    want = w1 - lr * (g2.clamp(-clip, clip) + wd * w1 + gamma * (w1 - w0))
    np.testing.assert_allclose(model.weight.detach(), want, rtol=1e-6)


def test_momentum_is_heavy_ball_and_alpha_is_projected():
    model, x, y = linear_problem()
    loss = AUCMLoss(imratio=0.3, from_logits=True)
    set_aux(loss, 0.0, 0.0, 0.0)
    lr, mu = 0.3, 0.9
    opt = PrimalDualSGD(model.parameters(), loss, lr=lr, momentum=mu)
    grads, w = [], [model.weight.detach().clone()]
    for _ in range(3):
        opt.zero_grad()
        value = loss(model(x), y)
        value.backward()
        grads.append(model.weight.grad.clone())
        opt.step()
        w.append(model.weight.detach().clone())
        assert loss.alpha.item() >= 0
    u1 = grads[0]
    u2 = mu * u1 + grads[1]
    u3 = mu * u2 + grads[2]
    for got, want in zip(w[1:], (w[0] - lr * u1, w[0] - lr * u1 - lr * u2, w[0] - lr * (u1 + u2) - lr * u3),
                         strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)


def test_stage_ends_decay_lr_and_centre_on_the_stages_average_iterate():
    model, x, y = linear_problem()
    loss = AUCSquareLoss(imratio=0.3, from_logits=True)
    opt = PrimalDualSGD(model.parameters(), loss, lr=0.1, prox_weight=0.01, lr_decay=3, stage_length=2)
    iterates = []
    for _ in range(2):
        opt.zero_grad()
        loss(model(x), y).backward()
        opt.step()
        iterates.append(model.weight.detach().clone())
    assert opt.stage == 2 and opt.param_groups[0]["lr"] == pytest.approx(0.1 / 3)
    np.testing.assert_allclose(opt.state[model.weight]["reference"], (iterates[0] + iterates[1]) / 2, rtol=1e-6)
    last = PrimalDualSGD(model.parameters(), loss, lr=0.1, reference_point="last")
    last.end_stage()
    assert torch.equal(last.state[model.weight]["reference"], model.weight.detach())
    assert last.param_groups[-1]["lr"] == pytest.approx(0.1 / 3)


def test_optimizer_state_dict_resumes_exactly():
    def train(steps, split=None):
        torch.manual_seed(3)
        model, x, y = linear_problem(seed=1)
        loss = AUCMLoss(imratio=0.3, from_logits=True)
        opt = PrimalDualSGD(model.parameters(), loss, lr=0.2, momentum=0.9, prox_weight=0.01, stage_length=3)
        for i in range(steps):
            if i == split:
                saved = {"m": model.state_dict(), "l": loss.state_dict(), "o": opt.state_dict()}
                model, _, _ = linear_problem(seed=9)
                loss = AUCMLoss(imratio=0.3, from_logits=True)
                opt = PrimalDualSGD(model.parameters(), loss, lr=0.2, momentum=0.9, prox_weight=0.01,
                                    stage_length=3)
                model.load_state_dict(saved["m"])
                loss.load_state_dict(saved["l"])
                opt.load_state_dict(saved["o"])
            opt.zero_grad()
            loss(model(x), y).backward()
            opt.step()
        return torch.cat([model.weight.detach().reshape(-1), loss.a.detach(), loss.alpha.detach()])

    assert torch.equal(train(8), train(8, split=4))


def test_the_optimizer_takes_the_federations_local_step_to_the_bit():
    """PrimalDualSGD on a model equals LocalSolver on the same model in flat storage (momentum, prox, wd, clip)."""
    model, x, y = linear_problem()
    twin = torch.nn.Linear(5, 1)
    twin.load_state_dict(model.state_dict())
    loss = AUCMLoss(imratio=0.3, margin=0.9, from_logits=True)
    kw = dict(prox_weight=0.02, weight_decay=0.001, grad_clip=0.1)
    opt = PrimalDualSGD(model.parameters(), loss, lr=0.4, momentum=0.8, **kw)
    objective = Objective("auc_margin", num_tasks=1, margin=0.9)
    objective.set_positive_ratio(0.3)
    flat = FlatModel(twin, aux_size=1, device=torch.device("cpu"), precision=Precision("fp32", torch.device("cpu")))
    solver = LocalSolver(flat, objective, correction=DRIFT_CORRECTIONS["none"].client(flat), **kw)
    solver.set_local_step("sgd", 0.8)
    solver.bind_moments(solver.new_moments())
    solver.set_reference(flat.v.detach().numpy().copy())
    for _ in range(4):
        opt.zero_grad()
        loss(model(x), y).backward()
        opt.step()
        solver.loss(x, y).backward()
        solver.apply(0.4)
    assert torch.equal(flat.v[: flat.num_weights], torch.cat([model.weight.reshape(-1), model.bias]).detach())
    assert torch.equal(flat.a, loss.a.detach()) and torch.equal(flat.alpha, loss.alpha.detach())


# -- LibAUC 2.x, where its definitions agree with ours: AUCMLoss "v1" with a fixed p (auto=False), and PESG's
# primal step without momentum and with a clip that binds nowhere (its alpha step is the closed-form direction
# 2(m + b - a) - 2 alpha, not the gradient, and its momentum buffer is (1 - mu) u + mu d: neither is compared)


def test_aucm_loss_agrees_with_libauc():
    libauc = pytest.importorskip("libauc.losses")
    ours, theirs = AUCMLoss(imratio=P, margin=M), libauc.AUCMLoss(margin=M, imratio=P, device="cpu")
    for loss in (ours, theirs):
        set_aux(loss, A, B, ALPHA)
    h1 = torch.tensor(H, dtype=torch.float32, requires_grad=True)
    h2 = torch.tensor(H, dtype=torch.float32, requires_grad=True)
    mine, libs = ours(h1, torch.tensor(Y)), theirs(h2.reshape(-1, 1), torch.tensor(Y).reshape(-1, 1), auto=False)
    mine.backward()
    libs.backward()
    np.testing.assert_allclose(mine.item(), libs.item(), rtol=1e-6)
    np.testing.assert_allclose(h1.grad, h2.grad, rtol=1e-5, atol=1e-7)
    for name in ("a", "b", "alpha"):
        np.testing.assert_allclose(getattr(ours, name).grad, getattr(theirs, name).grad, rtol=1e-5, atol=1e-7)


def test_primal_step_agrees_with_libauc_pesg():
    losses = pytest.importorskip("libauc.losses")
    optimizers = pytest.importorskip("libauc.optimizers")
    results = []
    for which in ("ours", "libauc"):
        model, x, y = linear_problem()
        if which == "ours":
            loss = AUCMLoss(imratio=0.3, from_logits=True)
            opt = PrimalDualSGD(model.parameters(), loss, lr=0.3, prox_weight=0.01, weight_decay=0.001,
                                grad_clip=10.0)
        else:
            loss = losses.AUCMLoss(imratio=0.3, device="cpu")
            # its clip also clips a and b (ours clips the network alone): a clip that binds nowhere
            opt = optimizers.PESG(model.parameters(), loss_fn=loss, lr=0.3, momentum=0, epoch_decay=0.01,
                                  weight_decay=0.001, clip_value=10.0, verbose=False, device="cpu")
            for ref, p in zip(opt.model_ref, [*model.parameters(), loss.a, loss.b], strict=True):
                ref.copy_(p.detach())  # its centre starts at a random draw; ours (and the paper's) at v_0
        for _ in range(2):
            opt.zero_grad()
            if which == "ours":
                loss(model(x), y).backward()
            else:
                loss(torch.sigmoid(model(x)), y.reshape(-1, 1), auto=False).backward()
            opt.step()
            with torch.no_grad():
                loss.alpha.zero_()  # the alpha steps differ by definition: compare the primal steps alone
        results.append([model.weight.detach().clone(), model.bias.detach().clone(), loss.a.detach().clone()])
    for mine, theirs in zip(*results, strict=True):
        np.testing.assert_allclose(mine, theirs, rtol=1e-5, atol=1e-7)
