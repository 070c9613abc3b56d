"""Sample-level DP-SGD (fdam_ray.privacy.dpsgd): the per-sample loss against the objective, the degenerate case
(no noise, no clipping) against autograd's batch gradient, clipping against a loop of one backward pass per
sample, the noise's reproducibility and size, and the step's signs against the project's own local step."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch import nn
from torch.func import vmap

from fdam_ray.algorithms.drift import NoCorrection
from fdam_ray.algorithms.local import LocalSolver
from fdam_ray.core.flat import FlatModel
from fdam_ray.features.precision import Precision
from fdam_ray.models import build_model
from fdam_ray.objectives import Objective
from fdam_ray.privacy.dpsgd import check_private_model, noise_std, per_sample_loss, private_gradient

HUGE = 1e30  # a clip no gradient reaches: C = infinity
P = (0.3, 0.45, 0.6)


def make(objective: str, tasks: int = 2, *, seed: int = 0, net: nn.Module | None = None) -> tuple[FlatModel, Objective]:
    """A 2-layer MLP bound to flat storage, with a, b, alpha away from 0 (every term of F matters)."""
    torch.manual_seed(seed)
    model = net if net is not None else nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, tasks))
    obj = Objective(objective, num_tasks=tasks, margin=0.8)
    flat = FlatModel(model, aux_size=obj.aux_size)
    if obj.has_auxiliary:
        obj.set_positive_ratio(list(P[:tasks]))
        with torch.no_grad():
            flat.a.copy_(torch.linspace(0.2, 0.6, tasks))
            flat.b.copy_(torch.linspace(0.5, 0.1, tasks))
            flat.alpha.copy_(torch.linspace(0.3, 0.9, tasks))
    return flat, obj


def batch(n: int = 8, tasks: int = 2, *, seed: int = 1, missing: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g)
    y = (torch.rand(n, tasks, generator=g) < 0.4).float()
    y[0], y[1] = 1.0, 0.0  # both classes on every task
    if missing:
        y[2:5, 0] = float("nan")
        y[5, -1] = float("nan")
    return x, y


def dp(flat: FlatModel, obj: Objective, x: torch.Tensor, y: torch.Tensor, *, clip: float = HUGE, sigma: float = 0.0,
       batch_size: int | None = None, seed: int = 0, precision: Precision | None = None):
    return private_gradient(flat.model, flat.a, flat.b, flat.alpha, x, y, per_sample_loss(obj), clip=clip,
                            noise_multiplier=sigma, batch_size=batch_size or x.shape[0],
                            generator=torch.Generator().manual_seed(seed), precision=precision)


def autograd_gradient(flat: FlatModel, obj: Objective, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """(g_v, g_alpha) of the objective's batch value, by autograd into the flat buffers: one vector."""
    flat.grad.zero_()
    flat.alpha_grad.zero_()
    obj(flat.forward(x), y, flat.a, flat.b, flat.alpha).backward()
    return torch.cat([flat.grad, flat.alpha_grad]).clone()


def numpy_f(name: str, h: np.ndarray, y: np.ndarray, p: np.ndarray, a: np.ndarray, b: np.ndarray,
            alpha: np.ndarray, margin: float) -> np.ndarray:
    """F of docs/algorithms.md s.1 per sample and task, in float64, 0 where the label is missing."""
    pos, neg, valid = (y == 1).astype(float), (y == 0).astype(float), (~np.isnan(y)).astype(float)
    q = p * (1 - p)
    per = (1 - p) * (h - a) ** 2 * pos + p * (h - b) ** 2 * neg
    cross = p * h * neg - (1 - p) * h * pos
    extra = 2 * (1 + alpha) * cross if name == "auc_square" else 2 * alpha * (q * margin * valid + cross)
    return per + extra - q * alpha**2 * valid


def vector_norm(v: torch.Tensor) -> float:
    return float(np.linalg.norm(v.double().numpy()))


# -- the per-sample loss ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["auc_square", "auc_margin", "bce"])
@pytest.mark.parametrize("tasks", [1, 3])
def test_mean_of_per_sample_losses_is_the_objectives_batch_value(name, tasks):
    flat, obj = make(name, tasks)
    x, y = batch(8, tasks)
    with torch.no_grad():
        logits = flat.forward(x)
        per = vmap(per_sample_loss(obj))(logits, y, *(t.expand(8, -1) for t in (flat.a, flat.b, flat.alpha)))
        whole = obj(logits, y, flat.a, flat.b, flat.alpha)
    assert per.shape == (8,)
    torch.testing.assert_close(per.mean(), whole, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("name", ["auc_square", "auc_margin"])
def test_missing_labels_add_zero_and_tasks_weigh_by_their_labelled_share(name):
    flat, obj = make(name, 3)
    x, y = batch(8, 3, missing=True)
    with torch.no_grad():
        logits = flat.forward(x)
        per = torch.stack([per_sample_loss(obj)(logits[i], y[i], flat.a, flat.b, flat.alpha) for i in range(8)])
    f = numpy_f(name, 1 / (1 + np.exp(-logits.double().numpy())), y.numpy(), np.array(P), flat.a.detach().numpy(),
                flat.b.detach().numpy(), flat.alpha.detach().numpy(), 0.8)
    np.testing.assert_allclose(per.numpy(), np.nansum(f, axis=1) / 3, rtol=1e-5, atol=1e-7)
    assert np.isnan(y.numpy()).any() and not torch.isnan(per).any()


# -- sigma = 0, C = infinity: the plain batch gradient ----------------------------------------------------------
@pytest.mark.parametrize("name", ["auc_square", "auc_margin", "bce"])
@pytest.mark.parametrize("tasks", [1, 3])
def test_no_noise_no_clip_is_the_autograd_batch_gradient(name, tasks):
    flat, obj = make(name, tasks)
    x, y = batch(16, tasks)
    got = dp(flat, obj, x, y)
    want = autograd_gradient(flat, obj, x, y)
    assert got.v.shape == flat.grad.shape and got.alpha.shape == flat.alpha.shape
    torch.testing.assert_close(torch.cat([got.v, got.alpha]), want, rtol=1e-5, atol=1e-7)
    assert vector_norm(want) > 1e-2  # not a vacuous comparison of zeros
    torch.testing.assert_close(got.loss, obj(flat.forward(x), y, flat.a, flat.b, flat.alpha).detach())


def test_the_model_and_its_flat_storage_are_left_as_they_were():
    flat, obj = make("auc_margin")
    v, alpha = flat.v.clone(), flat.alpha.detach().clone()
    flat.grad.fill_(7.0)
    dp(flat, obj, *batch(), sigma=1.0, clip=0.1)
    assert torch.equal(flat.v, v) and torch.equal(flat.alpha.detach(), alpha)
    assert bool((flat.grad == 7.0).all()) and flat.bound()


def test_the_sum_is_divided_by_the_planned_batch_size_not_the_realised_one():
    flat, obj = make("auc_margin")
    x, y = batch(7)
    realised = dp(flat, obj, x, y)
    planned = dp(flat, obj, x, y, batch_size=10)
    torch.testing.assert_close(planned.v, realised.v * 7 / 10)
    torch.testing.assert_close(planned.alpha, realised.alpha * 7 / 10)


# -- clipping ------------------------------------------------------------------------------------------------
def naive_clipped_sum(flat: FlatModel, obj: Objective, x: torch.Tensor, y: torch.Tensor, clip: float) -> np.ndarray:
    """One backward pass per sample through the objective itself, each (w, a, b, alpha) gradient clipped in NumPy."""
    total = np.zeros(flat.state_size + flat.aux_size)
    for i in range(x.shape[0]):
        g = autograd_gradient(flat, obj, x[i : i + 1], y[i : i + 1]).double().numpy()
        total += g * min(1.0, clip / np.linalg.norm(g))
    return total


@pytest.mark.parametrize("name", ["auc_margin", "auc_square", "bce"])
def test_clipping_matches_a_loop_of_one_backward_pass_per_sample(name):
    flat, obj = make(name, 3)
    x, y = batch(10, 3)
    norms = [np.linalg.norm(autograd_gradient(flat, obj, x[i : i + 1], y[i : i + 1]).numpy()) for i in range(10)]
    clip = float(np.median(norms))  # half the samples clipped, half not
    assert min(norms) < clip < max(norms)
    got = dp(flat, obj, x, y, clip=clip)
    want = naive_clipped_sum(flat, obj, x, y, clip) / 10
    np.testing.assert_allclose(torch.cat([got.v, got.alpha]).numpy(), want, rtol=1e-5, atol=1e-7)
    unclipped = dp(flat, obj, x, y)
    assert vector_norm(torch.cat([got.v - unclipped.v, got.alpha - unclipped.alpha])) > 1e-3


def test_a_sample_with_a_huge_gradient_contributes_a_vector_of_norm_exactly_c():
    flat, obj = make("bce", 1, net=nn.Linear(6, 1))  # a linear scorer: nothing saturates
    x, y = batch(4, 1)
    x[0] *= 1e4
    y[0] = 1.0 - (flat.forward(x[:1]) > 0).float()  # the wrong side: BCE's gradient grows with |x|
    clip = 0.5
    whole = dp(flat, obj, x, y, clip=clip, batch_size=1)
    rest = dp(flat, obj, x[1:], y[1:], clip=clip, batch_size=1)
    alone = torch.cat([whole.v - rest.v, whole.alpha - rest.alpha])
    assert vector_norm(autograd_gradient(flat, obj, x[:1], y[:1])) > 1e3
    assert vector_norm(alone) == pytest.approx(clip, rel=1e-5)


def test_alpha_is_clipped_in_the_same_vector_as_w_a_b():
    flat, obj = make("auc_margin", 1)
    with torch.no_grad():
        flat.alpha.fill_(1e5)  # dF/dalpha = 2(p(1-p)m + cross) - 2 p(1-p) alpha: huge, and only in alpha's part
    x, y = batch(2, 1)
    x, y = x[:1], y[:1]  # one sample: the clipped sum is its gradient scaled to norm C
    clip = 0.25
    got = dp(flat, obj, x, y, clip=clip)
    full = autograd_gradient(flat, obj, x, y)
    assert vector_norm(torch.cat([got.v, got.alpha])) == pytest.approx(clip, rel=1e-5)
    # the direction is kept: the alpha part dominates, so (w, a, b) shrink by the same factor ||g|| / C
    factor = clip / vector_norm(full)
    np.testing.assert_allclose(got.v.numpy(), full[: flat.state_size].numpy() * factor, rtol=1e-4, atol=1e-12)
    assert float(got.alpha) < 0  # ascent direction of -p(1-p) alpha^2 at a large alpha points down


def test_a_network_with_group_norm_and_convolutions_matches_the_loop():
    net = nn.Sequential(nn.Unflatten(1, (1, 2, 3)), nn.Conv2d(1, 4, 2), nn.GroupNorm(2, 4), nn.ReLU(),
                        nn.Flatten(), nn.Linear(8, 2))
    flat, obj = make("auc_margin", 2, net=net)
    x, y = batch(6, 2)
    got = dp(flat, obj, x, y, clip=0.05)
    want = naive_clipped_sum(flat, obj, x, y, 0.05) / 6
    np.testing.assert_allclose(torch.cat([got.v, got.alpha]).numpy(), want, rtol=1e-5, atol=1e-7)


def test_bf16_autocast_runs_close_to_fp32():
    flat, obj = make("auc_margin")
    x, y = batch()
    got = dp(flat, obj, x, y, precision=Precision("bf16", torch.device("cpu")))
    want = autograd_gradient(flat, obj, x, y)
    err = vector_norm(torch.cat([got.v, got.alpha]) - want) / vector_norm(want)
    assert err < 2e-2  # bf16 keeps 8 bits of mantissa


# -- noise ---------------------------------------------------------------------------------------------------
def test_the_noise_repeats_with_the_generators_seed_and_changes_with_it():
    flat, obj = make("auc_margin")
    x, y = batch()
    first, again, other = (dp(flat, obj, x, y, clip=1.0, sigma=1.0, seed=s) for s in (3, 3, 4))
    assert torch.equal(first.v, again.v) and torch.equal(first.alpha, again.alpha)
    assert not torch.equal(first.v, other.v) and not torch.equal(first.alpha, other.alpha)


def test_the_noise_has_mean_zero_and_std_sigma_c_over_b_on_every_part():
    flat, obj = make("auc_margin", 3)
    x, y = batch(8, 3)
    clip, sigma, planned = 0.7, 1.5, 8
    clean = dp(flat, obj, x, y, clip=clip)
    gen = torch.Generator().manual_seed(11)
    draws = torch.stack([
        torch.cat([(g := private_gradient(flat.model, flat.a, flat.b, flat.alpha, x, y, per_sample_loss(obj),
                                          clip=clip, noise_multiplier=sigma, batch_size=planned, generator=gen)).v
                   - clean.v, g.alpha - clean.alpha])
        for _ in range(300)]).double().numpy()
    want = noise_std(clip, sigma, planned)
    assert want == pytest.approx(sigma * clip / planned)
    n = draws.size  # 300 x 62 values: std's relative standard error 1 / sqrt(2n), about 0.5%
    assert draws.std() == pytest.approx(want, rel=0.03)
    assert abs(draws.mean()) < 5 * want / np.sqrt(n)
    alpha_part = draws[:, flat.state_size :]  # 900 values: the dual part is noised alike (rel. error about 2.4%)
    assert alpha_part.std() == pytest.approx(want, rel=0.12)
    assert np.corrcoef(draws[:, 0], draws[:, 1])[0, 1] == pytest.approx(0, abs=0.25)  # independent coordinates


# -- the step: descent on v, ascent on alpha ------------------------------------------------------------------
@pytest.mark.parametrize("name", ["auc_margin", "auc_square"])
def test_one_noiseless_private_step_is_the_solvers_own_step(name):
    flat, obj = make(name, 2)
    twin = FlatModel(copy.deepcopy(flat.model), aux_size=obj.aux_size)
    twin.v.copy_(flat.v)
    twin.alpha.detach().copy_(flat.alpha.detach())
    reference = (flat.v.detach() + 0.3).numpy()
    solvers = []
    for f in (flat, twin):
        solver = LocalSolver(f, obj, correction=NoCorrection(), prox_weight=1e-2, weight_decay=1e-3, grad_clip=None)
        solver.set_reference(reference)
        solvers.append(solver)
    x, y = batch(8, 2)
    alpha_before = flat.alpha.detach().clone()
    solvers[0].loss(x, y).backward()  # the project's own step
    g_alpha = flat.alpha_grad.clone()
    solvers[0].apply(0.5)
    g = dp(twin, obj, x, y)  # the private step: its gradients in the flat buffers, then the same apply
    twin.grad.copy_(g.v)
    twin.alpha_grad.copy_(g.alpha)
    solvers[1].apply(0.5)
    torch.testing.assert_close(twin.v, flat.v, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(twin.alpha.detach(), flat.alpha.detach(), rtol=1e-6, atol=1e-7)
    moved = (flat.alpha.detach() - alpha_before).numpy()
    assert np.all(np.sign(moved) == np.sign(g_alpha.numpy())) and np.all(moved != 0)  # ascent: with g_alpha


# -- what is refused -----------------------------------------------------------------------------------------
def test_batch_norm_is_refused_naming_the_layer():
    net = nn.Sequential(nn.Linear(6, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))
    flat, obj = make("auc_margin", 1, net=net)
    with pytest.raises(ValueError, match=r"layer '1' is a BatchNorm1d.*GroupNorm") as err:
        dp(flat, obj, *batch(4, 1))
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(("model", "shape", "refused"), [("linear", (6,), False), ("mlp", (6,), False),
                                                         ("cnn", (1, 8, 8), True), ("resnet20", (3, 8, 8), True)])
def test_which_built_in_networks_have_batch_norm(model, shape, refused):
    net = build_model(model, shape, 1, width=4, seed=0)
    if refused:
        with pytest.raises(ValueError, match="BatchNorm2d"):
            check_private_model(net)
    else:
        check_private_model(net)


@pytest.mark.parametrize(("kwargs", "match"), [({"clip": 0.0}, "dp_clip"), ({"clip": float("inf")}, "dp_clip"),
                                               ({"sigma": -1.0}, "dp_noise_multiplier"),
                                               ({"batch_size": 0}, "batch_size"),
                                               ({"precision": Precision("fp16", torch.device("cpu"))}, "fp16")])
def test_bad_arguments_are_one_line_errors(kwargs, match):
    flat, obj = make("auc_margin")
    if kwargs.get("batch_size") == 0:
        with pytest.raises(ValueError, match=match):
            private_gradient(flat.model, flat.a, flat.b, flat.alpha, *batch(), per_sample_loss(obj), clip=1.0,
                             noise_multiplier=1.0, batch_size=0, generator=torch.Generator())
        return
    with pytest.raises(ValueError, match=match):
        dp(flat, obj, *batch(), **kwargs)
