"""Client sampling and client weights (docs/algorithms.md s.3b) against the NumPy oracle and closed forms."""

from __future__ import annotations

import numpy as np
import pytest
from oracle import assert_matches, run_oracle
from test_oracle import initial_v, uneven_clients

import fdam_ray
from fdam_ray.algorithms.sampling import sample_clients
from fdam_ray.algorithms.stages import coda_alpha
from fdam_ray.assembly.recipe import federate
from fdam_ray.config import ConfigError, build_config
from fdam_ray.core.state import ScoreSums
from fdam_ray.data.arrays import ArraysSource
from fdam_ray.outputs import Observer

BASE = dict(model="linear", batch_size="full", eval_every=1000, seed=0, executor="inline")

CASES = [
    dict(algorithm="codasca", objective="auc_margin", local_steps=3, iterations=24, lr=0.3, global_lr=1.2,
         prox_weight=0.02, stage_length=12, clients_per_round=2, client_weighting="uniform"),
    dict(algorithm="codasca", objective="auc_square", local_steps=3, iterations=21, lr=0.2, prox_weight=0.01,
         stage_length=9, clients_per_round=2, client_weighting="samples", reset_control_variates=False),
    dict(algorithm="coda_plus", objective="auc_margin", local_steps=4, iterations=24, lr=0.3, prox_weight=0.02,
         clients_per_round=1, client_weighting="samples", seed=5),
    dict(algorithm="codasca", objective="auc_square", local_steps=2, iterations=12, lr=0.3, prox_weight=0.0,
         client_weighting="samples"),  # weights with every client taking part
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c['algorithm']}-S{c.get('clients_per_round')}-"
                                                      f"{c['client_weighting']}")
def test_sampling_and_weights_match_numpy_oracle(case):
    clients, test = uneven_clients()  # sizes 20, 60, 100: weights by samples differ from uniform
    result = fdam_ray.train_arrays({**BASE, **case}, clients, test)
    kwargs = {k: v for k, v in case.items() if k != "algorithm"}
    v0 = initial_v(4, case.get("seed", 0))
    v, alpha, c_v, c_a = run_oracle([(X.astype(np.float64), y) for X, y in clients], v0,
                                    control_variates=case["algorithm"] == "codasca", **kwargs)
    codasca = case["algorithm"] == "codasca"
    assert_matches(result, v, alpha, *((c_v, c_a) if codasca else ()))
    # the case is not the plain run: leaving out sampling or weights gives another end point
    plain = {k: v for k, v in kwargs.items() if k not in ("clients_per_round", "client_weighting")}
    v_plain, *_ = run_oracle([(X.astype(np.float64), y) for X, y in clients], v0,
                             control_variates=case["algorithm"] == "codasca", **plain)
    assert np.abs(v - v_plain).max() > 1e-3


def test_the_draw_is_seeded_by_seed_and_round_and_without_replacement():
    draws = [sample_clients(3, r, 10, 4) for r in range(1, 30)]
    assert all(len(set(d)) == 4 and d == sorted(d) and max(d) < 10 for d in draws)
    assert draws == [sample_clients(3, r, 10, 4) for r in range(1, 30)]
    assert len({tuple(d) for d in draws}) > 15  # rounds draw different sets
    assert draws != [sample_clients(4, r, 10, 4) for r in range(1, 30)]
    assert sample_clients(3, 1, 10, None) is None and sample_clients(3, 1, 10, 10) is None


def test_clients_per_round_above_num_clients_is_refused():
    with pytest.raises(ConfigError, match=r"config field 'clients_per_round': 5 is not allowed \(at most "
                                          r"num_clients = 4"):
        build_config(clients_per_round=5)


@pytest.mark.parametrize("algorithm", ["codasca", "coda_plus", "scaffold"])
def test_s_equal_k_is_the_full_run_bit_for_bit(algorithm, clients_and_test):
    clients, test = clients_and_test
    cfg = dict(BASE, algorithm=algorithm, local_steps=3, iterations=18, lr=0.2, stage_length=9, batch_size=8)
    full = fdam_ray.train_arrays(cfg, clients, test)
    same = fdam_ray.train_arrays(dict(cfg, clients_per_round=len(clients)), clients, test)
    for a, b in ((full.state.v, same.state.v), (full.alpha, same.alpha), (full.state.buffers, same.state.buffers)):
        np.testing.assert_array_equal(a, b)
    if full.control_variates is not None:
        np.testing.assert_array_equal(full.control_variates[0], same.control_variates[0])
    assert full.summary["bytes_up"] == same.summary["bytes_up"]


class ClientStates(Observer):
    """Keeps every client's state at the end of the run (what a final checkpoint holds)."""

    def finish(self, summary, model, snapshot):
        self.payload = snapshot()


@pytest.mark.parametrize("algorithm", ["codasca", "scaffold"])
@pytest.mark.parametrize("weighting", ["uniform", "samples"])
def test_under_sampling_c_stays_the_weighted_mean_of_every_clients_c(algorithm, weighting):
    clients, test = uneven_clients()
    cfg = build_config(dict(BASE, dataset="arrays", num_clients=3, algorithm=algorithm, local_steps=3,
                            iterations=30, lr=0.2, clients_per_round=2, client_weighting=weighting,
                            stage_length=18, tensorboard=False))
    seen = ClientStates()
    result = federate(cfg, source=ArraysSource(clients, test), save=False, observers=[seen])
    c_k = np.array([s["c_v"] for s in seen.payload.clients])
    w = np.ones(3) if weighting == "uniform" else np.array([20.0, 60.0, 100.0])
    np.testing.assert_allclose(result.control_variates[0], (w / w.sum()) @ c_k, rtol=1e-4, atol=1e-6)
    assert np.abs(c_k).max() > 1e-3


def test_bytes_count_only_the_clients_that_took_part(clients_and_test):
    clients, test = clients_and_test
    cfg = dict(BASE, algorithm="codasca", local_steps=2, iterations=10, lr=0.2)
    full = fdam_ray.train_arrays(cfg, clients, test)
    part = fdam_ray.train_arrays(dict(cfg, clients_per_round=1), clients, test)
    rounds, K = 5, len(clients)
    state_bytes = full.state.nbytes
    v_bytes = full.state.v.nbytes
    assert full.summary["bytes_down"] == K * v_bytes + rounds * K * state_bytes  # v_ref to all, then rounds
    assert part.summary["bytes_down"] == K * v_bytes + rounds * 1 * state_bytes
    assert part.summary["bytes_up"] * K == full.summary["bytes_up"]


@pytest.mark.parametrize("algorithm", ["coda", "fedavg", "npa"])
def test_every_algorithm_runs_with_a_sample_of_clients(algorithm, clients_and_test):
    clients, test = clients_and_test
    cfg = dict(BASE, algorithm=algorithm, local_steps=1 if algorithm == "npa" else 2, iterations=12, lr=0.2,
               stage_length=6, clients_per_round=2, client_weighting="samples")
    result = fdam_ray.train_arrays(cfg, clients, test)
    full = fdam_ray.train_arrays({k: v for k, v in cfg.items() if k != "clients_per_round"}, clients, test)
    assert result.state.iteration == 12 and np.isfinite(result.state.v).all()
    assert np.abs(result.state.v - full.state.v).max() > 1e-4  # the sample changed the run
    if algorithm != "coda":  # CODA's alpha round asks every client for its score sums
        assert result.summary["bytes_up"] * 3 == full.summary["bytes_up"] * 2


def test_a_resumed_sampled_run_draws_the_same_clients(tmp_path, clients_and_test):
    clients, test = clients_and_test
    cfg = dict(BASE, algorithm="codasca", local_steps=2, iterations=12, lr=0.2, stage_length=6, batch_size=8,
               clients_per_round=2, out_dir=str(tmp_path), tensorboard=False)
    whole = fdam_ray.train_arrays(cfg, clients, test)
    fdam_ray.train_arrays(dict(cfg, iterations=6, run_name="r"), clients, test, save=True)
    resumed = fdam_ray.resume(tmp_path / "r", {"iterations": 12}, source=ArraysSource(clients, test))
    np.testing.assert_array_equal(resumed.state.v, whole.state.v)
    np.testing.assert_array_equal(resumed.control_variates[0], whole.control_variates[0])


@pytest.mark.parametrize("objective", ["auc_square", "auc_margin"])
def test_coda_alpha_is_the_maximiser_of_the_weighted_objective(objective):
    rng = np.random.default_rng(2)
    sizes, prevalence = (10, 40, 150), (0.5, 0.2, 0.05)
    h = [rng.random(n) for n in sizes]
    y = [(rng.random(n) < q).astype(float) for n, q in zip(sizes, prevalence, strict=True)]
    moments = [ScoreSums(np.array([(hk * (yk == 1)).sum()]), np.array([(yk == 1).sum()]),
                       np.array([(hk * (yk == 0)).sum()]), np.array([(yk == 0).sum()]), k)
               for k, (hk, yk) in enumerate(zip(h, y, strict=True))]
    p = np.array([sum(yk.sum() for yk in y) / sum(sizes)])
    m = 0.7
    alphas = np.linspace(-3, 3, 600001)

    def objective_in_alpha(w):  # sum_k w_k f_k, alpha part only
        total = 0.0
        for wk, hk, yk in zip(w, h, y, strict=True):
            cross = np.mean(p[0] * hk * (yk == 0) - (1 - p[0]) * hk * (yk == 1))
            lin = (1 + alphas) if objective == "auc_square" else alphas
            extra = p[0] * (1 - p[0]) * m * 2 * alphas if objective == "auc_margin" else 0.0
            total = total + wk * (2 * lin * cross + extra - p[0] * (1 - p[0]) * alphas**2)
        return total

    for weights in (None, np.array(sizes, float)):
        w = np.ones(3) / 3 if weights is None else weights / weights.sum()
        best = alphas[np.argmax(objective_in_alpha(w))]
        if objective == "auc_margin":
            best = max(best, 0.0)
        got = coda_alpha(moments, objective=objective, margin=m, positive_ratio=p, weights=weights)
        assert got[0] == pytest.approx(best, abs=2e-5)
    # with sample weights and the pooled p, the maximiser is E[h|neg] - E[h|pos] over the pooled data
    H, Y = np.concatenate(h), np.concatenate(y)
    pooled = coda_alpha(moments, objective="auc_square", margin=m, positive_ratio=p, weights=np.array(sizes, float))
    assert pooled[0] == pytest.approx(H[Y == 0].mean() - H[Y == 1].mean(), abs=1e-6)
    uniform = coda_alpha(moments, objective="auc_square", margin=m, positive_ratio=p)
    assert abs(uniform[0] - pooled[0]) > 0.01  # uniform weights give another maximiser here
