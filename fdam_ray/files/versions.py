"""The versions a run ran under (fdam-ray, torch, Ray, Python, numpy), recorded with the run.

A result is reproduced only under the versions it was made with: ``config.yaml``
(under the key :data:`VERSIONS_KEY`, which is not a config field and is skipped
when a run's config is read back), ``summary.json`` and the trackers' tags keep
them, and a resumed run under other versions says which changed. Ray's version
is read from its package metadata, so this module does not import Ray.
"""

from __future__ import annotations

import importlib.metadata
import logging
import platform
from collections.abc import Mapping

import numpy as np
import torch

log = logging.getLogger(__name__)

VERSIONS_KEY = "versions"  # the key of config.yaml and summary.json that holds them


def _package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def run_versions() -> dict[str, str | None]:
    """``{"fdam_ray", "torch", "ray", "python", "numpy"}`` -> version (None: Ray is not installed)."""
    from fdam_ray import __version__

    return {"fdam_ray": str(__version__), "torch": str(torch.__version__), "ray": _package_version("ray"),
            "python": platform.python_version(), "numpy": str(np.__version__)}


def changed_versions(before: Mapping[str, object], now: Mapping[str, object]) -> str:
    """What differs between two version records, as ``torch 2.3.0 -> 2.4.1, ray 2.9.0 -> 2.60.0`` ('' if none)."""
    return ", ".join(f"{k} {before[k]} -> {now.get(k)}" for k in before if k in now and before[k] != now.get(k))
