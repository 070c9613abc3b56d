"""Client side of a round: init (load the global state), step (docs/algorithms.md s.2), final (control variate).

One local step, with g the minibatch gradients at (v, alpha):

    d_v    = clip(g_w), g_a, g_b  +  gamma (v - v_ref)  +  wd v  +  correction
    v     <- v - eta d_v
    alpha <- alpha + eta (g_alpha + correction), then max(alpha, 0) for auc_margin

The correction is the drift-correction strategy's (:mod:`.drift`): c - c^k
with control variates (CODASCA, SCAFFOLD), nothing without (CODA+, FedAvg),
and at the round's end that strategy updates c^k. The proximal centre v_ref is
the stage's reference point (CODA+, CODASCA: ``proximal="stage"``) or the point
the round started from (FedProx: ``proximal="round"``).

The solver holds the math only: mixed precision and loss scaling wrap it from
the replica that runs it (:meth:`fdam_ray.client.TrainingReplica.train_step`).
"""

from __future__ import annotations

import numpy as np
import torch

from fdam_ray.algorithms.drift import ClientCorrection, ClientVariate
from fdam_ray.flat import FlatModel
from fdam_ray.objectives import Objective
from fdam_ray.state import GlobalState, vector_names

PROXIMAL_CENTRES = ("stage", "round")


class LocalSolver:
    """Local primal-descent / dual-ascent steps on a :class:`FlatModel`.

    Args:
        flat: the client's model replica in flat storage.
        objective: the minibatch objective (p already set).
        correction: the client half of the drift correction.
        prox_weight: gamma (FedProx's mu).
        weight_decay: wd.
        grad_clip: element-wise clip of the network's gradient (None = off).
        proximal: the proximal term's centre: ``stage`` (the stage's reference point, set by
            :meth:`set_reference`) or ``round`` (the global state the round starts from).
    """

    def __init__(
        self,
        flat: FlatModel,
        objective: Objective,
        *,
        correction: ClientCorrection,
        prox_weight: float,
        weight_decay: float,
        grad_clip: float | None,
        proximal: str = "stage",
    ) -> None:
        if proximal not in PROXIMAL_CENTRES:
            raise ValueError(f"proximal centre {proximal!r} is not one of {', '.join(PROXIMAL_CENTRES)}")
        self.flat = flat
        self.objective = objective
        self.correction = correction
        self.prox_weight = prox_weight
        self.weight_decay = weight_decay
        self.grad_clip = grad_clip
        self.proximal = proximal
        self.prox_ref = torch.zeros(flat.state_size, device=flat.device)  # gamma * v_ref

    # -- stage -------------------------------------------------------------------
    def set_reference(self, reference: np.ndarray) -> None:
        """Set the proximal centre v_ref of the stage that starts (unused when the centre is the round's start)."""
        if self.proximal == "stage":
            with torch.no_grad():
                self.prox_ref.copy_(torch.from_numpy(reference)).mul_(self.prox_weight)

    # -- round: init, step, final ---------------------------------------------------
    def begin(self, state: GlobalState) -> None:
        """Start a round from the global state (the correction computes this round's terms)."""
        self.correction.begin(self.flat, state)
        if self.proximal == "round" and self.prox_weight:
            with torch.no_grad():
                self.prox_ref.copy_(self.flat.v).mul_(self.prox_weight)

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The minibatch objective at the current point, gradients zeroed for its backward pass."""
        flat = self.flat
        flat.grad.zero_()
        flat.alpha_grad.zero_()
        return self.objective(flat.forward(x), y, flat.a, flat.b, flat.alpha)

    def scaled_params(self) -> list[torch.Tensor]:
        """The tensors whose gradients a loss scaler unscales: one over the whole flat gradient, and alpha."""
        whole = torch.nn.Parameter(self.flat.v, requires_grad=False)  # shares flat.v's storage
        whole.grad = self.flat.grad
        return [whole, self.flat.alpha]

    def apply(self, lr: float) -> None:
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
            self.correction.correct_v(d)
            flat.v.add_(d, alpha=-lr)
            if flat.aux_size:
                g_alpha = flat.alpha_grad
                self.correction.correct_alpha(g_alpha)
                flat.alpha.add_(g_alpha, alpha=lr)
                if self.objective.alpha_nonnegative:
                    flat.alpha.clamp_(min=0)

    def end(self, steps: int, lr: float, *, partial: bool = False) -> None:
        """The round's final phase: the correction updates the client's own state (c^k); in a round of sampled
        clients (``partial``) the change c^k_new - c^k_old is what :meth:`export` sends."""
        self.correction.end(self.flat, steps, lr, change=partial)

    def export(self, *, copy: bool = True) -> dict[str, np.ndarray | None]:
        """The round's end point and what the server needs of the client's own state, in one pass to the host,
        as the state vectors by name (those the algorithm does not use are absent)."""
        # the flat model exports in the vectors' declared order, the correction's tensors last
        return dict(zip(vector_names(), self.flat.export(copy=copy, also=self.correction.exported()), strict=False))

    # -- the bound client's own state ----------------------------------------------------
    def new_variate(self) -> ClientVariate:
        return self.correction.new_variate()

    def bind(self, variate: ClientVariate) -> None:
        self.correction.bind(variate)
