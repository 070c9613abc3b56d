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
stage lengths and step sizes in :mod:`fdam_ray.core.schedules` (s.5), the state
vectors in :mod:`fdam_ray.core.state`.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

from fdam_ray.algorithms.base import Algorithm, Preset
from fdam_ray.algorithms.local import LocalSolver
from fdam_ray.algorithms.presets import PRESETS
from fdam_ray.algorithms.server import PartialSum, RoundReducer
from fdam_ray.algorithms.stages import ServerState
from fdam_ray.pauc import PAUC_OBJECTIVES
from fdam_ray.settings.sections import AT_LEAST_ONE, FRACTION, NONNEGATIVE, POSITIVE, Section, fail, setting, shared

__all__ = ["PRESETS", "Algorithm", "AlgorithmSection", "LocalSolver", "PartialSum", "Preset", "RoundReducer",
           "ServerState", "build_algorithm"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class AlgorithmSection(Section):
    """The config fields that define the algorithm: objective, drift correction and the server's step."""

    name = "algorithm"

    algorithm: str = setting("codasca", "Named preset: objective x drift correction (docs/algorithms.md s.4).",
                             choices=tuple(PRESETS))
    objective: str | None = setting(None, "Loss: auc_square (paper eq. 2), auc_margin (AUC-M), bce, or for partial "
                                    "AUC pauc_one_way (FPR <= beta: AUC-M over KL-DRO-weighted negatives) or "
                                    "pauc_two_way (also TPR >= alpha: weighted positives), their global weights "
                                    "from summed training-score counts (docs/algorithms.md s.1b); default from the "
                                    "algorithm preset.", choices=("auc_square", "auc_margin", "bce", *PAUC_OBJECTIVES))
    margin: float = setting(1.0, "m, the margin of auc_margin and of the pAUC objectives.", check=POSITIVE)
    pauc_temperature: float = setting(0.1, "lambda of pauc_one_way / pauc_two_way: a negative scored h weighs "
                                      "exp(h / lambda) / Z (a positive exp(-h / lambda) / Z+); smaller = harder "
                                      "examples only, large = AUC-M.", check=POSITIVE,
                                      aliases=("pauc_lambda",))
    num_clients: int = setting(4, "K, number of federated clients.", check=AT_LEAST_ONE,
                               aliases=("clients", "n_clients", "k"))
    clients_per_round: int | None = setting(None, "S, clients sampled (uniformly, without replacement, seeded by "
                                            "seed and round; under dp by the privacy secret, never seed) to take "
                                            "part in each round; null = all K.",
                                            check=AT_LEAST_ONE)
    client_weighting: str = setting("uniform", "Weights of the server's means and CODA's alpha: uniform (1/K, the "
                                    "paper) or samples (n_k / n, the objective of the pooled data).",
                                    choices=("uniform", "samples"))
    global_lr: float = setting(1.0, "eta_g, server extrapolation; 1 is plain averaging.", check=POSITIVE,
                               aliases=("global_learning_rate", "server_lr", "eta_g"))
    prox_weight: float = setting(0.002, "gamma, weight of the proximal term towards the stage reference (fedprox, "
                                 "fedprox_auc: towards the round's start, FedProx's mu).",
                                 check=NONNEGATIVE, aliases=("gamma",))
    weight_decay: float = setting(0.0, "wd, L2 weight decay on v.", check=NONNEGATIVE)
    grad_clip: float | None = setting(None, "Element-wise clip of the model gradient to [-clip, clip]; null = off.",
                                      check=POSITIVE)
    positive_ratio: float | None = setting(None, "p in the objective; null = global positive ratio from client "
                                           "counts.", check=FRACTION, aliases=("p",))
    reference_point: str = setting("average", "Proximal centre of the next stage: average of the stage's "
                                   "round-end global iterates, or the last one.", choices=("average", "last"))
    reset_control_variates: bool = setting(True, "Zero the control variates at each stage start.")
    dp: str = shared()

    def check(self) -> None:
        preset = PRESETS[self.algorithm]
        if self.objective not in preset.objectives:
            raise fail("objective", self.objective,
                       f"algorithm '{self.algorithm}' takes one of {', '.join(preset.objectives)}")
        if self.objective in PAUC_OBJECTIVES and self.dp != "off":
            raise fail("objective", self.objective, f"not with dp: {self.dp} (its training-score counts are not "
                       "noised); one of auc_square, auc_margin")
        if self.clients_per_round is not None and self.clients_per_round > self.num_clients:
            raise fail("clients_per_round", self.clients_per_round,
                       f"at most num_clients = {self.num_clients}, or null for all")


class NamesAlgorithm(Protocol):
    """A section that names an algorithm: the algorithm's own, or a client's (which shares its fields)."""

    @property
    def algorithm(self) -> str: ...

    @property
    def objective(self) -> str | None: ...


def build_algorithm(section: NamesAlgorithm) -> Algorithm:
    """The algorithm a config section names (the algorithm's section, or a client's), built as its family's class
    with the hyperparameters the section carries (a client's section has no server fields: those keep their
    neutral defaults)."""
    if section.objective is None:
        raise ValueError("the algorithm section has no objective (build the config with build_config)")
    chosen = PRESETS[section.algorithm]
    hyper = {f.name: getattr(section, f.name) for f in dataclasses.fields(Algorithm)
             if f.name not in ("preset", "objective_name") and hasattr(section, f.name)}
    return chosen.family(chosen, section.objective, **hyper)
