"""Straggler-tolerant rounds: a round deadline, the clients that made it, and the record that replays a run.

With ``round_deadline`` a round folds the partial sums that arrived in time (at least ``min_clients`` clients'
worth: past the deadline the round waits until that many have reported) and goes on without the rest. A client
that misses the deadline does not take part in that round, under the partial-participation rule of
docs/algorithms.md s.3b, exactly as a client that client sampling left out: its c^k and sampler position stay
as they were (its actor rolls the round back once the late call ends, and the late result is discarded, never
folded later), the means of v, alpha and BatchNorm statistics renormalise over the clients that made it, and c
moves by their changes over the total weight of all clients. A round every client was asked to run sends c^k
as usual (so a deadline no client misses changes nothing, bit for bit); when a client misses it, each actor
that made it sends the weighted sum of its clients' changes of c^k (it kept their states from before the
round), folded in the order and arithmetic of a sampled round of the clients that made it
(:func:`as_sampled_round`): under ``reduce: star`` with ``fold_order: client`` and float32 transfers the run
equals its replay bit for bit. With ``transfer_precision`` bf16/fp16 and control variates it does not: the
missed round folds the float32 changes of c^k its actors kept, while the replay's sampled round sends them
rounded to 16 bits (the two differ by that rounding, within the 16-bit transfer's own error).

Under ``transport: collective`` no driver waits on the round: each member cuts its own late local steps and
the members agree on who made it before their all-reduce (:mod:`fdam_ray.executors.ray.transports.collective_deadline`;
a node behind a slow link sits out, :mod:`fdam_ray.executors.ray.transports.collective_links`).

Each round whose participants differ from the plan (the sampled set, or every client) is recorded (round -> its
clients) in the checkpoint and in the next evaluation's metrics record. ``participation_record`` (a run folder or
its ``checkpoint.pt``) forces those sets in a new run: a replay waits for every client it runs (no deadline), so
the run is repeatable from its record.

The record is checked whole against the run that replays it before any client starts (:func:`check_record`). A
round the record does not name runs the replay's own plan, so the sampling rule of s.3b decides what a record
means: it must come from a run of the same ``num_clients``, the same ``clients_per_round`` and, when sampling, the
same ``seed``, and each recorded set must lie inside that round's sample S_r (a client that missed a deadline was
one the round asked). Ids outside 0..K-1, a client named twice, an empty set, a round key that is not a round, a
round the recorded run never reached, or a record of a run that had no deadline (an empty record: it would force
nothing) are each one line naming the round and the value. Recorded rounds past this run's last round are not
replayed, with a warning (a shorter replay, to be resumed with more iterations, is a use).

What a factor deadline tells apart (:meth:`Deadline.due`). ``'<f>x'`` is due at f * m, m being the lower
median of the times at which the actors' calls ended, counted from when the round's calls went out (known once
half the actors have reported). An actor's time is its download of the state, its local steps and its export:
t_k = c_k + n_k (steps, the rest). It is left out when t_k > f * m, that is when it is later than the median
by more than (f - 1) * m: the factor is the lateness tolerated, as a share of the median round. Where the
local steps make up most of every actor's time (slow or shared cores: m close to c), a client slowed by its
link alone is left out only once its link costs (f - 1) times a whole round: with rounds of 1.3 s on two
shared cores and one node at 100 Mbit/s, ``'2x'`` is due after about 2.5 s and never leaves the slow node out.
No rule on a classic round's times tells that node from an even one: a late link and slow steps look the same
until the call ends, so a deadline that left out a client 0.2 s behind the median would leave out every even
client whose steps varied by 0.2 s. When compute dominates, a factor near 1 (``'1.1x'`` tolerates a tenth of
the median round) fits only where the even clients' times vary by less than that (cores of their own); on
shared cores, where they vary by a tenth or more from round to round, it leaves even clients out: use seconds
there (the even round's time and the margin tolerated), or accept the wait.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import numbers
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from fdam_ray.core.schedules import ScheduleSection, planned_rounds
from fdam_ray.features.capabilities import no_deadline
from fdam_ray.settings.redact import short
from fdam_ray.settings.sections import AT_LEAST_ONE, Section, fail, setting, shared, warn_once

if TYPE_CHECKING:
    import numpy as np

    from fdam_ray.algorithms.drift import DriftCorrection
    from fdam_ray.algorithms.server import RoundReducer


class ReportsChanges(Protocol):
    """What a late round asks of the executor: the sums of the changes of c^k its hosts send
    (:meth:`fdam_ray.executors.base.Executor.round_changes`)."""

    def round_changes(self, round_index: int) -> list[tuple[np.ndarray, np.ndarray]]: ...

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


@dataclasses.dataclass(frozen=True, kw_only=True)
class DeadlineSection(Section):
    """Straggler-tolerant rounds (this module's docstring): the deadline, the clients a round waits for, replay."""

    name = "deadline"

    round_deadline: float | str | None = setting(
        None, "ray executor: a round folds the clients that reported within this many seconds (e.g. 30) or this "
        "factor of the round's median client time (e.g. '2x': late once (factor - 1) median times behind the "
        "median, so where local compute fills the round only seconds or a factor near 1 leave a slow link out); "
        "a client that misses it sits the round out as a sampled-out client does (its c^k and sampler "
        "unchanged) and its late result is discarded. transport=collective: each member cuts its own local steps "
        "at it (seconds, or the factor times the members' median step time of the previous round; a client stops "
        "once its fastest step says the rest cannot end in time); across three nodes or more a node whose link is "
        "slow sits out of the exchange until a probe finds it fast; null = wait for every client.",
        kind="deadline", allowed=_ALLOWED)
    min_clients: int = setting(1, "With round_deadline: a round waits past the deadline until at least this many "
                               "clients have reported (refused without round_deadline).", check=AT_LEAST_ONE)
    participation_record: str | None = setting(
        None, "A run folder (or its checkpoint.pt) whose recorded participating sets this run forces, round by "
        "round, without deadline: the run is repeatable from its record (of a run with the same num_clients, "
        "clients_per_round and seed; checked before any client starts).", kind="str")
    num_clients: int = shared()
    clients_per_round: int | None = shared()
    executor: str = shared()
    transport: str = shared()
    dp: str = shared()

    def check(self) -> None:
        """min_clients within K and S, and only with a deadline; a deadline needs the Ray executor and a transport
        that leaves a late client out."""
        if self.min_clients > self.num_clients:
            raise fail("min_clients", self.min_clients, f"at most num_clients = {self.num_clients}")
        if self.clients_per_round is not None and self.min_clients > self.clients_per_round:
            raise fail("min_clients", self.min_clients, f"at most clients_per_round = {self.clients_per_round}")
        if self.round_deadline is None:
            if self.min_clients != 1:  # it would be ignored: every round waits for every client it asked
                why = ("a replay (participation_record) waits for every client it runs"
                       if self.participation_record is not None else "without a deadline every round waits for "
                       "every client it asked")
                raise fail("min_clients", self.min_clients, f"1 without round_deadline: min_clients is how many "
                           f"clients a round with a deadline waits for, and {why}; set round_deadline or remove "
                           "min_clients")
            return
        if self.executor != "ray":
            raise fail("round_deadline", self.round_deadline, "null with executor=inline (its clients run one "
                       "after another in this process: none can be left behind)")
        refused = no_deadline(self.transport)  # a transport that cannot leave a late client out, as it declares
        if refused:
            raise fail("round_deadline", self.round_deadline, f"null with transport={self.transport} ({refused})")
        if self.transport == "collective" and self.dp != "off":
            raise fail("round_deadline", self.round_deadline, f"null with transport=collective and dp={self.dp} (the "
                       "members keep the deadline in runs of rounds, and under dp each round is accounted on the "
                       "driver, one at a time); use transport=classic")
        if self.participation_record is not None:
            raise fail("round_deadline", self.round_deadline, "null with participation_record (a replay runs the "
                       "recorded sets and waits for every client)")

    @property
    def cut_by(self) -> str:
        """What a late client was late by, in train.log: its steps or its node's link (collective), or its call."""
        return "its local steps ran past the deadline, or its node sat out for a slow link (named above)" \
            if self.transport == "collective" else "its call ended after the deadline"

    @property
    def tolerant(self) -> bool:
        """Whether a round may run a set of clients other than the plan's (a deadline, or a replayed record)."""
        return self.round_deadline is not None or self.participation_record is not None


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReplaySection(Section):
    """What a participation record is checked against (:func:`check_record`): the replaying run's clients and how
    it draws each round's sample (``seed``, or under dp the privacy secret). Its last round is its schedule's
    (:class:`~fdam_ray.core.schedules.ScheduleSection`)."""

    name = "replay"

    num_clients: int = shared()
    clients_per_round: int | None = shared()
    seed: int = shared()
    dp: str = shared()
    dp_noise_seed: int | None = shared()
    dp_sampling: str | None = shared()
    dp_noise_at: str = shared()


@dataclasses.dataclass(frozen=True)
class Deadline:
    """One round's deadline as a transport applies it.

    Attributes:
        seconds: a fixed deadline after the round's calls went out, or None.
        factor: a deadline of this factor times the round's median (lower median) actor time, or None: an
            actor is left out once it is (factor - 1) median times behind the median (the module's docstring:
            what this tells apart when local compute dominates the round).
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
        None while a median-based deadline is not known yet.

        A factor f is due at f * m, m the ((expected + 1) // 2)-th arrival (the lower median of all
        ``expected``: the earlier half has then reported, whatever the others do); the arrivals are the times
        the actors' calls ended, their local steps included."""
        if self.seconds is not None:
            return self.seconds
        median_at = (expected + 1) // 2
        if len(arrivals) < median_at:
            return None
        return float(self.factor or 1.0) * sorted(arrivals)[median_at - 1]


class MissedRounds:
    """Counts the rounds each client missed in a row; names one in train.log when it reaches ``in_a_row``, with
    what the deadline measured (``cut_by``, :attr:`DeadlineSection.cut_by`)."""

    def __init__(self, in_a_row: int = MISSED_IN_A_ROW, cut_by: str = "") -> None:
        self.in_a_row, self.cut_by = in_a_row, cut_by
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
                log.warning("client %s missed the round deadline %d rounds in a row (rounds %d-%d)%s; it keeps "
                            "being asked each round", label(k), self.in_a_row, round_index - self.in_a_row + 1,
                            round_index, f"; {self.cut_by}" if self.cut_by else "")


def read_record(where: str, run: ReplaySection | None = None,
                schedule: ScheduleSection | None = None) -> dict[int, list[int]]:
    """The recorded participating sets (round -> sorted clients) of a run folder or its checkpoint file, each entry
    checked (:func:`parse_record`); with ``run`` and ``schedule``, the run that replays it, the whole record is
    checked against that run as well (:func:`check_record`). One line when there is none to read, or when it
    cannot be replayed."""
    checkpoint = record_checkpoint(where)
    record = parse_record(checkpoint.loop.participation, where)
    if run is not None:
        if schedule is None:
            raise TypeError("read_record: a replaying run's ReplaySection needs its ScheduleSection")
        recorded = checkpoint.config if isinstance(checkpoint.config, Mapping) else {}
        check_record(record, run, schedule, where=where, recorded=recorded, reached=checkpoint.loop.state.round)
    return record


def record_checkpoint(where: str) -> Any:
    """The checkpoint of a run folder (or the checkpoint file) a ``participation_record`` names; one line when
    there is none to read."""
    from fdam_ray.checkpoint import CheckpointError, load_checkpoint  # the checkpoint imports the algorithms

    path = Path(where)
    if path.is_dir():
        path = path / "checkpoint.pt"
    try:
        return load_checkpoint(path)
    except CheckpointError as exc:
        raise ValueError(f"config field 'participation_record': {short(where)} holds no record to replay "
                         f"({exc})") from None


def _refuse(where: str, why: str) -> ValueError:
    return ValueError(f"config field 'participation_record': {short(where)} cannot be replayed: {why}")


def parse_record(record: Any, where: str = "the record") -> dict[int, list[int]]:
    """A record as stored (str(round) -> clients) to round -> sorted clients; a record of another shape, a round
    that is not a number >= 1, a set that is empty, names a client twice or a client that is not an integer is
    one line naming the round and the value."""
    if not isinstance(record, Mapping):
        raise _refuse(where, f"its record is not a mapping of round -> clients (a {type(record).__name__})")
    out: dict[int, list[int]] = {}
    for key, clients in record.items():
        r = _round_number(key)
        if r is None:
            raise _refuse(where, f"round key {short(key)} is not a round number (an integer >= 1)")
        if r in out:
            raise _refuse(where, f"round {r} is recorded twice")
        if not isinstance(clients, (list, tuple)):
            raise _refuse(where, f"round {r}: {short(clients)} is not a list of client ids")
        if not clients:
            raise _refuse(where, f"round {r} names no client (a recorded round had at least one: the record is "
                          "damaged)")
        seen: set[int] = set()
        for k in clients:
            if isinstance(k, bool) or not isinstance(k, numbers.Integral):
                raise _refuse(where, f"round {r}: {short(k)} is not a client id (an integer)")
            if int(k) in seen:
                raise _refuse(where, f"round {r} names client {int(k)} twice")
            seen.add(int(k))
        out[r] = sorted(seen)
    return out


def _round_number(key: Any) -> int | None:
    """A round key as stored (``'3'``) or as a number, or None when it is neither (or below 1)."""
    if isinstance(key, bool):
        return None
    if isinstance(key, numbers.Integral):
        r = int(key)
    elif isinstance(key, str) and key.isascii() and key.isdigit():
        r = int(key)
    else:
        return None
    return r if r >= 1 else None


def _sampling(values: ReplaySection | Mapping[str, Any], num_clients: int) -> Any:
    """The S a run samples per round (None: every client), from its section or a recorded config's mapping (whose
    value, when it is not a number, is returned as it is, to be named)."""
    s = values.get("clients_per_round") if isinstance(values, Mapping) else values.clients_per_round
    if s is None or isinstance(s, bool) or not isinstance(s, int):
        return s
    return None if s >= num_clients else s


def _null(value: Any) -> str:
    return "null" if value is None else str(value)


def check_record(record: dict[int, list[int]], run: ReplaySection, schedule: ScheduleSection, *, where: str,
                 recorded: Mapping[str, Any], reached: int | None = None, rebuilds: bool = False) -> None:
    """Refuse a record this run cannot replay, in one line naming the round and the value.

    A replayed round runs the recorded set; a round the record does not name runs the run's plan (its sample
    under ``clients_per_round``, else every client). So the record must come from a run of the same clients
    and the same sampling (``num_clients``, ``clients_per_round`` and, when sampling, ``seed``, read from the
    recorded run's config where the checkpoint has one), and each set must be within 0..K-1 and within the
    round's sample (a client that missed a deadline was one the round asked). A record of a run that had
    neither a deadline nor a record of its own is empty and would force nothing: refused. ``reached``: the last
    round the recorded run finished; a round past it was never run. A round past this run's last round is not
    replayed: said once (a replay may be shorter than its record, e.g. to be resumed with more iterations), as
    is an empty record of a run with a deadline (no client missed one; the replay runs every round as planned).
    ``rebuilds``: the record names rebuilt clients (:mod:`fdam_ray.executors.rebuilds`): an empty one is no
    refusal.
    """
    k = int(run.num_clients)
    s = _sampling(run, k)
    _check_recorded_run(run, k, s, where=where, recorded=recorded)
    if not record:
        if rebuilds:
            return
        if recorded and recorded.get("round_deadline") is None and recorded.get("participation_record") is None:
            raise _refuse(where, "that run ran without round_deadline: every round ran its plan, so it recorded "
                          "nothing and a replay would force nothing (it is the run itself): remove "
                          "participation_record")
        warn_once(log, f"config field 'participation_record': {short(where)} records no round: no client missed a "
                   "deadline in that run, so it forces nothing and the replay runs every round as planned")
        return
    last = planned_rounds(schedule)
    past = [r for r, clients in sorted(record.items()) if _check_round(r, clients, run, k, s, where=where,
                                                                       reached=reached) > last]
    if past:
        rounds = ", ".join(map(str, past))
        warn_once(log, f"config field 'participation_record': {short(where)}: round{'s' if len(past) > 1 else ''} "
                   f"{rounds} {'are' if len(past) > 1 else 'is'} past this run's last round {last} "
                   f"(iterations = {schedule.iterations}): not replayed; a resume with more iterations replays "
                   f"{'them' if len(past) > 1 else 'it'}")


def _check_recorded_run(run: ReplaySection, k: int, s: int | None, *, where: str,
                        recorded: Mapping[str, Any]) -> None:
    """The recorded run had this run's clients and sampling (``num_clients``, ``clients_per_round``, and the
    ``seed`` when sampling), as far as its checkpoint's config says."""
    if "num_clients" in recorded and recorded["num_clients"] != k:
        raise _refuse(where, f"it was recorded with num_clients = {short(recorded['num_clients'])}, this run has "
                      f"{k} (a record names clients of its own run)")
    if "clients_per_round" in recorded and isinstance(recorded.get("num_clients", k), int):
        was = _sampling(recorded, int(recorded.get("num_clients", k)))
        if was != s:
            raise _refuse(where, f"it was recorded with clients_per_round = {_null(was)}, this run with "
                          f"{_null(s)} (a round the record does not name runs the run's own sample)")
        if s is not None and "seed" in recorded and recorded["seed"] != run.seed:
            raise _refuse(where, f"it was recorded with seed = {short(recorded['seed'])}, this run has "
                          f"{run.seed} (the seed draws each round's sample of clients_per_round = {s})")


def _check_round(r: int, clients: list[int], run: ReplaySection, k: int, s: int | None, *, where: str,
                 reached: int | None) -> int:
    """Round ``r``'s recorded set: a round the recorded run finished, clients within 0..K-1 and within the
    round's sample. Returns ``r``."""
    if reached is not None and r > reached:
        raise _refuse(where, f"round {r} is past round {reached}, the last the recorded run finished (the "
                      "record is damaged)")
    bad = [c for c in clients if not 0 <= c < k]
    if bad:
        raise _refuse(where, f"round {r} names client {bad[0]}, outside 0..{k - 1} (num_clients = {k}: a "
                      "record of a run with other clients cannot be replayed)")
    sample = None if s is None else _round_sample(run, r, k, s)
    if sample is not None:
        out = [c for c in clients if c not in sample]
        if out:
            raise _refuse(where, f"round {r} names client {out[0]}, not in the round's sample {sample} "
                          f"(clients_per_round = {s}): the record is of another run")
    return r


def _round_sample(run: ReplaySection, r: int, k: int, s: int) -> list[int] | None:
    """Round ``r``'s sample as the run draws it: from ``seed``, or under dp from the privacy secret
    (``dp_noise_seed``; None when that is fresh entropy, which only the recorded run's checkpoint holds), Poisson
    where the run's client draw is (:attr:`~fdam_ray.privacy.section.PrivacySection.sampling`)."""
    from fdam_ray.algorithms.sampling import poisson_sample_clients, sample_clients, secret_sample_clients
    from fdam_ray.privacy.section import client_draw_is_poisson  # the algorithms import torch

    if run.dp == "off":
        return sample_clients(run.seed, r, k, s)
    secret = run.dp_noise_seed
    if secret is None:
        return None
    poisson = client_draw_is_poisson(run.dp, run.dp_sampling, k, s, run.dp_noise_at)
    return (poisson_sample_clients if poisson else secret_sample_clients)(secret, r, k, s)


def as_sampled_round(reducer: RoundReducer, executor: ReportsChanges, round_index: int, total_weight: float,
                     drift: DriftCorrection) -> None:
    """Make a round every client was asked to run, and that some missed, fold as a sampled round of those that
    made it (s.3b): the rule of ``drift``, the algorithm's drift correction
    (:meth:`~fdam_ray.algorithms.drift.DriftCorrection.as_sampled`), with the sums of the changes of c^k their
    actors send (:meth:`~fdam_ray.executors.base.Executor.round_changes`), c moving by them over
    ``total_weight`` (that of all clients). Nothing to do without control variates."""
    if not reducer.sums.control_variates:
        return
    drift.as_sampled(reducer, executor.round_changes(round_index), total_weight)
