"""Input data checked before training: non-finite features are refused by name; oversized batches are pointed out."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from conftest import gaussian_clients

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
    with caplog.at_level(logging.WARNING, logger="fdam_ray.client"):
        fdam_ray.train_arrays(dict(BASE, batch_size=50), clients, test)
    assert "client 0 has 30 training samples, fewer than batch_size=50" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="fdam_ray.client"):
        fdam_ray.train_arrays(dict(BASE, batch_size=30), clients, test)
    assert "fewer than batch_size" not in caplog.text
