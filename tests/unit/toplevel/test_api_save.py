"""Whether ``train_datasets`` writes a run folder: the config names one (``run_name`` or ``out_dir``, whatever
value, the default's included) or ``save=True`` (fdam_ray.api)."""

from __future__ import annotations

import pytest
import torch

import fdam_ray.api as api
from fdam_ray.config import FIELD_BY_NAME, build_config


@pytest.fixture
def saved(monkeypatch):
    asked = []
    monkeypatch.setattr(api, "run", lambda cfg, *, source, save, **kw: asked.append(save))
    return asked


def _train(config, **kw):
    data = torch.utils.data.TensorDataset(torch.zeros(4, 3), torch.tensor([0.0, 1.0, 0.0, 1.0]))
    api.train_datasets(config, [data, data], data, **kw)


DEFAULT_OUT = FIELD_BY_NAME["out_dir"].default


@pytest.mark.parametrize("config, expected", [
    ({}, False),
    (None, False),
    ({"iterations": 5}, False),
    ({"out_dir": DEFAULT_OUT}, True),
    ({"out_dir": "elsewhere"}, True),
    ({"run_name": "mine"}, True),
])
def test_a_config_that_names_a_run_folder_gets_one_whatever_the_value(saved, config, expected):
    _train(config)
    assert saved == [expected]


def test_save_says_so_either_way(saved):
    _train({"out_dir": DEFAULT_OUT}, save=False)
    _train({}, save=True)
    assert saved == [False, True]


def test_a_config_object_with_out_dir_given_writes_one(saved):
    _train(build_config(out_dir=DEFAULT_OUT))
    _train(build_config())
    assert saved == [True, False]
