"""Ending a compiled round graph (fdam_ray.executors.ray.transports.compiled.CompiledRounds.teardown): a loop that
never sees its channel close is ended by ``on_stuck``, and a teardown that ends by itself never calls it."""

from __future__ import annotations

import threading
import time

import pytest

from fdam_ray.executors.ray.transports import compiled
from fdam_ray.executors.ray.transports.compiled import CompiledRounds


class Graph:
    """A graph whose teardown waits, as Ray's does, until its loops end (``ended``), at most ``wait_s``."""

    def __init__(self, ends_by_itself: bool) -> None:
        self.ended = threading.Event()
        if ends_by_itself:
            self.ended.set()
        self.torn_down = False

    def teardown(self) -> None:
        if not self.ended.wait(timeout=30):
            raise AssertionError("a stuck loop was never ended")
        self.torn_down = True


@pytest.fixture()
def short_wait(monkeypatch):
    monkeypatch.setattr(compiled, "STUCK_AFTER_S", 0.2)


def test_a_teardown_stuck_on_a_loop_ends_it_with_on_stuck_and_then_completes(short_wait):
    rounds, graph = CompiledRounds(), Graph(ends_by_itself=False)
    rounds.graph, rounds.key = graph, ("key",)
    calls: list[float] = []
    rounds.on_stuck = lambda: (calls.append(time.monotonic()), graph.ended.set())
    started = time.monotonic()
    rounds.teardown()
    assert graph.torn_down and rounds.graph is None and rounds.key == ()
    assert len(calls) == 1 and calls[0] - started >= 0.2  # only once the wait passed STUCK_AFTER_S


def test_a_teardown_that_ends_by_itself_never_ends_anything(short_wait):
    rounds, graph = CompiledRounds(), Graph(ends_by_itself=True)
    rounds.graph = graph
    rounds.on_stuck = lambda: pytest.fail("on_stuck called for a teardown that ended by itself")
    rounds.teardown()
    assert graph.torn_down and rounds.graph is None


def test_without_on_stuck_the_teardown_is_ray_s_own_wait():
    rounds, graph = CompiledRounds(), Graph(ends_by_itself=True)
    rounds.graph = graph
    rounds.teardown()
    assert graph.torn_down
    rounds.teardown()  # nothing left: a second call does nothing
