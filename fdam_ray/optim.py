"""The primal-dual step for your own PyTorch loop (docs/algorithms.md s.2, s.5), with optional momentum.

[`PrimalDualSGD`][fdam_ray.optim.PrimalDualSGD] is the local step the federation's clients take
(`fdam_ray.algorithms.LocalSolver`), as a `torch.optim.Optimizer`:
LibAUC's PESG in shape. With g the gradients of an AUC loss
([`fdam_ray.losses`][fdam_ray.losses]) at (v, alpha), v = (w, a, b):

    d_v      = clip(g_w), g_a, g_b  +  gamma (v - v_ref)  +  wd v
    u        = mu u + d_v         (heavy-ball momentum, u = 0 at the start; mu = 0: u = d_v)
    v       <- v - eta u
    alpha   <- alpha + eta g_alpha, then max(alpha, 0) for AUC-M

The stagewise schedule of the paper's experiments: at a stage end eta is
divided by ``lr_decay`` and the proximal centre v_ref moves to the average of
the stage's iterates (``reference_point="average"``) or to the last one. Stage
1's centre is the starting point. Stages end every ``stage_length`` steps when
it is given, or when you call [`PrimalDualSGD.end_stage`][fdam_ray.optim.PrimalDualSGD.end_stage] (LibAUC's
``update_regularizer``). The momentum buffer is kept across stages.

The vector operations are the functions below, which the federation's local
step calls too, in the same order, so both give the same bits.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from fdam_ray.core.schedules import stagewise_lr
from fdam_ray.losses import AUCLoss
from fdam_ray.objectives import number_argument, whole_argument
from fdam_ray.settings.redact import short

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
        raise ValueError(f"{name}: {short(value)} is not allowed ({allowed})")


# The hyperparameters of a group, with the range each may take (the constructor's, and a loaded group's).
GROUP_RANGES: dict[str, tuple[Callable[[float], bool], str]] = {
    "lr": (lambda v: v > 0, "a finite number > 0"),
    "initial_lr": (lambda v: v > 0, "a finite number > 0"),
    "momentum": (lambda v: 0 <= v < 1, "a number in [0, 1)"),
    "weight_decay": (lambda v: v >= 0, "a finite number >= 0"),
    "prox_weight": (lambda v: v >= 0, "a finite number >= 0"),
    "grad_clip": (lambda v: v > 0, "a finite number > 0, or None for no clip"),
}
GROUP_NAMES = ("the model's parameters", "the loss's a, b", "the loss's alpha")
TOP_KEYS = ("state", "param_groups", "schedule")
STATE_KEYS = ("reference", "velocity", "iterate_sum", "iterates")  # what a primal parameter's state may hold
SCHEDULE_KEYS = ("stage", "steps")


def _keys(keys: Iterable[object]) -> str:
    """``key 'a'`` or ``keys 'a', 'b'`` (at most 8 shown)."""
    listed = sorted(short(k, 40) for k in keys)
    more = f" and {len(listed) - 8} more" if len(listed) > 8 else ""
    return ("key " if len(listed) == 1 else "keys ") + ", ".join(listed[:8]) + more


def _check_keys(where: str, found: Iterable[object], expected: Iterable[str], whose: str) -> None:
    found, expected = set(found), set(expected)
    missing, extra = expected - found, found - expected
    if missing or extra:
        parts = [f"{_keys(missing)} {'is' if len(missing) == 1 else 'are'} missing"] if missing else []
        parts += [f"{_keys(extra)} {'is' if len(extra) == 1 else 'are'} not {whose}"] if extra else []
        raise ValueError(f"{where}: {'; '.join(parts)} (expected {_keys(expected)})")


def _kind(value: object) -> str:
    name = type(value).__name__
    return f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name}"


def _whole(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


class ArgumentTypeError(TypeError, ValueError):
    """An argument of the wrong kind: a TypeError, and a ValueError as every other bad argument of the class."""


def _model_tensors(params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    allowed = "an iterable of the model's parameters, such as model.parameters()"
    if isinstance(params, torch.Tensor | Mapping) or not isinstance(params, Iterable):
        raise ArgumentTypeError(f"params: {_kind(params)} is not allowed ({allowed})")
    tensors = list(params)
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            what = "a dict (a parameter group: the optimizer makes its groups itself)" if isinstance(t, Mapping) \
                else _kind(t)
            raise ArgumentTypeError(f"params: {what} is not allowed ({allowed})")
        if not t.is_leaf:
            raise ValueError(f"params: a tensor computed from others (not a leaf) is not allowed ({allowed})")
    return tensors


class PrimalDualSGD(torch.optim.Optimizer):
    """Descent on the model and the loss's a, b, ascent on its alpha (the module docstring's step).

    Args:
        params: the model's parameters (``model.parameters()``); the loss's own are added from ``loss_fn``.
        loss_fn: the AUC loss ([`AUCSquareLoss`][fdam_ray.losses.AUCSquareLoss] or
            [`AUCMLoss`][fdam_ray.losses.AUCMLoss]) whose a, b are descended and whose alpha is ascended.
        lr: eta of stage 1.
        momentum: mu, heavy-ball momentum of the primal step (0 = plain SGD).
        weight_decay: wd, L2 decay of v.
        prox_weight: gamma, weight of the proximal term towards the stage's centre v_ref (the paper: 1/500 ..
            1/1000; 0 = off).
        grad_clip: element-wise clip of the model's gradient to [-clip, clip] (None = off; a, b not clipped).
        lr_decay: divisor of eta at each stage end.
        stage_length: T0, steps per stage (None: stages end only when
            [`end_stage`][fdam_ray.optim.PrimalDualSGD.end_stage] is called).
        reference_point: the next stage's centre: ``average`` of the stage's iterates, or the ``last``.
    """

    def __init__(self, params: Iterable[torch.Tensor], loss_fn: AUCLoss, *, lr: float, momentum: float = 0.0,
                 weight_decay: float = 0.0, prox_weight: float = 0.0, grad_clip: float | None = None,
                 lr_decay: float = 3.0, stage_length: int | None = None, reference_point: str = "average") -> None:
        for name, value in (("lr", lr), ("momentum", momentum), ("weight_decay", weight_decay),
                            ("prox_weight", prox_weight)):
            number_argument(name, value, *GROUP_RANGES[name])
        if grad_clip is not None:
            number_argument("grad_clip", grad_clip, *GROUP_RANGES["grad_clip"])
        number_argument("lr_decay", lr_decay, lambda v: v >= 1, "a finite number >= 1")
        if stage_length is not None:
            stage_length = whole_argument("stage_length", stage_length, lambda v: v >= 1,
                                          "a whole number >= 1, or None to end stages by end_stage()")
        _check("reference_point", reference_point,
               isinstance(reference_point, str) and reference_point in REFERENCE_POINTS, " or ".join(REFERENCE_POINTS))
        if not isinstance(loss_fn, AUCLoss):
            raise ArgumentTypeError(f"loss_fn: a {type(loss_fn).__name__} is not an AUC loss of fdam_ray.losses")
        aux = list(loss_fn.primal_parameters())
        dual = list(loss_fn.dual_parameters())
        own = {id(t) for t in aux + dual}
        model = [t for t in _model_tensors(params) if id(t) not in own]
        defaults = {"lr": lr, "initial_lr": lr, "momentum": momentum, "weight_decay": weight_decay,
                    "prox_weight": prox_weight, "grad_clip": None, "role": "primal"}
        groups: list[dict[str, Any]] = [{"params": model, "grad_clip": grad_clip}, {"params": aux},
                                        {"params": dual, "role": "dual"}]
        self._group_names = [name for name, g in zip(GROUP_NAMES, groups, strict=True) if g["params"]]
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
        """Load a `state_dict` of a PrimalDualSGD over parameters of the same shapes (the same model and
        ``num_tasks``). Anything else (another optimizer's state, other shapes, a damaged entry) is refused with a
        ValueError naming what differs, and nothing is changed."""
        self._check_loadable(state_dict)
        schedule = state_dict["schedule"]
        super().load_state_dict({k: v for k, v in state_dict.items() if k != "schedule"})
        saved = self._saved_params(state_dict)
        for p, entry in saved:  # torch casts every state tensor to the parameter's dtype: the sum stays float64
            if "iterate_sum" in entry:
                self.state[p]["iterate_sum"] = entry["iterate_sum"].to(device=p.device, dtype=torch.float64,
                                                                       copy=True)
        self.stage, self.steps = int(schedule["stage"]), int(schedule["steps"])

    def _saved_params(self, state_dict: Mapping[str, Any]) -> list[tuple[torch.Tensor, Mapping[str, Any]]]:
        """(parameter, its saved state) for every parameter the (checked) ``state_dict`` keeps a state for."""
        ids = [i for group in state_dict["param_groups"] for i in group["params"]]
        params = [p for group in self.param_groups for p in group["params"]]
        by_id = dict(zip(ids, params, strict=True))
        return [(by_id[i], entry) for i, entry in state_dict["state"].items()]

    def _check_loadable(self, state_dict: object) -> None:
        """Refuse (one ValueError line) a state that is not this optimizer's kind, over these shapes."""
        if not isinstance(state_dict, Mapping):
            raise ValueError(f"state dict: {_kind(state_dict)} is not a PrimalDualSGD state (a mapping with "
                             f"{_keys(TOP_KEYS)})")
        if not {"param_groups", "state"} <= state_dict.keys():  # torch's own parts first, then ours
            _check_keys("state dict", state_dict.keys(), TOP_KEYS, "PrimalDualSGD's")
        groups = state_dict["param_groups"]
        if not isinstance(groups, list | tuple):
            raise ValueError(f"state dict param_groups: {_kind(groups)}, but a list of {len(self.param_groups)} "
                             "groups is expected")
        if len(groups) != len(self.param_groups):
            raise ValueError(f"state dict param_groups: {len(groups)} group{'s' * (len(groups) != 1)}, but this "
                             f"optimizer has {len(self.param_groups)} ({'; '.join(self._group_names)})")
        seen: dict[int, tuple[int, torch.Tensor, str]] = {}  # saved id: group, parameter, role
        for g, (saved, group) in enumerate(zip(groups, self.param_groups, strict=True)):
            where = f"state dict param_groups[{g}] ({self._group_names[g]})"
            self._check_group(where, saved, group, clipped=g == 0 and self._group_names[0] == GROUP_NAMES[0])
            for i, p in zip(saved["params"], group["params"], strict=True):
                if not _whole(i) or i in seen:
                    why = "appears twice" if _whole(i) else "is not an integer id"
                    raise ValueError(f"{where} params: {short(i)} {why} (each parameter's id once)")
                seen[i] = (g, p, group["role"])
        state = state_dict["state"]
        if not isinstance(state, Mapping):
            raise ValueError(f"state dict state: {_kind(state)}, but a mapping of parameter id to its state is "
                             "expected")
        for i, entry in state.items():
            if i not in seen:
                raise ValueError(f"state dict state: id {short(i)} is no parameter of its param_groups (ids "
                                 f"{', '.join(str(k) for k in sorted(seen)[:8])}{' ...' * (len(seen) > 8)})")
            self._check_param_state(i, entry, *seen[i])
        for i, (g, _, role) in seen.items():
            if role == "primal" and i not in state:
                raise ValueError(f"state dict state[{i}]: missing, but parameter {i} of param_groups[{g}] "
                                 f"({self._group_names[g]}) keeps its stage's reference point")
        _check_keys("state dict", state_dict.keys(), TOP_KEYS, "PrimalDualSGD's")
        schedule = state_dict["schedule"]
        if not isinstance(schedule, Mapping):
            raise ValueError(f"state dict schedule: {_kind(schedule)}, but a mapping of {', '.join(SCHEDULE_KEYS)} "
                             "is expected")
        _check_keys("state dict schedule", schedule.keys(), SCHEDULE_KEYS, "PrimalDualSGD's")
        for key, low in (("stage", 1), ("steps", 0)):
            value = schedule[key]
            _check(f"state dict schedule {key}", value, _whole(value) and value >= low, f"a whole number >= {low}")

    def _check_group(self, where: str, saved: object, group: dict[str, Any], *, clipped: bool) -> None:
        if not isinstance(saved, Mapping):
            raise ValueError(f"{where}: {_kind(saved)} is not a parameter group (a mapping)")
        _check_keys(where, saved.keys(), group.keys(), "a PrimalDualSGD group's")
        if not (isinstance(saved["role"], str) and saved["role"] == group["role"]):
            raise ValueError(f"{where}: role {short(saved['role'])}, but this optimizer's group is "
                             f"{group['role']!r}")
        for name, (ok, allowed) in GROUP_RANGES.items():
            value = saved[name]
            if name == "grad_clip" and value is None:
                continue
            if name == "grad_clip" and not clipped:
                raise ValueError(f"{where} grad_clip: {short(value)} is not allowed (None: only the model's "
                                 "gradient is clipped)")
            number_argument(f"{where} {name}", value, ok, allowed)
        params = saved["params"]
        if not isinstance(params, list | tuple) or len(params) != len(group["params"]):
            found = f"{len(params)} parameters" if isinstance(params, list | tuple) else _kind(params)
            raise ValueError(f"{where} params: {found}, but this optimizer's group has {len(group['params'])}")

    def _check_param_state(self, i: object, entry: object, g: int, p: torch.Tensor, role: str) -> None:
        where = f"state dict state[{i}] (parameter {i} of param_groups[{g}], {self._group_names[g]})"
        if not isinstance(entry, Mapping):
            raise ValueError(f"{where}: {_kind(entry)} is not a parameter's state (a mapping)")
        if role == "dual":
            if entry:
                raise ValueError(f"{where}: {_keys(entry.keys())}, but the dual step (alpha) keeps no state")
            return
        unknown = set(entry) - set(STATE_KEYS)
        if unknown:
            raise ValueError(f"{where}: {_keys(unknown)} {'is' if len(unknown) == 1 else 'are'} not PrimalDualSGD's "
                             f"(a parameter's state holds {', '.join(STATE_KEYS)})")
        if "reference" not in entry:
            raise ValueError(f"{where}: key 'reference' is missing (the stage's proximal centre of the parameter)")
        if ("iterate_sum" in entry) != ("iterates" in entry):
            raise ValueError(f"{where}: iterate_sum and iterates come together (the stage's running sum and its "
                             f"count), but only {'iterate_sum' if 'iterate_sum' in entry else 'iterates'} is here")
        for key in ("reference", "velocity", "iterate_sum"):
            if key not in entry:
                continue
            value = entry[key]
            if not isinstance(value, torch.Tensor) or not value.is_floating_point():
                found = _kind(value) if not isinstance(value, torch.Tensor) else f"a {value.dtype} tensor"
                raise ValueError(f"{where} {key}: {found}, but a floating-point tensor of the parameter's shape "
                                 "is expected")
            if value.shape != p.shape:
                raise ValueError(f"{where} {key}: shape {tuple(value.shape)}, but the parameter is "
                                 f"{tuple(p.shape)}")
            if not bool(torch.isfinite(value).all()):
                raise ValueError(f"{where} {key}: holds NaN or infinity (a finite tensor is expected)")
        if "iterates" in entry:
            count = entry["iterates"]
            _check(f"{where} iterates", count, _whole(count) and count >= 1, "a whole number >= 1")
