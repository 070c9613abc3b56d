"""Imported first by every module of this package that uses Flower: without Flower, one line says what to install."""

from __future__ import annotations

try:
    import flwr  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the environment
    from fdam_ray.data.base import MissingExtraError

    raise MissingExtraError('fdam_ray.flower needs Flower: pip install "fdam-ray[flower]"') from exc
