"""examples/own_model_and_data.py in reduced form: its --quick run, and the command line its docstring shows."""

from __future__ import annotations

import importlib
from pathlib import Path

import yaml

from fdam_ray.cli import main

EXAMPLES = Path(__file__).parents[2] / "examples"


def test_the_example_runs_quick_and_learns(monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    example = importlib.import_module("own_model_and_data")
    result = example.main(["--quick", "--clients", "2"])
    assert result.history[-1]["test_auc"] > 0.8
    assert set(result.history[-1]["client_auc"]) == {"0", "1"}
    assert "pooled test AUC" in capsys.readouterr().out
    assert result.model_state["1.running_mean"].abs().sum() > 0  # its BatchNorm statistics were federated


def test_the_command_line_of_the_docstring_names_both_factories(monkeypatch, tmp_path, capsys):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    doc = importlib.import_module("own_model_and_data").__doc__
    assert "dataset=own_model_and_data:client_dataset" in doc and "model=own_model_and_data:build_model" in doc
    rc = main(["train", f"out_dir={tmp_path}", "dataset=own_model_and_data:client_dataset",
               "model=own_model_and_data:build_model", "num_clients=2", "executor=inline", "iterations=4",
               "local_steps=2", "eval_every=2", "tensorboard=false"])
    assert rc == 0, capsys.readouterr().err
    (run,) = list(tmp_path.iterdir())
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert (saved["dataset"], saved["model"]) == ("own_model_and_data:client_dataset", "own_model_and_data:build_model")
