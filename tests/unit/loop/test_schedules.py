from __future__ import annotations

import logging

import pytest

from fdam_ray.config import build_config
from fdam_ray.core.schedules import Schedule, last_stage


def plans(**kw):
    return list(Schedule(build_config(**kw)).plans())


def switches(out):
    return [p.iteration for p, starts in out if starts]  # iterations done when each new stage begins


def test_stagewise_switches_at_the_first_round_end_after_each_multiple_of_t0(caplog):
    with caplog.at_level(logging.WARNING):
        out = plans(iterations=50, local_steps=4, stage_length=10, lr=0.9, lr_decay=3)
    assert "not a multiple" in caplog.text
    steps = [p.steps for p, _ in out]
    assert sum(steps) == 50 and steps[-1] == 2  # last round shortened to hit the budget
    assert switches(out) == [12, 20, 32, 40]  # at or after 10, 20, 30, 40: late by < I, never drifting
    lrs = {p.stage: p.lr for p, _ in out}
    assert lrs == pytest.approx({1: 0.9, 2: 0.3, 3: 0.1, 4: 0.1 / 3, 5: 0.1 / 9})


def test_a_schedule_continues_from_a_saved_position_even_with_a_longer_budget():
    full = plans(iterations=36, local_steps=3, stage_length=12)
    first = Schedule(build_config(iterations=24, local_steps=3, stage_length=12))
    head = list(first.plans())
    assert switches(head) == [12]  # the switch due at 24 is not made: the run ends there
    rest = list(Schedule(build_config(iterations=36, local_steps=3, stage_length=12), first.position).plans())
    assert [(p, s) for p, s in head + rest] == full  # resumed with more iterations: the same schedule
    assert switches(rest) == [24]
    short = Schedule(build_config(iterations=25, local_steps=3))
    list(short.plans())
    more = list(Schedule(build_config(iterations=30, local_steps=3), short.position).plans())
    assert [p.steps for p, _ in more] == [3, 2] and more[-1][0].iteration + more[-1][0].steps == 30


def test_stagewise_without_warning_when_multiple(caplog):
    with caplog.at_level(logging.WARNING):
        out = plans(iterations=40, local_steps=5, stage_length=20)
    assert "not a multiple" not in caplog.text
    assert [p.round for p, starts in out if starts] == [5]


def test_geometric_grows_local_steps_and_shrinks_lr():
    out = plans(schedule="geometric", iterations=200, local_steps=2, lr=0.8, stage_growth=2, rounds_per_stage=3)
    by_stage = {}
    for p, _ in out:
        by_stage.setdefault(p.stage, []).append((p.steps, p.lr))
    assert by_stage[1] == [(2, 0.8)] * 3
    assert by_stage[2] == [(4, 0.4)] * 3
    assert by_stage[3] == [(8, 0.2)] * 3
    assert all(s * lr == pytest.approx(1.6) for p, _ in out for s, lr in [(p.steps, p.lr)] if p.stage < 5)
    assert sum(p.steps for p, _ in out) == 200


@pytest.mark.parametrize("kw", [
    dict(iterations=50, local_steps=4, stage_length=10),
    dict(iterations=60, local_steps=5, stage_length=10),
    dict(iterations=7, local_steps=3, stage_length=100),
    dict(schedule="geometric", iterations=100, local_steps=2, rounds_per_stage=3, stage_growth=2.0),
    dict(schedule="geometric", iterations=37, local_steps=1, rounds_per_stage=2, stage_growth=1.5),
])
def test_last_stage_bounds_the_stage_and_lr_a_run_reaches(kw):
    out = plans(lr=0.5, **kw)
    stage, lr = last_stage(build_config(lr=0.5, **kw))
    reached = out[-1][0]
    assert reached.stage <= stage and lr <= reached.lr
    if kw.get("schedule") == "geometric" or kw["stage_length"] % kw["local_steps"] == 0:
        assert (stage, lr) == (reached.stage, pytest.approx(reached.lr))
