"""With ``clinical: on`` the experiment trackers get the clinical columns: every evaluation's interval, pAUC and
per-site figures under their metrics.csv names, and at the end the summary's final and selected figures (MLflow on a
local SQLite store, W&B offline; fdam_ray.outputs.trackers)."""

from __future__ import annotations

import math

import pytest
from test_trackers import wandb_run

from fdam_ray.assembly.recipe import run
from fdam_ray.config import build_config
from fdam_ray.outputs import scalars
from fdam_ray.outputs.trackers import SUMMARY_KEYS, summary_metrics

pytest.importorskip("mlflow")
pytest.importorskip("wandb")

CLINICAL = dict(dataset="synthetic", model="mlp", model_width=8, num_clients=2, samples_per_client=120,
                batch_size=16, local_steps=3, iterations=18, stage_length=9, eval_every=6, executor="inline",
                tensorboard=False, tracker_project="clinic", val_fraction=0.25, clinical="on", pauc_min_tpr=0.5,
                select_by="val_pauc", run_name="run")
COLUMNS = ("test_auc_ci_low", "test_auc_ci_high", "test_auc_ci_logit_low", "test_auc_se", "test_pauc",
           "test_pauc_mcclish", "test_tpauc", "client_auc_ci_low.0", "client_pauc.1", "val_pauc", "val_auc_ci_high",
           "val_client_pauc_mcclish.0")
ENDING = ("final_test_auc_ci_low", "final_test_pauc_mcclish", "best_test_auc_ci_high", "best_test_pauc",
          "best_val_pauc", "final_val_pauc")


def test_summary_metrics_are_the_plain_keys_and_the_clinical_ones():
    summary = {"final_test_auc": 0.9, "best_val_auc": float("nan"), "final_test_auc_ci_low": 0.8,
               "best_val_pauc": 0.05, "best_test_sens_at_spec_0.9": 0.7, "selected_by": "val_pauc",
               "client_names": ["a"], "best_val_tpauc": None, "final_val_client_pauc": 0.1, "rounds": 3,
               "positive_ratio": [0.5], "dp_epsilon": 2.0}
    got = summary_metrics(summary)
    assert set(got) == {"final_test_auc", "best_val_auc", "final_test_auc_ci_low", "best_val_pauc",
                        "best_test_sens_at_spec_0.9", "rounds"}
    assert math.isnan(got["best_val_auc"]) and set(SUMMARY_KEYS) >= {"final_test_auc", "rounds"}


@pytest.fixture
def mlflow_store(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.chdir(tmp_path)
    return MlflowClient(uri)


def test_mlflow_gets_the_clinical_columns_and_the_summarys_figures(tmp_path, mlflow_store):
    r = run(build_config(dict(CLINICAL, out_dir=str(tmp_path / "runs"), trackers=["mlflow"])))
    client = mlflow_store
    experiment = client.get_experiment_by_name("clinic")
    (logged,) = client.search_runs([experiment.experiment_id])
    run_id = logged.info.run_id
    for name in COLUMNS:
        history = sorted((m.step, m.value) for m in client.get_metric_history(run_id, name))
        want = [(h["iteration"], scalars(h)[name]) for h in r.history]
        assert [s for s, _ in history] == [s for s, _ in want], name
        assert [v for _, v in history] == pytest.approx([v for _, v in want]), name
    for name in ENDING:
        (metric,) = client.get_metric_history(run_id, f"summary.{name}")
        assert metric.value == pytest.approx(r.summary[name]), name
    assert r.summary["selected_by"] == "val_pauc"


def test_wandb_gets_the_clinical_columns_and_the_summarys_figures(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    r = run(build_config(dict(CLINICAL, trackers=["wandb"])), save=False)
    logged = wandb_run(tmp_path)
    for h in r.history:
        row = logged["history"][h["iteration"]]
        for name in COLUMNS:
            assert row[name] == pytest.approx(scalars(h)[name]), name
    for name in ENDING:
        assert logged["summary"][name] == pytest.approx(r.summary[name]), name
