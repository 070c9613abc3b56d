"""Client side of a round: init (load the global state), step (docs/algorithms.md s.2), final (control variate).

One local step, with g the minibatch gradients at (v, alpha):

    d_v    = clip(g_w), g_a, g_b  +  gamma (v - v_ref)  +  wd v
    u     <- mu u + d_v        (only with momentum mu > 0; u is the client's own, kept across rounds)
    v     <- v - eta (u + correction)      (d_v in place of u without momentum)
    alpha <- alpha + eta (g_alpha + correction), then max(alpha, 0) for auc_margin

The correction is added after the momentum, not fed into it: c^k, which
estimates the client's mean step direction from its displacement over the round
(v_{r-1} - v^k) / (I eta), then estimates the mean of u, and the corrected step
is u + c - c^k. Fed into u, a correction would be amplified by 1 / (1 - mu) and
come back in the next c^k (at mu 0.9 every CODASCA run diverged on digits-IH).
Adam (``local_optimizer: adam``, pre-training) takes the place of the momentum.
The correction is the drift-correction strategy's (:mod:`.drift`): c - c^k
with control variates (CODASCA, SCAFFOLD), nothing without (CODA+, FedAvg),
and at the round's end that strategy updates c^k. The proximal centre v_ref is
the stage's reference point (CODA+, CODASCA: ``proximal="stage"``) or the point
the round started from (FedProx: ``proximal="round"``).

The solver holds the math only: mixed precision and loss scaling wrap it from
the replica that runs it (:meth:`fdam_ray.clients.client.TrainingReplica.train_step`).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch

from fdam_ray.algorithms.drift import ClientCorrection, ClientVariate
from fdam_ray.core.flat import FlatModel
from fdam_ray.core.state import GlobalState, reads_store_arrays, vector_names
from fdam_ray.objectives import Objective
from fdam_ray.optim import dual_ascent_, heavy_ball_, primal_direction_
from fdam_ray.settings.sections import Section, fail, setting, shared

reads_store_arrays(__name__)  # a stage's reference point from the object store is only copied in

PROXIMAL_CENTRES = ("stage", "round")
LOCAL_OPTIMIZERS = ("sgd", "adam")
ADAM_BETAS = (0.9, 0.999)  # torch's defaults
ADAM_EPS = 1e-8

# A client's own moments of its local step: (u,) with momentum, (m, s, t) with Adam, None for plain SGD.
LocalMoments = tuple[torch.Tensor, ...] | None


@dataclasses.dataclass(frozen=True, kw_only=True)
class LocalStepSection(Section):
    """The config fields of the clients' local step beyond the algorithm's (how v moves, not what it optimises)."""

    name = "local_step"

    momentum: float = setting(0.0, "mu, heavy-ball momentum of the local primal step (u <- mu u + d_v, v <- v - "
                              "eta u, the drift correction added after; u is each client's own, kept across rounds "
                              "and checkpointed; lr x (1 - mu) keeps the step size); 0 = plain SGD.",
                              check=(lambda v: 0 <= v < 1, "in [0, 1)"))
    local_optimizer: str = setting("sgd", "Local step: sgd (the primal-dual step, with momentum) or adam (Adam on "
                                   "the network; bce objectives only, as in pre-training).",
                                   choices=LOCAL_OPTIMIZERS)
    objective: str | None = shared()

    def check(self) -> None:
        if self.local_optimizer == "adam" and self.objective != "bce":
            raise fail("local_optimizer", self.local_optimizer,
                       f"adam takes objective bce (pre-training); objective {self.objective} takes sgd")
        if self.local_optimizer == "adam" and self.momentum:
            raise fail("momentum", self.momentum, "0 with local_optimizer adam (Adam has its own moments)")


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
        self.local_optimizer, self.momentum = "sgd", 0.0
        self.moments: LocalMoments = None  # the bound client's

    # -- the local step's optimiser -----------------------------------------------------
    def set_local_step(self, local_optimizer: str, momentum: float) -> None:
        """Choose the step on v: ``sgd`` (with heavy-ball ``momentum`` when > 0) or ``adam`` (a bce objective)."""
        if local_optimizer not in LOCAL_OPTIMIZERS:
            raise ValueError(f"local_optimizer {local_optimizer!r} is not one of {', '.join(LOCAL_OPTIMIZERS)}")
        if local_optimizer == "adam" and self.flat.aux_size:
            raise ValueError("local_optimizer adam takes the bce objective (it has no dual step)")
        self.local_optimizer, self.momentum = local_optimizer, float(momentum)

    def new_moments(self) -> LocalMoments:
        """A client's own zero moments for the chosen step (None for plain SGD: nothing to keep)."""
        zeros = lambda: torch.zeros(self.flat.state_size, device=self.flat.device)
        if self.local_optimizer == "adam":
            return zeros(), zeros(), torch.zeros(1, device=self.flat.device)
        return (zeros(),) if self.momentum else None

    def bind_moments(self, moments: LocalMoments) -> None:
        self.moments = moments

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
            primal_direction_(d, flat.v, prox_weight=self.prox_weight, weight_decay=self.weight_decay,
                              prox_ref=self.prox_ref)
            if self.local_optimizer == "adam":
                d.copy_(self._adam_direction(d))
            elif self.momentum:
                d.copy_(heavy_ball_(self._moments()[0], d, self.momentum))
            self.correction.correct_v(d)
            flat.v.add_(d, alpha=-lr)
            if flat.aux_size:
                g_alpha = flat.alpha_grad
                self.correction.correct_alpha(g_alpha)
                dual_ascent_(flat.alpha, g_alpha, lr, nonnegative=self.objective.alpha_nonnegative)

    def _moments(self) -> tuple[torch.Tensor, ...]:
        if self.moments is None:
            raise RuntimeError("the local step has moments but no client's were bound (bind_moments)")
        return self.moments

    def _adam_direction(self, d: torch.Tensor) -> torch.Tensor:
        """Adam's direction from d (torch's single-tensor formula, L2 decay and prox already in d): the step is
        -lr times it."""
        m, s, t = self._moments()
        beta1, beta2 = ADAM_BETAS
        t.add_(1)
        step = float(t.item())
        m.mul_(beta1).add_(d, alpha=1 - beta1)
        s.mul_(beta2).addcmul_(d, d, value=1 - beta2)
        denom = (s.sqrt() / math.sqrt(1 - beta2**step)).add_(ADAM_EPS)
        return (m / denom).div_(1 - beta1**step)

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
