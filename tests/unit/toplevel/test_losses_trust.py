"""The public AUC losses (and the federation's Objective) trust none of their inputs (issue 40): labels only in the
scores' layout, labels only 0, 1 or missing, finite scores, and constructor arguments in range, each refused in one
line that names the argument; valid inputs give the same bits as before."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fdam_ray.losses import AUCMLoss, AUCSquareLoss, positive_ratio
from fdam_ray.objectives import Objective
from fdam_ray.settings.redact import short

LOSSES = [AUCSquareLoss, AUCMLoss]


def one_line(call, *words, kind=ValueError):
    with pytest.raises(kind) as info:
        call()
    message = str(info.value)
    assert "\n" not in message
    for word in words:
        assert word in message, message
    return message


@pytest.mark.parametrize("cls", LOSSES)
def test_multi_task_labels_in_another_layout_are_refused_naming_both_shapes(cls):
    torch.manual_seed(0)
    loss = cls(num_tasks=3, imratio=0.3)
    scores, labels = torch.rand(8, 3), (torch.rand(8, 3) < 0.4).float()
    loss(scores, labels)  # the scores' layout: accepted
    for wrong in (labels.T.contiguous(), labels.T.reshape(-1), labels.reshape(-1), labels[:, :1]):
        one_line(lambda w=wrong: loss(scores, w), "labels", str(tuple(wrong.shape)), "(8, 3)")
    one_line(lambda: loss(scores, labels.T.numpy()), "labels", "(3, 8)", "(8, 3)")


@pytest.mark.parametrize("cls", LOSSES)
def test_single_task_labels_take_b_or_b_by_one_and_nothing_else(cls):
    loss = cls(imratio=0.3)
    y = torch.tensor([1.0, 0, 0, 1, 0, 0])
    for scores in (torch.rand(6), torch.rand(6, 1)):
        assert torch.equal(loss(scores, y), loss(scores, y[:, None]))
        for wrong in (y[:3], y.reshape(2, 3), y.reshape(1, 6), torch.tensor([1.0])):
            one_line(lambda s=scores, w=wrong: loss(s, w), "labels", str(tuple(wrong.shape)),
                     str(tuple(scores.shape)))
    one_line(lambda: loss(torch.rand(6, 1, 1), y), "predictions", "(6, 1, 1)")
    one_line(lambda: loss(torch.tensor(0.5), torch.tensor(1.0)), "predictions")


@pytest.mark.parametrize("cls", LOSSES)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("from_logits", [False, True])
def test_non_finite_scores_are_an_error_not_a_nan_loss(cls, bad, from_logits):
    loss = cls(num_tasks=2, imratio=0.3, from_logits=from_logits)
    scores = torch.rand(4, 2)
    scores[2, 1] = bad
    labels = torch.tensor([[1.0, 0], [0, 1], [1, 0], [0, 1]])
    one_line(lambda: loss(scores, labels), "predictions", "row 2", "task 1")
    assert loss.positives.sum() == 0  # nothing counted towards p from the refused batch


@pytest.mark.parametrize("cls", LOSSES)
@pytest.mark.parametrize("bad", [2.0, 0.5, -2.0, float("inf")])
def test_labels_outside_zero_one_and_missing_are_refused(cls, bad):
    loss = cls(num_tasks=2, imratio=0.3)
    labels = torch.tensor([[1.0, 0], [0, 1], [1, bad]])
    one_line(lambda: loss(torch.rand(3, 2), labels), "labels", "row 2", "task 1")


@pytest.mark.parametrize("cls", LOSSES)
def test_missing_labels_stay_supported_and_valid_results_are_unchanged(cls):
    torch.manual_seed(1)
    loss = cls(num_tasks=2, imratio=[0.2, 0.4], margin=0.8, from_logits=True)
    scores = torch.randn(6, 2)
    labels = torch.tensor([[1.0, 0], [0, float("nan")], [-1, 1], [0, 0], [1, 1], [0, -1]])
    value = loss(scores, labels)
    objective = Objective(loss.objective, num_tasks=2, margin=0.8)
    objective.set_positive_ratio([0.2, 0.4])
    nan_labels = torch.where(labels == -1, torch.full_like(labels, float("nan")), labels)
    assert torch.equal(value, objective(scores, nan_labels, loss.a, loss.b, loss.alpha))


def test_positive_ratio_takes_labels_in_rows_of_num_tasks_only():
    rows = np.array([[1, 0], [0, -1], [1, 1], [0, 0]])
    np.testing.assert_allclose(positive_ratio(rows, num_tasks=2), [0.5, 1 / 3])
    one_line(lambda: positive_ratio(rows.T, num_tasks=2), "labels", "(2, 4)", "num_tasks=2")
    one_line(lambda: positive_ratio(rows.reshape(-1), num_tasks=2), "labels", "(8,)", "num_tasks=2")
    np.testing.assert_allclose(positive_ratio([1, 0, 0, 1]), [0.5])
    one_line(lambda: positive_ratio([[1, 0], [0, 1]]), "labels", "(2, 2)", "num_tasks=1")
    one_line(lambda: positive_ratio([1, 0], num_tasks=2.5), "num_tasks", "2.5")


def test_the_federations_objective_refuses_labels_in_another_layout():
    objective = Objective("auc_margin", num_tasks=3)
    objective.set_positive_ratio(0.3)
    logits, labels, aux = torch.randn(8, 3), (torch.rand(8, 3) < 0.4).float(), torch.zeros(3)
    objective(logits, labels, aux, aux, aux)
    for wrong in (labels.T.contiguous(), labels.reshape(-1)):
        one_line(lambda w=wrong: objective(logits, w, aux, aux, aux), "labels", str(tuple(wrong.shape)), "(8, 3)")
    bce = Objective("bce", num_tasks=3)
    one_line(lambda: bce(logits, labels.T.contiguous(), aux, aux, aux), "labels", "(3, 8)")


BAD_LOSS_ARGUMENTS = [
    ("num_tasks", 2.5), ("num_tasks", 0), ("num_tasks", True), ("num_tasks", "2"), ("num_tasks", float("nan")),
    ("margin", float("inf")), ("margin", float("nan")), ("margin", -1.0), ("margin", "1"),
    ("imratio", float("nan")), ("imratio", 0.0), ("imratio", 1.0), ("imratio", [0.2, 0.3]), ("imratio", "0.3"),
    ("imratio", [[0.2]]), ("from_logits", "yes"), ("from_logits", 1),
]


@pytest.mark.parametrize("cls", LOSSES)
@pytest.mark.parametrize("name,value", BAD_LOSS_ARGUMENTS, ids=lambda v: repr(v))
def test_every_bad_loss_argument_is_one_line_naming_it(cls, name, value):
    message = one_line(lambda: cls(**{name: value}), f"{name}: ", "allowed")
    assert message.startswith(f"{name}: ")


@pytest.mark.parametrize("name,value", [("num_tasks", 2.5), ("num_tasks", 0), ("margin", float("nan")),
                                        ("margin", 0.0), ("margin", float("inf")), ("name", "auc")])
def test_bad_objective_arguments_are_refused(name, value):
    kwargs = {"name": "auc_margin", "num_tasks": 1, name: value}
    one_line(lambda: Objective(**kwargs), "objective" if name == "name" else name, short(value))


@pytest.mark.parametrize("p", [float("nan"), [0.2, float("nan")], [0.2, 0.3, 0.4]])
def test_a_nan_or_misshapen_positive_ratio_is_refused(p):
    objective = Objective("auc_margin", num_tasks=2)
    one_line(lambda: objective.set_positive_ratio(p), "positive ratio")
    assert objective.p is None
