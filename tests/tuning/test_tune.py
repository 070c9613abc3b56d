"""Tune sweeps over whole federations: grid, ASHA early stopping, resume after a stop, best config."""

from __future__ import annotations

import csv
import logging

import pytest
import ray
import yaml

from fdam_ray.cli import main
from fdam_ray.config import ConfigError, build_config, parse_overrides
from fdam_ray.executors.ray.compat import start_loopback_ray
from fdam_ray.tuning import load_space, run_sweep

BASE = dict(algorithm="codasca", dataset="synthetic", heterogeneity=1.0, num_clients=2, samples_per_client=200,
            model="mlp", model_width=8, batch_size=32, iterations=120, eval_every=30, stage_length=60,
            executor="inline", threads_per_client=1, tensorboard=False)


@pytest.fixture(scope="module")
def ray_session():
    start_loopback_ray(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield
    ray.shutdown()


def read_rows(sweep_dir):
    with open(sweep_dir / "sweep_results.csv", newline="") as fh:
        return list(csv.DictReader(fh))


def write_space(tmp_path, search, tune_opts, base=None, name="space.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump({"base": {**BASE, **(base or {})}, "search": search,
                                    "tune": {"storage_path": str(tmp_path / "sweeps"), **tune_opts}}))
    return path


@pytest.mark.slow
def test_grid_sweep_picks_the_best_trial_and_its_config_trains(tmp_path, ray_session, capsys):
    # Client actors inside each trial's placement group: 0.5 + 2 x 0.25 CPU, so two trials share 2 CPUs.
    space = load_space(str(write_space(tmp_path, {"lr": {"grid": [0.2, 0.002]}, "local_steps": {"grid": [2, 10]}},
                                       {"name": "grid", "driver_cpus": 0.5},
                                       base={"executor": "ray", "cpus_per_client": 0.25})))
    out = run_sweep(space).path
    rows = read_rows(out)
    assert len(rows) == 4
    aucs = [float(r["final_test_auc"]) for r in rows]
    assert aucs == sorted(aucs, reverse=True)  # sorted by the metric
    assert all(r["iterations"] == "120" for r in rows)
    assert float(rows[0]["lr"]) == 0.2 and aucs[0] > aucs[-1] + 0.05  # the large lr learns in 120 iterations
    best = yaml.safe_load((out / "best_config.yaml").read_text())
    assert best["lr"] == 0.2 and best["local_steps"] == int(rows[0]["local_steps"])
    assert (out / "top_trials.png").stat().st_size > 5000
    rc = main(["train", "--config", str(out / "best_config.yaml"), f"out_dir={tmp_path / 'runs'}", "iterations=20",
               "executor=inline", "--quiet"])
    assert rc == 0 and "final test AUC" in capsys.readouterr().out


@pytest.mark.slow
def test_each_trial_reserves_bundles_for_its_own_number_of_clients(tmp_path, ray_session):
    space = load_space(str(write_space(tmp_path, {"num_clients": {"grid": [1, 3]}},
                                       {"name": "k", "driver_cpus": 0.5},
                                       base={"executor": "ray", "cpus_per_client": 0.25, "iterations": 30})))
    rows = read_rows(run_sweep(space).path)
    assert sorted(int(r["num_clients"]) for r in rows) == [1, 3]
    assert all(r["iterations"] == "30" and not r["error"] for r in rows)


@pytest.mark.slow
def test_compiled_rounds_run_inside_the_trials_and_end_with_them(tmp_path, ray_session):
    from ray.util.placement_group import placement_group_table

    space = load_space(str(write_space(tmp_path, {"lr": {"grid": [0.2, 0.002]}}, {"name": "cg", "driver_cpus": 0.5},
                                       base={"executor": "ray", "cpus_per_client": 0.25, "iterations": 60,
                                             "transport": "compiled"})))
    rows = read_rows(run_sweep(space).path)
    assert len(rows) == 2 and all(r["iterations"] == "60" and not r["error"] for r in rows)
    assert float(rows[0]["lr"]) == 0.2 and float(rows[0]["final_test_auc"]) > float(rows[1]["final_test_auc"])
    # each trial's graph, actors and bundles went with the trial
    assert all(g["state"] == "REMOVED" for g in placement_group_table().values())


@pytest.mark.slow
def test_asha_stops_weak_trials_early(tmp_path, ray_session):
    space = load_space(str(write_space(
        tmp_path, {"lr": {"grid": [0.3, 0.1, 0.001, 0.0003]}},
        {"name": "asha", "scheduler": "asha", "grace_period": 30, "reduction_factor": 2, "driver_cpus": 1,
         "max_concurrent_trials": 2})))
    out = run_sweep(space).path
    iterations = sorted(int(r["iterations"]) for r in read_rows(out))
    assert iterations[0] < 120 and iterations[-1] == 120


def test_bad_space_files_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="search field 'learning_rate' is not a config field"):
        load_space(str(write_space(tmp_path, {"learning_rate": {"grid": [0.1]}}, {})))
    with pytest.raises(ConfigError, match=r"config field 'lr': -1\.0 is not allowed"):
        load_space(str(write_space(tmp_path, {"lr": {"grid": [0.1, -1.0]}}, {})))
    with pytest.raises(ConfigError, match="unknown tune option 'schedular'"):
        load_space(str(write_space(tmp_path, {"lr": {"grid": [0.1]}}, {"schedular": "asha"})))
    with pytest.raises(ConfigError, match="grid takes only"):
        load_space(str(write_space(tmp_path, {"lr": {"loguniform": [0.001, 0.1]}}, {})))


def test_random_search_spaces_and_the_optional_bayesian_searcher(tmp_path, monkeypatch):
    import importlib.util

    from ray import tune

    from fdam_ray.tuning import param_space
    from fdam_ray.tuning.sweep import _searcher

    search = {"lr": {"loguniform": [0.001, 0.1]}, "local_steps": {"randint": [1, 8]},
              "global_lr": {"uniform": [0.9, 1.1]}}
    space = load_space(str(write_space(tmp_path, search, {"searcher": "random", "num_samples": 3})))
    params = param_space(space.search, "random")
    assert isinstance(params["lr"], tune.search.sample.Float) and params["lr"].lower == 0.001
    assert isinstance(params["local_steps"], tune.search.sample.Integer) and params["local_steps"].upper == 9
    optuna = load_space(str(write_space(tmp_path, {"lr": {"uniform": [0.01, 0.1]}}, {"searcher": "optuna"})))
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "optuna" else object())
    with pytest.raises(ConfigError, match="optuna needs the optuna package"):
        _searcher(optuna)


def test_scientific_notation_in_space_files_and_tune_options(tmp_path):
    path = tmp_path / "space.yaml"
    path.write_text("base: {dataset: synthetic, iterations: 2e2, prox_weight: 2E-3}\n"
                    "search: {lr: {grid: [1e-3, 1e-2]}, weight_decay: {loguniform: [1e-5, 1e-3]}}\n"
                    "tune: {searcher: random, reduction_factor: 3e0}\n")
    space = load_space(str(path), parse_overrides(["tune.grace_period=1e2", "global_lr=1.5e0"]))
    assert space.search["lr"] == {"grid": [0.001, 0.01]}
    assert space.search["weight_decay"] == {"loguniform": [1e-05, 0.001]}
    assert space.base["iterations"] == 200.0 and space.base["prox_weight"] == 0.002 and space.base["global_lr"] == 1.5
    assert space.options.reduction_factor == 3.0 and space.options.grace_period == 100
    assert isinstance(space.options.grace_period, int)


def test_a_sweep_whose_trials_all_fail_has_no_best_config_and_exits_1(tmp_path, ray_session, capsys):
    space = write_space(tmp_path, {"lr": {"grid": [0.1, 0.01]}}, {"name": "allfail", "driver_cpus": 0.5},
                        base={"iterations": 20, "model_weights": str(tmp_path / "missing.pt")})
    assert main(["tune", str(space)]) == 1
    err = capsys.readouterr().err
    sweep = tmp_path / "sweeps" / "allfail"
    assert not (sweep / "best_config.yaml").exists()
    failures = [line for line in err.splitlines() if "failed: ValueError: model_weights:" in line]
    assert len(failures) == 2 and "2 of 2 trials failed" in err and "no trial finished without an error" in err
    assert "is not a file" in (sweep / "errors.log").read_text()


def test_a_sweep_with_one_failed_trial_takes_its_best_config_from_the_others(tmp_path, ray_session, capsys):
    space = write_space(tmp_path, {"model_weights": {"grid": [None, str(tmp_path / "missing.pt")]}},
                        {"name": "onefail", "driver_cpus": 0.5}, base={"iterations": 20})
    assert main(["tune", str(space)]) == 0
    err = capsys.readouterr().err
    sweep = tmp_path / "sweeps" / "onefail"
    assert "1 of 2 trials failed" in err and len([x for x in err.splitlines() if "failed: " in x]) == 1
    assert yaml.safe_load((sweep / "best_config.yaml").read_text())["model_weights"] is None
    rows = read_rows(sweep)
    assert [r["error"] for r in rows] == ["", "error"]  # the failed trial is listed last


@pytest.mark.parametrize("change", ["group-writable file", "world-writable folder", "file of another user"])
def test_resume_refuses_a_sweep_folder_others_can_write(tmp_path, capsys, change):
    import dataclasses
    import os

    from fdam_ray.tuning.space import SPACE_FILE, TuneOptions

    sweep = tmp_path / "sweep"
    sweep.mkdir(mode=0o755)
    (sweep / SPACE_FILE).write_text(yaml.safe_dump({"base": BASE, "search": {"lr": {"grid": [0.1]}},
                                                    "tune": dataclasses.asdict(TuneOptions())}))
    pkl = sweep / "tuner.pkl"
    pkl.write_bytes(b"a pickle that must never be opened")
    os.chmod(pkl, 0o644)
    {"group-writable file": lambda: os.chmod(pkl, 0o664),
     "world-writable folder": lambda: os.chmod(sweep, 0o777),
     "file of another user": lambda: os.chown(pkl, 54321, -1)}[change]()
    was_running = ray.is_initialized()
    assert main(["tune", "--resume", str(sweep)]) == 2
    err = capsys.readouterr().err
    target = sweep if change == "world-writable folder" else pkl
    assert f"--resume: the sweep {'folder' if target == sweep else 'file'} '{target}'" in err
    assert "resuming unpickles the sweep's state" in err and err.count("\n") == 1
    assert ray.is_initialized() == was_running  # refused before Ray was started
    assert sorted(p.name for p in sweep.iterdir()) == [SPACE_FILE, "tuner.pkl"]


def test_trials_report_per_task_per_client_and_worst_aucs_and_the_metric_may_name_them():
    from fdam_ray.tuning.space import TuneOptions
    from fdam_ray.tuning.trial import TuneReport, reported_metrics

    record = {"iteration": 30, "round": 3, "stage": 1, "lr": 0.1, "train_loss": 0.2, "test_auc": 0.8,
              "test_samples": 90, "task_auc": {"Edema": 0.75, "Cardiomegaly": 0.85},
              "client_auc": {"0": 0.9, "1": 0.7}, "bytes_up": 10, "bytes_down": 20, "wall_s": 1.5,
              "samples_per_s": None}
    reported = reported_metrics(record)
    assert reported == {"iteration": 30, "round": 3, "stage": 1, "test_auc": 0.8, "train_loss": 0.2, "bytes_up": 10,
                        "bytes_down": 20, "wall_s": 1.5, "client_auc.0": 0.9, "client_auc.1": 0.7, "lr": 0.1,
                        "task_auc.Cardiomegaly": 0.85, "task_auc.Edema": 0.75, "test_samples": 90,
                        "worst_client_auc": 0.7, "worst_task_auc": 0.75}
    for metric in ("worst_client_auc", "task_auc.Edema", "client_auc.1", "client_auc.site-A", "worst_task_auc",
                   "train_loss"):
        assert TuneOptions(metric=metric).metric == metric
    for metric in ("client_auc.", "auc", "task_auc."):
        with pytest.raises(ConfigError, match=f"tune option 'metric': '{metric}' is not reported"):
            TuneOptions(metric=metric)
    report = TuneReport(build_config(dataset="synthetic"), metric="task_auc.Edema")
    with pytest.raises(ValueError, match=r"this federation does not report 'task_auc\.Edema' \(it reports iteration, "):
        report.record({k: v for k, v in record.items() if k != "task_auc"}, dict)


def test_the_sweep_example_writes_the_best_config_without_tunes_snapshot_warning(tmp_path, ray_session, capfd,
                                                                                 caplog, monkeypatch):
    from test_examples import load

    monkeypatch.delenv("TUNE_WARN_EXCESSIVE_EXPERIMENT_CHECKPOINT_SYNC_THRESHOLD_S", raising=False)
    with caplog.at_level(logging.WARNING):
        assert load("sweep").main(["--quick", "--out", str(tmp_path / "sweeps")]) == 0
    out, err = capfd.readouterr()
    # Tune warns "Experiment state snapshotting has been triggered multiple times" at nearly every report of a
    # short sweep unless fdam turns it off (local storage)
    assert "Experiment state snapshotting" not in out + err + caplog.text
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
    from test_examples import load
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


def test_a_storage_uri_goes_to_tune_untouched(tmp_path, ray_session, monkeypatch, capsys):
    # file:// is the one URI scheme reachable offline; Tune reads it as the local folder it names
    monkeypatch.chdir(tmp_path)
    remote = tmp_path / "bucket"
    uri = f"file://{remote}/sweeps"
    space = write_space(tmp_path, {"lr": {"grid": [0.2, 0.002]}}, {"name": "remote", "driver_cpus": 0.5})
    assert main(["tune", str(space), f"tune.storage_path={uri}", "iterations=60"]) == 0
    sweep = remote / "sweeps" / "remote"
    assert f"sweep results: {sweep / 'sweep_results.md'}" in capsys.readouterr().out
    assert not any(p.name.endswith(":") for p in tmp_path.rglob("*"))  # no local 'file:' folder
    assert len(read_rows(sweep)) == 2 and (sweep / "best_config.yaml").is_file()
    assert len(list(sweep.glob("trial_*/run/metrics.jsonl"))) == 2
    from fdam_ray.tuning.sweep import check_resume_trusted

    check_resume_trusted(f"{uri}/remote")  # a file:// sweep is checked like a local folder, and
    sweep.chmod(0o777)
    with pytest.raises(ConfigError, match="can be written by other users"):
        check_resume_trusted(f"{uri}/remote")
    with pytest.raises(ConfigError, match=r"is remote storage.*--trust-storage"):
        check_resume_trusted("s3://lab/sweeps/remote")  # a bucket's writers cannot be checked from here


def test_a_sweep_kept_at_remote_storage_writes_its_results_there_and_a_local_copy(tmp_path, monkeypatch):
    # the sweep's results, written after Tune returns, go through the same filesystem layer Tune uses; here
    # s3:// is served by a local folder (only in this process: no trial runs)
    import pyarrow.fs

    from fdam_ray.files import locations
    from fdam_ray.tuning.report import write_sweep_outputs

    bucket = tmp_path / "bucket"

    def open_storage(uri):
        assert uri.startswith("s3://lab/sweeps/s3sweep"), uri
        return pyarrow.fs.SubTreeFileSystem(str(bucket), pyarrow.fs.LocalFileSystem()), uri[len("s3://"):]

    monkeypatch.setattr(locations, "open_storage", open_storage)
    monkeypatch.chdir(tmp_path)
    space = load_space(str(write_space(tmp_path, {"lr": {"grid": [0.1]}}, {"name": "s3sweep"})))

    class Result:
        def __init__(self):
            self.error, self.path, self.config = None, "s3://lab/sweeps/s3sweep/trial_0", {"lr": 0.1}
            self.metrics = {"done": True, "test_auc": 0.9, "iteration": 120}
            self.metrics_dataframe = None

    class Grid(list):
        experiment_path = "s3://lab/sweeps/s3sweep"

    (bucket / "lab" / "sweeps" / "s3sweep").mkdir(parents=True)
    (bucket / "lab" / "sweeps" / "s3sweep" / "errors.log").write_text("from an earlier, interrupted pass")
    outcome = write_sweep_outputs(Grid([Result()]), space)
    assert outcome.storage == "s3://lab/sweeps/s3sweep" and outcome.resume_from == outcome.storage
    stored = bucket / "lab" / "sweeps" / "s3sweep"
    assert outcome.path == tmp_path / "tune_results" / "s3sweep"
    for name in ("sweep_results.csv", "sweep_results.md", "best_config.yaml", "top_trials.png"):
        assert (stored / name).read_bytes() == (outcome.path / name).read_bytes(), name
    assert not (stored / "errors.log").exists()  # a stale answer does not stand
    assert read_rows(stored)[0]["final_test_auc"] == "0.9"


def test_an_unreachable_storage_uri_is_one_line_and_no_local_folder(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    space = write_space(tmp_path, {"lr": {"grid": [0.1]}}, {"name": "s3sweep"})
    assert main(["tune", str(space), "tune.storage_path=s3://no-such-bucket-here/sweeps"]) == 1
    err = capsys.readouterr().err
    assert "storage 's3://no-such-bucket-here/sweeps/s3sweep' cannot be opened" in err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["space.yaml"]


def test_a_relative_out_dir_inside_a_ray_job_lands_in_the_home_folder_and_says_where(tmp_path, monkeypatch,
                                                                                       capsys, caplog):
    import json

    from fdam_ray.files.locations import JOB_CONFIG_VARIABLE, output_root

    package = tmp_path / "session" / "runtime_resources" / "working_dir_files" / "_ray_pkg_0123"
    package.mkdir(parents=True)
    home = tmp_path / "home"
    monkeypatch.chdir(package)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv(JOB_CONFIG_VARIABLE, json.dumps({"runtime_env": {"working_dir": "gcs://_ray_pkg_0123.zip"}}))
    assert output_root("/shared/runs", "out_dir") == __import__("pathlib").Path("/shared/runs")  # absolute: kept
    rc = main(["train", "executor=inline", "iterations=4", "eval_every=2", "run_name=job", "--quiet",
               *[f"{k}={v}" for k, v in BASE.items() if k not in ("iterations", "eval_every", "executor")]])
    assert rc == 0
    assert (home / "runs" / "job" / "metrics.jsonl").is_file() and not (package / "runs").exists()
    out = capsys.readouterr().out
    assert f"run folder: {home / 'runs' / 'job'} (on host " in out
    assert any("Ray deletes after the job" in r.getMessage() and "out_dir=runs" in r.getMessage()
               for r in caplog.records)
    monkeypatch.delenv(JOB_CONFIG_VARIABLE)  # a plain process: a relative path is the current folder's
    assert output_root("runs", "out_dir") == __import__("pathlib").Path("runs")
