from __future__ import annotations

import logging

import pytest

from fdam_ray.config import build_config
from fdam_ray.schedules import Schedule


def plans(**kw):
    return list(Schedule(build_config(**kw)).plans())


def test_stagewise_switches_at_round_ends_and_decays_lr(caplog):
    with caplog.at_level(logging.WARNING):
        out = plans(iterations=50, local_steps=4, stage_length=10, lr=0.9, lr_decay=3)
    assert "not a multiple" in caplog.text
    steps = [p.steps for p, _ in out]
    assert sum(steps) == 50 and steps[-1] == 2  # last round shortened to hit the budget
    ends = [p.iteration + p.steps for p, e in out if e]
    assert ends == [12, 24, 36, 48]  # first round end at or after 10 iterations into each stage
    lrs = {p.stage: p.lr for p, _ in out}
    assert lrs == pytest.approx({1: 0.9, 2: 0.3, 3: 0.1, 4: 0.1 / 3, 5: 0.1 / 9})


def test_stagewise_without_warning_when_multiple(caplog):
    with caplog.at_level(logging.WARNING):
        out = plans(iterations=40, local_steps=5, stage_length=20)
    assert "not a multiple" not in caplog.text
    assert [p.round for p, e in out if e] == [4]


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
