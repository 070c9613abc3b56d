"""Kept for two importers on other branches (``fdam_ray/loop/client.py``, ``fdam_ray/flower/site.py``) until
they import :mod:`fdam_ray.settings.factories`, where the import paths of your own factories now live."""

from fdam_ray.settings.factories import describe_error, resolve

__all__ = ["describe_error", "resolve"]
