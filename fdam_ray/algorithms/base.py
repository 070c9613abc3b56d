"""The algorithm protocol: one class per family, in fedjax's split of server init/apply and client init/step/final.

An algorithm is an objective x a drift correction x a proximal centre x a
schedule (docs/algorithms.md s.4). A *family* is a module under
:mod:`fdam_ray.algorithms` with a subclass of :class:`Algorithm` and the named
presets it offers; a preset only chooses (objective, drift correction, default
and fixed config values). The phases, and where each runs:

- server init (:meth:`Algorithm.init`): the :class:`ServerState` of round 0;
- client init / step / final (:meth:`Algorithm.solver`, a :class:`LocalSolver`:
  ``begin``, ``loss`` + ``apply``, ``end``), on every client of a round;
- server apply (:meth:`Algorithm.reducer`, then :meth:`Algorithm.after_round`):
  the round's weighted means, eta_g and projection, folded as updates arrive;
- stage end (:meth:`Algorithm.end_stage`): the next proximal centre, control
  variates reset, and a family's own hook (CODA's closed-form alpha).

What travels is the state vectors of :class:`fdam_ray.core.state.StateVectors`;
the drift correction decides whether the control variates are among them.
Adding a family is one module that subclasses :class:`Algorithm`, overrides what
differs and lists its presets, plus its import in :mod:`.presets`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any, ClassVar

import numpy as np

from fdam_ray.algorithms.drift import DRIFT_CORRECTIONS, DriftCorrection
from fdam_ray.algorithms.local import LocalSolver
from fdam_ray.algorithms.sampling import ClientSampler, client_weights
from fdam_ray.algorithms.server import RoundReducer, ServerStep
from fdam_ray.algorithms.stages import ServerState, after_round, after_rounds, coda_alpha, end_stage, init_server_state
from fdam_ray.core.flat import FlatModel
from fdam_ray.core.state import GlobalState, ScoreSums
from fdam_ray.objectives import Objective
from fdam_ray.pauc import PAUC_OBJECTIVES

AUC_OBJECTIVES = ("auc_square", "auc_margin")
PRIMAL_DUAL_OBJECTIVES = (*AUC_OBJECTIVES, *PAUC_OBJECTIVES)  # the pAUC ones: fdam_ray/pauc.py


@dataclasses.dataclass(frozen=True)
class Preset:
    """What a named algorithm fixes.

    Attributes:
        name: the config's ``algorithm`` value.
        family: the :class:`Algorithm` subclass that runs it.
        objectives: objectives the algorithm may use (the first is its default).
        drift: the drift correction (``none`` or ``control_variates``).
        defaults: config values used when the user leaves the field unset.
        fixed: config values the algorithm requires (a different user value is an error).
        summary: one line for ``fdam fields`` and the docs.
    """

    name: str
    family: type[Algorithm]
    objectives: tuple[str, ...]
    drift: str
    summary: str
    defaults: Mapping[str, Any] = dataclasses.field(default_factory=lambda: MappingProxyType({}))
    fixed: Mapping[str, Any] = dataclasses.field(default_factory=lambda: MappingProxyType({}))

    @property
    def control_variates(self) -> bool:
        return DRIFT_CORRECTIONS[self.drift].control_variates


def preset(name: str, family: type[Algorithm], objectives: tuple[str, ...], drift: str, summary: str, *,
           defaults: Mapping[str, Any] | None = None, fixed: Mapping[str, Any] | None = None) -> Preset:
    """A preset whose default objective is the first of ``objectives``."""
    if drift not in DRIFT_CORRECTIONS:
        raise ValueError(f"drift correction {drift!r} is not one of {', '.join(DRIFT_CORRECTIONS)}")
    return Preset(name, family, objectives, drift, summary,
                  MappingProxyType({"objective": objectives[0], **(defaults or {})}), MappingProxyType(fixed or {}))


@dataclasses.dataclass(frozen=True)
class Algorithm:
    """A family's algorithm with its hyperparameters (built from a config by :func:`fdam_ray.algorithms.build`).

    The server-side fields have neutral defaults, so a client, which receives only the client's part of the
    config, builds the same algorithm and uses its client phases.
    """

    # the centre of the proximal term: the stage's reference point, or where the round started (FedProx)
    proximal: ClassVar[str] = "stage"
    # whether the stage end needs the clients' score sums (CODA's closed-form alpha)
    needs_score_sums: ClassVar[bool] = False

    preset: Preset
    objective_name: str
    margin: float = 1.0
    pauc_temperature: float = 0.1
    prox_weight: float = 0.0
    weight_decay: float = 0.0
    grad_clip: float | None = None
    client_weighting: str = "uniform"
    global_lr: float = 1.0
    reference_point: str = "average"
    reset_control_variates: bool = True
    clients_per_round: int | None = None

    @property
    def drift(self) -> DriftCorrection:
        return DRIFT_CORRECTIONS[self.preset.drift]

    @property
    def control_variates(self) -> bool:
        return self.drift.control_variates

    # -- client side: init / step / final ----------------------------------------------
    def objective(self, num_tasks: int) -> Objective:
        return Objective(self.objective_name, num_tasks=num_tasks, margin=self.margin,
                         temperature=self.pauc_temperature)

    def solver(self, flat: FlatModel, objective: Objective) -> LocalSolver:
        """The client phases on one model replica (the drift correction's client half inside)."""
        return LocalSolver(flat, objective, correction=self.drift.client(flat), prox_weight=self.prox_weight,
                           weight_decay=self.weight_decay, grad_clip=self.grad_clip, proximal=self.proximal)

    # -- server side: init / apply ---------------------------------------------------------
    def init(self, initial: GlobalState) -> ServerState:
        """The server state before round 1: ``initial`` with what the drift correction keeps (zero global c)."""
        self.drift.init(initial)
        return init_server_state(initial)

    def sampler(self, num_clients: int, key: int, *, secret: bool = False) -> ClientSampler:
        """Who takes part in each round (client sampling): S of ``num_clients`` drawn by the public seed ``key``,
        or with ``secret`` by the privacy secret ``key`` (:mod:`.sampling`)."""
        return ClientSampler(num_clients, self.clients_per_round, key, secret)

    def weights(self, num_train: Sequence[int]) -> np.ndarray | None:
        """w_k by client id for the server's means and CODA's alpha (None: uniform)."""
        return client_weights(self.client_weighting, num_train)

    def reducer(self, previous: GlobalState, *, weights: np.ndarray | None = None,
                partial_total: float | None = None) -> RoundReducer:
        """The round's reducer; ``partial_total`` (all clients' total weight) for a round of sampled clients."""
        step = self._step()
        return RoundReducer(previous, global_lr=step.global_lr, alpha_nonnegative=step.alpha_nonnegative,
                            control_variates=step.control_variates, weights=weights, partial_total=partial_total)

    def server_step(self) -> ServerStep | None:
        """The server step as settings that can run where the clients are (the collective transport's members),
        or None for a family with a reducer of its own (the step then stays on the driver)."""
        return self._step() if type(self).reducer is Algorithm.reducer else None

    def _step(self) -> ServerStep:
        return ServerStep(global_lr=self.global_lr, alpha_nonnegative=self.objective_name in ("auc_margin",
                                                                                            *PAUC_OBJECTIVES),
                          control_variates=self.control_variates)

    def after_round(self, server: ServerState, new_state: GlobalState) -> ServerState:
        return after_round(server, new_state, reference_point=self.reference_point)

    def after_rounds(self, server: ServerState, new_state: GlobalState, v_sum: np.ndarray | None,
                     count: int) -> ServerState:
        """After a run of ``count`` rounds (``v_sum``: the sum of their v, needed with ``average``)."""
        return after_rounds(server, new_state, v_sum, count, reference_point=self.reference_point)

    def before_round(self, executor: Any, loop: Any, positive_ratio: np.ndarray) -> None:
        """At the start of a round (or of a run of rounds) from ``loop.state``: under a pAUC objective the count
        pass of the sites' training scores and their new global normaliser (:func:`fdam_ray.pauc.refresh`; its
        bytes are added to the loop's); nothing otherwise."""
        if self.objective_name in PAUC_OBJECTIVES:
            from fdam_ray.pauc import refresh

            down, up = refresh(executor, loop.state, positive_ratio, self.objective_name, self.pauc_temperature)
            loop.bytes_down += down
            loop.bytes_up += up

    # -- stage end ---------------------------------------------------------------------------
    def stage_alpha(self, sums: Sequence[ScoreSums], positive_ratio: np.ndarray,
                    weights: np.ndarray | None = None) -> np.ndarray | None:
        """A new global alpha from the clients' score sums at a stage end, or None to keep it (the default)."""
        return None

    def end_stage(self, server: ServerState, *, alpha: np.ndarray | None = None) -> ServerState:
        server = end_stage(server, reference_point=self.reference_point, alpha=alpha)
        self.drift.end_stage(server.global_state, reset=self.reset_control_variates)
        return server


def closed_form_stage_alpha(algorithm: Algorithm, sums: Sequence[ScoreSums], positive_ratio: np.ndarray,
                            weights: np.ndarray | None) -> np.ndarray:
    """CODA's closed-form alpha for ``algorithm``'s objective (see :func:`.stages.coda_alpha`)."""
    return coda_alpha(sums, objective=algorithm.objective_name, margin=algorithm.margin,
                      positive_ratio=positive_ratio, weights=weights)
