"""Input data checked before training: non-finite features are refused by name; oversized batches are pointed out."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from sample_clients import gaussian_clients

import fdam_ray

BASE = dict(model="linear", batch_size=8, iterations=4, local_steps=2, eval_every=4, executor="inline")


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_training_features_are_refused_naming_client_sample_and_column(bad, tmp_path):
    clients, test = gaussian_clients(3, n=30)
    clients[1][0][3, 2] = bad
    with pytest.raises(ValueError, match=r"client 1: its training features hold NaN or infinite values \(first at "
                                         r"sample 3, feature column 2\)"):
        fdam_ray.train_arrays(dict(BASE, out_dir=str(tmp_path)), clients, test, save=True)
    assert not any(tmp_path.iterdir())  # refused before the run folder is made


def test_non_finite_client_test_features_are_refused_too():
    clients, test = gaussian_clients(2, n=30)
    own = [(x.copy(), y) for x, y in clients]
    own[0][0][5, 0] = np.nan
    with pytest.raises(ValueError, match=r"client 0: its test features hold NaN .*sample 5, feature column 0"):
        fdam_ray.train_arrays(BASE, clients, test, client_tests=own)


def test_a_batch_larger_than_a_clients_data_is_pointed_out(caplog):
    clients, test = gaussian_clients(2, n=30)
    with caplog.at_level(logging.WARNING, logger="fdam_ray.clients.client"):
        fdam_ray.train_arrays(dict(BASE, batch_size=50), clients, test)
    assert "client 0 has 30 training samples, fewer than batch_size=50" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="fdam_ray.clients.client"):
        fdam_ray.train_arrays(dict(BASE, batch_size=30), clients, test)
    assert "fewer than batch_size" not in caplog.text


def test_a_test_set_of_one_class_is_pointed_out_once_naming_the_set(caplog):
    clients, test = gaussian_clients(2, n=30)
    negatives_only = (test[0][:20], np.zeros(20, np.float32))
    own = [clients[0], (clients[1][0], np.ones(30, np.float32))]  # client 1's own test split: positives only
    with caplog.at_level(logging.WARNING, logger="fdam_ray"):
        r = fdam_ray.train_arrays(BASE, clients, negatives_only, client_tests=own)
    assert np.isnan(r.history[-1]["test_auc"]) and r.history[-1]["client_auc"]["1"] is None
    warned = [m for m in caplog.messages if "AUC is NaN" in m]
    assert warned == ["test has 0 positives and 20 negatives, so the pooled test AUC is NaN; client_tests[1] has 30 "
                      "positives and 0 negatives, so client 1's AUC is NaN (an AUC needs positives and negatives)"]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="fdam_ray"):
        fdam_ray.train_arrays(BASE, clients, test)  # both classes: nothing to say
    assert not [m for m in caplog.messages if "AUC is NaN" in m]


def test_a_task_without_positives_in_the_test_set_is_named(caplog):
    from fdam_ray.api import warn_one_class
    from fdam_ray.data.arrays import ArraysSource

    X = np.random.default_rng(0).standard_normal((60, 3)).astype(np.float32)
    Y = np.stack([X[:, 0] > 0, X[:, 1] > 0], 1).astype(np.float32)
    test_y = Y[40:].copy()
    test_y[:, 1] = 0.0  # task 1 has no positive in the test set
    source = ArraysSource([(X[:20], Y[:20]), (X[20:40], Y[20:40])], (X[40:], test_y))
    with caplog.at_level(logging.WARNING, logger="fdam_ray"):
        warn_one_class(source)
    assert caplog.messages == ["test has 0 positives and 20 negatives for task 'task1', so its AUC for that task is "
                               "NaN (an AUC needs positives and negatives)"]
