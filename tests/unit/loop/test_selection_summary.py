"""With a validation part whose AUC is never defined (one class), no model is selected: summary.json says so
(``selected_by: last``, and why) instead of claiming a selection by val_auc (fdam_ray.loop.summary)."""

from __future__ import annotations

import logging
import math

import numpy as np

from fdam_ray.algorithms.stages import init_server_state
from fdam_ray.checkpoint import LoopState
from fdam_ray.core.state import GlobalState
from fdam_ray.loop.summary import keep_best, run_summary, selected_evaluation

NAN = float("nan")


def _loop(records):
    state = GlobalState(v=np.zeros(3, np.float32), alpha=np.zeros(1, np.float32), buffers=np.zeros(0, np.float32),
                        counters=np.zeros(0, np.int64))
    loop = LoopState(server=init_server_state(state))
    for rec in records:
        keep_best(loop, rec)
        loop.history.append(rec)
    return loop


def _summary(loop):
    best = selected_evaluation(loop, validation=True)
    return run_summary(loop, best, algorithm="codasca", validation=True, started=0.0,
                       positive_ratio=np.array([0.5]), client_names=None)


def test_a_validation_auc_never_defined_selects_nothing_and_says_why(caplog):
    records = [{"iteration": i, "test_auc": t, "val_auc": NAN} for i, t in [(0, 0.5), (10, 0.8), (20, 0.7)]]
    with caplog.at_level(logging.WARNING, logger="fdam_ray.loop.summary"):
        summary = _summary(_loop(records))
    assert summary["selected_by"] == "last"
    assert "one class" in summary["selection"] and "\n" not in summary["selection"]
    assert summary["best_iteration"] == 20 and summary["best_test_auc"] == 0.7  # the last evaluation, said so
    assert math.isnan(summary["best_val_auc"])
    assert [r.getMessage() for r in caplog.records if "no model was selected" in r.getMessage()]


def test_a_defined_validation_auc_still_selects_by_it():
    records = [{"iteration": 0, "test_auc": 0.5, "val_auc": 0.6}, {"iteration": 10, "test_auc": 0.7, "val_auc": 0.9},
               {"iteration": 20, "test_auc": 0.8, "val_auc": 0.7}]
    summary = _summary(_loop(records))
    assert summary["selected_by"] == "val_auc" and "selection" not in summary
    assert summary["best_iteration"] == 10 and summary["best_val_auc"] == 0.9


def test_the_command_line_summary_does_not_claim_a_selection():
    from fdam_ray.cli import _summary as printed

    records = [{"iteration": i, "test_auc": 0.7, "val_auc": NAN} for i in (0, 10)]
    line = printed(_summary(_loop(records)))
    assert "selected by val AUC" not in line and "none selected" in line
