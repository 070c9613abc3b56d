"""Every named algorithm, gathered from the family modules (docs/algorithms.md s.4).

A preset only chooses; the loop, the local step and the server update are the
same code for all of them. A new family adds its module to :data:`FAMILIES`.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from fdam_ray.algorithms import coda, fedavg, fedprox, fedprox_auc
from fdam_ray.algorithms.base import AUC_OBJECTIVES, Preset

FAMILIES = (coda, fedavg, fedprox, fedprox_auc)

PRESETS: Mapping[str, Preset] = MappingProxyType({p.name: p for family in FAMILIES for p in family.PRESETS})

__all__ = ["AUC_OBJECTIVES", "FAMILIES", "PRESETS", "Preset"]
