"""Weights of the wrong kind (integer, half, complex) or not finite are refused in one line naming the entry,
where a model file is read (initial weights, ``load_model``): copying them would truncate or poison every weight."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fdam_ray.assembly.weights import load_weights
from fdam_ray.files.torchload import value_problems


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))


def _state(change):
    state = {k: v.clone() for k, v in _net().state_dict().items()}
    change(state)
    return state


@pytest.mark.parametrize("change, entry, why", [
    (lambda s: s.update({"0.weight": (s["0.weight"] * 10).to(torch.int64)}), "0.weight", "int64"),
    (lambda s: s.update({"0.weight": s["0.weight"].to(torch.float16)}), "0.weight", "float16"),
    (lambda s: s.update({"0.bias": s["0.bias"].to(torch.complex64)}), "0.bias", "complex64"),
    (lambda s: s.update({"1.running_mean": torch.full((4,), float("nan"))}), "1.running_mean", "NaN"),
    (lambda s: [s.__setitem__(k, torch.full_like(v, float("nan"))) for k, v in s.items() if v.is_floating_point()],
     "0.weight", "NaN"),
    (lambda s: s.update({"0.weight": s["0.weight"].index_fill(0, torch.tensor([1]), float("inf"))}), "0.weight",
     "infinite"),
    (lambda s: s.update({"1.num_batches_tracked": torch.tensor(2.5)}), "1.num_batches_tracked", "float32"),
])
def test_weights_of_another_kind_or_not_finite_are_refused_naming_the_entry(change, entry, why):
    net = _net()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    with pytest.raises(ValueError) as got:
        load_weights(net, _state(change), source="model_weights 'w.pt'")
    message = str(got.value)
    assert "\n" not in message and message.startswith("model_weights 'w.pt'") and entry in message and why in message
    assert all(torch.equal(before[k], v) for k, v in net.state_dict().items())  # nothing copied


def test_float64_weights_and_integer_counters_are_fine():
    state = _state(lambda s: s.update({"0.weight": s["0.weight"].double()}))
    assert value_problems(_net().state_dict(), state) == []
    net = _net()
    load_weights(net, state)
    assert torch.allclose(net.state_dict()["0.weight"], state["0.weight"].float())
