"""Experiment trackers, offline: MLflow on a local SQLite store, W&B in offline mode; each read back after the run."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import struct
import time
from pathlib import Path

import pytest
import torch
from sample_clients import gaussian_clients

import fdam_ray
import fdam_ray.loop.federation
from fdam_ray.assembly.recipe import resume, run
from fdam_ray.cli import main
from fdam_ray.config import ConfigError, build_config, parse_overrides
from fdam_ray.files.extras import extra_hint
from fdam_ray.outputs import scalars
from fdam_ray.settings.sections import SECRET_FIELDS

pytest.importorskip("mlflow")  # the dev extra installs both; a plain install has neither
pytest.importorskip("wandb")


def cfg(tmp_path, **kw):
    base = dict(dataset="synthetic", model="mlp", model_width=8, num_clients=2, samples_per_client=80,
                batch_size=16, local_steps=3, iterations=18, stage_length=9, eval_every=6, out_dir=str(tmp_path),
                run_name="run", executor="inline", tensorboard=False, tracker_project="tests")
    base.update(kw)
    return build_config(base)


@pytest.fixture(scope="module")
def mlflow_db(tmp_path_factory):
    """A local MLflow store (SQLite, MLflow's default backend), made once: making its tables takes seconds."""
    from mlflow.tracking import MlflowClient

    folder = tmp_path_factory.mktemp("mlflow")
    uri = f"sqlite:///{folder / 'mlflow.db'}"
    here = os.getcwd()
    os.chdir(folder)  # the store (which MLflow keeps per URI) puts artifacts under ./mlruns of where it is made
    try:
        client = MlflowClient(uri)
        client.search_experiments()  # creates the tables
    finally:
        os.chdir(here)
    return uri, client


@pytest.fixture
def mlflow_store(mlflow_db, tmp_path, monkeypatch):
    """The module's MLflow store as this test's tracking URI (artifacts under tmp_path/mlruns)."""
    uri, client = mlflow_db
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.chdir(tmp_path)  # MLflow's default artifact root is ./mlruns
    return client


def only_run(client, project):
    experiment = client.get_experiment_by_name(project)
    assert experiment is not None
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 1
    return runs[0]


def test_config_takes_trackers_as_a_list_or_names_joined_by_commas():
    assert build_config().trackers == ()
    assert build_config(parse_overrides(["trackers=mlflow,wandb"])).trackers == ("mlflow", "wandb")
    assert build_config(parse_overrides(["trackers=[wandb]"])).trackers == ("wandb",)
    assert build_config(parse_overrides(["trackers="])).trackers == ()
    with pytest.raises(ConfigError, match="'trackers': \\['neptune'\\] is not allowed \\(each one of mlflow, wandb"):
        build_config(parse_overrides(["trackers=neptune"]))


def test_mlflow_gets_the_config_every_evaluation_and_the_model_and_a_resume_continues_its_run(
        tmp_path, mlflow_store):
    r = run(cfg(tmp_path / "runs", trackers=["mlflow"], tracker_project="resumed"))
    client = mlflow_store
    logged = only_run(client, "resumed")
    assert logged.info.run_name == "run" and logged.info.status == "FINISHED"
    params = logged.data.params
    assert params["lr"] == "0.1" and params["algorithm"] == "codasca" and params["trackers"] == '["mlflow"]'
    assert set(params) == set(r.config.to_dict()) - SECRET_FIELDS  # every field but the secret ones
    run_id = logged.info.run_id
    # the metrics.csv names, as a sweep trial's reports have them (one scheme for runs and sweeps)
    assert not [k for k in logged.data.metrics if "/" in k]
    for name in ("test_auc", "client_auc.0", "client_auc.1", "worst_client_auc", "bytes_up", "bytes_down",
                 "train_loss", "lr"):
        logged_steps = sorted((m.step, m.value) for m in client.get_metric_history(run_id, name))
        want = [(h["iteration"], scalars(h)[name]) for h in r.history if name in scalars(h)]
        assert [s for s, _ in logged_steps] == [s for s, _ in want], name
        assert len(want) == len(r.history) - (name == "train_loss"), name  # no training loss before round 1
        assert [v for _, v in logged_steps] == pytest.approx([v for _, v in want]), name
    worst = [min(h["client_auc"].values()) for h in r.history]
    assert [m.value for m in sorted(client.get_metric_history(run_id, "worst_client_auc"), key=lambda m: m.step)] \
        == pytest.approx(worst)
    assert [a.path for a in client.list_artifacts(run_id)] == ["model.pt"]
    model = torch.load(client.download_artifacts(run_id, "model.pt", str(tmp_path)), weights_only=True)
    for key, value in r.model_state.items():
        assert torch.equal(model["model"][key], value)
    assert client.get_metric_history(run_id, "summary.final_test_auc")[0].value == pytest.approx(
        r.summary["final_test_auc"])
    assert json.loads((r.run_dir / "trackers.json").read_text()) == {"mlflow": run_id}

    longer = resume(r.run_dir, {"iterations": 30})
    again = only_run(client, "resumed")  # the same MLflow run, continued
    assert again.info.run_id == run_id and again.info.status == "FINISHED"
    steps = sorted(m.step for m in client.get_metric_history(run_id, "test_auc"))
    assert steps == [h["iteration"] for h in longer.history] and steps[-1] == 30


def read_wandb_records(path: Path):
    """The records of a W&B offline run file (``run-<id>.wandb``): its own LevelDB-style log of protobufs."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    block, pos, chunks, pending = 32768, 7, [], b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:
            pos += left
            continue
        if pos + 7 + length > len(data):  # a record still being written
            break
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind == 1:  # full
            chunks.append(chunk)
        elif kind == 2:  # first
            pending = chunk
        elif kind == 3:  # middle
            pending += chunk
        else:  # last
            chunks.append(pending + chunk)
    records = []
    for chunk in chunks:
        rec = pb.Record()
        rec.ParseFromString(chunk)
        records.append(rec)
    return records


def wandb_run(where: Path) -> dict:
    """What a W&B offline run logged: ``where`` is its ``.wandb`` file, or a WANDB_DIR holding one run."""
    if where.is_dir():
        files = list(where.glob("wandb/offline-run-*/run-*.wandb"))
        assert len(files) == 1, files
        where = files[0]
    # W&B's service process may still be writing the file after run.finish() returns: wait for its run and exit
    # records (both must be there to read the run)
    deadline = time.monotonic() + 180
    records = read_wandb_records(where)
    while not {"run", "exit"} <= {r.WhichOneof("record_type") for r in records} and time.monotonic() < deadline:
        time.sleep(0.2)
        records = read_wandb_records(where)
    out = {"history": {}, "summary": {}, "artifacts": [], "exit": None}
    for rec in records:
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            out["name"], out["project"] = rec.run.display_name, rec.run.project
            out["config"] = {i.key: json.loads(i.value_json) for i in rec.run.config.update}
        elif kind == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item}
            out["history"][items.pop("_step")] = items
        elif kind == "summary":
            out["summary"].update({i.key or "/".join(i.nested_key): json.loads(i.value_json)
                                   for i in rec.summary.update})
        elif kind == "artifact":
            out["artifacts"].append((rec.artifact.type, [m.path for m in rec.artifact.manifest.contents]))
        elif kind == "exit":
            out["exit"] = rec.exit.exit_code
    return out


def test_wandb_offline_gets_the_config_every_evaluation_and_the_model_without_a_run_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    clients, test = gaussian_clients(num_clients=2)
    r = fdam_ray.train_arrays(dict(model="linear", iterations=12, local_steps=3, eval_every=4, executor="inline",
                                   trackers=["wandb"], tracker_project="tests", run_name="arrays-run"),
                              clients, test)  # save=False: no run folder, the model goes from a temporary file
    logged = wandb_run(tmp_path)
    assert logged["name"] == "arrays-run" and logged["project"] == "tests"
    assert logged["config"]["lr"] == 0.1 and logged["config"]["trackers"] == ["wandb"]
    assert sorted(logged["history"]) == [h["iteration"] for h in r.history]
    for h in r.history:
        row = logged["history"][h["iteration"]]
        assert row["test_auc"] == pytest.approx(h["test_auc"])
        assert row["bytes_up"] == h["bytes_up"] and row["bytes_down"] == h["bytes_down"]
    assert set(logged["config"]) - {"_wandb"} == (set(r.config.to_dict()) - SECRET_FIELDS) | {"versions"}
    assert ("model", ["model.pt"]) in logged["artifacts"]
    assert logged["summary"]["final_test_auc"] == pytest.approx(r.summary["final_test_auc"])
    assert logged["exit"] == 0


def test_a_tracker_that_is_not_installed_is_one_line_before_training(tmp_path, monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    out = tmp_path / "runs"
    rc = main(["train", f"out_dir={out}", "dataset=synthetic", "model=mlp", "executor=inline", "trackers=wandb"])
    captured = capsys.readouterr()
    assert rc == 2
    assert captured.err == (f"fdam: error: trackers: wandb is not installed; {extra_hint('wandb', 'wandb')}; or leave "
                            "wandb out of trackers\n")
    assert "test AUC" not in captured.out and not out.exists()


def test_a_tracker_that_fails_mid_run_warns_once_and_the_run_goes_on(tmp_path, mlflow_store, monkeypatch, caplog):
    from fdam_ray.outputs.trackers import MLflowTracker

    calls = []

    def broken(self, metrics, step):
        calls.append(step)
        raise ConnectionError("tracking server went away")

    monkeypatch.setattr(MLflowTracker, "log_metrics", broken)
    with caplog.at_level(logging.WARNING, logger="fdam_ray"):
        r = run(cfg(tmp_path / "runs", trackers=["mlflow"], tracker_project="failing"))
    assert r.summary["final_test_auc"] > 0.5 and (r.run_dir / "model.pt").is_file()
    assert calls == [0]  # nothing more after the first failure
    warnings = [m for m in caplog.messages if "mlflow tracker" in m]
    assert warnings == ["mlflow tracker: logging an evaluation failed (ConnectionError: tracking server went away); "
                        "it logs nothing more for this run"]


def test_a_tracking_store_mlflow_refuses_stops_the_run_before_training_in_one_line(tmp_path, monkeypatch, capsys):
    # MLflow 3 refuses a file store (./mlruns) unless MLFLOW_ALLOW_FILE_STORE=true: the run would train untracked
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"file://{tmp_path / 'mlruns'}")
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    from fdam_ray.outputs.trackers import check_mlflow_store

    try:
        check_mlflow_store()
    except ConfigError:
        pass
    else:
        pytest.skip("this MLflow takes a file store")
    out = tmp_path / "runs"
    rc = main(["train", f"out_dir={out}", "run_name=r", "dataset=synthetic", "model=mlp", "executor=inline",
               "trackers=mlflow", "tensorboard=false"])
    captured = capsys.readouterr()
    assert rc == 2 and "test AUC" not in captured.out and not out.exists()
    assert captured.err.startswith(f"fdam: error: trackers: mlflow cannot use its tracking store 'file://{tmp_path}")
    assert captured.err.count("\n") == 1 and "MLFLOW_TRACKING_URI" in captured.err


def test_a_tracker_that_cannot_open_its_run_stops_before_the_first_round_and_leaves_no_folder(
        tmp_path, mlflow_store, monkeypatch, capsys):
    from fdam_ray.outputs.trackers import MLflowTracker, TrackerError

    def refused(self, run_name, params, resume_id):
        raise ConnectionError("connection refused by http://user:pw@tracker.example/ \nmore")

    monkeypatch.setattr(MLflowTracker, "open", refused)
    rounds = []
    monkeypatch.setattr(fdam_ray.loop.federation.Federation, "_round", lambda self, *a: rounds.append(1))
    out = tmp_path / "runs"
    rc = main(["train", f"out_dir={out}", "run_name=r", "dataset=synthetic", "model=mlp", "executor=inline",
               "trackers=mlflow", "tensorboard=false", "--quiet"])
    err = capsys.readouterr().err
    assert rc == 2 and rounds == []
    assert err == ("fdam: error: trackers: mlflow could not start its run (ConnectionError: connection refused by "
                   "http://user:***@tracker.example/); fix mlflow's setting or leave mlflow out of trackers\n")
    assert not (out / "r").exists()  # the folder the run made is gone: run_name=r runs again at once
    with pytest.raises(TrackerError, match="mlflow could not start its run"):  # from Python: raised
        run(cfg(out, trackers=["mlflow"]))
    assert rounds == [] and not (out / "run").exists()
