"""The round deadline's rule in closed form (fdam_ray.executors.deadlines.Deadline.due), from given arrival times:
seconds are due at once; a factor f is due at f times the lower median arrival, which leaves an actor out only when
it is more than (f - 1) median times behind the median. Rounds whose local steps dominate every actor's time are
therefore cut only with a factor near 1 (the module's docstring says why no rule on the round's times can do
better); and the transport that cannot leave an actor out of a round refuses a deadline in one line."""

from __future__ import annotations

import random

import pytest

from fdam_ray.config import ConfigError, build_config
from fdam_ray.executors.deadlines import Deadline


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


def test_the_collective_transport_refuses_a_deadline_saying_why_and_what_to_use():
    with pytest.raises(ConfigError) as info:
        build_config(dict(round_deadline="2x", executor="ray", transport="collective"))
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("config field 'round_deadline': '2x' is not allowed (null with transport=collective")
    assert "every actor's all-reduce waits for every other" in message and "use transport=classic" in message
    assert build_config(dict(round_deadline="2x", executor="ray", transport="classic")).round_deadline == "2x"
