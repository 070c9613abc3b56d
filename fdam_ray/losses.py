"""AUC losses for your own PyTorch loop: AUC-square and AUC-M, one task or many with missing labels.

The same objectives the federation optimises (docs/algorithms.md s.1; Yuan et
al. 2021, eq. 2 and AUC-M), as `torch.nn.Module` losses that hold their
own a, b (minimised) and alpha (maximised), as LibAUC's ``AUCMLoss`` does. With
P = [y = 1], N = [y = 0] and score h in [0, 1] the per-sample objective is

    AUCSquareLoss:  (1-p)(h-a)^2 P + p(h-b)^2 N + 2(1+alpha)(p h N - (1-p) h P) - p(1-p) alpha^2
    AUCMLoss:       (1-p)(h-a)^2 P + p(h-b)^2 N + 2 alpha (p(1-p) m + p h N - (1-p) h P) - p(1-p) alpha^2

where p is the positive ratio (``imratio``) and m the margin; alpha >= 0 for
AUC-M ([`fdam_ray.optim.PrimalDualSGD`][fdam_ray.optim.PrimalDualSGD] projects it). The loss of a batch
is the mean of F over the samples, per task, then the mean over the tasks that
have a labelled sample in the batch. With ``num_tasks`` T > 1 the model gives
T scores, a, b, alpha and p are length-T vectors, and a label of -1 or NaN is
missing: that sample is left out of that task only. Labels come in the scores'
layout, one row per sample; a loss is never computed from NaN or infinite
scores (a ValueError says where, rather than a NaN written into the model).

The arithmetic is [`fdam_ray.objectives.auc_objective`][fdam_ray.objectives.auc_objective], the one the
federation's clients call, so a loss here and a federated run agree to the bit.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import ClassVar

import numpy as np
import torch
from torch import nn

from fdam_ray.objectives import (
    auc_objective,
    check_batch,
    check_label_layout,
    global_positive_ratio,
    number_argument,
    whole_argument,
)
from fdam_ray.settings.redact import short

__all__ = ["AUCLoss", "AUCMLoss", "AUCSquareLoss", "PartialAUCLoss", "positive_ratio"]


def _label_tensor(labels: torch.Tensor | np.ndarray | Sequence) -> torch.Tensor:
    try:
        return torch.as_tensor(labels)
    except (TypeError, ValueError, RuntimeError):
        raise ValueError(f"labels: {short(labels)} is not allowed (a tensor, array or sequence of 0, 1, and -1 / "
                         "NaN for missing)") from None


def _as_label_matrix(y: torch.Tensor, num_tasks: int) -> torch.Tensor:
    """Labels (already in a (B, T) or (B,) layout) as a float (B, T) tensor with NaN for missing (-1 or NaN);
    anything else but 0 and 1 is refused."""
    y = y.to(torch.float32).reshape(-1, num_tasks)
    y = torch.where(y == -1, torch.full_like(y, float("nan")), y)
    bad = ~(torch.isnan(y) | (y == 0) | (y == 1))
    if bool(bad.any()):
        row, task = (int(i) for i in bad.nonzero()[0])
        raise ValueError(f"labels: {float(y[row, task])!r} at row {row}, task {task} is not 0, 1, or -1 / NaN "
                         "(missing)")
    return y


def positive_ratio(labels: torch.Tensor | np.ndarray | Sequence, num_tasks: int = 1) -> np.ndarray:
    """p per task from training labels: positives over labelled samples (-1 and NaN are not labelled).

    Give it the whole training set's labels once (``imratio=positive_ratio(train_y)``): a p fixed for the run,
    as the federation's global p, rather than one that moves with each batch.
    """
    num_tasks = whole_argument("num_tasks", num_tasks, lambda v: v >= 1, "a whole number >= 1")
    given = _label_tensor(labels)
    if not ((given.ndim == 2 and given.shape[1] == num_tasks) or (num_tasks == 1 and given.ndim == 1)):
        layout = "(N,) or (N, 1)" if num_tasks == 1 else f"(N, {num_tasks}), one row per sample"
        raise ValueError(f"labels: shape {tuple(given.shape)} is not allowed for num_tasks={num_tasks} ({layout})")
    y = _as_label_matrix(given, num_tasks).numpy()
    return global_positive_ratio([(y == 1).sum(0)], [(~np.isnan(y)).sum(0)])


def _positive_ratio_argument(imratio: float | Sequence[float] | np.ndarray, num_tasks: int) -> np.ndarray:
    """``imratio`` as p per task: one number, or one per task, each in (0, 1)."""
    allowed = "a number in (0, 1)" + (f", or {num_tasks} of them (one per task)" if num_tasks > 1 else "")
    try:
        given = np.asarray(imratio)
    except (TypeError, ValueError, RuntimeError):
        given = np.asarray(None)
    if given.dtype.kind not in "iuf" or given.ndim > 1 or given.size not in (1, num_tasks):
        raise ValueError(f"imratio: {short(imratio)} is not allowed ({allowed}, or None to estimate it)")
    p = np.broadcast_to(given.astype(np.float64).reshape(-1), (num_tasks,)).copy()
    if not np.all((p > 0) & (p < 1)):  # NaN fails both
        raise ValueError(f"imratio: {p.tolist()[:8]} is not allowed ({allowed}, or None to estimate it)")
    return p


class AUCLoss(nn.Module):
    """Shared part of the AUC losses: the auxiliary variables, p, and the label handling.

    Args:
        num_tasks: T, scores per sample.
        imratio: p, one value or one per task, in (0, 1); None estimates it as (positives + 1) / (labelled + 2)
            over every batch seen in training mode (never 0 or 1, and the pooled ratio as batches add up).
        margin: m of AUC-M.
        from_logits: True when the model's raw outputs are given (the loss applies the sigmoid); False when
            they are scores in [0, 1] already, as LibAUC's losses take them.
    """

    objective: ClassVar[str] = ""
    alpha_nonnegative: ClassVar[bool] = False
    p: torch.Tensor  # buffers: p per task, and the counts its estimate comes from
    positives: torch.Tensor
    labelled: torch.Tensor

    def __init__(self, *, num_tasks: int = 1, imratio: float | Sequence[float] | np.ndarray | None = None,
                 margin: float = 1.0, from_logits: bool = False) -> None:
        super().__init__()
        num_tasks = whole_argument("num_tasks", num_tasks, lambda v: v >= 1, "a whole number >= 1")
        margin = number_argument("margin", margin, lambda v: v > 0, "a finite number > 0")
        if not isinstance(from_logits, (bool, np.bool_)):
            raise ValueError(f"from_logits: {short(from_logits)} is not allowed (True or False)")
        p = np.full(num_tasks, 0.5) if imratio is None else _positive_ratio_argument(imratio, num_tasks)
        self.num_tasks, self.margin, self.from_logits = num_tasks, float(margin), bool(from_logits)
        self.a = nn.Parameter(torch.zeros(num_tasks))
        self.b = nn.Parameter(torch.zeros(num_tasks))
        self.alpha = nn.Parameter(torch.zeros(num_tasks))
        self.estimate_p = imratio is None
        self.register_buffer("p", torch.as_tensor(p, dtype=torch.float32))
        self.register_buffer("positives", torch.zeros(num_tasks, dtype=torch.float64))
        self.register_buffer("labelled", torch.zeros(num_tasks, dtype=torch.float64))

    def primal_parameters(self) -> Iterator[nn.Parameter]:
        """a and b: minimised with the model."""
        yield self.a
        yield self.b

    def dual_parameters(self) -> Iterator[nn.Parameter]:
        """alpha: maximised."""
        yield self.alpha

    def _update_estimate(self, y: torch.Tensor) -> None:
        with torch.no_grad():
            self.positives += (y == 1).sum(0).to(self.positives)
            self.labelled += (~torch.isnan(y)).sum(0).to(self.labelled)
            self.p.copy_((self.positives + 1) / (self.labelled + 2))

    def forward(self, predictions: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The minibatch loss of (B,) or (B, T) ``predictions`` (scores, or logits with ``from_logits``) and
        labels of the same shape (0, 1; -1 or NaN missing).

        Refused with a ValueError (before p's estimate counts the batch): predictions of another shape or holding
        NaN or infinity, labels in another layout ((T, B) or a flat (T*B,) for T > 1; (B,) and (B, 1) are the
        same for T = 1) or with a value other than 0, 1, -1 and NaN."""
        t = self.num_tasks
        if not isinstance(predictions, torch.Tensor):
            raise ValueError(f"predictions: {type(predictions).__name__} is not allowed (a tensor of scores)")
        if not ((predictions.ndim == 2 and predictions.shape[1] == t) or (t == 1 and predictions.ndim == 1)):
            layout = "(B,) or (B, 1)" if t == 1 else f"(B, {t})"
            raise ValueError(f"predictions: shape {tuple(predictions.shape)} is not allowed ({layout} scores for "
                             f"num_tasks={t})")
        check_batch(predictions, "predictions")
        given = _label_tensor(labels)
        check_label_layout(given, predictions.shape, t)
        h = predictions.reshape(predictions.shape[0], -1)
        if not bool(torch.isfinite(h).all()):  # one check per step; a NaN loss would write NaN into the model
            row, task = (int(i) for i in (~torch.isfinite(h)).nonzero()[0])
            raise ValueError(f"predictions: {float(h[row, task])!r} at row {row}, task {task} is not a finite "
                             "score (the model's output holds NaN or infinity: it diverged, or its input holds one)")
        if not self.from_logits and not bool(((h >= 0) & (h <= 1)).all()):  # raw logits would train on nonsense
            row, task = (int(i) for i in ((h < 0) | (h > 1)).nonzero()[0])
            raise ValueError(f"predictions: {float(h[row, task])!r} at row {row}, task {task} is not a score in "
                             "[0, 1] (give the model's raw outputs with from_logits=True, or its sigmoid)")
        y = _as_label_matrix(given, t).to(h.device)
        if self.estimate_p and self.training:
            self._update_estimate(y)
        if self.from_logits:
            h = torch.sigmoid(h)
        return self._objective(h, y)

    def _objective(self, h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return auc_objective(self.objective, h, y, self.p, self.a, self.b, self.alpha, margin=self.margin)


class AUCSquareLoss(AUCLoss):
    """AUC-square, the paper's eq. 2 (alpha unconstrained); see the module docstring for F and the arguments."""

    objective = "auc_square"


class AUCMLoss(AUCLoss):
    """AUC-M, the min-max margin loss (alpha >= 0, margin m, default 1); see the module docstring."""

    objective = "auc_margin"
    alpha_nonnegative = True


class PartialAUCLoss(AUCLoss):
    """Partial AUC: AUC-M over KL-DRO-weighted negatives (FPR <= beta), with ``two_way`` also weighted positives
    (TPR >= alpha); the federation's ``pauc_one_way`` / ``pauc_two_way`` (docs/algorithms.md s.1b), a negative
    scored h weighing exp(h / temperature) / Z. Z is each batch's own mean over its negatives (positives), or
    the log normalisers ``(T, 2)`` last given to :meth:`set_log_normalisers` (over the whole training set, say).

    Args:
        temperature: lambda (> 0); large gives back AUC-M.
        two_way: weight the positives too.
        **kwargs: those of :class:`AUCLoss`.
    """

    objective = "pauc_one_way"
    alpha_nonnegative = True

    def __init__(self, *, temperature: float = 0.1, two_way: bool = False, **kwargs) -> None:
        super().__init__(**kwargs)
        self.temperature = float(number_argument("temperature", temperature, lambda v: v > 0, "a finite number > 0"))
        if not isinstance(two_way, (bool, np.bool_)):
            raise ValueError(f"two_way: {short(two_way)} is not allowed (True or False)")
        self.kind = "pauc_two_way" if two_way else "pauc_one_way"  # (the class's objective: one-way)
        self.log_norms: torch.Tensor | None = None

    def set_log_normalisers(self, log_norms: np.ndarray | torch.Tensor | None) -> None:
        """``(T, 2)``: per task log Z of the negatives and of the positives (None: each batch's own)."""
        if log_norms is not None:
            log_norms = torch.as_tensor(np.asarray(log_norms, dtype=np.float32).reshape(self.num_tasks, 2))
        self.log_norms = log_norms

    def _objective(self, h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        from fdam_ray.pauc import pauc_objective

        norms = None if self.log_norms is None else self.log_norms.to(h.device, h.dtype)
        return pauc_objective(self.kind, h, y, self.p, self.a, self.b, self.alpha, margin=self.margin,
                              temperature=self.temperature, log_norms=norms)
