"""Private evaluation (``dp_eval: on``, docs/algorithms.md s.8b): the test and validation records' own guarantee.

Each evaluation releases, per split (the test records; the validation parts), the per-class score counts summed
over every record of the split, ``(T, 2, B)`` (the clients' histograms summed on the driver, a SecAgg+ sum, or the
driver's own test set binned). Under ``dp_eval`` the driver adds N(0, sigma_e^2) to every count, clips the noised
counts at 0 and reads the AUCs (pooled, per task), the sample count and the model choice off them (post-processing).

Neighbouring relation: add or remove one record. A record with a label for task t is counted once in task t's
histogram (one bin, one class), so one record moves at most one count per task by 1: L2 sensitivity sqrt(T) over T
tasks (replace-one would move two: sqrt(2T); not the relation used). One release is the Gaussian mechanism with
noise multiplier sigma_e / sqrt(T); E releases of the same split compose exactly as one Gaussian of noise
multiplier sigma_e / sqrt(E T) (the analytic Gaussian, Balle and Wang 2018: :func:`eval_epsilon`). The refinement
passes (:mod:`fdam_ray.scores.histogram_passes`) are off under ``dp_eval``: each would be a further release, and
its ranges come from un-noised counts; one pass a split per evaluation. Per-site AUCs are not recorded: they come
from a site's own un-noised scores.

Two accountants, one per split: the test records' (``dp_eval_epsilon``) and the validation records'
(``dp_eval_val_epsilon``, when ``val_fraction`` > 0; the model choice on ``val_auc`` is post-processing of those
releases). Test, validation and training records are different records (parallel composition): each epsilon is
its own records' guarantee, beside the training ``dp_epsilon``; delta is ``dp_delta`` for all.

From whom it protects: the noise is added on the driver to the sum, so the guarantee holds against every reader of
the metrics, the summary, the logs and the chosen model, not against the driver, which sees the un-noised sums
(and, without SecAgg+, each site's histogram); under Flower with SecAgg+ the driver sees only the sums.

The noise is keyed by the privacy secret (``dp_noise_seed``, else 128 bits of fresh entropy kept in the checkpoint)
under its own domain tag: release i of a split draws from SeedSequence(secret, spawn_key=(EVAL_NOISE_DOMAIN, split,
i)), so a resumed run continues the accountant and the draws where the checkpoint left them.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any

import numpy as np

from fdam_ray.loop.plug import Plug, PlugStart, Released
from fdam_ray.privacy.mechanisms import run_secret
from fdam_ray.privacy.pld import analytic_gaussian_epsilon

log = logging.getLogger(__name__)

EVAL_NOISE_DOMAIN = 0x4556  # "EV": the evaluation noise's stream, apart from the client draw and DP-SGD's
SPLITS = {"test": 1, "val": 2}
RELATION = "add or remove one record (one count per task by 1: L2 sensitivity sqrt(T))"


def planned_evaluations(iterations: int, eval_every: int) -> int:
    """The evaluations a run of ``iterations`` makes at most: the start, one per ``eval_every`` and the end."""
    return 1 + math.ceil(iterations / eval_every)


def eval_epsilon(sigma_e: float, tasks: int, releases: int, delta: float) -> float:
    """The epsilon at ``delta`` of ``releases`` Gaussian releases of counts with noise std ``sigma_e`` and L2
    sensitivity sqrt(``tasks``): one Gaussian of noise multiplier sigma_e / sqrt(releases * tasks)."""
    return analytic_gaussian_epsilon(sigma_e / math.sqrt(tasks), delta, releases)


def solve_eval_noise(target: float, delta: float, tasks: int, releases: int) -> float:
    """The sigma_e whose ``releases`` releases reach ``target`` epsilon at ``delta`` (to 1e-10 relative)."""
    from scipy.optimize import brentq

    def excess(log_sigma: float) -> float:
        return eval_epsilon(math.exp(log_sigma), tasks, releases, delta) - target

    lo, hi = -10.0, 10.0
    while excess(lo) < 0:
        lo -= 10
    while excess(hi) > 0:
        hi += 10
    return math.exp(brentq(excess, lo, hi, xtol=1e-12, rtol=1e-12))


def noised_counts(counts: np.ndarray, sigma_e: float, rng: np.random.Generator) -> np.ndarray:
    """``counts`` + N(0, sigma_e^2) each, clipped at 0 (float64)."""
    counts = np.asarray(counts, dtype=np.float64)
    return np.maximum(counts + rng.normal(0.0, sigma_e, counts.shape), 0.0)


class PrivateEvaluation:
    """sigma_e, the secret, and the releases of each split so far (this module's docstring)."""

    def __init__(self, *, noise: float | None, target: float | None, delta: float, seed: int | None,
                 tasks: int, planned: int, state: dict | None = None) -> None:
        self.delta = float(delta)
        if state is not None:  # a resume: never re-solve (the planned evaluations may have changed)
            self.sigma, self.tasks = float(state["sigma"]), int(state["tasks"])
            self.releases = {k: int(v) for k, v in state["releases"].items()}
            self.secret = int(state["secret"])
            if self.tasks != tasks:
                raise ValueError(f"dp_eval: the checkpoint counted {self.tasks} tasks, the data has {tasks}")
            return
        self.tasks = int(tasks)
        if noise is not None:
            self.sigma = float(noise)
        elif target is not None:
            self.sigma = solve_eval_noise(target, delta, tasks, planned)
        else:
            raise ValueError("dp_eval: on needs dp_eval_noise or dp_eval_epsilon")
        self.releases = {split: 0 for split in SPLITS}
        self.secret = run_secret(None, seed)
        log.info("dp_eval: sigma_e %.4g per count, %d tasks, %d planned evaluations, delta %g", self.sigma, tasks,
                 planned, delta)

    def release(self, split: str, counts: np.ndarray) -> np.ndarray:
        """The noised, clipped counts of ``split``'s next release; counted."""
        if split not in SPLITS:
            raise ValueError(f"dp_eval: split {split!r}: test or val")
        if counts.shape[0] != self.tasks:
            raise ValueError(f"dp_eval: counts of {counts.shape[0]} tasks, the accountant counts {self.tasks}")
        seq = np.random.SeedSequence(self.secret, spawn_key=(EVAL_NOISE_DOMAIN, SPLITS[split], self.releases[split]))
        self.releases[split] += 1
        return noised_counts(counts, self.sigma, np.random.default_rng(seq))

    def epsilon(self, split: str = "test") -> float:
        return eval_epsilon(self.sigma, self.tasks, self.releases[split], self.delta)

    def record(self) -> dict[str, float]:
        out = {"dp_eval_epsilon": self.epsilon("test"), "dp_eval_delta": self.delta}
        if self.releases["val"]:
            out["dp_eval_val_epsilon"] = self.epsilon("val")
        return out

    def state(self) -> dict[str, Any]:
        return {"sigma": self.sigma, "tasks": self.tasks, "releases": dict(self.releases), "secret": self.secret}

    def summary(self) -> dict[str, Any]:
        return {**self.record(), "dp_eval": "on", "dp_eval_noise": self.sigma, "dp_eval_relation": RELATION,
                "dp_eval_releases": dict(self.releases)}


class EvaluationPlug(Plug):
    """A plug (``inner``: the training's privacy plug, or the one that does nothing) with private evaluation: every
    hook is ``inner``'s; :meth:`evaluation` noises the pooled counts; records, summary and checkpoint gain the
    evaluation accountant's entries (the checkpoint's under ``"evaluation"``)."""

    counts_only = True

    def __init__(self, inner: Plug, *, noise: float | None, target: float | None, delta: float, seed: int | None,
                 planned: int) -> None:
        self.inner = inner
        self.noise, self.target, self.delta, self.seed, self.planned = noise, target, delta, seed, planned
        self._eval: PrivateEvaluation | None = None

    @property
    def runs_of_rounds(self) -> bool:  # type: ignore[override]
        return self.inner.runs_of_rounds

    @property
    def private(self) -> PrivateEvaluation:
        if self._eval is None:
            raise RuntimeError("the evaluation plug has not been set up (Plug.setup runs at the federation's start)")
        return self._eval

    def setup(self, setup: Any, start: PlugStart) -> Any:
        state = dict(start.state) if start.state is not None else {}
        own = state.pop("evaluation", None)
        self._eval = PrivateEvaluation(noise=self.noise, target=self.target, delta=self.delta, seed=self.seed,
                                       tasks=len(start.source.task_names), planned=self.planned, state=own)
        return self.inner.setup(setup, dataclasses.replace(start, state=state or None))

    def started(self, num_train: list[int]) -> None:
        self.inner.started(num_train)

    def sampler(self, default: Any) -> Any:
        return self.inner.sampler(default)

    def before_round(self, plan: Any, clients: list[int] | None) -> str | None:
        return self.inner.before_round(plan, clients)

    def reducer(self, reducer: Any, plan: Any) -> Any:
        return self.inner.reducer(reducer, plan)

    def after_round(self, plan: Any, clients: list[int] | None, reported: int) -> None:
        self.inner.after_round(plan, clients, reported)

    def evaluation(self, split: str, counts: np.ndarray) -> Released:
        return Released(self.private.release(split, counts), per_site=False, refine=False)

    def record(self) -> dict[str, Any]:
        return {**self.inner.record(), **self.private.record()}

    def state(self) -> dict | None:
        return {**(self.inner.state() or {}), "evaluation": self.private.state()}

    def summary(self) -> dict[str, Any]:
        return {**self.inner.summary(), **self.private.summary()}


def evaluation_plug(inner: Plug, *, dp_eval: str, noise: float | None, target: float | None, delta: float,
                    seed: int | None, iterations: int, eval_every: int) -> Plug:
    """``inner`` with private evaluation under ``dp_eval: on``, else ``inner`` itself."""
    if dp_eval != "on":
        return inner
    return EvaluationPlug(inner, noise=noise, target=target, delta=delta, seed=seed,
                          planned=planned_evaluations(iterations, eval_every))
