"""Straggler-tolerant rounds: a round deadline, the clients that made it, and the record that replays a run.

With ``round_deadline`` a round folds the partial sums that arrived in time
(at least ``min_clients`` clients' worth: past the deadline the round waits
until that many have reported) and goes on without the rest. A client that
misses the deadline does not take part in that round, under the
partial-participation rule of ALGORITHMS.md s.3b, exactly as a client that
client sampling left out: its c^k and sampler position stay as they were
(its actor rolls the round back once the late call ends, and the late result
is discarded, never folded later), the means of v, alpha and BatchNorm
statistics renormalise over the clients that made it, and c moves by their
changes over the total weight of all clients. A round every client was
asked to run sends c^k as usual (so a deadline no client misses changes
nothing, bit for bit); when a client misses it, each actor that made it sends
the weighted sum of its clients' changes of c^k (it kept their states from
before the round), folded in the order and arithmetic of a sampled round of
the clients that made it (:func:`as_sampled_round`): under ``reduce: star``
with ``fold_order: client`` the run equals its replay bit for bit.

Each round whose participants differ from the plan (the sampled set, or every
client) is recorded (round -> its clients) in the checkpoint and in the next
evaluation's metrics record. ``participation_record`` (a run folder or its
``checkpoint.pt``) forces those sets in a new run: a replay waits for every
client it runs (no deadline), so the run is repeatable from its record.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from fdam_ray.redact import short
from fdam_ray.sections import AT_LEAST_ONE, Section, fail, setting, shared

log = logging.getLogger(__name__)

MISSED_IN_A_ROW = 3  # a client that misses this many rounds in a row is named in train.log (once per streak)

_FACTOR = re.compile(r"\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*[xX]\s*")
_ALLOWED = "seconds > 0 (e.g. 30), a factor of the round's median client time (e.g. '2x', > 1), or null"


def deadline_value(name: str, value: Any) -> float | str:
    """``round_deadline`` coerced: seconds as a float, or a factor as text ``'<f>x'``; one-line error otherwise."""
    if isinstance(value, str) and _FACTOR.fullmatch(value):
        factor = float(_FACTOR.fullmatch(value).group(1))  # type: ignore[union-attr]
        if math.isfinite(factor) and factor > 1:
            return f"{factor:g}x"
        raise fail(name, value, _ALLOWED)
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            raise fail(name, value, _ALLOWED) from None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise fail(name, value, _ALLOWED)
    return float(value)


# transports that cannot leave a late client out of a round, and why
_NO_DEADLINE = {"compiled": "its graph returns every actor's output at once",
                "collective": "every actor's all-reduce waits for every other"}


@dataclasses.dataclass(frozen=True, kw_only=True)
class DeadlineSection(Section):
    """Straggler-tolerant rounds (this module's docstring): the deadline, the clients a round waits for, replay."""

    name = "deadline"

    round_deadline: float | str | None = setting(
        None, "ray executor: a round folds the clients that reported within this many seconds (e.g. 30) or this "
        "factor of the round's median client time (e.g. '2x'); a client that misses it sits the round out as a "
        "sampled-out client does (its c^k and sampler unchanged) and its late result is discarded; null = wait "
        "for every client.", kind="deadline", allowed=_ALLOWED)
    min_clients: int = setting(1, "With round_deadline: a round waits past the deadline until at least this many "
                               "clients have reported.", check=AT_LEAST_ONE)
    participation_record: str | None = setting(
        None, "A run folder (or its checkpoint.pt) whose recorded participating sets this run forces, round by "
        "round, without deadline: the run is repeatable from its record.", kind="str")
    num_clients: int = shared()
    clients_per_round: int | None = shared()
    executor: str = shared()
    transport: str = shared()

    def check(self) -> None:
        """min_clients within K and S; a deadline needs the Ray executor's classic transport."""
        if self.min_clients > self.num_clients:
            raise fail("min_clients", self.min_clients, f"at most num_clients = {self.num_clients}")
        if self.clients_per_round is not None and self.min_clients > self.clients_per_round:
            raise fail("min_clients", self.min_clients, f"at most clients_per_round = {self.clients_per_round}")
        if self.round_deadline is None:
            return
        if self.executor != "ray":
            raise fail("round_deadline", self.round_deadline, "null with executor=inline (its clients run one "
                       "after another in this process: none can be left behind)")
        if self.transport in _NO_DEADLINE:
            raise fail("round_deadline", self.round_deadline, f"null with transport={self.transport} "
                       f"({_NO_DEADLINE[self.transport]}; use transport=classic)")
        if self.participation_record is not None:
            raise fail("round_deadline", self.round_deadline, "null with participation_record (a replay runs the "
                       "recorded sets and waits for every client)")

    @property
    def tolerant(self) -> bool:
        """Whether a round may run a set of clients other than the plan's (a deadline, or a replayed record)."""
        return self.round_deadline is not None or self.participation_record is not None


@dataclasses.dataclass(frozen=True)
class Deadline:
    """One round's deadline as a transport applies it.

    Attributes:
        seconds: a fixed deadline after the round's calls went out, or None.
        factor: a deadline of this factor times the round's median (lower median) actor time, or None.
        min_clients: past the deadline, wait until this many clients have reported.
    """

    seconds: float | None
    factor: float | None
    min_clients: int

    @classmethod
    def of(cls, section: DeadlineSection) -> Deadline | None:
        value = section.round_deadline
        if value is None:
            return None
        if isinstance(value, str):
            return cls(None, float(value.rstrip("x")), section.min_clients)
        return cls(float(value), None, section.min_clients)

    def due(self, arrivals: Sequence[float], expected: int) -> float | None:
        """Seconds after the round's start when it is due, given the arrival times so far of ``expected`` actors;
        None while a median-based deadline is not known yet."""
        if self.seconds is not None:
            return self.seconds
        median_at = (expected + 1) // 2
        if len(arrivals) < median_at:
            return None
        return float(self.factor or 1.0) * sorted(arrivals)[median_at - 1]


class MissedRounds:
    """Counts the rounds each client missed in a row; names one in train.log when it reaches ``in_a_row``."""

    def __init__(self, in_a_row: int = MISSED_IN_A_ROW) -> None:
        self.in_a_row = in_a_row
        self.streak: dict[int, int] = {}

    def round(self, round_index: int, planned: Sequence[int], took_part: Sequence[int], label: Any = str) -> None:
        """After a round: ``planned`` clients were asked, ``took_part`` made it."""
        made = set(took_part)
        for k in planned:
            if k in made:
                self.streak.pop(k, None)
                continue
            self.streak[k] = self.streak.get(k, 0) + 1
            if self.streak[k] == self.in_a_row:
                log.warning("client %s missed the round deadline %d rounds in a row (rounds %d-%d); it keeps being "
                            "asked each round", label(k), self.in_a_row, round_index - self.in_a_row + 1,
                            round_index)


def read_record(where: str) -> dict[int, list[int]]:
    """The recorded participating sets (round -> clients) of a run folder or its checkpoint file; one line when
    there is none to read."""
    from fdam_ray.checkpoint import CheckpointError, load_checkpoint  # the checkpoint imports the algorithms

    path = Path(where)
    if path.is_dir():
        path = path / "checkpoint.pt"
    try:
        checkpoint = load_checkpoint(path)
    except CheckpointError as exc:
        raise ValueError(f"config field 'participation_record': {short(where)} holds no record to replay "
                         f"({exc})") from None
    return parse_record(checkpoint.loop.participation)


def parse_record(record: Mapping[str, Sequence[int]]) -> dict[int, list[int]]:
    """A record as stored (str(round) -> clients) to round -> sorted clients."""
    return {int(r): sorted(int(k) for k in clients) for r, clients in record.items()}


def as_sampled_round(reducer: Any, executor: Any, round_index: int, total_weight: float) -> None:
    """Make a round every client was asked to run, and that some missed, fold as a sampled round of those that
    made it (s.3b): the reducer's sums of c^k become the sums of their changes (sent by their actors,
    :meth:`~fdam_ray.executors.ray.executor.RayExecutor.round_changes`), and c moves by them over
    ``total_weight`` (that of all clients). Nothing to do without control variates."""
    sums = reducer.sums
    if not sums.control_variates:
        return
    changes = executor.round_changes(round_index)
    for i, name in enumerate(("c_v", "c_alpha")):
        total = getattr(sums, name)
        total.fill(0)
        for part in changes:
            np.add(total, part[i], out=total)
    reducer.partial_total = total_weight
