"""An algorithm = objective x drift correction x schedule (docs/algorithms.md s.4).

:class:`Algorithm` is built from the algorithm section of a config and hands
out the pieces each side runs, in the manner of an ``init`` / ``apply`` pair
over named state:

- client side: :meth:`Algorithm.solver` (local steps and the control-variate
  update, :mod:`.local`);
- server side: :meth:`Algorithm.init` (the :class:`ServerState` of round 0),
  :meth:`Algorithm.reducer` (one round's running means and extrapolation,
  :mod:`.server`), :meth:`Algorithm.after_round` and :meth:`Algorithm.end_stage`
  (the stage's reference point, control-variate reset and CODA's alpha,
  :mod:`.stages`).

Where each equation lives: the objectives and p in :mod:`fdam_ray.objectives`
(s.1), the local step and c^k in :mod:`.local` (s.2, s.3 step 2), the server
step in :mod:`.server` (s.3 step 3), stage transitions in :mod:`.stages` (s.5),
the schedules' stage lengths and step sizes in :mod:`fdam_ray.schedules` (s.5),
client sampling and client weights in :mod:`.sampling` (s.3b).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from fdam_ray.algorithms.local import LocalSolver
from fdam_ray.algorithms.presets import PRESETS, Preset
from fdam_ray.algorithms.sampling import client_weights, sample_clients
from fdam_ray.algorithms.server import PartialSum, RoundReducer
from fdam_ray.algorithms.stages import ServerState, after_round, coda_alpha, end_stage, init_server_state
from fdam_ray.flat import FlatModel
from fdam_ray.objectives import Objective
from fdam_ray.sections import AT_LEAST_ONE, FRACTION, NONNEGATIVE, POSITIVE, Section, fail, setting
from fdam_ray.state import GlobalState, Moments

__all__ = ["PRESETS", "Algorithm", "AlgorithmSection", "LocalSolver", "PartialSum", "Preset", "RoundReducer",
           "ServerState"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class AlgorithmSection(Section):
    """The config fields that define the algorithm: objective, drift correction and the server's step."""

    name = "algorithm"

    algorithm: str = setting("codasca", "Named preset: objective x drift correction (docs/algorithms.md s.4).",
                             choices=tuple(PRESETS))
    objective: str | None = setting(None, "Loss: auc_square (paper eq. 2), auc_margin (AUC-M) or bce; default "
                                    "from the algorithm preset.", choices=("auc_square", "auc_margin", "bce"))
    margin: float = setting(1.0, "m, the margin of auc_margin.", check=POSITIVE)
    num_clients: int = setting(4, "K, number of federated clients.", check=AT_LEAST_ONE,
                               aliases=("clients", "n_clients", "k"))
    clients_per_round: int | None = setting(None, "S, clients sampled (uniformly, without replacement, seeded by "
                                            "seed and round) to take part in each round; null = all K.",
                                            check=AT_LEAST_ONE)
    client_weighting: str = setting("uniform", "Weights of the server's means and CODA's alpha: uniform (1/K, the "
                                    "paper) or samples (n_k / n, the objective of the pooled data).",
                                    choices=("uniform", "samples"))
    global_lr: float = setting(1.0, "eta_g, server extrapolation; 1 is plain averaging.", check=POSITIVE,
                               aliases=("global_learning_rate", "server_lr", "eta_g"))
    prox_weight: float = setting(0.002, "gamma, weight of the proximal term towards the stage reference.",
                                 check=NONNEGATIVE, aliases=("gamma",))
    weight_decay: float = setting(0.0, "wd, L2 weight decay on v.", check=NONNEGATIVE)
    grad_clip: float | None = setting(None, "Element-wise clip of the model gradient to [-clip, clip]; null = off.",
                                      check=POSITIVE)
    positive_ratio: float | None = setting(None, "p in the objective; null = global positive ratio from client "
                                           "counts.", check=FRACTION, aliases=("p",))
    reference_point: str = setting("average", "Proximal centre of the next stage: average of the stage's "
                                   "round-end global iterates, or the last one.", choices=("average", "last"))
    reset_control_variates: bool = setting(True, "Zero the control variates at each stage start.")

    def check(self) -> None:
        preset = PRESETS[self.algorithm]
        if self.objective not in preset.objectives:
            raise fail("objective", self.objective,
                       f"algorithm '{self.algorithm}' takes one of {', '.join(preset.objectives)}")
        if self.clients_per_round is not None and self.clients_per_round > self.num_clients:
            raise fail("clients_per_round", self.clients_per_round,
                       f"at most num_clients = {self.num_clients}, or null for all")


@dataclasses.dataclass(frozen=True)
class Algorithm:
    preset: Preset
    objective_name: str
    margin: float
    global_lr: float
    prox_weight: float
    weight_decay: float
    grad_clip: float | None
    reference_point: str = "average"
    reset_control_variates: bool = True
    clients_per_round: int | None = None
    client_weighting: str = "uniform"

    @classmethod
    def from_section(cls, section: AlgorithmSection) -> Algorithm:
        if section.objective is None:
            raise ValueError("the algorithm section has no objective (build the config with build_config)")
        return cls(PRESETS[section.algorithm], section.objective, section.margin, section.global_lr,
                   section.prox_weight, section.weight_decay, section.grad_clip, section.reference_point,
                   section.reset_control_variates, section.clients_per_round, section.client_weighting)

    @property
    def control_variates(self) -> bool:
        return self.preset.control_variates

    @property
    def recompute_alpha(self) -> bool:
        return self.preset.recompute_alpha

    # -- client side -------------------------------------------------------------------
    def objective(self, num_tasks: int) -> Objective:
        return Objective(self.objective_name, num_tasks=num_tasks, margin=self.margin)

    def solver(self, flat: FlatModel, objective: Objective) -> LocalSolver:
        return LocalSolver(flat, objective, control_variates=self.control_variates, prox_weight=self.prox_weight,
                           weight_decay=self.weight_decay, grad_clip=self.grad_clip)

    # -- server side -------------------------------------------------------------------
    def init(self, initial: GlobalState) -> ServerState:
        """The server state before round 1: ``initial`` with zero global c when the algorithm has one."""
        if self.control_variates:
            initial.c_v = np.zeros_like(initial.v)
            initial.c_alpha = np.zeros_like(initial.alpha)
        return init_server_state(initial)

    def participants(self, seed: int, round_: int, num_clients: int) -> list[int] | None:
        """The clients of round ``round_`` (client sampling), or None when every client takes part."""
        return sample_clients(seed, round_, num_clients, self.clients_per_round)

    def weights(self, num_train: Sequence[int]) -> np.ndarray | None:
        """w_k by client id for the server's means and CODA's alpha (None: uniform)."""
        return client_weights(self.client_weighting, num_train)

    def reducer(self, previous: GlobalState, *, weights: np.ndarray | None = None,
                partial_total: float | None = None) -> RoundReducer:
        """The round's reducer; ``partial_total`` (all clients' total weight) for a round of sampled clients."""
        return RoundReducer(previous, global_lr=self.global_lr,
                            alpha_nonnegative=self.objective_name == "auc_margin",
                            control_variates=self.control_variates, weights=weights, partial_total=partial_total)

    def after_round(self, server: ServerState, new_state: GlobalState) -> ServerState:
        return after_round(server, new_state, reference_point=self.reference_point)

    def stage_alpha(self, moments: Sequence[Moments], positive_ratio: np.ndarray,
                    weights: np.ndarray | None = None) -> np.ndarray:
        """CODA's closed-form alpha from the clients' score sums (only for ``recompute_alpha``)."""
        return coda_alpha(moments, objective=self.objective_name, margin=self.margin,
                          positive_ratio=positive_ratio, weights=weights)

    def end_stage(self, server: ServerState, *, alpha: np.ndarray | None = None) -> ServerState:
        return end_stage(server, reference_point=self.reference_point,
                         reset_control_variates=self.reset_control_variates, alpha=alpha)
