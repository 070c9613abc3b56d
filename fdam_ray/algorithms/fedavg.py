"""The FedAvg family: local SGD on binary cross-entropy, the standard federated baselines.

FedAvg (McMahan et al. 2017) averages the clients' end points; SCAFFOLD
(Karimireddy et al. 2020, option II control variates) adds the same drift
correction as CODASCA. Both run the stage schedule like every algorithm here,
with no proximal term by default (``prox_weight`` 0).
"""

from __future__ import annotations

from fdam_ray.algorithms.base import Algorithm, preset


class FedAvg(Algorithm):
    """Local SGD steps on BCE; the server averages (eta_g = 1 by default)."""


PRESETS = (
    preset("fedavg", FedAvg, ("bce",), "none", "FedAvg with binary cross-entropy.", defaults={"prox_weight": 0.0}),
    preset("scaffold", FedAvg, ("bce",), "control_variates",
           "SCAFFOLD (option II control variates) with binary cross-entropy.",
           defaults={"prox_weight": 0.0, "reset_control_variates": False}),
)
