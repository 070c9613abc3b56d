"""A run stopped part-way, as by Ctrl+C: for the tests that resume it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest

from fdam_ray.executors.inline import InlineExecutor


@contextlib.contextmanager
def crash_in_round(monkeypatch: pytest.MonkeyPatch, round_: int) -> Iterator[None]:
    """While inside, an inline run raises KeyboardInterrupt when round ``round_`` starts; the block must end with
    it (the run stopped there). Rounds run as before afterwards."""
    original = InlineExecutor.run_round

    def crash(self, state, plan, fold):
        if plan.round == round_:
            raise KeyboardInterrupt
        return original(self, state, plan, fold)

    monkeypatch.setattr(InlineExecutor, "run_round", crash)
    try:
        with pytest.raises(KeyboardInterrupt):
            yield
    finally:
        monkeypatch.setattr(InlineExecutor, "run_round", original)
