"""The primal-dual step for your own PyTorch loop (docs/algorithms.md s.2, s.5), with optional momentum.

:class:`PrimalDualSGD` is the local step the federation's clients take
(:class:`fdam_ray.algorithms.LocalSolver`), as a :class:`torch.optim.Optimizer`:
LibAUC's PESG in shape. With g the gradients of an AUC loss
(:mod:`fdam_ray.losses`) at (v, alpha), v = (w, a, b):

    d_v      = clip(g_w), g_a, g_b  +  gamma (v - v_ref)  +  wd v
    u        = mu u + d_v         (heavy-ball momentum, u = 0 at the start; mu = 0: u = d_v)
    v       <- v - eta u
    alpha   <- alpha + eta g_alpha, then max(alpha, 0) for AUC-M

The stagewise schedule of the paper's experiments: at a stage end eta is
divided by ``lr_decay`` and the proximal centre v_ref moves to the average of
the stage's iterates (``reference_point="average"``) or to the last one. Stage
1's centre is the starting point. Stages end every ``stage_length`` steps when
it is given, or when you call :meth:`PrimalDualSGD.end_stage` (LibAUC's
``update_regularizer``). The momentum buffer is kept across stages.

The vector operations are the functions below, which the federation's local
step calls too, in the same order, so both give the same bits.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from fdam_ray.losses import AUCLoss
from fdam_ray.schedules import stagewise_lr

__all__ = ["PrimalDualSGD", "dual_ascent_", "heavy_ball_", "primal_direction_"]

REFERENCE_POINTS = ("average", "last")


def primal_direction_(d: torch.Tensor, v: torch.Tensor, *, prox_weight: float, weight_decay: float,
                      prox_ref: torch.Tensor | None) -> torch.Tensor:
    """d += (gamma + wd) v - gamma v_ref, in place; ``prox_ref`` is gamma v_ref (None when gamma is 0)."""
    pull = prox_weight + weight_decay
    if pull:
        d.add_(v, alpha=pull)
    if prox_weight and prox_ref is not None:
        d.sub_(prox_ref)
    return d


def heavy_ball_(velocity: torch.Tensor, d: torch.Tensor, momentum: float) -> torch.Tensor:
    """u <- mu u + d, in place; the direction the step takes."""
    return velocity.mul_(momentum).add_(d)


def dual_ascent_(alpha: torch.Tensor, g_alpha: torch.Tensor, lr: float, *, nonnegative: bool) -> None:
    """alpha <- alpha + eta g_alpha, projected on alpha >= 0 for AUC-M."""
    alpha.add_(g_alpha, alpha=lr)
    if nonnegative:
        alpha.clamp_(min=0)


def _check(name: str, value: object, ok: bool, allowed: str) -> None:
    if not ok:
        raise ValueError(f"{name}: {value!r} is not allowed ({allowed})")


class PrimalDualSGD(torch.optim.Optimizer):
    """Descent on the model and the loss's a, b, ascent on its alpha (the module docstring's step).

    Args:
        params: the model's parameters (``model.parameters()``); the loss's own are added from ``loss_fn``.
        loss_fn: the AUC loss (:class:`fdam_ray.losses.AUCSquareLoss` or :class:`~fdam_ray.losses.AUCMLoss`)
            whose a, b are descended and whose alpha is ascended.
        lr: eta of stage 1.
        momentum: mu, heavy-ball momentum of the primal step (0 = plain SGD).
        weight_decay: wd, L2 decay of v.
        prox_weight: gamma, weight of the proximal term towards the stage's centre v_ref (the paper: 1/500 ..
            1/1000; 0 = off).
        grad_clip: element-wise clip of the model's gradient to [-clip, clip] (None = off; a, b not clipped).
        lr_decay: divisor of eta at each stage end.
        stage_length: T0, steps per stage (None: stages end only when :meth:`end_stage` is called).
        reference_point: the next stage's centre: ``average`` of the stage's iterates, or the ``last``.
    """

    def __init__(self, params: Iterable[torch.Tensor], loss_fn: AUCLoss, *, lr: float, momentum: float = 0.0,
                 weight_decay: float = 0.0, prox_weight: float = 0.0, grad_clip: float | None = None,
                 lr_decay: float = 3.0, stage_length: int | None = None, reference_point: str = "average") -> None:
        _check("lr", lr, lr > 0, "> 0")
        _check("momentum", momentum, 0 <= momentum < 1, "in [0, 1)")
        _check("weight_decay", weight_decay, weight_decay >= 0, ">= 0")
        _check("prox_weight", prox_weight, prox_weight >= 0, ">= 0")
        _check("grad_clip", grad_clip, grad_clip is None or grad_clip > 0, "> 0 or None")
        _check("lr_decay", lr_decay, lr_decay >= 1, ">= 1")
        _check("stage_length", stage_length, stage_length is None or stage_length >= 1, ">= 1 or None")
        _check("reference_point", reference_point, reference_point in REFERENCE_POINTS, " or ".join(REFERENCE_POINTS))
        if not isinstance(loss_fn, AUCLoss):
            raise TypeError(f"loss_fn: a {type(loss_fn).__name__} is not an AUC loss of fdam_ray.losses")
        aux = list(loss_fn.primal_parameters())
        dual = list(loss_fn.dual_parameters())
        own = {id(t) for t in aux + dual}
        model = [t for t in params if id(t) not in own]
        defaults = {"lr": lr, "initial_lr": lr, "momentum": momentum, "weight_decay": weight_decay,
                    "prox_weight": prox_weight, "grad_clip": None, "role": "primal"}
        groups: list[dict[str, Any]] = [{"params": model, "grad_clip": grad_clip}, {"params": aux},
                                        {"params": dual, "role": "dual"}]
        super().__init__([g for g in groups if g["params"]], defaults)
        self.loss_fn = loss_fn
        self.lr_decay, self.stage_length, self.reference_point = lr_decay, stage_length, reference_point
        self.stage, self.steps = 1, 0  # saved by state_dict()
        for group in self._primal_groups():
            for p in group["params"]:
                self.state[p]["reference"] = p.detach().clone()  # stage 1's centre: the starting point

    def _primal_groups(self) -> list[dict[str, Any]]:
        return [g for g in self.param_groups if g["role"] == "primal"]

    @torch.no_grad()
    def step(self, closure: Callable[[], torch.Tensor] | None = None) -> torch.Tensor | None:  # type: ignore[override]
        """One primal-dual step from the gradients in ``.grad`` (then a stage end every ``stage_length`` steps)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._step_one(p, group)
        self.steps += 1
        if self.stage_length is not None and self.steps % self.stage_length == 0:
            self.end_stage()
        return loss

    def _step_one(self, p: torch.Tensor, group: dict[str, Any]) -> None:
        lr, grad = group["lr"], p.grad
        assert grad is not None  # step() skips parameters without a gradient
        if group["role"] == "dual":
            dual_ascent_(p, grad, lr, nonnegative=self.loss_fn.alpha_nonnegative)
            return
        state = self.state[p]
        d = grad.clone()
        if group["grad_clip"] is not None:
            d.clamp_(-group["grad_clip"], group["grad_clip"])
        gamma = group["prox_weight"]
        primal_direction_(d, p, prox_weight=gamma, weight_decay=group["weight_decay"],
                          prox_ref=state["reference"] * gamma if gamma else None)
        if group["momentum"]:
            velocity = state.setdefault("velocity", torch.zeros_like(p))
            d = heavy_ball_(velocity, d, group["momentum"])
        p.add_(d, alpha=-lr)
        if self.reference_point == "average" and gamma:  # the centre matters only with a proximal term
            total = state.setdefault("iterate_sum", torch.zeros_like(p, dtype=torch.float64))
            total.add_(p)
            state["iterates"] = state.get("iterates", 0) + 1

    @torch.no_grad()
    def end_stage(self) -> None:
        """Start the next stage: eta <- eta_0 / decay^(s-1) and the new proximal centre."""
        self.stage += 1
        for group in self.param_groups:
            group["lr"] = stagewise_lr(group["initial_lr"], self.lr_decay, self.stage)
        for group in self._primal_groups():
            for p in group["params"]:
                state = self.state[p]
                count = state.pop("iterates", 0)
                total = state.pop("iterate_sum", None)
                if self.reference_point == "average" and count:
                    state["reference"] = (total / count).to(p.dtype)
                else:
                    state["reference"] = p.detach().clone()

    def state_dict(self) -> dict[str, Any]:
        out = super().state_dict()
        out["schedule"] = {"stage": self.stage, "steps": self.steps}
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        schedule = state_dict.get("schedule", {"stage": 1, "steps": 0})
        super().load_state_dict({k: v for k, v in state_dict.items() if k != "schedule"})
        self.stage, self.steps = int(schedule["stage"]), int(schedule["steps"])
