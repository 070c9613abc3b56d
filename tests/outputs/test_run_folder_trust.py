"""A run folder is one run: a resume refuses a folder whose files come from different runs (a checkpoint.pt,
config.yaml, metrics, model.pt or summary.json of another run) and changes nothing in it; summary.json is always
strict JSON; a saturated validation set is said; two federations at once in one process are refused. All inline."""

from __future__ import annotations

import json
import logging
import math
import shutil
import threading
from pathlib import Path

import numpy as np
import pytest
import yaml

import fdam_ray
from fdam_ray.assembly.recipe import resume, run
from fdam_ray.cli import main
from fdam_ray.config import build_config
from fdam_ray.executors.inline import InlineExecutor

SMALL = dict(dataset="synthetic", model="mlp", model_width=8, num_clients=3, samples_per_client=60,
             batch_size=16, algorithm="codasca", local_steps=2, iterations=6, stage_length=4, eval_every=2,
             checkpoint_every=1, executor="inline", tensorboard=False)


def cfg(out: Path, **kw):
    return build_config({**SMALL, "out_dir": str(out), "run_name": "run", **kw})


def state_of(folder: Path) -> dict[str, tuple[bytes, int]]:
    """Every file's bytes and mtime (ns), and the folder's own listing."""
    return {str(p.relative_to(folder)): (p.read_bytes(), p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """This run (codasca, K=3) and runs that differ from it in one thing each."""
    root = tmp_path_factory.mktemp("runs")
    made = {"home": run(cfg(root / "home")).run_dir}
    for name, change in {"fedavg": {"algorithm": "fedavg"}, "k2": {"num_clients": 2},
                         "wide": {"model_width": 12}, "lr": {"lr": 0.05}}.items():
        made[name] = run(cfg(root / name, **change)).run_dir
    return made


def planted(tmp_path: Path, runs: dict, files: dict[str, str]) -> Path:
    """A copy of the home run's folder with ``files`` (name -> the run they come from) put in."""
    folder = tmp_path / "run"
    shutil.copytree(runs["home"], folder)
    for name, source in files.items():
        shutil.copy2(runs[source] / name, folder / name)
    return folder


def refused(folder: Path, capsys, *extra: str) -> str:
    before = state_of(folder)
    assert main(["train", "--resume", str(folder), *extra]) == 2
    err = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    assert len(err) == 1 and "Traceback" not in err[0], err
    assert state_of(folder) == before  # nothing written, nothing touched
    return err[0]


@pytest.mark.parametrize(("other", "field", "ours", "theirs"), [
    ("fedavg", "algorithm", "codasca", "fedavg"),
    ("k2", "num_clients", "3", "2"),
    ("wide", "model_width", "12", "8"),
])
def test_a_checkpoint_of_another_run_is_refused_naming_both_files_and_the_field(tmp_path, runs, capsys, other, field,
                                                                                ours, theirs):
    folder = planted(tmp_path, runs, {"checkpoint.pt": other})
    for extra in ([], ["iterations=8"]):  # finished as it is, or resumed for longer: refused either way
        line = refused(folder, capsys, *extra)
        assert "config.yaml" in line and "checkpoint.pt" in line and field in line, line
        if field == "model_width":
            ours, theirs = theirs, ours
        assert ours in line and theirs in line, line


def test_config_yaml_and_checkpoint_of_another_run_disagree_with_the_metrics(tmp_path, runs, capsys):
    folder = planted(tmp_path, runs, {"checkpoint.pt": "lr", "config.yaml": "lr"})
    line = refused(folder, capsys, "iterations=8")
    assert "checkpoint.pt" in line and "metrics" in line, line
    with pytest.raises(ValueError, match=r"checkpoint\.pt"):
        resume(folder, {"iterations": 8})


def test_metrics_csv_of_another_run_is_refused(tmp_path, runs, capsys):
    folder = planted(tmp_path, runs, {"metrics.csv": "lr"})
    line = refused(folder, capsys, "iterations=8")
    assert "metrics.csv" in line and "checkpoint.pt" in line, line


@pytest.mark.parametrize(("name", "other"), [("model.pt", "wide"), ("model.pt", "lr"), ("summary.json", "lr"),
                                             ("summary.json", "k2")])
def test_a_final_model_or_summary_of_another_run_is_refused(tmp_path, runs, capsys, name, other):
    folder = planted(tmp_path, runs, {name: other})
    line = refused(folder, capsys)  # a finished run: resume would return these files as its result
    assert name in line and "checkpoint.pt" in line, line
    refused(folder, capsys, "iterations=8")


def test_a_config_yaml_that_differs_only_in_what_a_resume_may_change_resumes(tmp_path, runs):
    folder = planted(tmp_path, runs, {})
    recorded = yaml.safe_load((folder / "config.yaml").read_text())
    recorded.update(iterations=4, checkpoint_every=3, eval_every=1)  # e.g. a resume stopped between two writes
    (folder / "config.yaml").write_text(yaml.safe_dump(recorded, sort_keys=False))
    longer = resume(folder, {"iterations": 8})
    assert longer.state.iteration == 8
    assert yaml.safe_load((folder / "config.yaml").read_text())["iterations"] == 8


# -- summary.json is strict JSON -------------------------------------------------------------------------------------

def _strict(text: str) -> dict:
    def refuse(name):
        raise ValueError(f"not JSON: {name}")

    return json.loads(text, parse_constant=refuse)


def part(rng, positives: int, negatives: int, shift: float = 1.0):
    x = rng.normal(size=(positives + negatives, 5)).astype(np.float32)
    x[:positives] += shift
    return x, np.r_[np.ones(positives), np.zeros(negatives)].astype(np.float32)


BASE = dict(model="linear", batch_size=8, iterations=6, local_steps=2, eval_every=2, executor="inline",
            tensorboard=False, val_fraction=0.1)


def test_summary_json_is_strict_json_with_one_class_validation_parts(tmp_path):
    rng = np.random.default_rng(0)
    clients = [part(rng, 1, 40) for _ in range(3)]  # one positive each: kept for training, none held out
    r = fdam_ray.train_arrays(dict(BASE, out_dir=str(tmp_path), run_name="one"), clients, part(rng, 20, 20),
                              save=True)
    summary = _strict((r.run_dir / "summary.json").read_text())
    assert summary["best_val_auc"] is None and summary["final_val_auc"] is None
    records = [_strict(line) for line in (r.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert records and all(rec["val_auc"] is None for rec in records)  # metrics.jsonl is strict JSON too
    assert "best_val_auc" in summary["notes"] and "one class" in summary["notes"]["best_val_auc"]
    assert math.isnan(r.summary["best_val_auc"])  # the run returns the numbers (NaN) and the same notes
    assert r.summary["notes"] == summary["notes"] and "one class" in (r.run_dir / "train.log").read_text()
    again = resume(r.run_dir).summary  # a resume of the finished run reads back what the run returned
    assert math.isnan(again["best_val_auc"]) and math.isnan(again["final_val_auc"])
    assert {k: v for k, v in again.items() if "val_auc" not in k} == {
        k: v for k, v in r.summary.items() if "val_auc" not in k}


# -- a validation set that cannot tell evaluations apart ------------------------------------------------------------

def test_a_saturated_validation_set_is_said_once(tmp_path, caplog):
    rng = np.random.default_rng(1)
    clients = [part(rng, 10, 30, shift=8.0) for _ in range(3)]  # separable: val AUC 1.0 at every evaluation
    with caplog.at_level(logging.WARNING, logger="fdam_ray"):
        r = fdam_ray.train_arrays(dict(BASE, val_fraction=0.25, out_dir=str(tmp_path), run_name="sat"), clients,
                                  part(rng, 20, 20, shift=8.0), save=True)
    vals = [h["val_auc"] for h in r.history]
    tied = sum(v == max(vals) for v in vals)
    assert tied >= 2
    lines = [m for m in caplog.messages if "tied" in m]
    assert len(lines) == 1 and f"{tied} evaluations" in lines[0] and "\n" not in lines[0], caplog.messages
    assert "tied" in (r.run_dir / "train.log").read_text()


def test_a_validation_set_that_tells_evaluations_apart_says_nothing(tmp_path, caplog):
    rng = np.random.default_rng(2)
    clients = [part(rng, 10, 30, shift=0.3) for _ in range(3)]
    with caplog.at_level(logging.WARNING, logger="fdam_ray"):
        r = fdam_ray.train_arrays(dict(BASE, val_fraction=0.25), clients, part(rng, 20, 20, shift=0.3))
    vals = [h["val_auc"] for h in r.history]
    assert sum(v == max(vals) for v in vals) == 1
    assert not [m for m in caplog.messages if "tied" in m]


# -- two federations at once in one process -------------------------------------------------------------------------

def test_a_second_federation_while_one_runs_in_this_process_is_refused_and_both_keep_their_results(tmp_path,
                                                                                                   monkeypatch):
    alone = run(cfg(tmp_path / "alone"), save=False)
    original = InlineExecutor.run_round
    inside, go_on = threading.Event(), threading.Event()

    def run_round(self, state, plan, fold, clients=None):
        if plan.round == 2:
            inside.set()
            go_on.wait(30)
        return original(self, state, plan, fold, clients)

    monkeypatch.setattr(InlineExecutor, "run_round", run_round)
    got: dict = {}
    first = threading.Thread(target=lambda: got.setdefault("r", run(cfg(tmp_path / "t"), save=False)))
    first.start()
    try:
        assert inside.wait(30)
        with pytest.raises(RuntimeError, match="another federation is running in this process") as caught:
            run(cfg(tmp_path / "second"))
        assert "\n" not in str(caught.value)
        assert not (tmp_path / "second").exists()
    finally:
        go_on.set()
        first.join(60)
    monkeypatch.undo()
    for r in (got["r"], run(cfg(tmp_path / "after"), save=False)):  # one after another: as alone
        np.testing.assert_array_equal(r.state.v, alone.state.v)
        assert [h["test_auc"] for h in r.history] == [h["test_auc"] for h in alone.history]
