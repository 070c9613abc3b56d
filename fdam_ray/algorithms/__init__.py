"""Algorithms as modules: one family per module, one protocol (docs/algorithms.md s.4).

- :mod:`.base`: the protocol (:class:`Algorithm`: server init/apply, client
  init/step/final, stage end) and :class:`Preset`;
- families: :mod:`.coda` (CODA+, CODASCA, NPA, CODA, centralized),
  :mod:`.fedavg` (FedAvg, SCAFFOLD), :mod:`.fedprox` (FedProx),
  :mod:`.fedprox_auc` (FedProx-AUC); :mod:`.presets` gathers their presets;
- parts they share: :mod:`.drift` (drift correction as a strategy: none or
  control variates), :mod:`.local` (the local step, s.2), :mod:`.server` (the
  server step and the one partial-sum format, s.3, s.3b), :mod:`.stages`
  (stage transitions, s.5), :mod:`.sampling` (client sampling and weights, s.3b).

The objectives and p live in :mod:`fdam_ray.objectives` (s.1), the schedules'
stage lengths and step sizes in :mod:`fdam_ray.schedules` (s.5), the state
vectors in :mod:`fdam_ray.state`.
"""

from __future__ import annotations

import dataclasses

from fdam_ray.algorithms.base import Algorithm, Preset
from fdam_ray.algorithms.local import LocalSolver
from fdam_ray.algorithms.presets import PRESETS
from fdam_ray.algorithms.server import PartialSum, RoundReducer
from fdam_ray.algorithms.stages import ServerState
from fdam_ray.sections import Section

__all__ = ["PRESETS", "Algorithm", "AlgorithmSection", "LocalSolver", "PartialSum", "Preset", "RoundReducer",
           "ServerState", "build_algorithm"]


@dataclasses.dataclass(frozen=True)
class AlgorithmSection(Section):
    """The config fields that define the algorithm (see ``fdam fields`` for each one's meaning)."""

    algorithm: str
    objective: str | None
    margin: float
    global_lr: float
    prox_weight: float
    weight_decay: float
    grad_clip: float | None
    positive_ratio: float | None
    reference_point: str
    reset_control_variates: bool
    clients_per_round: int | None
    client_weighting: str


def build_algorithm(section: object) -> Algorithm:
    """The algorithm a config section names, built as its family's class with the hyperparameters the section
    carries (a client's section has no server fields: those keep their neutral defaults)."""
    name = getattr(section, "algorithm")  # noqa: B009 (any section with the algorithm's fields)
    objective = getattr(section, "objective")  # noqa: B009
    if objective is None:
        raise ValueError("the algorithm section has no objective (build the config with build_config)")
    chosen = PRESETS[name]
    hyper = {f.name: getattr(section, f.name) for f in dataclasses.fields(Algorithm)
             if f.name not in ("preset", "objective_name") and hasattr(section, f.name)}
    return chosen.family(chosen, objective, **hyper)
