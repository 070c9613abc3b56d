"""A data field the run's dataset or partition does not read is said once, not ignored silently."""

from __future__ import annotations

import logging

import pytest

from fdam_ray.config import build_config


@pytest.fixture(autouse=True)
def _fresh_warnings(monkeypatch):
    monkeypatch.setattr("fdam_ray.settings.sections._WARNED", set(), raising=False)


@pytest.mark.parametrize("fields, said", [
    (dict(dirichlet_concentration=0.1), "'dirichlet_concentration' = 0.1 has no effect with partition = ih"),
    (dict(dataset="synthetic", partition="dirichlet"), "'partition' = dirichlet has no effect with dataset = "
                                                       "synthetic"),
    (dict(heterogeneity=2.0), "'heterogeneity' = 2.0 has no effect with dataset = digits (only dataset "
                              "synthetic reads it)"),
    (dict(chestxray_blank="ignore"), "'chestxray_blank' = ignore has no effect with dataset = digits"),
    (dict(download=True), "'download' = True has no effect with dataset = digits"),
])
def test_a_field_the_dataset_does_not_read_warns_once(caplog, fields, said):
    with caplog.at_level(logging.WARNING, logger="fdam_ray"):
        build_config(fields)
        build_config(fields)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and said in lines[0]


def test_fields_the_dataset_reads_say_nothing(caplog):
    with caplog.at_level(logging.WARNING, logger="fdam_ray"):
        build_config(dataset="synthetic", heterogeneity=2.0, num_features=4)
        build_config(partition="dirichlet", dirichlet_concentration=0.1)
        build_config(dataset="cifar10", download=True)
    assert not caplog.records
