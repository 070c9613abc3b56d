"""The first hour with a run's outputs: TensorBoard on only where it is installed (an explicit true without it is
one line), a planned stop logged as INFO (a real error stays ERROR), and the example sweep files inside the
package, where `fdam tune --example` finds them."""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

import pytest

from fdam_ray.assembly.recipe import run
from fdam_ray.cli import main
from fdam_ray.config import build_config, parse_overrides
from fdam_ray.outputs import RunStopped, clear_stop_request, request_stop

FAST = ["dataset=synthetic", "model=mlp", "model_width=8", "num_clients=2", "samples_per_client=60",
        "batch_size=16", "local_steps=2", "iterations=8", "stage_length=4", "eval_every=4", "executor=inline"]


def cfg(tmp_path, *overrides):
    items = {item.partition("=")[0]: item for item in [*FAST, f"out_dir={tmp_path}", "run_name=run", *overrides]}
    return build_config(parse_overrides(list(items.values())))  # an override replaces the default here


@pytest.fixture
def no_tensorboard(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name.split(".")[0] == "tensorboard" else real(name, *a))


def test_tensorboard_is_auto_by_default_and_silent_without_the_package(tmp_path, no_tensorboard, caplog):
    assert build_config().tensorboard == "auto"
    with caplog.at_level(logging.DEBUG, logger="fdam_ray"):
        r = run(cfg(tmp_path))
    assert r.summary["final_test_auc"] > 0 and not (r.run_dir / "events").exists()
    assert not [m for m in caplog.records if m.levelno >= logging.WARNING], caplog.text
    assert "WARNING" not in (r.run_dir / "train.log").read_text()


def test_tensorboard_auto_writes_event_files_where_the_package_is_installed(tmp_path):
    pytest.importorskip("tensorboard")
    r = run(cfg(tmp_path))
    assert list((r.run_dir / "events").iterdir())


def test_an_explicit_tensorboard_true_without_the_package_is_one_line_before_anything_runs(
        tmp_path, no_tensorboard, capsys):
    rc = main(["train", *FAST, f"out_dir={tmp_path / 'runs'}", "tensorboard=true", "--quiet"])
    err = capsys.readouterr().err
    assert rc == 2 and not (tmp_path / "runs").exists()
    assert err == ("fdam: error: config field 'tensorboard': True is not allowed (auto, false, or true where the "
                   "tensorboard package is installed (the 'tensorboard' extra))\n")


def test_a_planned_stop_is_logged_as_info_and_a_real_error_as_error(tmp_path, monkeypatch):
    def stop_after_first_round(record):
        if record["round"] >= 1:
            request_stop("received SIGTERM")

    clear_stop_request()
    try:
        with pytest.raises(RunStopped):
            from fdam_ray.assembly.recipe import federate

            federate(cfg(tmp_path, "tensorboard=false"), on_eval=stop_after_first_round)
    finally:
        clear_stop_request()
    log = (tmp_path / "run" / "train.log").read_text()
    assert " INFO run stopped: received SIGTERM: stopped after round" in log
    assert " ERROR " not in log

    from fdam_ray.clients.client import Client

    original = Client.local_round

    def broken_in_round_3(self, state, plan, **kw):
        if plan.round == 3:
            raise RuntimeError("disk on fire")
        return original(self, state, plan, **kw)

    monkeypatch.setattr(Client, "local_round", broken_in_round_3)
    with pytest.raises(Exception, match="disk on fire"):
        run(cfg(tmp_path, "tensorboard=false", "run_name=broken"))
    assert " ERROR run stopped: " in (tmp_path / "broken" / "train.log").read_text()


def test_the_example_spaces_ship_in_the_package_and_run_by_name_from_any_folder(tmp_path, monkeypatch, capsys):
    import fdam_ray
    from fdam_ray.tuning import load_space
    from fdam_ray.tuning.space import EXAMPLE_SPACES, example_names

    assert EXAMPLE_SPACES.is_relative_to(Path(fdam_ray.__file__).parent)  # package data: in the wheel
    assert example_names() == ["paper_grid", "small"]
    monkeypatch.chdir(tmp_path)  # not a checkout
    for name in ("small", "small.yaml", "tune/small.yaml"):
        space = load_space(name, {"iterations": 400, "tune.scheduler": "asha"})
        assert space.base["iterations"] == 400 and space.options.scheduler == "asha" and "lr" in space.search
    assert load_space("paper_grid").base["model"]
    (tmp_path / "small").write_text("base: {dataset: synthetic}\nsearch: {lr: {grid: [0.5]}}\n")
    assert load_space("small").search == {"lr": {"grid": [0.5]}}  # a file of that name here comes first

    assert main(["tune"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "paper_grid, small" in err and "`fdam tune small`" in err
    assert str(EXAMPLE_SPACES) in err and (EXAMPLE_SPACES / "small.yaml").is_file()


def test_setup_cfg_ships_the_example_spaces_as_package_data():
    import configparser

    root = Path(__file__).resolve().parents[2]
    setup = configparser.ConfigParser()
    setup.read(root / "setup.cfg")
    assert setup["options.package_data"]["fdam_ray.tuning"].strip() == "spaces/*.yaml"
    assert "recursive-include fdam_ray/tuning/spaces *.yaml" in (root / "MANIFEST.in").read_text()
