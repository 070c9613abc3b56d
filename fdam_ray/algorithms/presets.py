"""Every named algorithm, gathered from the family modules (docs/algorithms.md s.4).

A preset only chooses; the loop, the local step and the server update are the
same code for all of them. A new family adds its module's presets to :data:`FAMILIES`.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from fdam_ray.algorithms.base import AUC_OBJECTIVES, Preset
from fdam_ray.algorithms.coda import PRESETS as CODA
from fdam_ray.algorithms.fedavg import PRESETS as FEDAVG
from fdam_ray.algorithms.fedprox import PRESETS as FEDPROX
from fdam_ray.algorithms.fedprox_auc import PRESETS as FEDPROX_AUC

FAMILIES = (CODA, FEDAVG, FEDPROX, FEDPROX_AUC)  # each family module's presets

PRESETS: Mapping[str, Preset] = MappingProxyType({p.name: p for family in FAMILIES for p in family})

__all__ = ["AUC_OBJECTIVES", "FAMILIES", "PRESETS", "Preset"]
