"""FedProx (Li et al., "Federated Optimization in Heterogeneous Networks", MLSys 2020) with BCE.

Each client minimises its local loss plus (mu / 2) ||w - w_r||^2, where w_r is
the global model the round started from; ``prox_weight`` is mu. Its local step
is therefore the local step of docs/algorithms.md s.2 with the proximal centre
moved from the stage's reference point to the round's start:

    d_v = g_v + mu (v - v_{r-1}) + wd v,     v <- v - eta d_v

and the server averages as FedAvg does (eta_g applies as everywhere).
"""

from __future__ import annotations

from fdam_ray.algorithms.base import Algorithm, preset


class FedProx(Algorithm):
    proximal = "round"


PRESETS = (
    preset("fedprox", FedProx, ("bce",), "none",
           "FedProx: BCE with a proximal term (mu = prox_weight) towards the round's starting point.",
           defaults={"prox_weight": 0.01}),
)
