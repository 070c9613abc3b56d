"""dp: client with the Poisson client draw in the federation (inline executor; one Ray run): each round runs the
secret's Poisson set, an empty round applies the server's noise alone (against a NumPy recomputation with the same
noise generator) and is accounted, epsilon is the Poisson PLD's, full participation is unchanged."""

from __future__ import annotations

import numpy as np
import pytest
from sample_clients import gaussian_clients

import fdam_ray
from fdam_ray.algorithms.sampling import poisson_sample_clients
from fdam_ray.privacy.accountant import Accountant
from fdam_ray.privacy.mechanisms import gaussian_noise, noise_generator

BASE = dict(model="linear", batch_size="full", eval_every=100, seed=0, lr=0.3, executor="inline",
            algorithm="coda_plus", local_steps=2, positive_ratio=0.5, dp="client", dp_clip=0.05, dp_noise_seed=7,
            num_clients=4, clients_per_round=1, dp_noise_multiplier=0.8, global_lr=1.5)
# secret 7, K = 4, q = 1/4: rounds 1 and 2 draw no client, round 3 draws clients 1 and 3
EMPTY_FIRST = [[], [], [1, 3], []]


def spy_rounds(monkeypatch):
    """Each round the inline executor is asked to run: its clients and the (v, alpha) it starts from."""
    from fdam_ray.executors.inline import InlineExecutor

    seen: dict[int, tuple[list[int] | None, np.ndarray, np.ndarray]] = {}
    real = InlineExecutor.run_round

    def record(self, state, plan, fold, clients=None):
        seen[plan.round] = (None if clients is None else sorted(clients), state.v.copy(), state.alpha.copy())
        return real(self, state, plan, fold, clients)

    monkeypatch.setattr(InlineExecutor, "run_round", record)
    return seen


def poisson_epsilon(rounds, k=4, s=1, sigma=0.8):
    acc = Accountant.for_clients(noise_multiplier=sigma, delta=1e-5, num_clients=k, clients_per_round=s,
                                 sampling="poisson")
    acc.step(rounds)
    return acc.epsilon()


def test_an_empty_round_is_the_servers_noise_over_s_and_is_accounted(monkeypatch):
    assert [poisson_sample_clients(7, r, 4, 1) for r in range(1, 5)] == EMPTY_FIRST
    clients, test = gaussian_clients(4, seed=0)
    seen = spy_rounds(monkeypatch)
    r = fdam_ray.train_arrays(dict(BASE, iterations=6), clients, test)  # rounds 1, 2 empty; round 3 two clients
    assert [seen[i][0] for i in (1, 2, 3)] == EMPTY_FIRST[:3]
    for i, after in ((1, seen[2]), (2, seen[3])):  # v, alpha after round i = those round i + 1 starts from
        v, alpha = seen[i][1], seen[i][2]
        z = np.zeros(v.size + alpha.size, dtype=np.float32) + gaussian_noise(v.size + alpha.size, 0.8 * 0.05,
                                                                             noise_generator(7, i))
        step = (z * np.float32(1 / 1)) * np.float32(1.5)  # Z / S with S = qK = 1, times eta_g
        np.testing.assert_array_equal(after[1], v + step[:v.size])
        np.testing.assert_array_equal(after[2], alpha + step[v.size:])  # auc_square: alpha not projected
        assert np.any(after[1] != v)
    assert r.state.round == 3
    assert r.summary["dp_epsilon"] == poisson_epsilon(3) > poisson_epsilon(2) > 0  # the empty rounds count
    assert (r.summary["dp_sampling"], r.summary["dp_relation"], r.summary["dp_accountant"]) == (
        "poisson", "add_or_remove_one", "pld")
    assert r.summary["dp_accountant_note"] is None


def test_no_client_since_the_last_record_leaves_its_train_loss_empty(monkeypatch):
    clients, test = gaussian_clients(4, seed=0)
    r = fdam_ray.train_arrays(dict(BASE, iterations=4, eval_every=2), clients, test)  # two empty rounds
    assert [h["round"] for h in r.history] == [0, 1, 2]
    assert [h["train_loss"] for h in r.history] == [None, None, None]  # no NaN: no client reported a loss
    assert [h["bytes_up"] for h in r.history] == [0, 0, 0]
    assert r.history[-1]["dp_epsilon"] == poisson_epsilon(2)
    assert np.isfinite(r.history[-1]["test_auc"])


def test_the_sets_are_the_secrets_poisson_draws_whatever_the_public_seed(monkeypatch):
    clients, test = gaussian_clients(6, seed=0)
    cfg = dict(BASE, num_clients=6, clients_per_round=2, iterations=24)
    seen = spy_rounds(monkeypatch)
    draws, results = [], []
    for seed, secret in ((0, 7), (1, 7), (0, 8)):
        seen.clear()
        results.append(fdam_ray.train_arrays(dict(cfg, seed=seed, dp_noise_seed=secret), clients, test))
        draws.append({i: got[0] for i, got in seen.items()})
        assert draws[-1] == {i: poisson_sample_clients(secret, i, 6, 2) for i in range(1, 13)}
    assert draws[0] == draws[1] and draws[0] != draws[2]
    assert any(not d for d in draws[0].values()) and any(len(d) != 2 for d in draws[0].values() if d)
    want = poisson_epsilon(12, k=6, s=2)
    assert all(x.summary["dp_epsilon"] == want for x in results)  # the PLD of q = S / K over the run's rounds


def test_full_participation_is_unchanged_whatever_dp_sampling_says(monkeypatch):
    clients, test = gaussian_clients(4, seed=0)
    seen = spy_rounds(monkeypatch)
    cfg = dict(BASE, clients_per_round=None, iterations=6)
    runs = [fdam_ray.train_arrays(dict(cfg, **extra), clients, test)
            for extra in ({}, {"dp_sampling": "fixed"}, {"dp_sampling": "poisson"})]
    assert all(got[0] is None for got in seen.values())  # every client, every round: nothing drawn
    for other in runs[1:]:
        np.testing.assert_array_equal(other.state.v, runs[0].state.v)
        assert other.summary["dp_epsilon"] == runs[0].summary["dp_epsilon"]
    assert runs[0].summary["dp_sampling"] == "fixed" and runs[0].summary["dp_relation"] == "add_or_remove_one"
    gaussian = Accountant.for_clients(noise_multiplier=0.8, delta=1e-5, num_clients=4, clients_per_round=None)
    gaussian.step(3)
    assert runs[0].summary["dp_epsilon"] == gaussian.epsilon()


@pytest.mark.slow
def test_ray_runs_an_empty_round_as_inline_does():
    # two actors of two clients; rounds 1 and 2 call no actor, round 3 calls both (clients 1 and 3)
    clients, test = gaussian_clients(4, seed=2)
    cfg = dict(BASE, iterations=6)
    inline = fdam_ray.train_arrays(cfg, clients, test)
    from raytest import ray_session

    with ray_session():
        ray = fdam_ray.train_arrays(dict(cfg, executor="ray", clients_per_actor=2, cpus_per_actor=0.5,
                                         threads_per_actor=1), clients, test)
    for name in ("v", "alpha"):
        np.testing.assert_allclose(getattr(ray.state, name), getattr(inline.state, name), rtol=0, atol=1e-6)
    assert ray.state.round == 3 and ray.summary["dp_epsilon"] == inline.summary["dp_epsilon"]


def test_a_resume_draws_the_poisson_sets_of_the_secret_kept_in_its_checkpoint(tmp_path, monkeypatch):
    # dp_noise_seed null: fresh entropy, kept in the checkpoint; the resumed rounds draw what the run would have
    from fdam_ray.checkpoint import load_checkpoint
    from fdam_ray.cli import main

    eps = [poisson_epsilon(t, k=6, s=2, sigma=2.0) for t in range(1, 11)]
    args = ["dataset=synthetic", "num_clients=6", "clients_per_round=2", "model=linear", "executor=inline",
            "iterations=20", "eval_every=10", "local_steps=2", "dp=client", "dp_noise_multiplier=2",
            "positive_ratio=0.5", "algorithm=coda_plus", "--quiet", f"out_dir={tmp_path}", "run_name=r"]
    seen = spy_rounds(monkeypatch)
    assert main(["train", f"dp_max_epsilon={(eps[3] + eps[4]) / 2}", *args]) == 0  # stops before round 5
    secret = load_checkpoint(tmp_path / "r" / "checkpoint.pt").loop.privacy["draw_secret"]
    assert sorted(seen) == [1, 2, 3, 4]
    assert main(["train", "--resume", str(tmp_path / "r"), f"dp_max_epsilon={eps[-1] * 2}", "--quiet"]) == 0
    assert {r: got[0] for r, got in seen.items()} == {r: poisson_sample_clients(secret, r, 6, 2) for r in range(1, 11)}
    summary = load_checkpoint(tmp_path / "r" / "checkpoint.pt").loop.history[-1]
    assert summary["round"] == 10 and summary["dp_epsilon"] == eps[-1]
