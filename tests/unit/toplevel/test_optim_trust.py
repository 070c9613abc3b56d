"""PrimalDualSGD trusts nothing it is given (issue 40): its constructor's hyperparameters, and a state dict to
load, are checked whole first and refused in one line that names what differs; a refused load changes nothing."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from fdam_ray.losses import AUCMLoss, AUCSquareLoss
from fdam_ray.optim import PrimalDualSGD


def problem(d=5, num_tasks=1, momentum=0.9, prox_weight=0.01, seed=0, stage_length=3):
    torch.manual_seed(seed)
    model = torch.nn.Linear(d, num_tasks)
    loss = AUCMLoss(num_tasks=num_tasks, imratio=0.3, from_logits=True)
    opt = PrimalDualSGD(model.parameters(), loss, lr=0.2, momentum=momentum, prox_weight=prox_weight,
                        stage_length=stage_length)
    return model, loss, opt


def train(model, loss, opt, steps=2, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(12, model.in_features, generator=g)
    y = torch.tensor([1, 0, 0, 1, 0, 0, 0, 1, 0, 0, 1, 0], dtype=torch.float32)
    y = y[:, None].expand(12, model.out_features).contiguous() if model.out_features > 1 else y
    for _ in range(steps):
        opt.zero_grad()
        loss(model(x), y).backward()
        opt.step()


def snapshot(opt):
    return copy.deepcopy(opt.state_dict())


def same(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def refused(opt, state, *words):
    """Load ``state`` into ``opt``: a one-line ValueError holding each of ``words``; ``opt`` unchanged and usable."""
    before = snapshot(opt)
    with pytest.raises(ValueError) as info:
        opt.load_state_dict(state)
    message = str(info.value)
    assert "\n" not in message
    for word in words:
        assert word in message, message
    assert same(before, snapshot(opt))
    return message


def trained():
    model, loss, opt = problem()
    train(model, loss, opt)
    return model, loss, opt


def mutated(change):
    """A state dict of a trained twin optimizer, changed by ``change(state)``."""
    _, _, twin = trained()
    state = copy.deepcopy(twin.state_dict())
    change(state)
    return state


def adam_state(groups):
    """What ``torch.optim.Adam(groups).state_dict()`` gives after a step (written out: building a torch optimizer
    the first time in a process costs seconds of imports)."""
    hyper = {"lr": 0.1, "betas": (0.9, 0.999), "eps": 1e-08, "weight_decay": 0, "amsgrad": False, "maximize": False,
             "foreach": None, "capturable": False, "differentiable": False, "fused": None,
             "decoupled_weight_decay": False}
    out, ids = {"state": {}, "param_groups": []}, iter(range(100))
    for params in groups:
        group = {**hyper, "params": [next(ids) for _ in params]}
        out["param_groups"].append(group)
        for i, p in zip(group["params"], params, strict=True):
            out["state"][i] = {"step": torch.tensor(1.0), "exp_avg": torch.zeros_like(p),
                               "exp_avg_sq": torch.zeros_like(p)}
    return out


def test_an_adam_state_dict_is_refused_and_the_optimizer_still_steps():
    model, loss, opt = trained()
    refused(opt, adam_state([list(model.parameters())]), "param_groups", "1 group", "3")
    # an Adam over the same three groups fails on its keys, not on a KeyError at step()
    three = adam_state([list(model.parameters()), [loss.a, loss.b], [loss.alpha]])
    refused(opt, three, "param_groups[0]", "role")
    train(model, loss, opt, steps=1)
    assert all(math.isfinite(float(t.detach().abs().sum())) for t in model.parameters())


def test_a_state_for_other_parameter_shapes_is_refused_naming_the_parameter():
    model, loss, opt = trained()
    other_model, other_loss, other = problem(d=4)
    train(other_model, other_loss, other)
    message = refused(opt, other.state_dict(), "param_groups[0]", "(1, 4)", "(1, 5)")
    assert "reference" in message or "velocity" in message
    train(model, loss, opt, steps=1)


def test_a_state_for_another_num_tasks_is_refused():
    _, _, opt = trained()
    _, _, other = problem(num_tasks=3)
    refused(opt, other.state_dict(), "(3", "(1")


def test_a_state_with_another_number_of_params_is_refused():
    _, _, opt = trained()
    deep = torch.nn.Sequential(torch.nn.Linear(5, 5), torch.nn.Linear(5, 1))
    other = PrimalDualSGD(deep.parameters(), AUCMLoss(imratio=0.3), lr=0.1)
    refused(opt, other.state_dict(), "param_groups[0]", "4", "2")
    no_model = PrimalDualSGD([], AUCMLoss(imratio=0.3), lr=0.1)
    refused(opt, no_model.state_dict(), "param_groups", "2", "3")


@pytest.mark.parametrize("change,words", [
    (lambda s: s.pop("schedule"), ("schedule", "missing")),
    (lambda s: s.update(extra=1), ("extra",)),
    (lambda s: s["param_groups"][0].pop("role"), ("param_groups[0]", "role")),
    (lambda s: s["param_groups"][1].update(betas=(0.9, 0.99)), ("param_groups[1]", "betas")),
    (lambda s: s["param_groups"][2].update(role="primal"), ("param_groups[2]", "role", "'primal'", "'dual'")),
    (lambda s: s["param_groups"][0].update(role="dual"), ("param_groups[0]", "role", "'dual'", "'primal'")),
    (lambda s: s["param_groups"][0].update(lr=float("inf")), ("param_groups[0]", "lr", "inf")),
    (lambda s: s["param_groups"][1].update(momentum=1.5), ("param_groups[1]", "momentum", "1.5")),
    (lambda s: s["param_groups"][0].update(weight_decay=float("nan")), ("weight_decay", "nan")),
    (lambda s: s["param_groups"][0].update(grad_clip=-1.0), ("grad_clip", "-1.0")),
    (lambda s: s["param_groups"][0].update(params=[0, 0]), ("param_groups[0]", "params")),
    (lambda s: s["state"][0].pop("reference"), ("reference", "missing")),
    (lambda s: s["state"][0].update(exp_avg=torch.zeros(1, 5)), ("exp_avg",)),
    (lambda s: s["state"][0].update(reference=[[0.0] * 5]), ("reference", "list")),
    (lambda s: s["state"][0]["reference"].fill_(float("nan")), ("reference", "finite")),
    (lambda s: s["state"][1]["velocity"].fill_(float("inf")), ("velocity", "finite")),
    (lambda s: s["state"][0].update(velocity=torch.zeros(5)), ("velocity", "(5,)", "(1, 5)")),
    (lambda s: s["state"][0].update(iterates=2.5), ("iterates", "2.5")),
    (lambda s: s["state"][0].pop("iterates"), ("iterate_sum", "iterates")),
    (lambda s: s["state"].update({9: {"reference": torch.zeros(1)}}), ("state", "9")),
    (lambda s: s["state"].update({4: {"reference": torch.zeros(1)}}), ("state", "4", "dual")),
    (lambda s: s.update(state=[]), ("state", "list")),
    (lambda s: s["schedule"].update(stage=0), ("schedule", "stage", "0")),
    (lambda s: s["schedule"].update(steps=1.5), ("schedule", "steps", "1.5")),
    (lambda s: s["schedule"].update(epoch=3), ("schedule", "epoch")),
], ids=lambda v: v if isinstance(v, str) else None)
def test_a_damaged_state_is_refused_in_one_line_and_changes_nothing(change, words):
    model, loss, opt = trained()
    refused(opt, mutated(change), *words)
    train(model, loss, opt, steps=1)


def test_not_a_mapping_is_refused():
    _, _, opt = trained()
    refused(opt, [1, 2], "state dict", "list")


def test_a_valid_state_loads_and_a_resumed_stage_keeps_its_float64_iterate_sum():
    """Split mid-stage (the average centre's running sum is live): the resumed run is the same run, to the bit
    (torch casts a loaded state to the parameter's dtype: a float32 sum gave another centre at the stage end)."""
    def run(split=None):
        model, loss, opt = problem(seed=3, stage_length=10)
        for i in range(12):
            if i == split:
                saved = copy.deepcopy((model.state_dict(), loss.state_dict(), opt.state_dict()))
                model, loss, opt = problem(seed=8, stage_length=10)
                model.load_state_dict(saved[0])
                loss.load_state_dict(saved[1])
                opt.load_state_dict(saved[2])
                assert opt.state[model.weight]["iterate_sum"].dtype == torch.float64
            train(model, loss, opt, steps=1, seed=i)
        return torch.cat([model.weight.detach().reshape(-1), opt.state[model.weight]["reference"].reshape(-1)])

    assert torch.equal(run(), run(split=5))


def test_a_square_loss_state_loads_into_a_margin_loss_optimizer_of_the_same_shape():
    _, _, opt = trained()
    twin_model = torch.nn.Linear(5, 1)
    twin = PrimalDualSGD(twin_model.parameters(), AUCSquareLoss(imratio=0.3), lr=0.2, momentum=0.9,
                         prox_weight=0.01)
    twin.load_state_dict(opt.state_dict())
    assert twin.stage == opt.stage and twin.steps == opt.steps


BAD_ARGUMENTS = [
    ("lr", float("inf")), ("lr", float("nan")), ("lr", -0.1), ("lr", 0), ("lr", "0.1"), ("lr", True),
    ("lr", torch.tensor(0.1)),
    ("momentum", 1.0), ("momentum", -0.1), ("momentum", float("nan")), ("momentum", "0.9"),
    ("weight_decay", -1e-4), ("weight_decay", float("inf")), ("weight_decay", float("nan")),
    ("prox_weight", -0.01), ("prox_weight", float("inf")), ("prox_weight", float("nan")),
    ("grad_clip", 0.0), ("grad_clip", -1.0), ("grad_clip", float("nan")), ("grad_clip", float("inf")),
    ("lr_decay", 0.5), ("lr_decay", float("inf")), ("lr_decay", float("nan")),
    ("stage_length", 2.5), ("stage_length", 0), ("stage_length", True), ("stage_length", float("nan")),
    ("stage_length", "3"), ("stage_length", float("inf")),
    ("reference_point", "mean"), ("reference_point", None), ("reference_point", ["average"]),
]


@pytest.mark.parametrize("name,value", BAD_ARGUMENTS, ids=lambda v: repr(v))
def test_every_bad_hyperparameter_is_one_line_naming_it_its_value_and_the_range(name, value):
    kwargs = {"lr": 0.1, name: value}
    with pytest.raises(ValueError) as info:
        PrimalDualSGD(torch.nn.Linear(2, 1).parameters(), AUCMLoss(), **kwargs)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"{name}: "), message
    shown = {"inf": "inf", "nan": "nan"}.get(str(value), None)
    assert (shown or repr(value) if not isinstance(value, torch.Tensor) else "tensor") in message
    assert "(" in message and "allowed" in message


def test_whole_numbers_stay_accepted_and_mean_the_same():
    import numpy as np

    model = torch.nn.Linear(2, 1)
    for length in (3, np.int64(3), 3.0):
        opt = PrimalDualSGD(model.parameters(), AUCMLoss(), lr=np.float32(0.1), stage_length=length)
        assert opt.stage_length == 3 and type(opt.stage_length) is int


@pytest.mark.parametrize("params,words", [
    (lambda m: [1.0, 2.0], "a float"), (lambda m: [{"params": list(m.parameters())}], "a dict"),
    (lambda m: m.weight, "a Parameter"), (lambda m: [m.weight * 2], "a tensor computed"), (lambda m: 3, "an int"),
])
def test_params_and_loss_fn_are_checked(params, words):
    model = torch.nn.Linear(2, 1)
    for kind in (TypeError, ValueError):  # the wrong kind of argument is both, as in torch and as every check here
        with pytest.raises(kind, match=r"^loss_fn: a MSELoss"):
            PrimalDualSGD(model.parameters(), torch.nn.MSELoss(), lr=0.1)
    with pytest.raises(ValueError, match=f"^params: {words}") as info:
        PrimalDualSGD(params(model), AUCMLoss(), lr=0.1)
    assert "\n" not in str(info.value)
