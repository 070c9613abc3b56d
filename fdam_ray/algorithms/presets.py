"""The named algorithms as compositions: objective x drift correction x schedule.

Yuan et al., "Federated Deep AUC Maximization for Heterogeneous Data with a
Constant Communication Complexity", ICML 2021; table in docs/algorithms.md s.4.
A preset only chooses; the loop, the local step and the server update are the
same code for all of them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

AUC_OBJECTIVES = ("auc_square", "auc_margin")


@dataclasses.dataclass(frozen=True)
class Preset:
    """What a named algorithm fixes.

    Attributes:
        objectives: objectives the algorithm may use (the first is its default).
        control_variates: SCAFFOLD-style drift correction on v and alpha (CODASCA lines).
        recompute_alpha: at each stage end set alpha to its closed-form optimum
            from the current model (CODA).
        defaults: config values used when the user leaves the field unset.
        fixed: config values the algorithm requires (a different user value is an error).
    """

    name: str
    objectives: tuple[str, ...]
    control_variates: bool
    recompute_alpha: bool
    defaults: Mapping[str, Any]
    fixed: Mapping[str, Any]
    summary: str


def _preset(name, objectives, control_variates, summary, recompute_alpha=False, defaults=None, fixed=None):
    defaults = {"objective": objectives[0], **(defaults or {})}
    return Preset(name, objectives, control_variates, recompute_alpha,
                  MappingProxyType(defaults), MappingProxyType(fixed or {}), summary)


PRESETS: Mapping[str, Preset] = MappingProxyType({
    p.name: p
    for p in (
        _preset("codasca", AUC_OBJECTIVES, True,
                "CODASCA: local primal-dual steps with control variates on v and alpha, server step eta_g."),
        _preset("coda_plus", AUC_OBJECTIVES, False,
                "CODA+: local primal-dual steps, periodic averaging of v and alpha."),
        _preset("npa", AUC_OBJECTIVES, False,
                "Naive parallel algorithm: averaging after every step (I = 1) with local batch M.",
                fixed={"local_steps": 1, "schedule": "stagewise"}),
        _preset("coda", AUC_OBJECTIVES, False,
                "CODA: CODA+ plus alpha recomputed in closed form from v at every stage end.",
                recompute_alpha=True),
        _preset("fedavg", ("bce",), False, "FedAvg with binary cross-entropy.",
                defaults={"prox_weight": 0.0}),
        _preset("scaffold", ("bce",), True, "SCAFFOLD (option II control variates) with binary cross-entropy.",
                defaults={"prox_weight": 0.0, "reset_control_variates": False}),
        _preset("centralized", ("auc_square", "auc_margin", "bce"), False,
                "One client holding all the data (PESG-style reference).",
                fixed={"num_clients": 1}),
    )
})
