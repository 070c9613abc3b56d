"""A client's side of ``round_deadline`` under ``transport: collective``: no local step starts that cannot end in
time.

A member of the collective hands each of its clients a ``time.monotonic()`` time by which the round's local
steps must end (:mod:`fdam_ray.executors.ray.transports.collective_deadline`). Before each step after the first,
the client projects when its remaining steps would end at its fastest pace: the shortest of its steps so far in
this round and in its last round under a deadline, a lower bound (steps jitter upwards, on shared cores
especially). When that projection is past the deadline the client stops at once (:class:`LateSteps`) instead of
running steps whose work the round would throw away; its member then sits the round out (its clients put back)
and the others need not wait for it. Before the first step there is no projection, only the deadline itself: a
step starts unless the deadline has passed, so every client that starts times at least one step of the round,
and a client that was slow last round and is fast again is not cut for its past.

A member that is cut reports, as its round's step time, the projected end (a lower bound of what its steps
would have taken), never less than the time it ran, so the members' median step time, the unit of a factor
deadline, is not pulled down by the early stops.

The times are taken where the steps are launched: on a GPU, whose steps run asynchronously, they are launch
times until the queue fills, so the projection there is weaker and a step is then mostly cut by the deadline
itself.
"""

from __future__ import annotations

import time


class LateSteps(Exception):
    """A client's local steps would end, or started, past the round's deadline.

    Attributes:
        ends: the ``time.monotonic()`` time its steps would have ended at its fastest pace (a lower bound).
    """

    def __init__(self, message: str, ends: float) -> None:
        super().__init__(message)
        self.ends = ends


class StepClock:
    """One client's step times across its rounds under a deadline.

    Attributes:
        pace: the shortest step of the client's last round under a deadline, in seconds (None: none timed yet).
    """

    def __init__(self) -> None:
        self.pace: float | None = None
        self._until: float | None = None
        self._shortest: float | None = None  # this round's shortest step so far
        self._last: float | None = None  # when the step running now started

    def begin(self, until: float | None) -> None:
        """A local round starts; ``until``: the time its steps must end by (None: no deadline, nothing timed)."""
        self._until, self._shortest, self._last = until, None, None

    def before_step(self, left: int, label: str) -> None:
        """Before one of the round's last ``left`` steps: raises :class:`LateSteps` when the deadline has passed,
        or, after the round's first step, when ``left`` steps at the fastest pace would end past it."""
        until = self._until
        if until is None:
            return
        now = self._timed()
        fastest = self._shortest if self.pace is None or self._shortest is None else min(self._shortest, self.pace)
        ends = now + (fastest or 0.0) * left
        if ends > until:
            self.pace = self._shortest if self._shortest is not None else self.pace
            self._until = None
            raise LateSteps(f"client {label}: its local steps would end past the round's deadline", ends)

    def end(self) -> None:
        """The round's steps ended (or were cut): the last one timed, and the round's shortest step is the next
        round's pace."""
        if self._until is None:
            return
        self._timed()
        if self._shortest is not None:
            self.pace = self._shortest
        self._until = None

    def _timed(self) -> float:
        """Now; the step that just ended (if one ran) counted in the round's shortest."""
        now = time.monotonic()
        if self._last is not None:
            step = now - self._last
            self._shortest = step if self._shortest is None else min(self._shortest, step)
        self._last = now
        return now
