"""An algorithm = objective x drift correction x schedule (ALGORITHMS.md s.4).

:class:`Algorithm` reads those choices off a config and builds the pieces the
client (:class:`LocalSolver`) and the server (:class:`RoundReducer`) run; the
schedule lives in :mod:`fdam_ray.schedules`.
"""

from __future__ import annotations

import dataclasses

from fdam_ray.algorithms.local import LocalSolver
from fdam_ray.algorithms.presets import PRESETS, Preset
from fdam_ray.algorithms.server import RoundReducer
from fdam_ray.flat import FlatModel
from fdam_ray.objectives import Objective
from fdam_ray.state import GlobalState

__all__ = ["PRESETS", "Algorithm", "LocalSolver", "Preset", "RoundReducer"]


@dataclasses.dataclass(frozen=True)
class Algorithm:
    preset: Preset
    objective_name: str
    margin: float
    global_lr: float
    prox_weight: float
    weight_decay: float
    grad_clip: float | None

    @classmethod
    def from_config(cls, config) -> Algorithm:
        return cls(PRESETS[config.algorithm], config.objective, config.margin, config.global_lr,
                   config.prox_weight, config.weight_decay, config.grad_clip)

    @property
    def control_variates(self) -> bool:
        return self.preset.control_variates

    @property
    def recompute_alpha(self) -> bool:
        return self.preset.recompute_alpha

    def objective(self, num_tasks: int) -> Objective:
        return Objective(self.objective_name, num_tasks=num_tasks, margin=self.margin)

    def solver(self, flat: FlatModel, objective: Objective) -> LocalSolver:
        return LocalSolver(flat, objective, control_variates=self.control_variates, prox_weight=self.prox_weight,
                           weight_decay=self.weight_decay, grad_clip=self.grad_clip)

    def reducer(self, previous: GlobalState) -> RoundReducer:
        return RoundReducer(previous, global_lr=self.global_lr,
                            alpha_nonnegative=self.objective_name == "auc_margin",
                            control_variates=self.control_variates)
