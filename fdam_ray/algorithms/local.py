"""Client side of a round: begin (load global state), step (docs/algorithms.md s.2), end (control variate).

One local step, with g the minibatch gradients at (v, alpha):

    d_v    = clip(g_w), g_a, g_b  +  gamma (v - v_ref)  +  wd v
    v     <- v - eta (d_v - c_v^k + c_v)             # c terms only with control variates
    alpha <- alpha + eta (g_alpha - c_alpha^k + c_alpha), then max(alpha, 0) for auc_margin

and at the round's end, with I the steps taken (CODASCA lines; SCAFFOLD option II):

    c_v^k     <- c_v^k - c_v + (v_start - v_end) / (I eta)
    c_alpha^k <- c_alpha^k - c_alpha + (alpha_end - alpha_start) / (I eta)

Without control variates the same code runs with the c terms left out, which
is CODA+ (and, with bce, FedAvg); the drift correction is the only difference.
"""

from __future__ import annotations

import numpy as np
import torch

from fdam_ray.flat import FlatModel
from fdam_ray.objectives import Objective
from fdam_ray.state import GlobalState


class LocalSolver:
    """Local primal-descent / dual-ascent steps on a :class:`FlatModel`.

    Args:
        flat: the client's model replica in flat storage.
        objective: the minibatch objective (p already set).
        control_variates: keep a control variate c^k and correct every step with c - c^k.
        prox_weight: gamma.
        weight_decay: wd.
        grad_clip: element-wise clip of the network's gradient (None = off).
    """

    def __init__(
        self,
        flat: FlatModel,
        objective: Objective,
        *,
        control_variates: bool,
        prox_weight: float,
        weight_decay: float,
        grad_clip: float | None,
    ) -> None:
        self.flat = flat
        self.objective = objective
        self.control_variates = control_variates
        self.prox_weight = prox_weight
        self.weight_decay = weight_decay
        self.grad_clip = grad_clip
        flat.precision.note_training()
        n, m, dev = flat.state_size, flat.aux_size, flat.device
        self.prox_ref = torch.zeros(n, device=dev)  # gamma * v_ref
        self.v_start = torch.zeros(n, device=dev)
        self.alpha_start = torch.zeros(m, device=dev)
        self._change = False  # whether end() kept the change of c^k (in v_start, alpha_start)
        if control_variates:
            self.c_v = torch.zeros(n, device=dev)  # this client's c^k
            self.c_alpha = torch.zeros(m, device=dev)
            self.corr_v = torch.zeros(n, device=dev)  # c - c^k for this round
            self.corr_alpha = torch.zeros(m, device=dev)

    # -- stage -------------------------------------------------------------------
    def set_reference(self, reference: np.ndarray) -> None:
        """Set the proximal centre v_ref of the stage that starts."""
        with torch.no_grad():
            self.prox_ref.copy_(torch.from_numpy(reference)).mul_(self.prox_weight)

    def reset_control_variate(self) -> None:
        if self.control_variates:
            self.c_v.zero_()
            self.c_alpha.zero_()

    # -- round -------------------------------------------------------------------
    def begin(self, state: GlobalState) -> None:
        """Start a round from the global state (and compute this round's correction c - c^k)."""
        self._change = False
        if not self.control_variates:
            self.flat.load(state)
            return
        if state.c_v is None or state.c_alpha is None:
            raise ValueError("the algorithm uses control variates but the global state carries none")
        # the global c lands in corr (one crossing with the state), then corr = c - c^k on the device
        self.flat.load(state, also=[(state.c_v, self.corr_v), (state.c_alpha, self.corr_alpha)])
        with torch.no_grad():
            self.v_start.copy_(self.flat.v)  # the start point is needed only for the c^k update in end()
            self.alpha_start.copy_(self.flat.alpha)
            self.corr_v.sub_(self.c_v)
            self.corr_alpha.sub_(self.c_alpha)

    def step(self, x: torch.Tensor, y: torch.Tensor, lr: float) -> torch.Tensor:
        """One local step; returns the minibatch objective (a detached tensor, no device sync)."""
        flat = self.flat
        flat.grad.zero_()
        flat.alpha.grad.zero_()
        loss = self.objective(flat.forward(x), y, flat.a, flat.b, flat.alpha)
        flat.precision.backward(loss)
        flat.precision.step(lambda: self._apply(lr), self._scaled_params)
        return loss.detach()

    def _scaled_params(self) -> list[torch.Tensor]:
        """The gradients a loss scaler unscales: one tensor over the whole flat gradient, and alpha's."""
        whole = torch.nn.Parameter(self.flat.v, requires_grad=False)  # shares flat.v's storage
        whole.grad = self.flat.grad
        return [whole, self.flat.alpha]

    def _apply(self, lr: float) -> None:
        """The step of the module docstring, from the gradients in the flat buffers."""
        flat = self.flat
        with torch.no_grad():
            d = flat.grad
            if self.grad_clip is not None:
                d[: flat.num_weights].clamp_(-self.grad_clip, self.grad_clip)
            pull = self.prox_weight + self.weight_decay
            if pull:
                d.add_(flat.v, alpha=pull)
            if self.prox_weight:
                d.sub_(self.prox_ref)
            if self.control_variates:
                d.add_(self.corr_v)
            flat.v.add_(d, alpha=-lr)
            if flat.aux_size:
                g_alpha = flat.alpha.grad
                if self.control_variates:
                    g_alpha.add_(self.corr_alpha)
                flat.alpha.add_(g_alpha, alpha=lr)
                if self.objective.alpha_nonnegative:
                    flat.alpha.clamp_(min=0)

    def end(self, steps: int, lr: float) -> None:
        """Update c^k from the round's movement (no-op without control variates)."""
        self._end(steps, lr, change=False)

    def end_sampled(self, steps: int, lr: float) -> None:
        """:meth:`end` of a round of sampled clients: keeps the change c^k_new - c^k_old for :meth:`export`."""
        self._end(steps, lr, change=True)

    def _end(self, steps: int, lr: float, *, change: bool) -> None:
        self._change = change and self.control_variates
        if not self.control_variates:
            return
        scale = 1.0 / (steps * lr)
        with torch.no_grad():
            # c^k - c + (v_start - v_end)/(I eta): c^k - c is -corr.
            self.v_start.sub_(self.flat.v)
            self.alpha_start.sub_(self.flat.alpha)
            if not change:
                self.c_v.copy_(self.corr_v).neg_().add_(self.v_start, alpha=scale)
                self.c_alpha.copy_(self.corr_alpha).neg_().sub_(self.alpha_start, alpha=scale)
                return
            # c^k_new into corr (used up), the change into v_start / alpha_start, then c^k <- c^k_new
            self.corr_v.neg_().add_(self.v_start, alpha=scale)
            self.corr_alpha.neg_().sub_(self.alpha_start, alpha=scale)
            torch.sub(self.corr_v, self.c_v, out=self.v_start)
            torch.sub(self.corr_alpha, self.c_alpha, out=self.alpha_start)
            self.c_v.copy_(self.corr_v)
            self.c_alpha.copy_(self.corr_alpha)

    def export(self, *, copy: bool = True) -> tuple[np.ndarray, ...]:
        """The round's end point and what the server needs of c^k, in one pass to the host:
        (v, alpha, buffers, counters, c_v, c_alpha), where c is c^k, or its change after
        :meth:`end_sampled`, or None without control variates."""
        if not self.control_variates:
            return (*self.flat.export(copy=copy), None, None)
        cv = (self.v_start, self.alpha_start) if self._change else (self.c_v, self.c_alpha)
        return self.flat.export(copy=copy, also=cv)

    def control_variate(self, *, copy: bool = True) -> tuple[np.ndarray, np.ndarray] | None:
        """c^k as numpy arrays (copies, or with ``copy=False`` views where it lives on the CPU)."""
        if not self.control_variates:
            return None
        c_v, c_alpha = self.c_v.detach().cpu().numpy(), self.c_alpha.detach().cpu().numpy()
        return (c_v.copy(), c_alpha.copy()) if copy else (c_v, c_alpha)

    def set_control_variate(self, c_v: np.ndarray, c_alpha: np.ndarray) -> None:
        if self.control_variates:
            with torch.no_grad():
                self.c_v.copy_(torch.from_numpy(np.asarray(c_v, dtype=np.float32)))
                self.c_alpha.copy_(torch.from_numpy(np.asarray(c_alpha, dtype=np.float32)))
