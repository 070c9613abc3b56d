"""Pre-training fields without pre-training are said once; stage 1 says where it is while it runs."""

from __future__ import annotations

import logging

import pytest

import fdam_ray
from fdam_ray.assembly.pretrain import pretrain_config
from fdam_ray.config import build_config
from fdam_ray.core.state import RoundPlan
from fdam_ray.outputs.observer import RunStart

SMALL = dict(algorithm="codasca", dataset="synthetic", num_clients=2, samples_per_client=60, num_features=5,
             executor="inline", model="linear", batch_size=16, eval_every=1000)


@pytest.fixture(autouse=True)
def _fresh_warnings(monkeypatch):
    monkeypatch.setattr("fdam_ray.settings.sections._WARNED", set(), raising=False)


@pytest.mark.parametrize("fields, named", [
    (dict(pretrain_optimizer="adam"), "pretrain_optimizer = adam"),
    (dict(pretrain_lr=1e-5), "pretrain_lr = 1e-05"),
    (dict(pretrain_batch_size=8, pretrain_federated=False), "pretrain_batch_size = 8, pretrain_federated = false"),
])
def test_pretraining_fields_without_pretraining_warn_once(caplog, fields, named):
    with caplog.at_level(logging.WARNING, logger="fdam_ray"):
        build_config(fields)
        build_config(fields)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and named in lines[0] and "pretrain_iterations = 0" in lines[0]


def test_a_two_stage_run_and_its_stage_1_warn_nothing(caplog):
    with caplog.at_level(logging.WARNING, logger="fdam_ray"):
        config = build_config(pretrain_iterations=10, pretrain_optimizer="adam", pretrain_lr=0.01,
                              pretrain_batch_size=8, pretrain_federated=False)
        stage1 = pretrain_config(config)
    assert stage1.pretrain_iterations == 0 and stage1.local_optimizer == "adam"
    assert not caplog.records


def test_progress_lines_at_most_every_interval():
    from fdam_ray.assembly.pretrain import PretrainProgress

    now = [0.0]
    progress = PretrainProgress(every_s=30, clock=lambda: now[0])
    progress.start(RunStart(resumed=False, history=[], round=0, iteration=0, iterations=100))
    said = []
    import fdam_ray.assembly.pretrain as pretrain

    pretrain.log.info, keep = (lambda msg, *a: said.append(msg % a)), pretrain.log.info
    try:
        for r, t in enumerate([10, 31, 40, 62, 70], start=1):
            now[0] = float(t)
            progress.round_end(RoundPlan(round=r, stage=1, steps=10, lr=0.1, iteration=10 * (r - 1)), None, None)
        progress.record({"test_auc": 0.5}, lambda: None)  # an evaluation line was just logged (at 70 s)
        now[0] = 95.0
        progress.round_end(RoundPlan(round=6, stage=1, steps=10, lr=0.1, iteration=50), None, None)
    finally:
        pretrain.log.info = keep
    assert said == ["pre-training: iteration 20 of 100 (20%), round 2, 31 s so far",
                    "pre-training: iteration 40 of 100 (40%), round 4, 62 s so far"]


def test_stage_1_logs_its_progress(monkeypatch, caplog):
    monkeypatch.setattr("fdam_ray.assembly.pretrain.PROGRESS_EVERY_S", 0.0)
    with caplog.at_level(logging.INFO, logger="fdam_ray"):
        fdam_ray.train(build_config(SMALL, iterations=2, local_steps=1, pretrain_iterations=4), save=False)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("pre-training: iteration")]
    assert lines[0].startswith("pre-training: iteration 1 of 4 (25%), round 1") and len(lines) == 4
