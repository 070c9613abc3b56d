"""Tune as a building block: fdam_ray.tuning.trainable in a Tuner of the user's own (searcher, scheduler,
callback), examples/own_tuner.py as the README shows it, and the trials' trackers with every config field."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
from pathlib import Path

import pytest
import ray

from fdam_ray.config import ConfigError, build_config
from fdam_ray.settings.sections import SECRET_FIELDS
from fdam_ray.tuning import federation_trial, tracker_callbacks, trainable

ROOT = Path(__file__).resolve().parents[2]


def bundles_of(trainable_fn, params: dict) -> list[dict]:
    return trainable_fn._resources(params).bundles


def test_the_trainable_reserves_each_trials_placement_group_from_its_own_config():
    base = {"dataset": "synthetic", "model": "mlp", "num_clients": 3, "executor": "ray", "cpus_per_actor": 0.25}
    fn = trainable(base, metric="worst_client_auc", driver_cpus=0.5)
    assert bundles_of(fn, {}) == [{"CPU": 0.5}] + [{"CPU": 0.25}] * 3
    # a searched field that changes the actors changes the trial's bundles
    assert bundles_of(fn, {"num_clients": 4, "clients_per_actor": 2}) == [{"CPU": 0.5}] + [{"CPU": 0.25}] * 2
    assert bundles_of(fn, {"executor": "inline"}) == [{"CPU": 0.5}]
    assert federation_trial.__module__ == "fdam_ray.tuning.trial"


@pytest.mark.parametrize("kwargs, message", [
    ({"base": {"lr": "fast"}}, "config field 'lr': 'fast' is not allowed"),
    ({"base": {}, "metric": "auc"}, "metric: 'auc' is not reported"),
    ({"base": {}, "driver_cpus": 0}, "driver_cpus: 0 is not allowed"),
])
def test_a_bad_base_metric_or_driver_share_is_one_line_before_any_trial(kwargs, message):
    with pytest.raises(ConfigError, match=re.escape(message)) as err:
        trainable(**kwargs)
    assert "\n" not in str(err.value)


def test_the_readme_shows_the_tuner_of_the_example_that_the_tests_run():
    readme = (ROOT / "docs/tutorials/sweep.md").read_text()
    section = readme.split("## 3. Your own Tuner", 1)[1]
    snippet = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    example = (ROOT / "examples" / "own_tuner.py").read_text()
    lines = [line.strip() for line in snippet.splitlines() if line.strip()]
    assert len(lines) >= 8 and all(line in example for line in lines), [x for x in lines if x not in example]


def test_tracker_callbacks_log_every_field_of_a_trials_config_to_mlflow(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.chdir(tmp_path)
    base = {"dataset": "synthetic", "model": "mlp", "trackers": ["mlflow"], "tracker_project": "own"}
    [callback] = tracker_callbacks(base)
    callback.setup()

    class Trial:  # what Tune's callback reads of a trial
        def __init__(self):
            self.config = {"lr": 0.03, "local_steps": 7}
            self.local_path = str(tmp_path)

        def __str__(self):
            return "trial_1"

    trial = Trial()
    callback.log_trial_start(trial)
    client = MlflowClient()
    [run] = client.search_runs([client.get_experiment_by_name("own").experiment_id])
    params = run.data.params
    full = build_config({**base, **trial.config}).to_dict()
    assert set(params) == set(full) - SECRET_FIELDS and len(params) > 50  # every field but the secret ones
    assert params["lr"] == "0.03" and params["local_steps"] == "7" and params["dataset"] == "synthetic"
    assert params["trackers"] == '["mlflow"]'
    assert run.data.tags["fdam.algorithm"] == full["algorithm"]


def test_tracker_callbacks_give_wandb_every_field_of_a_trials_config(monkeypatch):
    pytest.importorskip("wandb")
    from ray.air.integrations.wandb import WandbLoggerCallback

    monkeypatch.setenv("WANDB_MODE", "offline")
    started = {}
    monkeypatch.setattr(WandbLoggerCallback, "_start_logging_actor",
                        lambda self, trial, exclude, **kwargs: started.update(kwargs))
    base = {"dataset": "synthetic", "model": "mlp", "trackers": ["wandb"]}
    [callback] = tracker_callbacks(base)

    class Trial:
        def __init__(self):
            self.config = {"lr": 0.03}
            self.trial_id = "t1"
            self.experiment_dir_name = "exp"

    callback.log_trial_start(Trial())
    assert started["config"]["lr"] == 0.03 and started["config"]["model"] == "mlp"
    assert set(started["config"]) == set(build_config({**base, "lr": 0.03}).to_dict()) - SECRET_FIELDS
    assert "config" not in callback.kwargs  # the next trial gets its own


@pytest.fixture
def no_ray_yet():
    """No Ray in this process and none recorded to join (a Ray temp folder of its own): what the example starts
    is its own. Stopped at the end, with the environment Ray changed."""
    if ray.is_initialized():
        ray.shutdown()
    saved = dict(os.environ)
    temp = tempfile.mkdtemp(prefix="fdt", dir="/tmp")  # short: Ray's socket paths live under it
    os.environ.pop("RAY_ADDRESS", None)
    os.environ["RAY_TMPDIR"] = temp
    try:
        yield
    finally:
        ray.shutdown()
        os.environ.clear()
        os.environ.update(saved)
        shutil.rmtree(temp, ignore_errors=True)


def _listening_addresses_of_children() -> list[tuple[int, str]]:
    """(pid, bound address) of each listening TCP socket of the processes this one started (Ray's servers,
    agents and workers), from /proc."""
    from fdam_ray.executors.ray.ownership import _proc_address

    listening = {}
    for table in ("tcp", "tcp6"):
        for line in Path("/proc/net", table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A":  # LISTEN
                listening[fields[9]] = str(_proc_address(fields[1].split(":")[0]))
    parents = {}
    for proc in Path("/proc").iterdir():
        with contextlib.suppress(OSError, IndexError, ValueError):
            if proc.name.isdigit():
                parents[int(proc.name)] = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
    mine, todo = [], [os.getpid()]
    while todo:
        parent = todo.pop()
        children = [pid for pid, ppid in parents.items() if ppid == parent]
        mine += children
        todo += children
    found = []
    for pid in mine:
        with contextlib.suppress(OSError):
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                with contextlib.suppress(OSError):
                    target = os.readlink(fd)
                    if target.startswith("socket:[") and target[8:-1] in listening:
                        found.append((pid, listening[target[8:-1]]))
    return found


@pytest.mark.slow  # in CI's slow tier: an ASHA sweep, 11 s
def test_the_own_tuner_example_runs_asha_and_its_callback_over_federations(tmp_path, no_ray_yet, capsys):
    from test_examples import load

    assert load("own_tuner").main(["--quick", "--out", str(tmp_path / "tune")]) == 0
    # the Ray it ran on is the one fdam starts (docs/explanation/trust.md), not Tune's own start on every interface
    assert ray.get_runtime_context().gcs_address.rpartition(":")[0] == "127.0.0.1"
    if Path("/proc/net/tcp").exists():
        listens = _listening_addresses_of_children()
        assert len(listens) >= 3 and all(address == "127.0.0.1" for _, address in listens), listens
    out = capsys.readouterr().out
    reports = re.findall(r"trial lr=([\d.]+): iteration (\d+), test AUC ([\d.]+)", out)
    assert {lr for lr, _, _ in reports} == {"0.1", "0.01"}  # the user's callback saw both trials
    assert ("0.1", "60") in {(lr, it) for lr, it, _ in reports}  # the better trial ran to its end
    best = re.search(r"best lr: ([\d.]+) \(test AUC ([\d.]+)", out)
    assert best.group(1) == "0.1" and float(best.group(2)) > 0.6  # lr=0.1 learns in 60 iterations
    run_folder = Path(re.search(r"its run folder: (\S+)", out).group(1))
    assert (run_folder / "metrics.csv").is_file() and (run_folder / "config.yaml").is_file()
    assert "lr: 0.1" in (run_folder / "config.yaml").read_text()

    # fdam plot takes the experiment folder as it takes a sweep folder of fdam tune: its trials, told apart by lr
    from fdam_ray import plots
    from fdam_ray.cli import main

    experiment = Path(re.search(r"experiment folder: (\S+)", out).group(1))
    assert main(["plot", str(experiment), "--out", str(tmp_path / "plots")]) == 0
    assert (tmp_path / "plots" / "auc_vs_iterations.png").is_file()
    runs = [plots.Run(p.parent) for p in experiment.glob("*/run/metrics.jsonl")]
    assert sorted(plots._labels(runs)) == ["codasca I=5 lr=0.01", "codasca I=5 lr=0.1"]
