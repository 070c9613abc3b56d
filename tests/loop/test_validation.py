"""The validation split (``val_fraction``): each client's held-out part, its AUCs at every evaluation, selection on
it (summary, best_model.pt, resume, Tune), and that a run without it is the run it always was."""

from __future__ import annotations

import json
import math
import types

import numpy as np
import pandas as pd
import pytest
import torch
from interrupted import crash_in_round

import fdam_ray
from fdam_ray.assembly.recipe import resume, run
from fdam_ray.checkpoint import load_checkpoint
from fdam_ray.cli import main
from fdam_ray.config import ConfigError, build_config
from fdam_ray.core.state import GlobalState
from fdam_ray.data import DatasetSplit, Shard, Split
from fdam_ray.data.base import RowsOf, hold_out_validation
from fdam_ray.data.partition import validation_rows
from fdam_ray.loop.evaluation import Evaluator
from fdam_ray.outputs import grouped_scalars, scalars
from fdam_ray.tuning.report import write_sweep_outputs
from fdam_ray.tuning.space import make_space

TIMING = {"wall_s", "samples_per_s"}
OLD_CHECKPOINT = __import__("pathlib").Path(__file__).parents[1] / "fixtures" / "checkpoint_v1.pt"


def cfg(tmp_path, **kw):
    base = dict(dataset="synthetic", model="mlp", model_width=16, num_clients=3, samples_per_client=120,
                batch_size=16, algorithm="codasca", local_steps=3, iterations=45, stage_length=21, eval_every=9,
                checkpoint_every=4, out_dir=str(tmp_path), run_name="run", executor="inline", tensorboard=False,
                val_fraction=0.25)
    base.update(kw)
    return build_config(base)


def labelled_split(n_pos, n_neg, d=3):
    """A split whose features are its row numbers (so rows can be traced) and ``n_pos`` positives first."""
    x = torch.arange(n_pos + n_neg, dtype=torch.float32)[:, None].repeat(1, d)
    y = torch.cat([torch.ones(n_pos), torch.zeros(n_neg)])
    return Split(x, y)


def rows(split):
    return split.x[:, 0].long().tolist()


# -- the split ----------------------------------------------------------------------------------------------------

def test_the_split_is_disjoint_from_training_covers_the_shard_and_is_the_same_for_a_seed():
    shard = Shard(labelled_split(12, 88))
    one = hold_out_validation(shard, 0.2, seed=3, client_id=1)
    again = hold_out_validation(shard, 0.2, seed=3, client_id=1)
    other_seed = hold_out_validation(shard, 0.2, seed=4, client_id=1)
    other_client = hold_out_validation(shard, 0.2, seed=3, client_id=2)
    train, val = rows(one.train), rows(one.val)
    assert not set(train) & set(val) and sorted(train + val) == list(range(100))
    assert len(val) == 20
    assert rows(again.val) == val and rows(again.train) == train
    assert rows(other_seed.val) != val and rows(other_client.val) != val
    # stratified: 12 % positives on the client, 12 % (of 20, rounded) in its validation part
    assert int(one.val.y.sum()) in (2, 3) and int(one.train.y.sum()) == 12 - int(one.val.y.sum())


def test_each_task_with_positives_keeps_one_in_both_parts():
    rng = np.random.default_rng(0)
    y = np.zeros((60, 3), dtype=np.float32)
    y[:30, 0] = 1
    y[[40, 50], 1] = 1  # a rare task: 2 positives, less than its share of a 10 % split
    y[:, 2] = np.nan
    y[[5, 45], 2] = 1
    y[[6, 7, 46], 2] = 0
    held = validation_rows(y, 0.1, rng, client_id=0)
    kept = np.setdiff1d(np.arange(60), held)
    for t in range(3):
        assert (y[held, t] == 1).any() and (y[kept, t] == 1).any(), t


def test_groups_such_as_patients_are_held_out_whole():
    rng = np.random.default_rng(1)
    groups = np.repeat(np.arange(40), 3)  # 40 patients of 3 images each
    y = np.zeros(120, dtype=np.float32)
    y[:30] = 1  # patients 0-9 positive
    held = validation_rows(y, 0.25, rng, client_id=0, groups=groups)
    kept = np.setdiff1d(np.arange(120), held)
    assert not set(groups[held]) & set(groups[kept]) and 27 <= len(held) <= 33
    assert y[held].sum() in (6, 9) and y[kept].sum() > 0  # stratified by patient: 2 or 3 of the 10 positive ones
    again = validation_rows(y, 0.25, np.random.default_rng(1), client_id=0, groups=groups)
    assert again.tolist() == held.tolist()
    shard = hold_out_validation(Shard(labelled_split(30, 90), groups=groups), 0.25, seed=0, client_id=0)
    assert len(shard.groups) == len(shard.train) and set(shard.groups) == set(groups[rows(shard.train)])


def test_a_dataset_read_from_disk_is_cut_by_rows_and_keeps_its_augmentation_generator():
    class Items(torch.utils.data.Dataset):
        generator = torch.Generator().manual_seed(0)

        def __len__(self):
            return 10

        def __getitem__(self, i):
            return torch.tensor([float(i)]), torch.tensor([float(i < 3)])

    split = DatasetSplit(Items(), np.array([[float(i < 3)] for i in range(10)]))
    shard = hold_out_validation(Shard(split), 0.3, seed=0, client_id=0)
    assert isinstance(shard.val.dataset, RowsOf) and shard.train.dataset.generator is Items.generator
    for part in (shard.train, shard.val):
        for i in range(len(part)):
            x, y = part.dataset[i]
            assert float(y[0]) == part.labels[i, 0] == float(x[0] < 3)
    assert len(shard.val) == 3 and shard.val.labels.sum() >= 1 and shard.train.labels.sum() >= 1


def test_a_datasets_own_validation_split_is_used_and_dropped_without_validation():
    own = labelled_split(2, 3)
    shard = Shard(labelled_split(10, 10), val=own)
    assert hold_out_validation(shard, 0.2, seed=0, client_id=0).val is own
    assert hold_out_validation(shard, 0.0, seed=0, client_id=0).val is None


# -- bad values ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("value, allowed", [(1.0, "in [0, 1)"), (-0.1, "in [0, 1)"), ("much", "")])
def test_a_bad_val_fraction_is_one_line(value, allowed, capsys):
    with pytest.raises(ConfigError, match="config field 'val_fraction'") as err:
        build_config(val_fraction=value)
    assert "\n" not in str(err.value) and allowed in str(err.value)
    assert main(["train", f"val_fraction={value}"]) == 2
    out = capsys.readouterr()
    assert "val_fraction" in out.err and "Traceback" not in out.err and len(out.err.strip().splitlines()) == 1


def test_validation_with_augmented_training_images_is_refused():
    with pytest.raises(ConfigError, match=r"'val_fraction': 0.2 is not allowed .*augment=true"):
        build_config(val_fraction=0.2, augment=True)


def test_a_fraction_that_leaves_a_client_no_positive_or_no_sample_names_the_client(clients_and_test):
    clients, test = clients_and_test
    x = clients[1][0]
    few = [clients[0], (x[:3], np.array([1, 0, 0], dtype=np.float32)), clients[2]]
    base = dict(model="linear", batch_size=4, iterations=2, local_steps=1, executor="inline")
    with pytest.raises(ValueError, match=r"^client 1: val_fraction=0.5 holds out all its 1 positive\(s\), leaving "
                                         r"its training part none; lower val_fraction$"):
        fdam_ray.train_arrays(dict(base, val_fraction=0.5), few, test)
    one = [clients[0], (x[:1], np.array([1], dtype=np.float32)), clients[2]]
    with pytest.raises(ValueError, match=r"^client 1: val_fraction=0.1 holds out 1 of its 1 training samples, "
                                         "leaving none to train on"):
        fdam_ray.train_arrays(dict(base, val_fraction=0.1), one, test)


# -- a run without validation is unchanged --------------------------------------------------------------------------

def test_val_fraction_0_reproduces_bit_for_bit_the_state_an_earlier_fdam_ray_wrote(tmp_path, monkeypatch):
    # the fixture's state after round 4 was written by fdam-ray before validation existed
    recorded = load_checkpoint(OLD_CHECKPOINT)
    assert recorded.loop.best_val_state is None and recorded.loop.best_val_auc is None  # an old file reads
    monkeypatch.setattr(Evaluator, "_score_validation", lambda *a: pytest.fail("no validation without val_fraction"))
    config = build_config({**recorded.config, "iterations": recorded.loop.state.iteration, "out_dir": str(tmp_path)})
    assert config.val_fraction == 0
    r = run(config)
    for name, want in recorded.loop.state.vectors().items():
        got = getattr(r.state, name)
        assert (got is None) == (want is None), name
        if want is not None:
            np.testing.assert_array_equal(got, want, err_msg=name)
    assert [h["test_auc"] for h in r.history[:2]] == [h["test_auc"] for h in recorded.loop.history]
    assert not any(k.startswith("val") for h in r.history for k in h)
    assert "best_val_auc" not in r.summary and not (r.run_dir / "best_model.pt").exists()
    saved = torch.load(r.run_dir / "checkpoint.pt", weights_only=True)["payload"]["loop"]
    assert not set(saved) & {"best_val_auc", "best_val_iteration", "best_val_state"}  # written as before


# -- a run with validation ------------------------------------------------------------------------------------------

def scripted_val_auc(monkeypatch, peak_iteration, peak=0.9):
    """Make val_auc peak at ``peak_iteration`` (0.5 elsewhere), so the selected evaluation is known."""
    original = Evaluator._score_validation

    def scripted(self, state):
        out = original(self, state)
        out["val_auc"] = peak if state.iteration == peak_iteration else 0.5
        return out

    monkeypatch.setattr(Evaluator, "_score_validation", scripted)


def model_file(path):
    return torch.load(path, weights_only=True)


def assert_same_model(a, b):
    assert list(a) == list(b) == ["model", "a", "b", "alpha", "task_names", "network"]
    for key in a["model"]:
        torch.testing.assert_close(a["model"][key], b["model"][key], rtol=0, atol=0, msg=key)
    for key in ("a", "b", "alpha"):
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=0, msg=key)


def test_a_validated_run_reports_both_aucs_and_selects_and_saves_on_validation(tmp_path, monkeypatch):
    scripted_val_auc(monkeypatch, peak_iteration=18)
    r = run(cfg(tmp_path / "a"))
    rec = r.history[-1]
    assert {"test_auc", "client_auc", "val_auc", "val_samples", "val_client_auc"} <= set(rec)
    assert set(rec["val_client_auc"]) == {"0", "1", "2"} and rec["val_samples"] == 3 * 30
    assert all(math.isfinite(h["test_auc"]) for h in r.history)
    header = (r.run_dir / "metrics.csv").read_text().splitlines()[0].split(",")
    assert {"val_auc", "val_client_auc.2", "test_auc", "client_auc.2"} <= set(header)
    log = (r.run_dir / "train.log").read_text()
    assert log.count("val_auc") == len(r.history) and "best_model.pt: the model of iteration 18" in log
    summary = json.loads((r.run_dir / "summary.json").read_text())
    at_best = next(h for h in r.history if h["iteration"] == 18)
    assert summary["best_val_auc"] == 0.9 and summary["best_iteration"] == 18 and summary["selected_by"] == "val_auc"
    assert summary["best_test_auc"] == at_best["test_auc"]  # the test AUC at the selected evaluation, not the best
    assert summary["final_test_auc"] == rec["test_auc"] and summary["final_val_auc"] == 0.5
    # best_model.pt is the state of iteration 18: the same run stopped there
    monkeypatch.undo()
    short = run(cfg(tmp_path / "b", iterations=18))
    assert_same_model(model_file(r.run_dir / "best_model.pt"), model_file(short.run_dir / "model.pt"))
    # trackers and TensorBoard see the validation AUCs under their own names
    grouped = grouped_scalars(rec)
    assert {"auc/val", "auc/val_client/0", "auc/worst_val_client", "auc/test"} <= set(grouped)
    assert scalars(rec)["worst_val_client_auc"] == min(rec["val_client_auc"].values())


def test_the_console_shows_the_validation_auc_beside_the_test_auc(tmp_path, capsys):
    run(cfg(tmp_path / "bar", iterations=12), progress=True)
    assert "val=" in capsys.readouterr().err
    args = ["train", "dataset=synthetic", "model=linear", "num_clients=2", "iterations=6", "local_steps=3",
            "eval_every=3", "executor=inline", "tensorboard=false", f"out_dir={tmp_path}", "val_fraction=0.2",
            "--no-progress"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert out.count("val AUC") == 4 and "(selected by val AUC " in out  # 3 evaluations and the summary


def test_resume_keeps_the_best_validation_point_and_its_state(tmp_path, monkeypatch):
    scripted_val_auc(monkeypatch, peak_iteration=18)
    full = run(cfg(tmp_path / "a"))
    with crash_in_round(monkeypatch, 11):
        run(cfg(tmp_path / "b"))
    saved = load_checkpoint(tmp_path / "b" / "run" / "checkpoint.pt").loop
    assert saved.state.round == 8 and saved.best_val_iteration == 18 and saved.best_val_auc == 0.9
    assert isinstance(saved.best_val_state, GlobalState) and saved.best_val_state.iteration == 18
    resumed = resume(tmp_path / "b" / "run")
    np.testing.assert_array_equal(resumed.state.v, full.state.v)
    for key in ("best_val_auc", "best_iteration", "best_test_auc", "final_val_auc"):
        assert resumed.summary[key] == full.summary[key], key
    assert_same_model(model_file(resumed.run_dir / "best_model.pt"), model_file(full.run_dir / "best_model.pt"))
    strip = [[{k: v for k, v in h.items() if k not in TIMING} for h in x.history] for x in (resumed, full)]
    assert strip[0] == strip[1]


# -- Tune -----------------------------------------------------------------------------------------------------------

TUNE_BASE = dict(dataset="synthetic", num_clients=2, model="mlp", model_width=8, iterations=20, eval_every=10,
                 executor="inline", tensorboard=False)


def test_tunes_default_metric_is_val_auc_when_trials_have_a_validation_split(caplog):
    search = {"lr": {"grid": [0.1, 0.01]}}
    assert make_space({"base": TUNE_BASE, "search": search}).options.metric == "test_auc"
    assert make_space({"base": {**TUNE_BASE, "val_fraction": 0.2}, "search": search}).options.metric == "val_auc"
    with pytest.raises(ConfigError, match="tune option 'metric': val_auc needs val_fraction > 0"):
        make_space({"base": TUNE_BASE, "search": search, "tune": {"metric": "val_auc"}})
    chosen = make_space({"base": {**TUNE_BASE, "val_fraction": 0.2}, "search": search, "tune": {"metric": "test_auc"}})
    assert chosen.options.metric == "test_auc" and "selects on it, not on val_auc" in caplog.text


def fake_result(tmp_path, name, lr, val, test):
    frame = pd.DataFrame({"iteration": [10, 20], "val_auc": [0.5, val], "test_auc": [0.5, test]})
    return types.SimpleNamespace(path=str(tmp_path / name), config={"lr": lr}, error=None,
                                 metrics={"val_auc": val, "test_auc": test, "iteration": 20, "done": True},
                                 metrics_dataframe=frame)


def test_the_best_config_of_a_validated_sweep_is_picked_by_validation_not_test(tmp_path):
    space = make_space({"base": {**TUNE_BASE, "val_fraction": 0.2}, "search": {"lr": {"grid": [0.1, 0.01]}},
                        "tune": {"top_trials": 0}})
    results = [fake_result(tmp_path, "t0", 0.1, val=0.6, test=0.95), fake_result(tmp_path, "t1", 0.01, val=0.8,
                                                                                  test=0.7)]
    grid = type("Grid", (list,), {"experiment_path": str(tmp_path / "sweep")})(results)
    outcome = write_sweep_outputs(grid, space)
    best = outcome.best_config.read_text()
    assert "lr: 0.01" in best and "val_auc = 0.8" in best
    table = (outcome.path / "sweep_results.csv").read_text().splitlines()
    assert table[0].split(",")[:5] == ["trial", "lr", "final_val_auc", "best_val_auc", "final_test_auc"]
    assert table[1].startswith("t1,0.01,0.8,0.8,0.7")  # the test AUC still reported


@pytest.mark.slow
def test_a_short_validated_sweep_reports_val_auc_and_writes_the_best_config(tmp_path):
    import ray

    from fdam_ray.executors.ray.compat import start_loopback_ray
    from fdam_ray.tuning import run_sweep

    space = make_space({"base": {**TUNE_BASE, "val_fraction": 0.2, "threads_per_client": 1},
                        "search": {"lr": {"grid": [0.2, 0.002]}},
                        "tune": {"storage_path": str(tmp_path / "sweeps"), "name": "val", "driver_cpus": 0.5,
                                 "top_trials": 0}})
    start_loopback_ray(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        outcome = run_sweep(space)
    finally:
        ray.shutdown()
    rows = (outcome.path / "sweep_results.csv").read_text().splitlines()
    assert rows[0].startswith("trial,lr,final_val_auc,best_val_auc,final_test_auc") and len(rows) == 3
    assert "# best trial" in outcome.best_config.read_text() and "val_auc =" in outcome.best_config.read_text()


# -- Ray ------------------------------------------------------------------------------------------------------------

@pytest.mark.slow  # in CI's slow tier: a Ray session of its own, 11 s
def test_the_ray_executor_scores_the_validation_parts_as_inline_does(clients_and_test):
    import raytest

    clients, test = clients_and_test
    config = dict(model="linear", batch_size=8, iterations=6, local_steps=2, eval_every=3, val_fraction=0.25,
                  algorithm="codasca", lr=0.2, fold_order="client", cpus_per_client=0.5, threads_per_client=1)
    inline = fdam_ray.train_arrays(dict(config, executor="inline"), clients, test)
    with raytest.ray_session(num_cpus=2):
        on_ray = fdam_ray.train_arrays(dict(config, executor="ray"), clients, test)
    assert len(inline.history) == len(on_ray.history) == 3
    for a, b in zip(inline.history, on_ray.history, strict=True):
        assert a["val_samples"] == b["val_samples"] == 30 and set(b["val_client_auc"]) == {"0", "1", "2"}
        assert a["val_auc"] == pytest.approx(b["val_auc"], abs=1e-4)
        assert a["val_client_auc"] == pytest.approx(b["val_client_auc"], abs=1e-4)
    assert on_ray.summary["selected_by"] == "val_auc"


# -- a dataset's own validation split -------------------------------------------------------------------------------

def test_mimics_own_validate_split_is_the_validation_part_of_its_clients(tmp_path):
    import chestxray_fixtures

    from fdam_ray.data import data_section
    from fdam_ray.data.chestxray import ChestXraySource

    root = chestxray_fixtures.write_mimic(tmp_path)
    values = dict(dataset="chestxray", chestxray_sources=["mimic"], num_clients=1, chestxray_mimic_root=str(root),
                  image_size=16, chestxray_test_split="official", val_fraction=0.2)
    official = ChestXraySource(data_section(build_config(values, chestxray_val_split="official")))
    shard = official.client_shard(0)
    table = official.table("mimic")[0]
    val_patients = set(table.patients[np.isin(table.paths, shard.val.dataset.paths)])
    train_patients = set(table.patients[np.isin(table.paths, shard.train.dataset.paths)])
    assert val_patients == {"10000898"} and "10000898" not in train_patients  # the publisher's validate study
    assert hold_out_validation(shard, 0.2, seed=0, client_id=0).val is shard.val
    holdout = ChestXraySource(data_section(build_config(values))).client_shard(0)
    assert holdout.val is None and len(holdout.train) == len(shard.train) + len(shard.val)
    assert holdout.groups.tolist() == table.patients[np.isin(table.paths, holdout.train.dataset.paths)].tolist()
    parts = hold_out_validation(holdout, 0.4, seed=0, client_id=0)  # by patient: none on both sides
    held = set(table.patients[np.isin(table.paths, parts.val.dataset.dataset.paths[parts.val.dataset.rows])])
    assert held and not held & set(parts.groups)
    with pytest.raises(ConfigError, match=r"'chestxray_val_split': 'official' is not allowed \(holdout unless "):
        build_config(values, val_fraction=0, chestxray_val_split="official")
