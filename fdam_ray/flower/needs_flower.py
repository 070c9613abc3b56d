"""Imported first by every module of this package that uses Flower: without Flower, one line says what to install."""

from __future__ import annotations

try:
    import flwr  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the environment
    from fdam_ray.data.base import MissingExtraError
    from fdam_ray.files.extras import extra_hint

    raise MissingExtraError(f"fdam_ray.flower needs Flower: {extra_hint('flower', 'flwr')}") from exc
