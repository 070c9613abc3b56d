"""Private evaluation (``dp_eval``, fdam_ray/privacy/evaluation.py): the noise's std per count, the clip at 0, the
epsilon of E evaluations against an independent analytic-Gaussian recomputation (scipy), the target solved back,
the fields' rules, the AUC of real-valued counts, the evaluator's release (no per-site AUC), and the accountant
kept across a checkpoint."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy.optimize import brentq
from scipy.stats import norm

from fdam_ray.config import build_config
from fdam_ray.core.state import ScoreHistogram
from fdam_ray.loop.plug import NO_PLUG, PlugStart
from fdam_ray.metrics import mean_auc
from fdam_ray.privacy.evaluation import (
    EvaluationPlug,
    PrivateEvaluation,
    eval_epsilon,
    planned_evaluations,
    solve_eval_noise,
)
from fdam_ray.scores.histogram import auc_of_counts, pooled_auc_from_histograms, score_histograms
from fdam_ray.settings.sections import ConfigError


def private(sigma: float = 2.0, tasks: int = 1, seed: int | None = 5, state: dict | None = None):
    return PrivateEvaluation(noise=sigma, target=None, delta=1e-5, seed=seed, tasks=tasks, planned=3, state=state)


def test_the_noise_of_each_count_has_std_sigma_e():
    ev = private(sigma=3.0, tasks=2)
    counts = np.full((2, 2, 4096), 1000, np.int64)  # far from 0: the clip never acts
    noise = np.concatenate([(ev.release("test", counts) - counts).ravel() for _ in range(4)])
    assert noise.size == 4 * 2 * 2 * 4096
    assert abs(noise.std() / 3.0 - 1) < 0.05
    assert abs(noise.mean()) < 0.05 * 3.0
    assert ev.releases == {"test": 4, "val": 0}


def test_releases_draw_fresh_noise_keyed_by_the_secret():
    counts = np.full((1, 2, 64), 50, np.int64)
    a, b = private(seed=1), private(seed=1)
    first = a.release("test", counts)
    assert np.array_equal(first, b.release("test", counts))  # the same secret, the same release: the same draw
    assert not np.array_equal(first, a.release("test", counts))  # the next release: another draw
    assert not np.array_equal(first, a.release("val", counts))  # the other split's stream
    assert not np.array_equal(first, private(seed=2).release("test", counts))


def test_noised_counts_are_clipped_at_zero():
    ev = private(sigma=1.0)
    out = ev.release("test", np.zeros((1, 2, 20000), np.int64))
    assert out.min() == 0.0
    assert abs((out == 0).mean() - 0.5) < 0.02  # half the draws are negative, all clipped to 0
    assert abs(out[out > 0].mean() - math.sqrt(2 / math.pi)) < 0.03  # the half-normal's mean


def _scipy_epsilon(sigma_e: float, tasks: int, evaluations: int, delta: float) -> float:
    """Balle and Wang 2018: delta(eps) = Phi(D/(2s) - eps s/D) - e^eps Phi(-D/(2s) - eps s/D), D = sqrt(T), the E
    releases as one Gaussian of std s = sigma_e / sqrt(E)."""
    d, s = math.sqrt(tasks), sigma_e / math.sqrt(evaluations)

    def excess(eps: float) -> float:
        return norm.cdf(d / (2 * s) - eps * s / d) - math.exp(eps) * norm.cdf(-d / (2 * s) - eps * s / d) - delta

    return brentq(excess, 0.0, 500.0, xtol=1e-13, rtol=1e-13)


@pytest.mark.parametrize(("sigma_e", "tasks", "evaluations"), [(5.0, 1, 1), (5.0, 1, 11), (20.0, 5, 21),
                                                                (2.0, 3, 7), (50.0, 1, 101)])
def test_the_epsilon_of_e_evaluations_is_the_analytic_gaussian(sigma_e, tasks, evaluations):
    ev = private(sigma=sigma_e, tasks=tasks)
    counts = np.full((tasks, 2, 8), 3, np.int64)
    for _ in range(evaluations):
        ev.release("test", counts)
    expected = _scipy_epsilon(sigma_e, tasks, evaluations, 1e-5)
    assert ev.epsilon("test") == pytest.approx(expected, abs=1e-6, rel=0)
    assert ev.epsilon("val") == 0.0  # the validation records were not released
    assert ev.record() == {"dp_eval_epsilon": ev.epsilon("test"), "dp_eval_delta": 1e-5}


def test_a_target_epsilon_is_solved_for_the_planned_evaluations():
    planned = planned_evaluations(iterations=200, eval_every=10)
    assert planned == 21
    sigma = solve_eval_noise(1.0, 1e-5, tasks=2, releases=planned)
    assert eval_epsilon(sigma, 2, planned, 1e-5) == pytest.approx(1.0, rel=1e-9)
    ev = PrivateEvaluation(noise=None, target=1.0, delta=1e-5, seed=0, tasks=2, planned=planned)
    assert ev.sigma == pytest.approx(sigma, rel=1e-12)


def test_the_state_keeps_the_accountant_and_the_draws():
    counts = np.full((1, 2, 32), 9, np.int64)
    whole = private(seed=None)  # fresh entropy: the checkpoint keeps it
    for _ in range(3):
        whole.release("test", counts)
    resumed = private(sigma=99.0, seed=None, state=whole.state())  # the checkpoint's sigma, never the new one
    assert resumed.sigma == 2.0 and resumed.releases == whole.releases and resumed.secret == whole.secret
    assert np.array_equal(resumed.release("test", counts), whole.release("test", counts))
    assert resumed.epsilon() == whole.epsilon()
    with pytest.raises(ValueError, match="counted 1 tasks, the data has 2"):
        private(tasks=2, state=whole.state())


def test_the_auc_of_real_counts_is_the_histogram_auc_on_integers():
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 2, (500, 3)).astype(float)
    scores = np.clip(rng.normal(0.5 + 0.1 * labels, 0.2), 0, 1)
    hist = score_histograms(scores, labels, 64)
    assert np.allclose(auc_of_counts(hist), pooled_auc_from_histograms(hist), rtol=0, atol=1e-12)
    assert np.isnan(auc_of_counts(np.zeros((1, 2, 4)))).all()
    with pytest.raises(ValueError):
        auc_of_counts(-np.ones((1, 2, 4)))


BASE = dict(dataset="synthetic", model="linear", num_clients=2, executor="inline")


def test_the_fields_rules():
    ok = build_config(dict(BASE, test_scores="histogram", dp_eval="on", dp_eval_noise=3.0, dp_delta=1e-6,
                           dp_noise_seed=4))  # dp: off: delta and the secret act for the evaluation
    assert ok.dp_eval == "on"
    with pytest.raises(ConfigError, match=r"test_scores.*exact.*histogram with dp_eval: on"):
        build_config(dict(BASE, dp_eval="on", dp_eval_noise=3.0))
    with pytest.raises(ConfigError, match="dp_eval_noise"):
        build_config(dict(BASE, test_scores="histogram", dp_eval="on"))
    with pytest.raises(ConfigError, match="dp_eval_noise"):
        build_config(dict(BASE, test_scores="histogram", dp_eval="on", dp_eval_noise=1.0, dp_eval_epsilon=1.0))
    with pytest.raises(ConfigError, match=r"dp_eval_epsilon.*null while dp_eval = off"):
        build_config(dict(BASE, dp_eval_epsilon=1.0))
    with pytest.raises(ConfigError, match="dp_delta"):
        build_config(dict(BASE, dp_delta=1e-6))  # dp and dp_eval off: still refused


class _Source:
    task_names = ("a", "b")


class _Executor:
    clients_from_setup = True


def test_the_plug_noises_the_counts_and_keeps_its_checkpoint_entry_beside_the_inner_ones():
    plug = EvaluationPlug(NO_PLUG, noise=2.0, target=None, delta=1e-5, seed=1, planned=3)
    plug.setup("setup", PlugStart(_Executor(), _Source(), None, None))
    counts = np.full((2, 2, 8), 4, np.int64)
    out = plug.evaluation("val", counts)
    assert not out.per_site and not out.refine and out.counts.dtype == np.float64
    assert not np.array_equal(out.counts, counts)
    assert set(plug.record()) == {"dp_eval_epsilon", "dp_eval_delta", "dp_eval_val_epsilon"}
    state = plug.state()
    assert set(state) == {"evaluation"} and state["evaluation"]["releases"] == {"test": 0, "val": 1}
    again = EvaluationPlug(NO_PLUG, noise=2.0, target=None, delta=1e-5, seed=1, planned=3)
    again.setup("setup", PlugStart(_Executor(), _Source(), None, state))
    assert again.private.releases == {"test": 0, "val": 1}
    assert NO_PLUG.evaluation("test", counts).counts is counts  # the plug that does nothing releases them as they are


def test_the_evaluator_releases_the_noised_pooled_counts_and_no_per_site_auc():
    from fdam_ray.loop.evaluation import Evaluator

    rng = np.random.default_rng(1)
    hists = []
    for k in range(3):
        labels = rng.integers(0, 2, (80, 1)).astype(float)
        scores = np.clip(rng.normal(0.4 + 0.2 * labels, 0.15), 0, 1)
        counts = score_histograms(scores, labels, 16)
        hists.append(ScoreHistogram(client_id=k, counts=counts, task_auc=pooled_auc_from_histograms(counts),
                                    samples=80))
    plug = EvaluationPlug(NO_PLUG, noise=1.5, target=None, delta=1e-5, seed=3, planned=3)
    plug.setup(None, PlugStart(_Executor(), type("S", (), {"task_names": ("t",)})(), None, None))

    class Exec:
        def evaluate(self, state, split="test", bins=None):
            return hists

        def score_test_set(self, state):
            return None

    ev = Evaluator.__new__(Evaluator)
    ev.__init__(type("R", (), {"config": type("C", (), {"client_names": None})()})(),
                type("Src", (), {"task_names": ("t",), "test_set": lambda self: None})(), Exec(),
                warn_one_class=False, histogram_bins=16, plug=plug)
    out = ev(None)
    expected_noise = PrivateEvaluation(noise=1.5, target=None, delta=1e-5, seed=3, tasks=1, planned=3)
    released = expected_noise.release("test", sum(h.counts for h in hists))
    assert out["test_auc"] == mean_auc(auc_of_counts(released))
    assert "test_samples" not in out  # the clipped counts' total is biased: not recorded
    assert "client_auc" not in out


def test_the_drivers_own_test_set_is_binned_and_released_the_same_way():
    from fdam_ray.core.state import Scores
    from fdam_ray.loop.evaluation import Evaluator

    rng = np.random.default_rng(2)
    labels = rng.integers(0, 2, (300, 2)).astype(np.float32)
    own = Scores(client_id=-1, scores=np.clip(rng.normal(0.4 + 0.2 * labels, 0.15), 0, 1).astype(np.float32),
                 labels=labels)

    class Exec:
        def evaluate(self, state, split="test", bins=None):
            return []

        def score_test_set(self, state):
            return own

    def evaluator(plug):
        source = type("Src", (), {"task_names": ("a", "b"), "test_set": lambda self: None})()
        replica = type("R", (), {"config": type("C", (), {"client_names": None})()})()
        return Evaluator(replica, source, Exec(), warn_one_class=False, histogram_bins=16, plug=plug)

    plug = EvaluationPlug(NO_PLUG, noise=1.0, target=None, delta=1e-5, seed=8, planned=3)
    plug.setup(None, PlugStart(_Executor(), _Source(), None, None))
    out = evaluator(plug)(None)
    expected = PrivateEvaluation(noise=1.0, target=None, delta=1e-5, seed=8, tasks=2, planned=3)
    released = expected.release("test", score_histograms(own.scores, own.labels, 16))
    assert out["test_auc"] == mean_auc(auc_of_counts(released))
    assert out["task_auc"] == {n: round(float(a), 6) for n, a in zip(("a", "b"), auc_of_counts(released), strict=True)}
    assert "test_samples" not in out
    plain = evaluator(NO_PLUG)(None)  # without the plug: the exact scores, as before
    assert plain["test_samples"] == 300 and plain["test_auc"] != out["test_auc"]
