"""Named sites (``client_names``) wherever a client is shown, and the versions a run records (config.yaml,
summary.json, tracker tags; a resume under other versions says which changed)."""

from __future__ import annotations

import json
import logging
import re

import numpy as np
import pytest
import yaml
from sample_clients import gaussian_clients

import fdam_ray
from fdam_ray.assembly.recipe import resume, run
from fdam_ray.cli import main
from fdam_ray.config import ConfigError, build_config, load_config_file
from fdam_ray.executors.errors import ClientError
from fdam_ray.files.versions import run_versions

NAMES = ["hospital-A", "clinic_b.2"]


def small(tmp_path, **kw):
    base = dict(dataset="synthetic", model="mlp", model_width=8, num_clients=2, samples_per_client=60,
                local_steps=3, iterations=9, eval_every=3, executor="inline", out_dir=str(tmp_path), run_name="r",
                tensorboard=False)
    return build_config({**base, **kw})


def test_names_are_the_per_client_keys_of_metrics_and_are_in_the_summary(tmp_path):
    r = run(small(tmp_path, client_names=NAMES))
    assert all(set(h["client_auc"]) == set(NAMES) for h in r.history)
    jsonl = [json.loads(line) for line in (r.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [set(h["client_auc"]) for h in jsonl] == [set(NAMES)] * len(r.history)
    header = (r.run_dir / "metrics.csv").read_text().splitlines()[0].split(",")
    assert {"client_auc.hospital-A", "client_auc.clinic_b.2"} <= set(header)
    assert not any(h in header for h in ("client_auc.0", "client_auc.1"))
    summary = json.loads((r.run_dir / "summary.json").read_text())
    assert summary["client_names"] == NAMES
    assert yaml.safe_load((r.run_dir / "config.yaml").read_text())["client_names"] == NAMES


def test_without_names_clients_are_their_indices_as_before(tmp_path):
    r = run(small(tmp_path))
    assert set(r.history[-1]["client_auc"]) == {"0", "1"}
    header = (r.run_dir / "metrics.csv").read_text().splitlines()[0]
    assert "client_auc.0,client_auc.1" in header
    assert "client_names" not in r.summary


def test_a_diverging_client_is_named_in_the_error_and_in_train_log(tmp_path):
    clients, test = gaussian_clients(num_clients=2)
    clients[0] = (clients[0][0] * np.float32(1e19), clients[0][1])  # finite features, an overflowing update
    config = dict(model="linear", iterations=6, local_steps=3, eval_every=3, executor="inline", lr=1e6,
                  out_dir=str(tmp_path), run_name="div", tensorboard=False, client_names=["north", "south"])
    with pytest.raises(fdam_ray.DivergenceError, match=r"round \d+: client north sent a NaN or infinite update"):
        fdam_ray.train_arrays(config, clients, test, save=True)
    log_text = (tmp_path / "div" / "train.log").read_text()
    assert re.search(r"ERROR run stopped: round \d+: client north sent a NaN or infinite update", log_text)
    assert "client 0 " not in log_text


def test_a_client_error_shows_the_names_it_is_given():
    err = ClientError(1, 3, "local_round", "ValueError: bad")
    assert str(err) == "client 1 failed in round 3 (local_round): ValueError: bad"
    err.names = ("north", "south")
    assert str(err) == "client south failed in round 3 (local_round): ValueError: bad"
    both = ClientError(0, 2, "start", "its actor process died", actor=0, clients=(0, 1), of_actor=True)
    both.names = ("north", "south")
    assert str(both).startswith("actor 0 (clients north, south) failed in round 2")


@pytest.mark.parametrize("names, message", [
    (["a"], "one name per client: 2 (num_clients), not 1"),
    (["a", "a"], "one distinct name per client"),
    (["ok", "no/slash"], "letters, digits, '_', '.' and '-'"),
    (["ok", ""], "letters, digits"),
    (["ok", "x" * 65], "at most 64 characters"),
    ([1, 2], "a non-empty list of names"),
])
def test_bad_names_are_one_line_errors(names, message):
    with pytest.raises(ConfigError, match="config field 'client_names'") as caught:
        build_config(num_clients=2, client_names=names)
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_bad_names_on_the_command_line_exit_2_with_one_line(tmp_path, capsys):
    rc = main(["train", "num_clients=2", "client_names=a,a", "executor=inline", f"out_dir={tmp_path}"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "client_names" in err and "one distinct name per client" in err
    assert len(err.splitlines()) == 1 and not list(tmp_path.iterdir())


def test_names_given_on_the_command_line_name_the_metrics(tmp_path):
    rc = main(["train", "dataset=synthetic", "model=mlp", "model_width=8", "num_clients=2", "samples_per_client=60",
               "local_steps=3", "iterations=6", "eval_every=3", "executor=inline", "tensorboard=false",
               f"out_dir={tmp_path}", "run_name=cli", "client_names=siteA,siteB", "--quiet"])
    assert rc == 0
    header = (tmp_path / "cli" / "metrics.csv").read_text().splitlines()[0]
    assert "client_auc.siteA,client_auc.siteB" in header


def test_versions_are_in_config_yaml_and_summary_and_a_run_config_reads_back(tmp_path):
    r = run(small(tmp_path))
    want = run_versions()
    assert set(want) == {"fdam_ray", "torch", "ray", "python", "numpy"} and want["fdam_ray"] == fdam_ray.__version__
    saved = yaml.safe_load((r.run_dir / "config.yaml").read_text())
    assert saved["versions"] == want
    assert json.loads((r.run_dir / "summary.json").read_text())["versions"] == want
    # replayed as a config file: the versions are a record, not a field
    again = build_config(load_config_file(str(r.run_dir / "config.yaml")))
    assert again == r.config


def test_a_resume_under_other_versions_says_which_changed(tmp_path, caplog):
    r = run(small(tmp_path))
    config_file = r.run_dir / "config.yaml"
    saved = yaml.safe_load(config_file.read_text())
    saved["versions"]["torch"] = "1.0.0"
    config_file.write_text(yaml.safe_dump(saved, sort_keys=False))
    with caplog.at_level(logging.WARNING, logger="fdam_ray"):
        longer = resume(r.run_dir, {"iterations": 15})
    assert longer.history[-1]["iteration"] == 15
    lines = [rec.getMessage() for rec in caplog.records if "versions" in rec.getMessage()]
    assert lines == [f"the run is resumed under other versions than it ran under before: torch 1.0.0 -> "
                     f"{run_versions()['torch']}"]
    assert lines[0] in (r.run_dir / "train.log").read_text()
    assert yaml.safe_load(config_file.read_text())["versions"] == run_versions()  # now the latest session's
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="fdam_ray"):
        resume(r.run_dir, {"iterations": 18})  # the same versions: nothing said
    assert not [rec for rec in caplog.records if "versions" in rec.getMessage()]


def test_mlflow_tags_and_wandb_config_carry_the_versions(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    pytest.importorskip("wandb")
    from mlflow.tracking import MlflowClient
    from test_trackers import only_run, wandb_run

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.chdir(tmp_path)  # MLflow's default artifact root is ./mlruns
    run(small(tmp_path / "runs", trackers=["mlflow"], tracker_project="versions"))
    tags = only_run(MlflowClient(uri), "versions").data.tags
    assert {k: tags[f"fdam.version.{k}"] for k in run_versions()} == {k: str(v) for k, v in run_versions().items()}

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wb"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    (tmp_path / "wb").mkdir()
    run(small(tmp_path / "runs", run_name="w", trackers=["wandb"], tracker_project="versions"))
    assert wandb_run(tmp_path / "wb")["config"]["versions"] == run_versions()


@pytest.mark.fault  # in benchmarks/fault_tests.py, not the CI tiers
def test_under_ray_a_replaced_client_and_the_placements_are_named_in_train_log(tmp_path):
    from raytest import ray_session
    from sample_clients import gaussian_clients as make_clients
    from test_ray_executor import ARRAYS, KillDuringRound

    from fdam_ray.data.arrays import ArraysSource

    clients, test = make_clients(3)
    config = build_config(dict(ARRAYS, dataset="arrays", num_clients=3, iterations=8, out_dir=str(tmp_path),
                               run_name="r", tensorboard=False, client_names=["north", "south", "east"]))
    with ray_session():
        r = run(config, source=ArraysSource(clients, test), executor=KillDuringRound(victim=1, at_round=2,
                                                                                     how="ray.kill"))
    log = (tmp_path / "r" / "train.log").read_text()
    assert "WARNING client south failed in round 2 (local_round)" in log and "-> replaced (attempt 1 of 2)" in log
    assert "placement: clients north -> actor 0" in log and "placement: clients east -> actor 2" in log
    assert "client 1 " not in log
    assert r.summary["client_names"] == ["north", "south", "east"]
