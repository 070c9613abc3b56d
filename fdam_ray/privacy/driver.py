"""The driver's and the server's faces of differential privacy: one plug (:class:`PrivacyPlug`, a
:class:`~fdam_ray.loop.plug.Plug`) the federation calls at its hooks.

:func:`privacy_plug` builds it at the top (``fdam_ray.assembly``) from the ``dp`` section and the few facts of the
run it reads (:class:`RunFacts`). At the start (:meth:`PrivacyPlug.setup`) it refuses what ``dp: client`` does not
run (:func:`~fdam_ray.privacy.client_level.check_model`, :func:`~fdam_ray.privacy.client_level.check_transport`),
resolves sigma (given, or solved for the planned run; a resumed run reads it from its checkpoint, never re-solves)
and puts the mode's client face (:mod:`fdam_ray.privacy.faces`) into the executor's setup, so every executor's
clients clip, noise and draw their batches the same way. Then a :class:`PrivacyRun` (one per mode) keys the client
draw by the privacy secret (:attr:`PrivacyRun.draw_secret`; a Poisson draw under dp: client with ``dp_sampling``
poisson, whose empty rounds apply the server's noise alone and are accounted like any other), says before a
round whether it would take epsilon past ``dp_max_epsilon`` (:meth:`PrivacyRun.over_budget`), counts each applied
round (:meth:`PrivacyRun.step`), adds ``dp_epsilon`` and ``dp_delta`` (and under ``dp: sample``
``dp_epsilon.<site>``) to each metrics record and sigma, the neighbouring relation and the sampling to the summary;
:meth:`PrivacyRun.state` is the checkpoint's entry (``LoopState.privacy``). Under ``dp: client`` the server face
is the round's reducer built wrapped (:class:`~fdam_ray.privacy.client_level.PrivateReducer`: the noise, the fixed
denominator, c by post-processing).

An executor whose clients are built elsewhere from the plain run config (``clients_from_setup = False``: a Flower
site) receives the resolved sigma in ``ExecutorSetup.run_config`` (``dp_noise_multiplier`` = sigma, ``dp_epsilon``
null); each site then builds the same client face from it (:func:`site_face`). Its driver has no site's data: a
source that is a :class:`TrainSizesElsewhere` says the n_k sigma is solved for (asked of the sites).
"""

from __future__ import annotations

import abc
import dataclasses
import logging
from collections.abc import Mapping
from typing import Any

from fdam_ray.clients.face import NO_FACE, ClientFace
from fdam_ray.core.state import RoundPlan
from fdam_ray.data import DataSource
from fdam_ray.data.base import hold_out_validation
from fdam_ray.executors.base import ExecutorSetup
from fdam_ray.loop.plug import Plug, PlugStart
from fdam_ray.privacy.accountant import REPLACE_ONE, Accountant, shares_noise_multiplier, solve_sigma
from fdam_ray.privacy.adaptive import AdaptiveClipState
from fdam_ray.privacy.client_level import PrivateReducer, ServerRound, check_model, check_transport, client_level
from fdam_ray.privacy.faces import ClientLevelFace, SampleLevelFace
from fdam_ray.privacy.mechanisms import run_secret
from fdam_ray.privacy.section import PrivacySection
from fdam_ray.settings.sections import fail

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class RunFacts:
    """What the privacy plug reads of a run beyond its ``dp`` section, cut from the config at the top.

    Attributes:
        planned_rounds: the schedule's rounds (``fdam_ray.core.schedules.planned_rounds``): dp: client's T.
        iterations: local steps a site runs in all: dp: sample's compositions.
        batch_size: B (0: the full batch).
        transport, transfer_precision: what dp: client refuses (the collective; 16-bit transfers).
        labels: how each client is shown (``client_names``, else its index).
        val_fraction, seed: the validation hold-out, so n_k is counted as the sites count it (:func:`train_size`).
    """

    planned_rounds: int
    iterations: int
    batch_size: int
    transport: str
    transfer_precision: str
    labels: tuple[str, ...]
    val_fraction: float
    seed: int


class TrainSizesElsewhere(abc.ABC):
    """A data source whose sites' data are elsewhere (a Flower server's): it says each site's number of training
    samples (after the validation hold-out), which dp: sample needs before the start to solve sigma."""

    @abc.abstractmethod
    def train_sizes(self) -> list[int]:
        """n_k by client id, each as :func:`train_size` counts it at the site."""


def train_size(source: DataSource, client_id: int, val_fraction: float, seed: int) -> int:
    """Client ``client_id``'s number of training samples after the validation hold-out (the n_k of its accountant):
    the driver's count, and a Flower site's of its own data."""
    return len(hold_out_validation(source.client_shard(client_id), val_fraction, seed=seed, client_id=client_id,
                                   task_names=tuple(source.task_names)).train)


def face_of(section: PrivacySection, sigma: float) -> ClientFace:
    """The client face of ``section``'s dp mode with the resolved ``sigma`` (the driver's, and a site's)."""
    if section.dp == "client":
        return ClientLevelFace(client_level(section, sigma))
    if section.dp == "sample":
        return SampleLevelFace(clip=section.dp_clip, sigma=float(sigma), seed=section.dp_noise_seed,
                               sampling=section.sampling, batch_size=section.batch_size,
                               positive_sampling=section.positive_sampling)
    return NO_FACE


def site_face(section: PrivacySection) -> ClientFace:
    """The client face a site builds from the run config it received (the driver resolved sigma into it, see
    :meth:`PrivacyPlug.setup`): the face the driver builds."""
    if section.enabled and section.dp_noise_multiplier is None:
        raise ValueError(f"dp: {section.dp}: the run config this site received has no resolved "
                         "dp_noise_multiplier (the server solves sigma from dp_epsilon and sends it)")
    return face_of(section, section.dp_noise_multiplier or 0.0)


def _with_sigma(setup: ExecutorSetup, sigma: float) -> ExecutorSetup:
    """``setup`` whose run config carries the resolved sigma (what clients built from it act by)."""
    run_config: Mapping[str, Any] = {**setup.run_config, "dp_noise_multiplier": float(sigma), "dp_epsilon": None}
    return dataclasses.replace(setup, run_config=run_config)


def privacy_plug(section: PrivacySection, facts: RunFacts) -> Plug:
    """The run's privacy plug: :class:`PrivacyPlug` under a dp mode, the plug that does nothing under dp: off."""
    return PrivacyPlug(section, facts) if section.enabled else Plug()


class PrivacyPlug(Plug):
    """Differential privacy as one plug (this module's docstring); its accounting is :attr:`run`'s."""

    runs_of_rounds = False  # each round is accounted (and, under dp: client, noised) on the driver

    def __init__(self, section: PrivacySection, facts: RunFacts) -> None:
        self.section, self.facts = section, facts
        self._run: PrivacyRun | None = None
        self._fresh = self._applied = False  # a new run (not a resume), and whether a round has been counted

    @property
    def run(self) -> PrivacyRun:
        if self._run is None:
            raise RuntimeError("the privacy plug has not been set up (Plug.setup runs at the federation's start)")
        return self._run

    def setup(self, setup: ExecutorSetup, start: PlugStart) -> ExecutorSetup:
        section, facts = self.section, self.facts
        run: PrivacyRun
        if section.dp == "client":
            initial = start.flat.initial_state()
            check_model(initial.buffers, initial.counters)
            check_transport(facts.transport, facts.transfer_precision)
            if section.dp_clip_quantile is not None and not start.executor.clients_from_setup:
                raise ValueError("dp_clip_quantile (adaptive clipping) runs on the inline and ray executors, not "
                                 "on flower (its sites do not receive the round's clip); set dp_clip_quantile: null")
            run = ClientLevelRun(section, rounds=facts.planned_rounds, state=start.state)
        else:
            sizes = None
            if start.state is None and section.dp_noise_multiplier is None:  # n_k before the start: to solve sigma
                source = start.source
                sizes = (source.train_sizes() if isinstance(source, TrainSizesElsewhere)
                         else [train_size(source, k, facts.val_fraction, facts.seed)
                               for k in range(section.num_clients)])
            run = SampleLevelRun(section, iterations=facts.iterations, batch_size=facts.batch_size,
                                 num_train=sizes, labels=list(facts.labels), state=start.state)
        self._run, self._fresh = run, start.state is None
        if (line := section.only_noise(run.sigma)) is not None:
            log.warning("%s", line)
        setup = dataclasses.replace(setup, face=face_of(section, run.sigma))
        solved = section.dp_epsilon is not None and not start.executor.clients_from_setup
        return _with_sigma(setup, run.sigma) if solved else setup

    def started(self, num_train: list[int]) -> None:
        self.run.sites_known(num_train)

    def sampler(self, default: Any) -> Any:
        """The client draw keyed by the secret (never the public seed): Poisson under dp: client when the
        accountant counts the Poisson-subsampled Gaussian (``dp_sampling`` poisson, S < K), else S of K."""
        return dataclasses.replace(default, seed=self.run.draw_secret, secret=True,
                                   poisson=self.section.poisson_clients)

    def before_round(self, plan: RoundPlan, clients: list[int] | None) -> str | None:
        line = self.run.over_budget(plan.round, plan.steps, clients)
        if line is not None and self._fresh and not self._applied:  # (dp: sample's n_k are known only now)
            first = self.run.epsilon_after(plan.steps, clients)
            raise fail("dp_max_epsilon", self.section.dp_max_epsilon, f">= {first:.4g}, the epsilon of the first "
                       "round alone: no round would run; raise it or the noise")
        return line

    def round_plan(self, plan: RoundPlan) -> RoundPlan:
        return self.run.round_plan(plan)

    def reducer(self, reducer: Any, plan: RoundPlan) -> Any:
        return self.run.reducer(reducer, plan)

    def after_round(self, plan: RoundPlan, clients: list[int] | None, reported: int) -> None:
        self._applied = True
        self.run.step(plan.steps, clients, reported)

    def record(self) -> dict[str, Any]:
        return self.run.record()

    def state(self) -> dict | None:
        return self.run.state()

    def summary(self) -> dict[str, Any]:
        return self.run.summary()


class PrivacyRun:
    """The driver's side of a dp mode: sigma, the accountants, the budget stop before a round, the metrics keys,
    the summary's entries and the checkpoint's entry (:attr:`~fdam_ray.checkpoint.LoopState.privacy`)."""

    mode = ""

    def __init__(self, section: PrivacySection, sigma: float, relation: str, state: dict | None = None) -> None:
        self.section = section
        self.sigma = float(sigma)
        self.relation = relation
        self.stopped: str | None = None  # the budget's stop line, when it stopped the run
        self.draw_secret = _draw_secret(section, state)

    def _with_secret(self, state: dict[str, Any]) -> dict[str, Any]:
        return {**state, "draw_secret": self.draw_secret}

    def epsilon(self) -> float:
        raise NotImplementedError

    def epsilon_after(self, steps: int, sites: list[int] | None) -> float:
        """epsilon (the largest one's, per site) after one more round of ``steps`` local steps run by ``sites``."""
        raise NotImplementedError

    def step(self, steps: int, sites: list[int] | None, reported: int) -> None:
        """Count one applied round of ``steps`` local steps, asked of ``sites`` (None: all), ``reported`` of which
        reached the server."""
        raise NotImplementedError

    def state(self) -> dict[str, Any]:
        raise NotImplementedError

    def sites_known(self, num_train: list[int]) -> None:
        """The clients have started and report ``num_train`` (n_k by client id)."""

    def reducer(self, reducer: Any, plan: RoundPlan) -> Any:
        """Round ``plan``'s reducer (the server face): ``reducer`` itself unless the mode acts on the server."""
        return reducer

    def round_plan(self, plan: RoundPlan) -> RoundPlan:
        """Round ``plan``'s plan as the clients receive it (adaptive clipping's C_r), else ``plan``."""
        return plan

    def over_budget(self, round_index: int, steps: int, sites: list[int] | None) -> str | None:
        """The log line when round ``round_index`` would take epsilon past ``dp_max_epsilon`` (kept in
        :attr:`stopped` for the summary), else None."""
        bound = self.section.dp_max_epsilon
        if bound is None:
            return None
        after = self.epsilon_after(steps, sites)
        if after <= bound:
            return None
        self.stopped = (f"privacy budget: stopping before round {round_index}: epsilon is {self.epsilon():.4g} and "
                        f"that round would take it to {after:.4g} > dp_max_epsilon {bound:g}")
        return self.stopped

    def record(self) -> dict[str, float]:
        return {"dp_epsilon": self.epsilon(), "dp_delta": self.section.dp_delta}

    def accountants(self) -> list[Accountant]:
        raise NotImplementedError

    def summary(self) -> dict[str, Any]:
        counted = self.accountants()
        used = sorted({a.accounting_used for a in counted}) or [self.section.dp_accountant]
        reasons = sorted({a.accounting_reason for a in counted if a.accounting_reason})
        return {"dp": self.mode, "dp_epsilon": self.epsilon(),  # inf (no noise): written null, with a note
                "dp_delta": self.section.dp_delta, "dp_noise_multiplier": self.sigma, "dp_relation": self.relation,
                "dp_sampling": self.section.sampling, "dp_stopped": self.stopped,
                "dp_accountant": " / ".join(used), "dp_accountant_note": reasons[0] if reasons else None,
                "dp_epsilon_rdp": max((a.epsilon_rdp() for a in counted), default=0.0)}


class ClientLevelRun(PrivacyRun):
    """dp: client on the driver: sigma (given, or solved for the planned rounds) and one accountant over the K
    clients, one composition a round."""

    mode = "client"

    def __init__(self, section: PrivacySection, *, rounds: int, state: dict | None = None) -> None:
        k, s = section.num_clients, section.sampled_clients
        if state is not None:  # a resume: never re-solve (the planned rounds may have changed)
            self.accountant = Accountant.from_state(state["client"])
            sigma = self.accountant.noise_multiplier
        else:
            sigma = _sigma(section, population=k, sample_size=s, compositions=rounds)
            self.accountant = Accountant.for_clients(noise_multiplier=sigma, delta=section.dp_delta, num_clients=k,
                                                     clients_per_round=section.clients_per_round,
                                                     sampling=section.sampling, accounting=section.dp_accountant)
            _warn_if_fixed_costs_more(section, self.accountant, rounds)
        super().__init__(section, sigma, self.accountant.relation, state)
        self.settings = client_level(section, sigma)
        self.clip = AdaptiveClipState(section.dp_clip, state)  # C_r: the next round's clip
        self._reducer: PrivateReducer | None = None
        log.info("dp: client: sigma %.4g, clip %g, noise at %s, %d of %d clients a round (%s), delta %g (%s)",
                 sigma, section.dp_clip, section.dp_noise_at, s, k, section.sampling, section.dp_delta, self.relation)

    def epsilon(self) -> float:
        return self.accountant.epsilon()

    def accountants(self) -> list[Accountant]:
        return [self.accountant]

    def epsilon_after(self, steps: int, sites: list[int] | None) -> float:
        return self.accountant.epsilon_after(1)

    def reducer(self, reducer: Any, plan: RoundPlan) -> Any:
        """The round's reducer built wrapped: the sums are clipped changes; its finish adds the server's noise,
        divides by the planned S and moves c by post-processing (:class:`PrivateReducer`)."""
        settings = self.settings
        if settings.adaptive is not None:
            settings = dataclasses.replace(settings, clip=plan.clip)
        self._reducer = PrivateReducer(reducer, ServerRound(settings, plan.round, plan.lr))
        return self._reducer

    def round_plan(self, plan: RoundPlan) -> RoundPlan:
        adaptive = self.settings.adaptive is not None
        return dataclasses.replace(plan, clip=self.clip.value) if adaptive else plan

    def step(self, steps: int, sites: list[int] | None, reported: int) -> None:
        """Count one applied round; with noise shares, only the ``reported`` sites' shares. Under adaptive
        clipping, move C by the round's released fraction."""
        adaptive = self.settings.adaptive
        if adaptive is not None and self._reducer is not None and self._reducer.fraction is not None:
            self.clip.update(self._reducer.fraction, adaptive)
        self._reducer = None  # the round's sums are not kept past it
        s = self.settings.sampled
        if self.settings.noise_at == "clients" and reported < s:
            self.accountant.step(1, noise_multiplier=shares_noise_multiplier(self.settings.sigma, s, reported))
        else:
            self.accountant.step(1)

    def state(self) -> dict[str, Any]:
        return self._with_secret({"client": self.accountant.state(), **self.clip.state()})

    def record(self) -> dict[str, float]:
        return {**super().record(), **self.clip.record(self.settings.adaptive is not None)}

    def summary(self) -> dict[str, Any]:
        return {**super().summary(), **self.clip.summary(self.settings)}


class SampleLevelRun(PrivacyRun):
    """dp: sample on the driver (the DP-SGD step itself runs on the clients, fdam_ray/privacy/dpsgd.py): one
    accountant per site k over its n_k samples with batches of B, one composition a local step, stepped by the
    steps site k was asked to run in each round (a site asked and late still ran them: counted). The run's
    epsilon is the largest site's; sigma, when solved, is for the smallest site taking part in every round."""

    mode = "sample"

    def __init__(self, section: PrivacySection, *, iterations: int, batch_size: int, num_train: list[int] | None,
                 labels: list[str], state: dict | None = None) -> None:
        self.labels = labels
        self.batch_size = batch_size
        self.sites: list[Accountant] = []  # by client id, from sites_known (or the resumed checkpoint)
        if state is not None:
            self.sites = [Accountant.from_state(s) for s in state["sites"]]
            sigma = self.sites[0].noise_multiplier
        elif section.dp_noise_multiplier is not None:
            sigma = float(section.dp_noise_multiplier)
        else:
            if num_train is None:
                raise ValueError("dp: sample with dp_epsilon needs each site's number of training samples")
            smallest = min(num_train)
            batch = smallest if batch_size <= 0 else min(batch_size, smallest)
            sigma = _sigma(section, population=smallest, sample_size=batch, compositions=iterations)
        relation = Accountant(noise_multiplier=sigma, delta=section.dp_delta, population=2, sample_size=1,
                              sampling=section.sampling).relation  # that of a sampled batch
        super().__init__(section, sigma, relation, state)
        log.info("dp: sample: sigma %.4g, clip %g, batch %d, delta %g, per site (%s)", sigma, section.dp_clip,
                 batch_size, section.dp_delta, self.relation)

    def sites_known(self, num_train: list[int]) -> None:
        """Start each site's accountant (a new run), or check the resumed ones count the n_k the sites report."""
        if not self.sites:
            self.sites = [Accountant.for_site(noise_multiplier=self.sigma, delta=self.section.dp_delta,
                                              num_samples=n, batch_size=self.batch_size, local_steps=1,
                                              sampling=self.section.sampling,
                                              accounting=self.section.dp_accountant) for n in num_train]
            self.relation = " / ".join(sorted({a.relation for a in self.sites}))  # a full batch: add or remove
            return
        counted = [a.population for a in self.sites]
        if counted != list(num_train):
            raise ValueError(f"dp: sample: the sites report {list(num_train)} training samples, the privacy "
                             f"accountants count {counted}; the data changed since the run started")

    def _asked(self, sites: list[int] | None) -> list[int]:
        return list(range(len(self.sites))) if sites is None else sites

    def epsilon(self) -> float:
        return max(a.epsilon() for a in self.sites)

    def accountants(self) -> list[Accountant]:
        return list(self.sites)

    def epsilon_after(self, steps: int, sites: list[int] | None) -> float:
        asked = set(self._asked(sites))
        return max(a.epsilon_after(1, compositions=steps) if k in asked else a.epsilon()
                   for k, a in enumerate(self.sites))

    def step(self, steps: int, sites: list[int] | None, reported: int) -> None:
        for k in self._asked(sites):
            self.sites[k].step(1, compositions=steps)

    def record(self) -> dict[str, float]:
        per = {f"dp_epsilon.{label}": a.epsilon() for label, a in zip(self.labels, self.sites, strict=True)}
        return {**super().record(), **per}

    def state(self) -> dict[str, Any]:
        return self._with_secret({"sites": [a.state() for a in self.sites]})


def _warn_if_fixed_costs_more(section: PrivacySection, accountant: Accountant, rounds: int) -> None:
    """One warning line when the fixed-size client draw (S of K, replace-one) spends more epsilon over the planned
    ``rounds`` than every client taking part each round would at the same sigma, both by ``dp_accountant``."""
    if accountant.relation != REPLACE_ONE or rounds < 1:
        return
    fixed = accountant.epsilon_after(rounds)
    full = Accountant.for_clients(noise_multiplier=accountant.noise_multiplier, delta=section.dp_delta,
                                  num_clients=section.num_clients, clients_per_round=None,
                                  accounting=section.dp_accountant).epsilon_after(rounds)
    if fixed > full:
        poisson = ("" if section.dp_noise_at == "server" else ", with dp_noise_at: server")
        log.warning("dp: client: dp_sampling: fixed (%d of %d clients a round, replace-one) spends epsilon %.4g over "
                    "the %d planned rounds, more than full participation's %.4g at the same sigma %.4g: set "
                    "dp_sampling: poisson%s (or clients_per_round: null)", section.sampled_clients,
                    section.num_clients, fixed, rounds, full, accountant.noise_multiplier, poisson)


def _draw_secret(section: PrivacySection, state: dict | None) -> int:
    """The key of the client draw (:class:`~fdam_ray.algorithms.sampling.ClientSampler`): a resumed run's own, else
    :func:`~fdam_ray.privacy.mechanisms.run_secret`. Kept in the checkpoint, so a resume draws the sets the run
    would have drawn."""
    return run_secret(None if state is None else state.get("draw_secret"), section.dp_noise_seed)


def _sigma(section: PrivacySection, *, population: int, sample_size: int, compositions: int) -> float:
    """sigma: the given ``dp_noise_multiplier``, else solved for ``dp_epsilon`` over the planned compositions."""
    if section.dp_noise_multiplier is not None:
        return float(section.dp_noise_multiplier)
    if section.dp_epsilon is None:
        raise ValueError("dp needs dp_noise_multiplier or dp_epsilon")
    return solve_sigma(section.dp_epsilon, section.dp_delta, population=population, sample_size=sample_size,
                       sampling=section.sampling, compositions=compositions, accounting=section.dp_accountant)
