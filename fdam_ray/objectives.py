"""AUC min-max objectives and the BCE baseline (docs/algorithms.md s.1).

For K clients with a shared positive ratio p, the per-sample objective with
P = [y = 1], N = [y = 0] and score h = sigmoid(model(x)) in [0, 1] is

    auc_square (Yuan et al. 2021, eq. 2):
        F = (1-p)(h-a)^2 P + p(h-b)^2 N + 2(1+alpha)(p h N - (1-p) h P) - p(1-p) alpha^2
    auc_margin (AUC-M with margin m; alpha >= 0):
        F = (1-p)(h-a)^2 P + p(h-b)^2 N + 2 alpha (p(1-p) m + p h N - (1-p) h P) - p(1-p) alpha^2

and the model is trained to min over v = (w, a, b), max over alpha. ``bce`` is
binary cross-entropy on h and has no a, b or alpha.

Multi-label: with T tasks, a, b, alpha and p are length-T vectors, labels are
(B, T) with NaN for a missing label. A task's minibatch estimate is the mean of
F over the samples that have a label for it; the loss is the mean over the
tasks that have at least one such sample in the batch (a task with none adds
nothing, rather than a zero that would shrink the others' weight).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F_nn

from fdam_ray.pauc import PAUC_OBJECTIVES, pauc_objective, task_mean
from fdam_ray.settings.redact import short

OBJECTIVES = ("auc_square", "auc_margin", "bce", "pauc_one_way", "pauc_two_way")  # pAUC: fdam_ray/pauc.py


def number_argument(name: str, value: object, ok: Callable[[float], bool], allowed: str) -> float:
    """``value`` if it is a finite real number (not a bool) for which ``ok`` holds, else the one-line ValueError
    naming ``name``, the value and the ``allowed`` range in words."""
    if (isinstance(value, bool) or not isinstance(value, numbers.Real)
            or not math.isfinite(value) or not ok(value)):  # type: ignore[arg-type]
        raise ValueError(f"{name}: {short(value)} is not allowed ({allowed})")
    return value  # type: ignore[return-value]  # as given: a check must not change what a valid run computes


def whole_argument(name: str, value: object, ok: Callable[[int], bool], allowed: str) -> int:
    """``value`` as an int if it is a whole number (an int, or a float without a fraction; not a bool) for which
    ``ok`` holds, else the one-line ValueError naming ``name``, the value and the ``allowed`` range in words."""
    whole: int | None = None
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        whole = int(value)
    elif isinstance(value, float | np.floating) and math.isfinite(value) and float(value).is_integer():
        whole = int(value)
    if whole is None or not ok(whole):
        raise ValueError(f"{name}: {short(value)} is not allowed ({allowed})")
    return whole


def check_batch(scores: torch.Tensor, name: str) -> None:
    """A batch holds at least one sample (an empty one has no AUC pair, and a reshape of it fails in torch's
    words); else one line naming ``name``."""
    if scores.ndim == 0 or scores.shape[0] == 0 or scores.numel() == 0:
        raise ValueError(f"{name}: shape {tuple(scores.shape)} is an empty batch, not allowed (at least one "
                         "sample)")


def check_label_layout(labels: torch.Tensor, scores_shape: torch.Size, num_tasks: int, *,
                       scores_name: str = "predictions") -> None:
    """Labels must come in the scores' layout: (B, T), or (B,) / (B, 1) when T = 1 (never (T, B) or a flat
    (T*B,) that a reshape would silently misread)."""
    batch = scores_shape[0]
    if labels.shape == (batch, num_tasks) or (num_tasks == 1 and labels.shape == (batch,)):
        return
    layout = f"({batch},) or ({batch}, 1)" if num_tasks == 1 else f"({batch}, {num_tasks}), one row per sample"
    raise ValueError(f"labels: shape {tuple(labels.shape)} does not match {scores_name} {tuple(scores_shape)} "
                     f"(labels take the scores' layout: {layout} for num_tasks={num_tasks})")


class Objective:
    """A minibatch objective over logits and labels.

    Args:
        name: ``auc_square``, ``auc_margin`` or ``bce``.
        num_tasks: T, the number of outputs of the model.
        margin: m of ``auc_margin``.
    """

    def __init__(self, name: str, *, num_tasks: int, margin: float = 1.0, temperature: float = 0.1) -> None:
        if not isinstance(name, str) or name not in OBJECTIVES:
            raise ValueError(f"objective {short(name)} is not one of {', '.join(OBJECTIVES)}")
        self.name = name
        self.num_tasks = whole_argument("num_tasks", num_tasks, lambda v: v >= 1, "a whole number >= 1")
        self.margin = float(number_argument("margin", margin, lambda v: v > 0, "a finite number > 0"))
        self.p: torch.Tensor | None = None
        self.temperature = float(number_argument("pauc_temperature", temperature, lambda v: v > 0,
                                                 "a finite number > 0"))
        self.log_norms: torch.Tensor | None = None  # pAUC: (T, 2) global log normalisers of the last pass

    @property
    def has_auxiliary(self) -> bool:
        """Whether the objective has the extra primal a, b and the dual alpha."""
        return self.name != "bce"

    @property
    def alpha_nonnegative(self) -> bool:
        return self.name in ("auc_margin", *PAUC_OBJECTIVES)

    def configure(self, values: np.ndarray, device: torch.device | str = "cpu") -> None:
        """p (T values, or one); under a pAUC objective also 3T values: p, then the log normalisers of the
        negatives and of the positives (`fdam_ray.pauc.configure_vector`)."""
        arr = np.asarray(values, dtype=np.float64).reshape(-1)
        t = self.num_tasks
        if self.name in PAUC_OBJECTIVES and arr.size == 3 * t and t > 0:
            self.set_positive_ratio(arr[:t], device)
            self.log_norms = torch.as_tensor(arr[t:].reshape(2, t).T.copy(), dtype=torch.float32, device=device)
            return
        self.set_positive_ratio(values, device)

    @property
    def aux_size(self) -> int:
        """Length of each of a, b, alpha (0 for bce)."""
        return self.num_tasks if self.has_auxiliary else 0

    def set_positive_ratio(self, p: np.ndarray | float, device: torch.device | str = "cpu") -> None:
        """Fix p (one value, or one per task) for every later call."""
        try:
            given = np.asarray(p, dtype=np.float64)
        except (TypeError, ValueError):
            raise ValueError(f"positive ratio p: {short(p)} is not a number or one number per task") from None
        if given.ndim > 1 or given.size not in (1, self.num_tasks):
            raise ValueError(f"positive ratio p: {given.size} values in shape {given.shape}, but num_tasks="
                             f"{self.num_tasks} (one value, or one per task)")
        arr = np.broadcast_to(given.reshape(-1), (self.num_tasks,)).copy()
        if not np.all((arr > 0) & (arr < 1)):  # NaN fails both
            raise ValueError(f"positive ratio p must lie in (0, 1) for every task, got {arr.tolist()[:8]}")
        self.p = torch.as_tensor(arr, dtype=torch.float32, device=device)

    def __call__(
        self,
        logits: torch.Tensor,
        labels: torch.Tensor,
        a: torch.Tensor,
        b: torch.Tensor,
        alpha: torch.Tensor,
    ) -> torch.Tensor:
        check_batch(logits, "logits")
        logits = logits.reshape(logits.shape[0], -1)
        check_label_layout(labels, logits.shape, logits.shape[1], scores_name="logits")
        labels = labels.reshape(logits.shape)
        if self.name == "bce":
            return bce_objective(logits, labels)
        if self.p is None:
            raise RuntimeError("set_positive_ratio() must be called before the AUC objective is used")
        if self.name in PAUC_OBJECTIVES:
            return pauc_objective(self.name, torch.sigmoid(logits), labels, self.p, a, b, alpha, margin=self.margin,
                                  temperature=self.temperature, log_norms=self.log_norms)
        return auc_objective(self.name, torch.sigmoid(logits), labels, self.p, a, b, alpha, margin=self.margin)


def bce_objective(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Binary cross-entropy on (B, T) logits, NaN labels left out, as the mean over tasks of the task means."""
    valid = ~torch.isnan(labels)
    target = torch.nan_to_num(labels, nan=0.0)
    per = F_nn.binary_cross_entropy_with_logits(logits, target, reduction="none") * valid
    return task_mean(per, valid.sum(0).to(logits.dtype))


def auc_objective(
    name: str,
    h: torch.Tensor,
    labels: torch.Tensor,
    p: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    alpha: torch.Tensor,
    *,
    margin: float = 1.0,
) -> torch.Tensor:
    """The minibatch AUC objective of the module docstring on (B, T) scores h in [0, 1] and labels (0, 1, NaN).

    The one implementation of F: the federation's [`Objective`][fdam_ray.objectives.Objective] and the public losses
    ([`fdam_ray.losses`][fdam_ray.losses]) both call it.
    """
    valid = ~torch.isnan(labels)
    pos = (labels == 1).to(h.dtype)
    neg = (labels == 0).to(h.dtype)
    count = valid.sum(0).to(h.dtype)
    q = p * (1 - p)
    per = (1 - p) * (h - a) ** 2 * pos + p * (h - b) ** 2 * neg
    cross = p * h * neg - (1 - p) * h * pos
    if name == "auc_square":
        per = per + 2 * (1 + alpha) * cross
    elif name == "auc_margin":
        per = per + 2 * alpha * (q * margin * valid + cross)
    else:
        raise ValueError(f"AUC objective {name!r} is not one of auc_square, auc_margin")
    per = per - q * alpha**2 * valid
    return task_mean(per, count)


def closed_form_alpha(
    mean_pos: np.ndarray, mean_neg: np.ndarray, objective: str, margin: float = 1.0
) -> np.ndarray:
    """alpha* for fixed v: E[h|neg] - E[h|pos] (square), max(0, m + E[h|neg] - E[h|pos]) (margin)."""
    gap = np.asarray(mean_neg, dtype=np.float64) - np.asarray(mean_pos, dtype=np.float64)
    if objective == "auc_square":
        return gap
    if objective == "auc_margin":
        return np.maximum(0.0, margin + gap)
    raise ValueError(f"closed-form alpha exists for auc_square and auc_margin, not {objective!r}")


def global_positive_ratio(positives: Sequence[np.ndarray], labelled: Sequence[np.ndarray]) -> np.ndarray:
    """p per task (s.1): all clients' positive labels over all clients' labelled samples.

    Pooled counts, not a mean of the clients' own ratios: with clients of
    different sizes or prevalences only the pooled ratio makes
    f = (1/K) sum_k f_k the objective of the union of their data.
    """
    pos = np.sum(positives, axis=0).astype(np.float64)
    lab = np.sum(labelled, axis=0).astype(np.float64)
    for t, (n_pos, n_lab) in enumerate(zip(pos, lab, strict=True)):
        if n_pos == 0 or n_pos == n_lab:
            side = "positive" if n_pos == 0 else "negative"
            raise ValueError(f"task {t}: no client has a {side} training label, so AUC cannot be optimised")
    return pos / lab
