"""Your own model and data code that misbehaves: each fault is one line naming the factory or the client, the
sample where known, and what to change; never a traceback through the federation's code.

Every case runs inline (in this process) except where the point is what reaches Ray: there the error comes
before Ray starts.
"""

from __future__ import annotations

import logging
import threading

import numpy as np
import own_fixtures
import pytest
import torch
from sample_clients import gaussian_clients

import fdam_ray
from fdam_ray.cli import main
from fdam_ray.config import ConfigError, build_config
from fdam_ray.data.datasets import DatasetsSource

FAST = dict(executor="inline", batch_size=4, local_steps=1, iterations=4, eval_every=2, stage_length=2, lr=0.1,
            seed=1, model="linear")


class Pairs(torch.utils.data.Dataset):
    """``n`` items of 6 features, every third one positive; ``fault`` says what goes wrong."""

    def __init__(self, n: int = 20, seed: int = 0, fault: str | None = None, at: int = 7,
                 positives: bool = True) -> None:
        rng = np.random.default_rng(seed)
        self.x = rng.standard_normal((n, 6)).astype(np.float32)
        self.y = (np.arange(n) % 3 == 0).astype(np.float32) if positives else np.zeros(n, np.float32)
        self.fault, self.at, self.reads = fault, at, 0

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i):
        self.reads += 1
        if self.fault == "raises" and i == self.at:
            raise KeyError(f"no file for sample {i}")
        if self.fault == "raises later" and self.reads > len(self):  # the label pass reads fine, training fails
            raise OSError(f"lost the connection reading sample {i}")
        x = self.x[i]
        if self.fault == "nan" and i == self.at:
            x = x.copy()
            x[2] = np.nan
        if self.fault == "int":
            x = (x * 4).astype(np.int64) % 10
        return torch.from_numpy(x), self.y[i]


def one_line(exc: BaseException) -> str:
    text = str(exc)
    assert "\n" not in text and "Traceback" not in text
    return text


# -- model factories ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("factory,raised", [("own_fixtures:wrong_kwargs", "TypeError: Linear.__init__() got an "
                                                                          "unexpected keyword argument 'hidden'"),
                                            ("own_fixtures:missing_key", "KeyError: 'mlp'")])
def test_a_model_factory_that_raises_is_one_line_naming_it_where_and_how_it_was_called(factory, raised):
    clients, test = gaussian_clients()
    with pytest.raises(ValueError) as info:
        fdam_ray.train_arrays(dict(FAST, model=factory), clients, test)
    line = one_line(info.value)
    assert line.startswith(f"model '{factory}': the factory raised {raised}")
    assert "(at own_fixtures.py:" in line and f"in {factory.split(':')[1]})" in line  # where in your code
    assert "factory((5,), 1)" in line and "fix the factory" in line


def test_the_cli_reports_a_failing_model_factory_in_one_line_with_rc_2(tmp_path, capsys):
    rc = main(["train", "dataset=synthetic", "num_features=4", "samples_per_client=20", "num_clients=2",
               "model=own_fixtures:missing_key", "executor=inline", "iterations=2", f"out_dir={tmp_path}", "--quiet"])
    err = capsys.readouterr().err
    assert rc == 2
    assert "fdam: error: model 'own_fixtures:missing_key': the factory raised KeyError: 'mlp'" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_a_model_module_that_calls_sys_exit_when_imported_is_reported_not_obeyed(tmp_path, monkeypatch):
    (tmp_path / "exits_on_import.py").write_text("import sys\nsys.exit(3)\n\ndef build(shape, tasks):\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError) as info:
        build_config(model="exits_on_import:build")
    line = one_line(info.value)
    assert "'exits_on_import:build'" in line and "called sys.exit(3) (at exits_on_import.py:2 in <module>)" in line
    assert 'if __name__ == "__main__"' in line


def test_nan_outputs_of_a_model_are_named_as_its_own_not_as_a_metric_error():
    clients, test = gaussian_clients()
    with pytest.raises(ValueError) as info:
        fdam_ray.train_arrays(dict(FAST, model="own_fixtures:nan_outputs"), clients, test)
    line = one_line(info.value)
    assert line.startswith("model 'own_fixtures:nan_outputs': its outputs were NaN for 100 of 100 samples of the "
                           "test set (first: sample 0) while its weights are finite")
    assert "Input contains NaN" not in line and "fix the network's forward" in line


# -- features -----------------------------------------------------------------------------------------------------
def test_integer_features_the_model_cannot_take_are_named_with_what_to_change():
    with pytest.raises(ValueError) as info:
        fdam_ray.train_datasets(FAST, [Pairs(fault="int"), Pairs(seed=1, fault="int")], Pairs(seed=2, fault="int"))
    line = one_line(info.value)
    assert "the features are torch.int64 and model 'linear' cannot take them (RuntimeError: mat1 and mat2 must " \
           "have the same dtype" in line
    assert "x.float()" in line and "or a model whose forward takes torch.int64" in line


def test_integer_features_a_model_takes_as_they_are_still_train():
    got = fdam_ray.train_datasets(dict(FAST, model="own_fixtures:token_model"),
                                  [Pairs(fault="int"), Pairs(seed=1, fault="int")], Pairs(seed=2, fault="int"))
    assert got.state.iteration == 4 and 0 <= got.history[-1]["test_auc"] <= 1


@pytest.mark.parametrize("workers", [0, 1])
def test_a_dataset_whose_getitem_raises_names_the_client_and_the_sample(workers):
    with pytest.raises(ValueError) as info:
        fdam_ray.train_datasets(dict(FAST, data_workers=workers), [Pairs(), Pairs(seed=1, fault="raises", at=7)],
                                Pairs(seed=2))
    line = one_line(info.value)
    assert line.startswith("client 1, sample 7: the Dataset's __getitem__ raised KeyError: 'no file for sample 7' "
                           "(at test_own_code_errors.py:")
    assert "fix the Dataset" in line


def test_a_read_that_fails_during_training_names_the_client_and_the_sample():
    with pytest.raises(ValueError) as info:
        fdam_ray.train_datasets(FAST, [Pairs(), Pairs(seed=1, fault="raises later")], Pairs(seed=2))
    line = one_line(info.value)
    assert line.startswith("client 1, sample ") and "__getitem__ raised OSError: lost the connection" in line


def test_nan_features_of_a_dataset_factory_are_data_with_nan_not_a_divergence():
    with pytest.raises(ValueError) as info:
        fdam_ray.train_datasets(dict(FAST, iterations=40), [Pairs(), Pairs(seed=1, fault="nan", at=5)],
                                Pairs(seed=2))
    line = one_line(info.value)
    assert line.startswith("client 1, sample 5: x holds NaN or infinite values (first at flat feature 2)")
    assert "clean or impute" in line and "diverge" not in line


# -- one class in a test split --------------------------------------------------------------------------------------
def test_a_test_set_of_one_class_on_the_dataset_path_warns_why_its_auc_is_nan(caplog):
    with caplog.at_level(logging.WARNING, logger="fdam_ray"):
        got = fdam_ray.train_datasets(FAST, [Pairs(), Pairs(seed=1)], Pairs(seed=2, positives=False),
                                      client_tests=[Pairs(seed=3), Pairs(seed=4, positives=False)])
    assert np.isnan(got.history[-1]["test_auc"])
    warned = [r.getMessage() for r in caplog.records if "AUC" in r.getMessage()]
    assert len(warned) == 1  # once, on the first evaluation
    assert "the test set has 0 positives and 20 negatives, so the pooled test AUC is NaN" in warned[0]
    assert "client 1's test split has 0 positives and 20 negatives, so client 1's AUC is NaN" in warned[0]
    assert "client 0's" not in warned[0]


def test_the_arrays_path_still_warns_once_before_the_run(caplog):
    clients, (x, y) = gaussian_clients()
    with caplog.at_level(logging.WARNING, logger="fdam_ray"):
        fdam_ray.train_arrays(FAST, clients, (x, np.zeros_like(y)))
    warned = [r.getMessage() for r in caplog.records if "AUC" in r.getMessage()]
    assert warned == ["test has 0 positives and 100 negatives, so the pooled test AUC is NaN (an AUC needs "
                      "positives and negatives)"]


# -- what cannot be sent to Ray --------------------------------------------------------------------------------------
def test_entries_ray_cannot_send_are_named_in_one_line_before_ray_starts():
    import ray

    from fdam_ray.data.datasets import check_shippable
    from fdam_ray.executors.ray.shipping import unpicklable

    lock = threading.Lock()
    with pytest.raises(ValueError) as info:
        fdam_ray.train_datasets(dict(FAST, executor="ray"), [Pairs(), lambda: (lock, Pairs())[1]], Pairs(seed=2))
    line = one_line(info.value)
    assert line.startswith("client 1: cannot be sent to the Ray processes that run the clients (TypeError: cannot "
                           "pickle '_thread.lock' object)")
    assert "must be picklable" in line and "executor=inline" in line
    assert not ray.is_initialized()
    source = DatasetsSource([Pairs(), Pairs()], Pairs(), client_tests=[None, Pairs()])
    lambda_factory = lambda shape, tasks: own_fixtures.same_as_linear(shape, tasks)
    check_shippable(lambda_factory, source, unpicklable)  # lambdas travel
    with pytest.raises(ValueError, match=r"^model 'python:.*<locals>.build': cannot be sent"):
        check_shippable(_factory_holding(lock), source, unpicklable)


def _factory_holding(lock):
    def build(shape, tasks):
        with lock:
            return own_fixtures.same_as_linear(shape, tasks)

    return build
