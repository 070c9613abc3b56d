"""dp: client in the federation (inline executor): one round against a NumPy model of docs/algorithms.md s.9, clipping
bounds the step, the budget stops the run. The NumPy model takes each client's unclipped end point (spied at the
one client-side hook) and recomputes clip, noise (same generators), the fixed-S mean, the server step and c."""

from __future__ import annotations

import numpy as np
import pytest
from sample_clients import gaussian_clients

import fdam_ray
import fdam_ray.privacy.faces as faces
from fdam_ray.privacy.mechanisms import gaussian_noise, noise_generator

BASE = dict(model="linear", batch_size="full", eval_every=100, seed=0, lr=0.3, executor="inline",
            algorithm="coda_plus", local_steps=2, positive_ratio=0.5, dp="client", dp_clip=0.05, dp_noise_seed=7)


def spy(monkeypatch):
    seen = []
    real = faces.private_update

    def record(update, start, dp):
        seen.append((update.client_id, np.array(update.v), np.array(update.alpha), start.v.copy(),
                     start.alpha.copy(), dp))
        return real(update, start, dp)

    monkeypatch.setattr(faces, "private_update", record)
    return seen


def clip(d, c):
    norm = np.linalg.norm(d.astype(np.float64))
    return d if norm <= c else (d.astype(np.float64) * (c / norm)).astype(np.float32)


@pytest.mark.parametrize("noise_at", ["server", "clients"])
def test_one_round_equals_the_numpy_model(monkeypatch, noise_at):
    clients, test = gaussian_clients(4, seed=0)
    seen = spy(monkeypatch)
    r = fdam_ray.train_arrays(dict(BASE, iterations=2, dp_noise_multiplier=0.7, dp_noise_at=noise_at), clients, test)
    assert len(seen) == 4
    x_v, x_a = seen[0][3], seen[0][4]
    n, s, c = x_v.size, 4, 0.05
    z = np.zeros(n + x_a.size)
    clipped_any = False
    for k, v, a, _, _, _ in seen:
        d = np.concatenate([v - x_v, a - x_a]).astype(np.float32)
        clipped_any |= np.linalg.norm(d) > c
        dk = clip(d, c)
        if noise_at == "clients":
            dk = dk + gaussian_noise(dk.size, 0.7 * c / np.sqrt(s), noise_generator(7, 1, site=k))
        z += dk
    if noise_at == "server":
        z += gaussian_noise(z.size, 0.7 * c, noise_generator(7, 1))
    assert clipped_any  # the test exercises the clip
    v_new = x_v + z[:n] / s
    a_new = x_a + z[n:] / s
    np.testing.assert_allclose(r.state.v, v_new, rtol=0, atol=1e-6)
    np.testing.assert_allclose(r.state.alpha, a_new, rtol=0, atol=1e-6)
    assert r.state.c_v is None  # dp: client runs presets without control variates (s.9 P3; the c rule's own
    # post-processing is pinned in tests/unit/privacy/test_dp_client_rule.py)
    assert r.history[-1]["dp_epsilon"] > 0 and r.summary["dp_noise_multiplier"] == 0.7


def test_clipping_bounds_the_noiseless_step(monkeypatch):
    clients, test = gaussian_clients(4, seed=1)
    big = [(x * 1e3, y) for x, y in clients]
    seen = spy(monkeypatch)
    r = fdam_ray.train_arrays(dict(BASE, iterations=2, lr=10.0, dp_noise_multiplier=0.0), big, test)
    x = np.concatenate([seen[0][3], seen[0][4]])
    huge = max(np.linalg.norm(np.concatenate([v, a]) - x) for _, v, a, *_ in seen)
    move = np.linalg.norm(np.concatenate([r.state.v, r.state.alpha]) - x)
    assert huge > 100 * 0.05 and 0 < move <= 0.05 * (1 + 1e-6)


def test_budget_stops_before_the_round_that_would_exceed_it():
    from fdam_ray.privacy.accountant import Accountant

    acc = Accountant.for_clients(noise_multiplier=2.0, delta=1e-5, num_clients=4, clients_per_round=None)
    eps = []
    for _ in range(10):
        acc.step(1)
        eps.append(acc.epsilon())
    bound = (eps[2] + eps[3]) / 2  # round 4 would exceed it
    clients, test = gaussian_clients(4, seed=0)
    r = fdam_ray.train_arrays(dict(BASE, iterations=20, dp_noise_multiplier=2.0, dp_max_epsilon=bound), clients,
                              test)
    assert r.state.round == 3
    assert r.summary["dp_epsilon"] == pytest.approx(eps[2], rel=1e-12)
    assert "round 4" in r.summary["dp_stopped"]
    assert r.history[-1]["round"] == 3 and r.history[-1]["dp_epsilon"] <= bound


def test_budget_stop_exits_0_with_a_checkpoint_and_a_resume_may_only_raise_it(tmp_path, capsys):
    import json

    from fdam_ray.checkpoint import load_checkpoint
    from fdam_ray.cli import main
    from fdam_ray.privacy.accountant import Accountant

    acc = Accountant.for_clients(noise_multiplier=2.0, delta=1e-5, num_clients=4, clients_per_round=None)
    eps = []
    for _ in range(12):
        acc.step(1)
        eps.append(acc.epsilon())
    first, second = (eps[4] + eps[5]) / 2, (eps[8] + eps[9]) / 2  # stop before round 6, then before round 10
    args = ["dataset=synthetic", "model=linear", "executor=inline", "iterations=40", "eval_every=10",
            "local_steps=2", "dp=client", "dp_noise_multiplier=2", "dp_noise_seed=1", "positive_ratio=0.5",
            "algorithm=coda_plus", "--quiet"]
    assert main(["train", f"out_dir={tmp_path}", "run_name=r", f"dp_max_epsilon={first}", *args]) == 0
    run = tmp_path / "r"
    assert "privacy budget: stopping before round 6" in (run / "train.log").read_text() or \
        "privacy budget: stopping before round 6" in capsys.readouterr().err
    summary = json.loads((run / "summary.json").read_text())
    assert summary["dp_epsilon"] == eps[4] and summary["dp_relation"] == "add_or_remove_one"
    assert summary["dp_noise_multiplier"] == 2.0 and summary["dp_sampling"] == "fixed"
    ck = load_checkpoint(run / "checkpoint.pt")
    assert ck.loop.state.round == 5 and Accountant.from_state(ck.loop.privacy["client"]).epsilon() == eps[4]
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["round"] == 5 and records[-1]["dp_epsilon"] == eps[4]
    assert main(["train", "--resume", str(run), f"dp_max_epsilon={first / 2}", "--quiet"]) == 2
    assert "dp_max_epsilon' may only be raised" in capsys.readouterr().err
    assert main(["train", "--resume", str(run), f"dp_max_epsilon={second}", "--quiet"]) == 0
    ck = load_checkpoint(run / "checkpoint.pt")
    assert ck.loop.state.round == 9 and json.loads((run / "summary.json").read_text())["dp_epsilon"] == eps[8]


@pytest.mark.slow  # in CI's slow tier: 9 s; test_dp_poisson's Ray run stays in the default run
def test_ray_two_actors_equal_inline_under_dp():
    # 4 clients on 2 actors (2 each): the actors clip and noise (shares keyed by site) where the clients run; the
    # driver sums the actors' partial sums ((u0 + u1) + (u2 + u3)), inline folds u0..u3 in turn: float32 sums in
    # another order, so equal to 1e-6, not bit for bit.
    clients, test = gaussian_clients(4, seed=2)
    cfg = dict(BASE, iterations=4, dp_noise_multiplier=0.6, dp_noise_at="clients")
    inline = fdam_ray.train_arrays(cfg, clients, test)
    from raytest import ray_session

    with ray_session():  # a Ray of this test's own, shut down after it
        ray = fdam_ray.train_arrays(dict(cfg, executor="ray", clients_per_actor=2, cpus_per_actor=0.5,
                                         threads_per_actor=1), clients, test)
    for name in ("v", "alpha"):
        np.testing.assert_allclose(getattr(ray.state, name), getattr(inline.state, name), rtol=0, atol=1e-6)
    assert ray.state.c_v is None and inline.state.c_v is None
    assert ray.history[-1]["dp_epsilon"] == inline.history[-1]["dp_epsilon"] > 0
    assert not np.array_equal(inline.state.v, fdam_ray.train_arrays(dict(cfg, dp_noise_seed=8), clients, test).state.v)


def spy_sets(monkeypatch):
    """The clients each round of the inline executor runs, by round."""
    from fdam_ray.executors.inline import InlineExecutor

    sets: dict[int, list[int] | None] = {}
    real = InlineExecutor.run_round

    def record(self, state, plan, fold, clients=None):
        sets[plan.round] = None if clients is None else sorted(clients)
        return real(self, state, plan, fold, clients)

    monkeypatch.setattr(InlineExecutor, "run_round", record)
    return sets


@pytest.mark.parametrize("mode", ["client", "sample"])
def test_the_client_draw_is_keyed_by_the_noise_secret_not_the_seed(monkeypatch, mode):
    from fdam_ray.algorithms.sampling import secret_sample_clients

    clients, test = gaussian_clients(6, seed=0)
    cfg = dict(BASE, dp=mode, iterations=12, clients_per_round=2, dp_noise_multiplier=1.0, batch_size=8,
               dp_sampling="fixed")  # the S-of-K draw (dp: client's Poisson draw: tests/loop/test_dp_poisson.py)
    if mode == "sample":
        cfg["dp_clip"] = 1.0
    draws, sets = [], spy_sets(monkeypatch)
    for seed, secret in ((0, 7), (1, 7), (0, 8)):
        sets.clear()
        fdam_ray.train_arrays(dict(cfg, seed=seed, dp_noise_seed=secret), clients, test)
        draws.append(dict(sets))
        assert sets == {r: secret_sample_clients(secret, r, 6, 2) for r in range(1, 7)}
    assert draws[0] == draws[1]  # another public seed, the same secret: the same sets
    assert draws[0] != draws[2]  # another secret: other sets


def test_a_resume_draws_from_the_secret_kept_in_its_checkpoint(tmp_path, monkeypatch):
    # dp_noise_seed null: the secret is fresh entropy; the checkpoint keeps it, so the resumed rounds draw the sets
    # the run would have drawn (each round's set is secret_sample_clients(secret, r)), and it is not the seed's
    from fdam_ray.algorithms.sampling import sample_clients, secret_sample_clients
    from fdam_ray.checkpoint import load_checkpoint
    from fdam_ray.cli import main
    from fdam_ray.privacy.accountant import Accountant

    acc = Accountant.for_clients(noise_multiplier=2.0, delta=1e-5, num_clients=6, clients_per_round=2)
    eps = []
    for _ in range(10):
        acc.step(1)
        eps.append(acc.epsilon())
    args = ["dataset=synthetic", "num_clients=6", "clients_per_round=2", "model=linear", "executor=inline",
            "iterations=20", "eval_every=10", "local_steps=2", "dp=client", "dp_noise_multiplier=2",
            "dp_sampling=fixed", "positive_ratio=0.5", "algorithm=coda_plus", "--quiet", f"out_dir={tmp_path}",
            "run_name=r"]
    sets = spy_sets(monkeypatch)
    assert main(["train", f"dp_max_epsilon={(eps[3] + eps[4]) / 2}", *args]) == 0  # stops before round 5
    secret = load_checkpoint(tmp_path / "r" / "checkpoint.pt").loop.privacy["draw_secret"]
    assert sorted(sets) == [1, 2, 3, 4]
    assert main(["train", "--resume", str(tmp_path / "r"), f"dp_max_epsilon={eps[-1] * 2}", "--quiet"]) == 0
    assert sorted(sets) == list(range(1, 11))
    assert sets == {r: secret_sample_clients(secret, r, 6, 2) for r in range(1, 11)}
    assert sets != {r: sample_clients(0, r, 6, 2) for r in range(1, 11)}


def test_the_reported_epsilon_is_the_exact_one_and_rdp_is_kept_beside_it():
    # full participation: each round is one Gaussian of sigma, so T rounds are the analytic Gaussian (Balle and Wang
    # 2018) of sigma / sqrt(T), recomputed here with scipy; dp_accountant: rdp reports the looser RDP number
    from scipy.optimize import brentq
    from scipy.stats import norm

    from fdam_ray.privacy.accountant import Accountant

    clients, test = gaussian_clients(4, seed=0)
    cfg = dict(BASE, iterations=8, dp_noise_multiplier=1.5)
    exact = fdam_ray.train_arrays(cfg, clients, test)
    s = 1.5 / np.sqrt(4)  # 4 rounds, sensitivity 1

    def delta(eps):
        return norm.cdf(1 / (2 * s) - eps * s) - np.exp(eps) * norm.cdf(-1 / (2 * s) - eps * s) - 1e-5

    want = brentq(delta, 1e-9, 200, xtol=1e-14, rtol=1e-14)
    assert exact.summary["dp_epsilon"] == pytest.approx(want, rel=1e-6)
    assert exact.summary["dp_accountant"] == "pld" and exact.summary["dp_accountant_note"] is None
    rdp = Accountant.for_clients(noise_multiplier=1.5, delta=1e-5, num_clients=4, clients_per_round=None,
                                 accounting="rdp")
    rdp.step(4)
    assert exact.summary["dp_epsilon_rdp"] == rdp.epsilon() > exact.summary["dp_epsilon"]
    looser = fdam_ray.train_arrays(dict(cfg, dp_accountant="rdp"), clients, test)
    assert looser.summary["dp_epsilon"] == rdp.epsilon() and looser.summary["dp_accountant"] == "rdp"
    np.testing.assert_array_equal(looser.state.v, exact.state.v)  # the accounting changes no step of the run
