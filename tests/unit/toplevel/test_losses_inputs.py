"""Scores outside [0, 1] given as probabilities (``from_logits=False``), and an empty batch, are one line naming
the argument, for the public losses and the federation's Objective (fdam_ray.losses, fdam_ray.objectives)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fdam_ray.losses import AUCMLoss, AUCSquareLoss
from fdam_ray.objectives import Objective

LOSSES = [AUCSquareLoss, AUCMLoss]


def one_line(call, *words):
    with pytest.raises(ValueError) as info:
        call()
    message = str(info.value)
    assert "\n" not in message, message
    for word in words:
        assert word in message, message
    return message


@pytest.mark.parametrize("cls", LOSSES)
@pytest.mark.parametrize("bad", [5.0, -0.5, 1.0001])
def test_a_score_outside_zero_one_without_from_logits_is_refused_naming_from_logits(cls, bad):
    loss = cls(imratio=0.5)
    h = torch.tensor([0.2, bad, 0.7])
    message = one_line(lambda: loss(h, torch.tensor([0.0, 1.0, 1.0])), "predictions", repr(bad), "row 1",
                       "from_logits=True")
    assert int(loss.labelled) == 0  # refused before p's estimate counts the batch
    with_logits = cls(imratio=0.5, from_logits=True)
    assert torch.isfinite(with_logits(h, torch.tensor([0.0, 1.0, 1.0])))
    assert message.startswith("predictions: ")


@pytest.mark.parametrize("cls", LOSSES)
def test_scores_at_the_edges_of_zero_one_are_fine(cls):
    loss = cls(imratio=0.5)
    assert torch.isfinite(loss(torch.tensor([0.0, 1.0]), torch.tensor([0.0, 1.0])))


@pytest.mark.parametrize("cls", LOSSES)
@pytest.mark.parametrize("shape, tasks", [((0,), 1), ((0, 1), 1), ((0, 3), 3)])
def test_an_empty_batch_is_one_line(cls, shape, tasks):
    loss = cls(num_tasks=tasks, imratio=np.full(tasks, 0.5))
    one_line(lambda: loss(torch.zeros(shape), torch.zeros(shape)), "predictions", "empty batch")


@pytest.mark.parametrize("name", ["auc_square", "auc_margin", "bce"])
def test_the_objective_refuses_an_empty_batch_in_one_line(name):
    objective = Objective(name, num_tasks=1)
    objective.set_positive_ratio(0.5)
    zero = torch.zeros(1)
    one_line(lambda: objective(torch.zeros(0, 1), torch.zeros(0, 1), zero, zero, zero), "logits", "empty batch")
