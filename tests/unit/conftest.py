"""The unit tier: the math and config tests, which need no Ray (``pytest tests/unit`` runs them alone, in under a
minute). A test here that starts Ray fails at once."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _no_ray(monkeypatch):
    import ray

    def refuse(*args, **kwargs):
        raise RuntimeError("a unit test started Ray: move it out of tests/unit/")

    monkeypatch.setattr(ray, "init", refuse)
