"""FedProx and FedProx-AUC (algorithms/fedprox.py, algorithms/fedprox_auc.py) against the NumPy oracle and their
degenerate cases: the proximal term is centred on the point each round starts from."""

from __future__ import annotations

import json

import numpy as np
import pytest
from oracle import assert_matches, run_oracle
from test_oracle import BASE, initial_v

import fdam_ray
from fdam_ray.algorithms import PRESETS, AlgorithmSection, build_algorithm
from fdam_ray.algorithms.fedprox import FedProx
from fdam_ray.algorithms.fedprox_auc import FedProxAUC
from fdam_ray.config import build_config

CASES = [
    # FedProx on BCE: several rounds, a stage switch (lr decay), eta_g != 1
    dict(algorithm="fedprox", objective="bce", local_steps=4, iterations=24, lr=0.5, prox_weight=0.3,
         stage_length=12, global_lr=1.1),
    # FedProx-AUC, margin loss with projection, weight decay
    dict(algorithm="fedprox_auc", objective="auc_margin", local_steps=3, iterations=24, lr=0.3, prox_weight=0.2,
         stage_length=9, margin=0.5, weight_decay=0.01),
    # FedProx-AUC, square loss, eta_g < 1
    dict(algorithm="fedprox_auc", objective="auc_square", local_steps=5, iterations=20, lr=0.2, prox_weight=0.5,
         global_lr=0.9),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c['algorithm']}-{c['objective']}")
def test_matches_numpy_oracle_with_the_proximal_centre_at_the_rounds_start(case, clients_and_test):
    clients, test = clients_and_test
    result = fdam_ray.train_arrays({**BASE, **case}, clients, test)
    v0 = initial_v(clients[0][0].shape[1])
    if case["objective"] == "bce":
        v0 = v0[:-2]  # no a, b
    oracle = {k: v for k, v in case.items() if k != "algorithm"}
    data = [(X.astype(np.float64), y) for X, y in clients]
    v, alpha, _, _ = run_oracle(data, v0, proximal="round", **oracle)
    assert_matches(result, v, alpha)
    assert result.control_variates is None
    # the stage-centred rule gives another end point: the test tells the two centres apart
    v_stage, _, _, _ = run_oracle(data, v0, proximal="stage", **oracle)
    assert np.abs(v_stage - v).max() > 1e-4


def test_fedprox_without_its_proximal_term_is_fedavg_bit_for_bit(clients_and_test):
    clients, test = clients_and_test
    cfg = dict(BASE, local_steps=4, iterations=16, lr=0.5, prox_weight=0.0)
    prox = fdam_ray.train_arrays(dict(cfg, algorithm="fedprox"), clients, test)
    avg = fdam_ray.train_arrays(dict(cfg, algorithm="fedavg"), clients, test)
    np.testing.assert_array_equal(prox.state.v, avg.state.v)
    with_term = fdam_ray.train_arrays(dict(cfg, algorithm="fedprox", prox_weight=0.3), clients, test)
    assert np.abs(with_term.state.v - avg.state.v).max() > 1e-4


def test_fedprox_auc_with_one_round_per_stage_is_coda_plus_bit_for_bit(clients_and_test):
    # With one round per stage the stage's reference point (the average of the last stage's one round-end
    # iterate; v_0 for stage 1) is exactly the point the next round starts from.
    clients, test = clients_and_test
    cfg = dict(BASE, objective="auc_margin", local_steps=4, iterations=16, stage_length=4, lr=0.3,
               prox_weight=0.2)
    prox = fdam_ray.train_arrays(dict(cfg, algorithm="fedprox_auc"), clients, test)
    plus = fdam_ray.train_arrays(dict(cfg, algorithm="coda_plus"), clients, test)
    np.testing.assert_array_equal(prox.state.v, plus.state.v)
    np.testing.assert_array_equal(prox.alpha, plus.alpha)
    longer = dict(cfg, stage_length=16)  # several rounds per stage: the centres differ
    prox = fdam_ray.train_arrays(dict(longer, algorithm="fedprox_auc"), clients, test)
    plus = fdam_ray.train_arrays(dict(longer, algorithm="coda_plus"), clients, test)
    assert np.abs(prox.state.v - plus.state.v).max() > 1e-4


def test_the_presets_name_their_family_and_defaults():
    assert PRESETS["fedprox"].family is FedProx and PRESETS["fedprox"].objectives == ("bce",)
    assert PRESETS["fedprox_auc"].family is FedProxAUC
    for name in ("fedprox", "fedprox_auc"):
        config = build_config(algorithm=name)
        algorithm = build_algorithm(AlgorithmSection.of(config))
        assert type(algorithm) is PRESETS[name].family and algorithm.proximal == "round"
        assert config.prox_weight == 0.01 and not algorithm.control_variates
    with pytest.raises(ValueError, match="objective"):
        build_config(algorithm="fedprox", objective="auc_square")


@pytest.mark.parametrize("name", ["fedprox", "fedprox_auc"])
def test_fdam_train_runs_the_new_algorithms_and_learns(name, tmp_path, capsys):
    from fdam_ray.cli import main

    rc = main(["train", f"algorithm={name}", f"out_dir={tmp_path}", "run_name=r", "iterations=800",
               "eval_every=400", "executor=inline", "model=mlp", "lr=0.1"])
    assert rc == 0
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert summary["algorithm"] == name and summary["final_test_auc"] > 0.8  # from 0.42 untrained
    assert f"algorithm: {name}" in (tmp_path / "r" / "config.yaml").read_text()
