"""fdam plot on the runs of a sweep: legends name the fields the runs differ in, runs of different lr are not
averaged into one local-steps band, and a sweep folder stands for its trials' run folders."""

from __future__ import annotations

import json
import logging

import pytest
import yaml

from fdam_ray import plots
from fdam_ray.cli import main


def make_run(folder, aucs, **config):
    """A run folder as fdam writes it: metrics.jsonl (one record per evaluation) and config.yaml."""
    folder.mkdir(parents=True)
    fields = {"algorithm": "codasca", "dataset": "synthetic", "lr": 0.1, "local_steps": 4, "seed": 0,
              "out_dir": str(folder.parent), "run_name": folder.name, **config}
    (folder / "config.yaml").write_text(yaml.safe_dump(fields, sort_keys=False))
    records = [{"iteration": 10 * i, "round": i, "test_auc": auc, "bytes_up": 1000 * i, "bytes_down": 1000 * i}
               for i, auc in enumerate(aucs)]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return folder


@pytest.fixture
def legends(monkeypatch):
    """The legend texts of every figure drawn, by file name."""
    drawn: dict[str, list[list[str]]] = {}
    save = plots._save

    def keep(fig, path, plt):
        drawn[path.name] = [[t.get_text() for t in ax.get_legend().get_texts()] for ax in fig.axes
                            if ax.get_legend() is not None]
        return save(fig, path, plt)

    monkeypatch.setattr(plots, "_save", keep)
    return drawn


def test_legends_show_the_fields_the_runs_differ_in(tmp_path, legends):
    a = make_run(tmp_path / "a", [0.5, 0.7, 0.8], lr=0.1)
    b = make_run(tmp_path / "b", [0.5, 0.6, 0.65], lr=0.01)
    plots.plot_runs([a, b], tmp_path / "out")
    assert legends["auc_vs_iterations.png"] == [["codasca I=4 lr=0.1", "codasca I=4 lr=0.01"]]
    assert legends["auc_vs_bytes.png"] == [["codasca I=4 lr=0.1", "codasca I=4 lr=0.01"]]
    # where and how a run was kept (out_dir, run_name) never tells runs apart; identical configs: the folder
    c = make_run(tmp_path / "c", [0.5, 0.6, 0.7], lr=0.1)
    assert plots._labels([plots.Run(a), plots.Run(c)]) == ["codasca I=4 (a)", "codasca I=4 (c)"]


def test_runs_of_different_lr_are_separate_local_steps_curves_and_seeds_make_the_band(tmp_path, legends):
    runs = [make_run(tmp_path / "s0", [0.5, 0.80], lr=0.1, local_steps=4, seed=0),
            make_run(tmp_path / "s1", [0.5, 0.84], lr=0.1, local_steps=4, seed=1),
            make_run(tmp_path / "s2", [0.5, 0.78], lr=0.1, local_steps=8, seed=0),
            make_run(tmp_path / "s3", [0.5, 0.60], lr=0.01, local_steps=4, seed=0)]
    groups = plots.local_steps_groups([plots.Run(r) for r in runs])
    assert {curve: dict(by_steps) for curve, by_steps in groups["codasca"].items()} == {
        "lr=0.1": {4: [0.80, 0.84], 8: [0.78]}, "lr=0.01": {4: [0.60]}}
    plots.plot_runs(runs, tmp_path / "out")
    assert sorted(legends["auc_vs_local_steps.png"][0]) == ["lr=0.01", "lr=0.1"]

    # runs that differ only in their seed: one curve, its band over the seeds
    seeds = plots.local_steps_groups([plots.Run(r) for r in runs[:2]])
    assert {curve: dict(v) for curve, v in seeds["codasca"].items()} == {"": {4: [0.80, 0.84]}}


def sweep(tmp_path):
    """A sweep folder as fdam tune (or a Tuner over fdam_ray.tuning.trainable) leaves it: trial folders holding
    run folders, one trial that never reported."""
    folder = tmp_path / "sweep-1"
    make_run(folder / "trial_a_lr=0.1" / "run", [0.5, 0.8, 0.85], lr=0.1)
    make_run(folder / "trial_b_lr=0.01" / "run", [0.5, 0.6, 0.62], lr=0.01)
    (folder / "trial_c_lr=1" / "run").mkdir(parents=True)
    (folder / "trial_c_lr=1" / "run" / "metrics.jsonl").write_text("")
    (folder / "sweep_results.csv").write_text("trial,lr\n")
    return folder


def test_a_sweep_folder_is_plotted_as_its_trials(tmp_path, legends, capsys, caplog):
    folder = sweep(tmp_path)
    with caplog.at_level(logging.WARNING, logger="fdam_ray"):
        assert main(["plot", str(folder)]) == 0
    assert (folder / "auc_vs_iterations.png").stat().st_size > 5000
    assert legends["auc_vs_iterations.png"] == [["codasca I=4 lr=0.1", "codasca I=4 lr=0.01"]]
    assert "trial_c_lr=1" in caplog.text and "no evaluation records" in caplog.text


def test_a_folder_that_is_neither_a_run_nor_a_sweep_is_one_line(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert main(["plot", str(tmp_path / "empty")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is not a run folder (it has no metrics.jsonl) nor a sweep folder" in err
