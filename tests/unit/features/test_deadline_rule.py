"""The round deadline's rule in closed form (fdam_ray.executors.deadlines.Deadline.due), from given arrival times:
seconds are due at once; a factor f is due at f times the lower median arrival, which leaves an actor out only when
it is more than (f - 1) median times behind the median. Rounds whose local steps dominate every actor's time are
therefore cut only with a factor near 1 (the module's docstring says why no rule on the round's times can do
better). Under transport: collective the members agree on a round's late members, its clients in time and the
median step time from one exact all-reduce of their flags, and each member's deadline runs from its own start."""

from __future__ import annotations

import random

import numpy as np
import pytest

from fdam_ray.clients import late
from fdam_ray.clients.late import LateSteps, StepClock
from fdam_ray.config import ConfigError, build_config
from fdam_ray.executors.deadlines import Deadline
from fdam_ray.executors.ray.transports.collective_deadline import Agreement, DeadlineSpec, MemberClock, agree


def _left_out(deadline: Deadline, times: list[float]) -> list[float]:
    """The arrival times past the deadline, given every actor's arrival time (the deadline as the round knows it
    once the earlier half has reported; the transport's wait applies it so)."""
    ordered = sorted(times)
    half = (len(times) + 1) // 2
    due = deadline.due(ordered[:half], len(times))
    assert due is not None
    return [t for t in times if t > due]


def test_no_deadline_is_none_and_seconds_ignore_the_arrivals():
    assert Deadline.of(build_config({})) is None  # a run without a deadline waits for every actor, as before
    fixed = Deadline.of(build_config(dict(round_deadline=1.5, executor="ray")))
    assert fixed == Deadline(1.5, None, 1)
    for arrivals in ([], [0.1], [9.0, 9.5, 10.0]):
        assert fixed.due(arrivals, 4) == 1.5


@pytest.mark.parametrize("expected", [1, 2, 3, 4, 5, 8])
def test_a_factor_is_due_at_the_factor_times_the_lower_median_arrival(expected):
    rng = random.Random(expected)
    times = [rng.uniform(0.5, 3.0) for _ in range(expected)]
    half = (expected + 1) // 2  # the lower median: 1 of 1 or 2, 2 of 3 or 4, 3 of 5, 4 of 8
    deadline = Deadline(None, 1.7, 1)
    for seen in range(half):
        assert deadline.due(times[:seen], expected) is None  # not known before the earlier half has reported
    for seen in range(half, expected + 1):
        arrived = sorted(times[:seen])
        assert deadline.due(times[:seen], expected) == pytest.approx(1.7 * arrived[half - 1])
    shuffled = times[:]
    rng.shuffle(shuffled)
    assert deadline.due(shuffled, expected) == deadline.due(times, expected)  # the order they came in is moot


def test_a_slow_but_even_round_leaves_no_one_out():
    compute = 1.2  # every actor's local steps on shared cores, and a spread of at most a fifth of a round
    times = [compute + 0.05 + 0.24 * k / 7 for k in range(8)]
    assert _left_out(Deadline(None, 1.2, 1), times) == []  # max <= 1.2 * lower median
    assert _left_out(Deadline(None, 2.0, 1), times) == []


def test_a_factor_tolerates_factor_minus_one_median_times_of_lateness():
    # t_k = c_k + n_k: 1.2 s of local steps each; links of 0.05 s, one of 0.30 s (a 100 Mbit/s node)
    even = [1.2 + 0.05] * 3
    straggler = 1.2 + 0.30
    median = even[0]
    for factor in (2.0, 1.5, 1.25):  # tolerated lateness (f - 1) * 1.25 s > 0.25 s: kept, the round waits for it
        assert straggler - median <= (factor - 1) * median
        assert _left_out(Deadline(None, factor, 1), [*even, straggler]) == []
    for factor in (1.1, 1.05):  # (f - 1) * 1.25 s < 0.25 s: left out at f * 1.25 s
        assert _left_out(Deadline(None, factor, 1), [*even, straggler]) == [straggler]
        assert Deadline(None, factor, 1).due(even[:2], 4) == pytest.approx(factor * median)


def test_where_the_link_dominates_the_factor_leaves_the_slow_node_out():
    # 0.1 s of local steps, state transfers of 0.2 s, 1.0 s on the slow node: 1.1 s > 2 * 0.3 s
    times = [0.3, 0.3, 0.3, 1.1]
    assert _left_out(Deadline(None, 2.0, 1), times) == [1.1]


def test_the_collective_transport_takes_a_deadline_but_not_under_dp():
    assert build_config(dict(round_deadline="2x", executor="ray", transport="collective")).round_deadline == "2x"
    with pytest.raises(ConfigError) as info:
        build_config(dict(round_deadline=5, executor="ray", transport="collective", dp="client", dp_clip=1.0,
                          dp_noise_multiplier=1.0))
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("config field 'round_deadline': 5.0 is not allowed (null with transport=collective "
                              "and dp=client")
    assert "use transport=classic" in message


class FlagsGroup:
    """Members of a group whose flags all-reduce returns ``total`` (each member checks its own slots first)."""

    def __init__(self, total: np.ndarray, rows: list[tuple[bool, float, int, int]]) -> None:
        self.total, self.rows, self.world = total, rows, len(rows)

    def member(self, rank: int):
        return FlagsMember(self, rank)


class FlagsMember:
    def __init__(self, group: FlagsGroup, rank: int) -> None:
        self.group, self.rank, self.world = group, rank, group.world

    def all_reduce_flags(self, flags):
        w, rank = self.world, self.rank
        mine = flags[[rank, w + rank, 2 * w + rank, 3 * w + rank]]
        assert list(mine) == [float(x) for x in self.group.rows[rank]]
        assert not np.delete(flags.reshape(4, w), rank, axis=1).any()  # its own slots only: the sums are exact
        flags[:] = self.group.total


def test_members_agree_on_the_late_ranks_the_clients_in_time_and_the_lower_median():
    # (late, step seconds, clients asked, clients in time); rank 2 had no client this round
    rows = [(False, 0.2, 2, 2), (True, 0.6, 1, 0), (False, 0.0, 0, 0), (False, 0.3, 1, 1)]
    total = np.array([[r[i] for r in rows] for i in range(4)], dtype=np.float64).reshape(-1)
    group = FlagsGroup(total, rows)
    got = [agree(group.member(r), late=rows[r][0], step_s=rows[r][1], asked=rows[r][2], made=rows[r][3])
           for r in range(4)]
    assert all(a == got[0] for a in got)  # every member reads the same decision
    assert got[0] == Agreement(late=(1,), made=3, median_s=0.3, asked=4)  # of 0.2, 0.3, 0.6 (rank 2 asked nothing)
    assert got[0].rerun(4) and not got[0].rerun(3)
    assert not Agreement(late=(), made=0, median_s=None).rerun(5)  # nobody late: never run again


def test_a_members_deadline_is_seconds_from_its_start_or_the_factor_of_the_last_median():
    clock = MemberClock()
    assert clock.until(DeadlineSpec(2.5, None, 1, 3.0), 100.0) == 102.5
    factor = DeadlineSpec(None, 2.0, 1, 3.0)
    assert clock.until(factor, 100.0) is None  # a group's first round: no median known yet
    clock.median_s = 0.3
    assert clock.until(factor, 100.0) == pytest.approx(100.6)
    assert DeadlineSpec.of(Deadline(None, 1.5, 2), 4.0) == DeadlineSpec(None, 1.5, 2, 4.0)
    assert DeadlineSpec.of(None, 4.0) is None


# -- a client's steps under the collective's deadline (fdam_ray/clients/late.py) -------------------------------
class _Now:
    """A monotonic clock the test moves."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _steps(clock: StepClock, now: _Now, until: float | None, times: list[float]) -> tuple[int, float | None]:
    """Run ``len(times)`` steps of those durations under ``until``; (steps run, the cut's projected end or None)."""
    clock.begin(until)
    for i, took in enumerate(times):
        try:
            clock.before_step(len(times) - i, "c")
        except LateSteps as cut:
            return i, cut.ends
        now.t += took
    clock.end()
    return len(times), None


def test_a_client_stops_at_the_first_step_its_fastest_pace_cannot_end_in_time(monkeypatch):
    now = _Now()
    monkeypatch.setattr(late.time, "monotonic", now)
    even, slow = StepClock(), StepClock()
    assert _steps(even, now, 1.25, [0.25] * 4) == (4, None) and even.pace == pytest.approx(0.25)
    now.t = 0.0
    # 4 steps of 0.75 s against 1.25 s: after the first, 3 more would end at 3.0 s; cut then, not at 1.5 s
    ran, ends = _steps(slow, now, 1.25, [0.75] * 4)
    assert ran == 1 and ends == pytest.approx(3.0) and slow.pace == pytest.approx(0.75)
    # without a deadline nothing is timed and nothing cut
    now.t = 0.0
    assert _steps(StepClock(), now, None, [5.0] * 3) == (3, None)
    # the first step starts unless the deadline has passed, whatever the last round's pace said
    now.t = 0.0
    assert _steps(slow, now, 1.25, [0.25] * 4) == (4, None)  # recovered: timed again, not cut for its past
    assert slow.pace == pytest.approx(0.25)
    now.t = 2.0
    assert _steps(StepClock(), now, 1.25, [0.1]) == (0, 2.0)  # past the deadline before any step


def test_the_last_rounds_pace_keeps_one_slow_step_from_cutting_an_even_client(monkeypatch):
    now = _Now()
    monkeypatch.setattr(late.time, "monotonic", now)
    jitter = [0.35, 0.25, 0.25, 0.25]  # 1.1 s in all: in time for 1.25 s
    fresh = StepClock()
    assert _steps(fresh, now, 1.25, jitter) == (1, pytest.approx(0.35 * 4))  # one step known: 0.35 s a step
    known = StepClock()
    now.t = 0.0
    assert _steps(known, now, 10.0, [0.25] * 4) == (4, None)
    now.t = 0.0
    assert _steps(known, now, 1.25, jitter) == (4, None)  # min(0.35, last round's 0.25): 1.1 s projected
    assert known.pace == pytest.approx(0.25)
