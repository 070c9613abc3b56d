"""Your own data: ``train_datasets`` (Datasets or callables building them) and ``dataset: module:attr``.

The Ray tests prove where data is read: ``own_fixtures.ON_DRIVER`` is set in this (the driver's) process, so a
data factory called here raises; Ray workers import the module afresh, where it is False.
"""

from __future__ import annotations

import functools

import numpy as np
import own_fixtures
import pytest
import torch
from own_fixtures import PairDataset, client_arrays
from raytest import ray_session

import fdam_ray
from fdam_ray.assembly.recipe import run
from fdam_ray.cli import main
from fdam_ray.config import build_config
from fdam_ray.data import base as data_base
from fdam_ray.data import make_source
from fdam_ray.executors.errors import ClientInputError

K = 3
FAST = dict(executor="inline", batch_size=8, local_steps=2, iterations=8, eval_every=4, stage_length=4, lr=0.5,
            seed=5, model="own_fixtures:bn_net", model_width=4)
HALF = dict(cpus_per_actor=0.5)


def arrays_of(factory=own_fixtures.client_dataset, num_clients=K):
    return [client_arrays(k, num_clients, "train") for k in range(num_clients)], \
        [client_arrays(k, num_clients, "test") for k in range(num_clients)]


def assert_close_runs(a, b, atol=1e-6):
    for key in a.model_state:
        np.testing.assert_allclose(a.model_state[key].numpy(), b.model_state[key].numpy(), rtol=0, atol=atol,
                                   err_msg=key)
    for ha, hb in zip(a.history, b.history, strict=True):
        assert ha["test_auc"] == pytest.approx(hb["test_auc"], abs=atol)
        assert ha.get("task_auc") == pytest.approx(hb.get("task_auc"), abs=atol)
        assert ha.get("client_auc") == pytest.approx(hb.get("client_auc"), abs=atol)


@pytest.fixture
def driver_reads_nothing(monkeypatch):
    monkeypatch.setattr(own_fixtures, "ON_DRIVER", True)


# -- in this process ---------------------------------------------------------------------------------------------
def test_datasets_give_the_run_train_arrays_gives_on_the_same_data_with_two_tasks_and_missing_labels():
    trains, tests = arrays_of()
    assert np.isnan(trains[0][1]).any() and trains[0][1].shape[1] == 2
    pooled = (np.concatenate([x for x, _ in tests]), np.concatenate([y for _, y in tests]))
    want = fdam_ray.train_arrays(FAST, trains, pooled, client_tests=tests)
    got = fdam_ray.train_datasets(FAST, [PairDataset(*a) for a in trains], PairDataset(*pooled),
                                  client_tests=[functools.partial(PairDataset, *a) for a in tests])
    assert set(got.history[-1]["task_auc"]) == {"task0", "task1"} and set(got.history[-1]["client_auc"]) == \
        {"0", "1", "2"}
    assert got.summary["positive_ratio"] == want.summary["positive_ratio"]
    assert_close_runs(got, want)
    assert got.history[-1]["test_auc"] > got.history[0]["test_auc"] + 0.1


def test_a_dataset_factory_named_in_the_config_gives_the_same_run_as_its_arrays():
    trains, tests = arrays_of()
    want = fdam_ray.train_arrays(FAST, trains, None, client_tests=tests)
    got = run(build_config(dict(FAST, dataset="own_fixtures:client_dataset", num_clients=K)), save=False)
    assert_close_runs(got, want)


def test_data_workers_auto_reads_the_labels_and_batches_with_the_clients_cpus_less_one(monkeypatch):
    monkeypatch.setattr(data_base, "client_cpus", lambda: 1.0)  # auto: no worker processes, as data_workers=0
    trains, tests = arrays_of()
    want = fdam_ray.train_arrays(FAST, trains, None, client_tests=tests)
    got = fdam_ray.train_datasets(dict(FAST, data_workers="auto"), [PairDataset(*a) for a in trains], None,
                                  client_tests=[PairDataset(*a) for a in tests])
    assert_close_runs(got, want)


def test_clients_without_a_test_split_are_left_out_of_the_pooled_test_set_and_one_task_labels_have_shape_empty():
    cfg = build_config(dict(FAST, dataset="own_fixtures:odd_clients_without_test", num_clients=4,
                            model="own_fixtures:one_dim_logits"))
    source = make_source(cfg)
    got = run(cfg, source=source, save=False)
    assert source.num_tasks == 1 and source.input_shape == (6,)
    assert set(got.history[-1]["client_auc"]) == {"0", "2"}
    assert got.history[-1]["test_samples"] == 40


def test_a_run_of_a_factory_model_on_a_factory_dataset_resumes_from_its_folder_alone(tmp_path):
    cfg = dict(FAST, dataset="own_fixtures:client_dataset", num_clients=K, out_dir=str(tmp_path),
               checkpoint_every=1, tensorboard=False)
    whole = run(build_config(cfg), save=False)
    first = run(build_config(dict(cfg, iterations=4, run_name="part")), save=True)
    resumed = fdam_ray.resume(first.run_dir, {"iterations": 8})
    for key in whole.model_state:
        np.testing.assert_array_equal(resumed.model_state[key].numpy(), whole.model_state[key].numpy(), key)
    assert resumed.history[-1]["test_auc"] == whole.history[-1]["test_auc"]


def test_the_cli_trains_on_a_dataset_factory(tmp_path, capsys):
    rc = main(["train", f"out_dir={tmp_path}", "dataset=own_fixtures:client_dataset", "num_clients=2",
               "model=own_fixtures:bn_net", "executor=inline", "iterations=4", "local_steps=2", "eval_every=2",
               "batch_size=8", "tensorboard=false"])
    assert rc == 0, capsys.readouterr().err


def _labels(values):
    return [(np.zeros(6, np.float32), v) for v in values]


class ListDataset(torch.utils.data.Dataset):
    def __init__(self, items):
        self.items = items

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


GOOD = _labels([1.0, 0.0, np.nan, 0.0])
BAD_DATA = [
    ("label value", [GOOD, _labels([0.0, 1.0, 0.0, 2.0])], "client 1, sample 3: label 2.0 is not 0, 1 or NaN"),
    ("label shape across clients", [GOOD, _labels([0.0, np.array([1.0, 0.0])])],
     "client 1, sample 1: the label has shape (2,), the federation's labels () (1 task, the same on every client)"),
    ("not a pair", [GOOD, [(np.zeros(6, np.float32),)]], "client 1, sample 0: items must be (x, y) pairs, got a tuple"),
    ("x not an array", [GOOD, [([0.0] * 6, 1.0)]], "client 1, sample 0: x is a list; it must be a torch tensor"),
    ("x shape", [GOOD, [(np.zeros(5, np.float32), 1.0)]], "client 1, sample 0: x has shape (5,), the federation's "
                                                         "samples (6,)"),
    ("label text", [GOOD, [(np.zeros(6, np.float32), "yes")]], "client 1, sample 0: the label is a str, not 0, 1"),
    ("empty first client", [[], GOOD], "client 0 has no samples"),
    ("empty second client", [GOOD, []], "client 1 has no samples"),
]


@pytest.mark.parametrize("items,message", [b[1:] for b in BAD_DATA], ids=[b[0] for b in BAD_DATA])
def test_bad_items_are_refused_in_one_line_naming_client_and_sample(items, message):
    with pytest.raises(ValueError) as info:
        fdam_ray.train_datasets(FAST, [ListDataset(i) for i in items], None, client_tests=[ListDataset(GOOD)] * 2)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_entries_that_are_not_datasets_are_refused_in_one_line():
    good = ListDataset(GOOD)
    with pytest.raises(ValueError, match=r"^client 1: expected a torch Dataset or a callable that builds one, got a "
                                         r"int$"):
        fdam_ray.train_datasets(FAST, [good, 3], good)
    with pytest.raises(ValueError, match=r"^client 0: the callable returned None, not a Dataset$"):
        fdam_ray.train_datasets(FAST, [lambda: None, good], good)
    with pytest.raises(ValueError, match=r"^client 0: the callable returned a dict, not a torch Dataset"):
        fdam_ray.train_datasets(FAST, [lambda: {}, good], good)
    with pytest.raises(ValueError, match="give a test set, per-client test splits, or both"):
        fdam_ray.train_datasets(FAST, [good, good], None)
    with pytest.raises(ValueError, match="dataset 'datasets' takes your own Datasets"):
        make_source(build_config(dataset="datasets"))


# -- under Ray: the data is read on the clients' processes -----------------------------------------------------------
@pytest.fixture(scope="module")
def session():
    with ray_session():
        yield


def test_under_ray_a_factory_model_and_dataset_train_on_the_actors_as_inline(session, driver_reads_nothing):
    cfg = dict(FAST, dataset="own_fixtures:client_dataset", num_clients=2, executor="ray", fold_order="client",
               **HALF)
    with pytest.raises(RuntimeError, match="read in the driver process"):
        run(build_config(dict(cfg, executor="inline")), save=False)
    got = run(build_config(cfg), save=False)
    own_fixtures.ON_DRIVER = False  # (monkeypatch restores it)
    want = run(build_config(dict(cfg, executor="inline")), save=False)
    for key in want.model_state:  # folded in client order: the inline run to the bit
        np.testing.assert_array_equal(got.model_state[key].numpy(), want.model_state[key].numpy(), key)
    assert [h["test_auc"] for h in got.history] == [h["test_auc"] for h in want.history]


def test_under_ray_callables_build_each_clients_data_on_its_actor(session, driver_reads_nothing):
    trains, tests = arrays_of(num_clients=2)
    pooled = (np.concatenate([x for x, _ in tests]), np.concatenate([y for _, y in tests]))
    want = fdam_ray.train_arrays(dict(FAST, **HALF), trains, pooled)
    clients = [functools.partial(own_fixtures.client_dataset, k, 2, "train") for k in range(2)]
    got = fdam_ray.train_datasets(dict(FAST, executor="ray", eval_on="clients", **HALF), clients,
                                  lambda: PairDataset(*pooled),  # test set and model travel by value
                                  model=lambda shape, tasks, width: own_fixtures.bn_net(shape, tasks, width))
    assert callable(got.config.model)
    assert_close_runs(got, want)


def test_under_ray_a_model_module_the_actors_cannot_import_is_one_line_naming_path_and_hint(
        session, tmp_path, monkeypatch):
    (tmp_path / "driver_only_models.py").write_text("from own_fixtures import bn_net as build\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    trains, tests = arrays_of(num_clients=1)
    with pytest.raises(ClientInputError) as info:
        fdam_ray.train_arrays(dict(FAST, executor="ray", model="driver_only_models:build", **HALF), trains,
                              tests[0])
    line = str(info.value)
    assert "(start): ValueError: model: cannot import module 'driver_only_models' of 'driver_only_models:build'" \
        in line and "No module named 'driver_only_models'" in line
    assert "PYTHONPATH" in line and "runtime_env" in line and "\n" not in line
