"""Sweeps over runs with ``clinical: on``: trials report the pooled read-out of the test and the validation parts
(not the per-site figures), ``tune.metric`` may name them, and with ``select_by: val_pauc`` in every trial the
sweep selects on ``val_pauc`` by default, as each run does (fdam_ray.tuning.space, fdam_ray.tuning.trial)."""

from __future__ import annotations

import logging

import pytest

from fdam_ray.config import ConfigError
from fdam_ray.tuning.space import TuneOptions, make_space
from fdam_ray.tuning.trial import reported_metrics

BASE = dict(dataset="synthetic", num_clients=2, model="mlp", model_width=8, iterations=20, eval_every=10,
            executor="inline", tensorboard=False, val_fraction=0.2, clinical="on")
SEARCH = {"lr": {"grid": [0.1, 0.01]}}


def test_trials_report_the_pooled_read_out_and_the_metric_may_name_it():
    record = {"iteration": 10, "test_auc": 0.8, "val_auc": 0.7, "test_auc_se": 0.02, "test_auc_ci_low": 0.76,
              "test_auc_ci_logit_high": 0.83, "test_pauc": 0.05, "test_pauc_mcclish": 0.7, "test_tpauc": 0.01,
              "test_sens_at_spec_0.9": 0.6, "val_spec_at_sens_0.95": 0.4, "val_pauc": 0.04, "val_auc_ci_high": 0.8,
              "client_pauc": {"0": 0.03}, "val_client_pauc": {"0": 0.02}, "task_pauc": {"a": 0.1}}
    reported = reported_metrics(record)
    assert set(reported) == {"iteration", "test_auc", "val_auc", "test_auc_se", "test_auc_ci_low",
                             "test_auc_ci_logit_high", "test_pauc", "test_pauc_mcclish", "test_tpauc",
                             "test_sens_at_spec_0.9", "val_spec_at_sens_0.95", "val_pauc", "val_auc_ci_high"}
    for metric in ("val_pauc", "test_pauc_mcclish", "val_tpauc", "test_auc_ci_logit_low", "val_sens_at_spec_0.9"):
        assert TuneOptions(metric=metric).metric == metric
    for metric in ("val_pauc_", "test_auc_ci_middle", "client_pauc.0"):
        with pytest.raises(ConfigError, match=f"tune option 'metric': '{metric}' is not reported"):
            TuneOptions(metric=metric)


def test_the_default_metric_is_the_trials_select_by(caplog):
    assert make_space({"base": BASE, "search": SEARCH}).options.metric == "val_auc"
    by_pauc = {**BASE, "select_by": "val_pauc"}
    assert make_space({"base": by_pauc, "search": SEARCH}).options.metric == "val_pauc"
    mixed = {"select_by": {"grid": ["val_auc", "val_pauc"]}}
    assert make_space({"base": BASE, "search": mixed}).options.metric == "val_auc"  # trials differ: val_auc
    with caplog.at_level(logging.WARNING):
        chosen = make_space({"base": by_pauc, "search": SEARCH, "tune": {"metric": "test_pauc"}})
    assert chosen.options.metric == "test_pauc" and "selects on it" in caplog.text
    with pytest.raises(ConfigError, match="val_pauc needs val_fraction > 0"):
        make_space({"base": {**BASE, "val_fraction": 0.0}, "search": SEARCH, "tune": {"metric": "val_pauc"}})
