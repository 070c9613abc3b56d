"""FedProx-AUC: the AUC min-max objective with FedProx's proximal term.

The CODA+ local primal-dual step (docs/algorithms.md s.2) with the proximal
centre at the point the round started from instead of the stage's reference
point: each client solves

    min_v max_alpha  f_k(v, alpha) + (gamma / 2) ||v - v_{r-1}||^2

locally, ``prox_weight`` being gamma; a, b are part of v and pulled with it.
alpha is not pulled (the dual step is plain ascent, projected for auc_margin).
No drift correction: the proximal term alone limits how far clients wander
from the global model between averagings, which is FedProx's answer to
heterogeneity where CODASCA's is control variates.
"""

from __future__ import annotations

from fdam_ray.algorithms.base import AUC_OBJECTIVES, Algorithm, preset


class FedProxAUC(Algorithm):
    proximal = "round"


PRESETS = (
    preset("fedprox_auc", FedProxAUC, AUC_OBJECTIVES, "none",
           "FedProx-AUC: the AUC min-max objective with a proximal term (gamma = prox_weight) towards the "
           "round's starting point.", defaults={"prox_weight": 0.01}),
)
