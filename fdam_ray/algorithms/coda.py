"""The CODA family: local primal-dual steps on an AUC min-max objective (Yuan et al. 2021, Alg. 1-4).

CODA+ (Alg. 1-2) and CODASCA (Alg. 3-4) share every phase; CODASCA adds
control variates on v and alpha (the drift correction) and the server step
eta_g. NPA is CODA+ with I = 1; CODA is CODA+ whose stage end sets alpha to its
closed-form optimum from one extra round of client score sums
(docs/algorithms.md s.1, s.3b); centralized is one client holding all data.
The proximal term pulls towards the stage's reference point v_ref.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from fdam_ray.algorithms.base import PRIMAL_DUAL_OBJECTIVES as AUC_OBJECTIVES  # AUC and partial AUC (s.1, s.1b)
from fdam_ray.algorithms.base import Algorithm, closed_form_stage_alpha, preset
from fdam_ray.core.state import ScoreSums
from fdam_ray.pauc import PAUC_OBJECTIVES


class Coda(Algorithm):
    """CODA+, CODASCA, NPA and centralized training (the stage end keeps alpha)."""


class CodaClosedForm(Coda):
    """CODA: at every stage end alpha <- alpha*(v), the maximiser of the weighted objective for fixed v."""

    needs_score_sums = True

    def stage_alpha(self, sums: Sequence[ScoreSums], positive_ratio: np.ndarray,
                    weights: np.ndarray | None = None) -> np.ndarray:
        return closed_form_stage_alpha(self, sums, positive_ratio, weights)


PRESETS = (
    preset("codasca", Coda, AUC_OBJECTIVES, "control_variates",
           "CODASCA: local primal-dual steps with control variates on v and alpha, server step eta_g."),
    preset("coda_plus", Coda, AUC_OBJECTIVES, "none",
           "CODA+: local primal-dual steps, periodic averaging of v and alpha."),
    preset("npa", Coda, AUC_OBJECTIVES, "none",
           "Naive parallel algorithm: averaging after every step (I = 1) with local batch M.",
           fixed={"local_steps": 1, "schedule": "stagewise"}),
    preset("coda", CodaClosedForm, ("auc_square", "auc_margin"), "none",
           "CODA: CODA+ plus alpha recomputed in closed form from v at every stage end."),
    preset("centralized", Coda, ("auc_square", "auc_margin", "bce", *PAUC_OBJECTIVES), "none",
           "One client holding all the data (PESG-style reference).", fixed={"num_clients": 1}),
)
