"""The scripts in examples/, each run in its reduced form (--quick), as a user would run them."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
import raytest
import yaml

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_examples_readme_lists_every_example():
    listed = set(re.findall(r"`(\w+\.py)`", (EXAMPLES / "README.md").read_text()))
    assert {p.name for p in EXAMPLES.glob("*.py")} <= listed
    assert {"hospitals.py", "sweep.py", "own_model_and_data.py"} <= listed


def test_hospitals_splits_real_imbalanced_data_and_reports_pooled_and_per_site_auc(capsys):
    hospitals = load("hospitals")
    sites = hospitals.hospitals()
    assert [name for name, _, _ in sites] == ["general", "screening", "referral"]
    rates = [float(train[1].mean()) for _, train, _ in sites]
    assert rates[0] < 0.25 < rates[1] < 0.4 < 0.6 < rates[2]  # imbalanced, and differently so per site
    assert sum(len(train[1]) + len(test[1]) for _, train, test in sites) == 569  # every patient, once
    assert all(0 < test[1].mean() < 1 for _, _, test in sites)  # each site's test split has both classes

    assert hospitals.main(["--quick"]) == 0
    out = capsys.readouterr().out
    pooled = float(re.search(r"pooled test AUC: ([\d.]+)", out).group(1))
    assert pooled > 0.85  # untrained scores sit near 0.5
    rows = re.findall(r"^(general|screening|referral)\s+([\d.]+)\s+([\d.]+)$", out, re.M)
    assert [r[0] for r in rows] == ["general", "screening", "referral"]
    assert all(0.7 < float(r[1]) <= 1 and 0 < float(r[2]) <= 1 for r in rows)


@pytest.fixture(scope="module")
def ray_session():
    with raytest.ray_session(num_cpus=2):
        yield


def test_sweep_from_python_writes_the_best_config_without_tunes_snapshot_warning(tmp_path, ray_session, capfd,
                                                                                 monkeypatch):
    monkeypatch.delenv("TUNE_WARN_EXCESSIVE_EXPERIMENT_CHECKPOINT_SYNC_THRESHOLD_S", raising=False)
    assert load("sweep").main(["--quick", "--out", str(tmp_path / "sweeps")]) == 0
    out, err = capfd.readouterr()
    # Tune warns "Experiment state snapshotting has been triggered multiple times" at nearly every report of a
    # short sweep unless fdam turns it off (local storage)
    assert "Experiment state snapshotting" not in out + err
    folder = next((tmp_path / "sweeps").iterdir())
    best = yaml.safe_load((folder / "best_config.yaml").read_text())
    rows = (folder / "sweep_results.csv").read_text().splitlines()
    assert rows[0].startswith("trial,lr,final_worst_client_auc,best_worst_client_auc") and len(rows) == 3
    assert best["lr"] == float(rows[1].split(",")[1])  # the best trial's lr, selected on the worst client
    assert f"best config: {folder / 'best_config.yaml'}" in out


@pytest.mark.slow
def test_sweep_trials_reach_mlflow_and_wandb_through_tunes_callbacks(tmp_path, ray_session, monkeypatch):
    pytest.importorskip("mlflow")
    pytest.importorskip("wandb")
    from mlflow.tracking import MlflowClient
    from test_trackers import wandb_run

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.chdir(tmp_path)  # MLflow's artifacts go to ./mlruns
    assert load("sweep").main(["--quick", "--out", str(tmp_path / "sweeps"), "--trackers", "mlflow,wandb"]) == 0
    best = yaml.safe_load(next((tmp_path / "sweeps").iterdir()).joinpath("best_config.yaml").read_text())
    assert best["trackers"] == ["mlflow", "wandb"]

    # Ray Tune's MLflow callback: one run per trial, with the trial's config and every report
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("fdam-ray").experiment_id])
    assert sorted(r.data.params["lr"] for r in runs) == ["0.01", "0.1"]
    for r in runs:
        assert [m.value for m in client.get_metric_history(r.info.run_id, "iteration")] == [0, 30, 60]
        assert {"test_auc", "worst_client_auc", "client_auc.0", "client_auc.2", "bytes_up"} <= set(r.data.metrics)
    # and W&B's, offline: a run per trial
    offline = list(tmp_path.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(offline) == 2
    for path in offline:
        logged = wandb_run(path)
        assert logged["config"]["lr"] in (0.1, 0.01)
        assert [row["iteration"] for _, row in sorted(logged["history"].items())] == [0, 30, 60]
