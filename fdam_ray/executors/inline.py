"""All clients in the driver process, one after another, hosted by one model replica.

This is the debugging executor that replaces Ray's removed ``local_mode``:
client code runs in the caller's process and thread, so ``breakpoint()``, a
debugger or a profiler work in it. Its results are the reference the Ray
executor is tested against.

One :class:`~fdam_ray.clients.client.TrainingReplica` runs every client (each keeps its
own shard, sampler position and control variate), so memory grows by a
client's state, not by a model, per client. Updates are folded in the groups a
Ray run with the same ``clients_per_actor`` folds them in (clients
``a*M .. a*M+M-1`` into one partial sum, the groups in order), so an inline run
equals a Ray run with ``fold_order: client`` to the bit, whatever
``clients_per_actor`` is.

Torch runs ``threads_per_actor`` intra-op threads here while the clients run,
by default one, as a Ray actor with one CPU does (all of a machine's threads
make small models many times slower on a busy machine, and an explicit
``OMP_NUM_THREADS`` is left as it is); the caller's setting comes back at
shutdown. The Ray executor's own fields mean nothing here: :func:`ignored_fields`
names those set to other than their defaults, for one warning.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from typing import Any, cast

import numpy as np
import torch

from fdam_ray.algorithms.server import PartialSum
from fdam_ray.clients.client import Client, begin_stage_hosted, host_clients, resolve_device, run_hosted
from fdam_ray.core.state import ClientInfo, ClientState, GlobalState, RoundPlan, ScoreHistogram, Scores, ScoreSums
from fdam_ray.data import DataSource
from fdam_ray.executors.base import Executor, ExecutorSection, ExecutorSetup, actor_groups
from fdam_ray.executors.ray_section import RayExecutorSection, RaySection
from fdam_ray.executors.transfer import Downlink, attach_residual, compress, expand, residual_of, sent_nbytes
from fdam_ray.scores.histogram import Binning
from fdam_ray.settings.sections import owned_fields

# ExecutorSection's fields that only the Ray executor reads (inline has no actors to replace or to score on).
_RAY_ONLY_EXECUTOR_FIELDS = ("on_client_failure", "max_client_retries")


def ignored_fields(section: RayExecutorSection) -> list[str]:
    """The Ray executor's fields that ``section`` (cut from the config by the caller) sets to other than their
    defaults: ``executor=inline`` ignores them (``transport=compiled``, ``client_resources``, ...)."""
    fields = [f for f in dataclasses.fields(ExecutorSection) if f.name in _RAY_ONLY_EXECUTOR_FIELDS]
    fields += owned_fields(RaySection)
    values = dataclasses.asdict(section)
    return [f"{f.name}={_short(values[f.name])}" for f in fields if values[f.name] != f.default]


def _short(value: Any, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def inline_threads(config: ExecutorSection) -> int | None:
    """Torch threads of an inline run: ``threads_per_actor``, else one (None: leave them, as an explicit
    ``OMP_NUM_THREADS`` asks)."""
    if config.threads_per_actor:
        return config.threads_per_actor
    return None if os.environ.get("OMP_NUM_THREADS") else 1


class InlineExecutor(Executor):
    rebuilds_clients = True

    def __init__(self) -> None:
        self.clients: list[Client] = []
        self.groups: list[list[int]] = []
        self._threads_before: int | None = None
        self.residuals: dict[int, dict] | None = None  # error feedback: per group, its upload residual

    def start(self, setup: ExecutorSetup, source: DataSource) -> list[ClientInfo]:
        config = setup.executor
        threads = inline_threads(config)
        if threads is not None:
            if self._threads_before is None:
                self._threads_before = torch.get_num_threads()
            torch.set_num_threads(threads)
        device = resolve_device(config.device)
        self.clients = host_clients(setup.client, source, range(source.num_clients), device=device, face=setup.face)
        self._build = (setup.client, source, device)  # what rebuild() builds a fresh client from
        self.groups = actor_groups(source.num_clients, config.clients_per_actor)
        self.downlink = Downlink.of(setup.transfer)  # bf16/fp16: the rounding a Ray run's transfers take
        self.residuals = {} if self.downlink is not None and self.downlink.error_feedback else None
        return [c.info() for c in self.clients]

    def configure(self, positive_ratio: np.ndarray) -> None:
        for c in self.clients:
            c.configure(positive_ratio)

    def begin_stage(self, reference: np.ndarray, reset_control_variates: bool) -> None:
        begin_stage_hosted(self.clients, reference, reset_control_variates)

    def run_round(self, state: GlobalState, plan: RoundPlan, fold: Callable[[PartialSum], None],
                  clients: Sequence[int] | None = None) -> None:
        chosen = None if clients is None else set(clients)
        if self.downlink is not None:
            self._run_rounded(state, plan, fold, chosen)
            return
        for group in self.groups:
            hosted = [self.clients[k] for k in group if chosen is None or k in chosen]
            if hosted:  # a partial sum per group, as the actor hosting the group returns it
                fold(run_hosted(hosted, state, plan))

    def _run_rounded(self, state: GlobalState, plan: RoundPlan, fold: Callable[[PartialSum], None],
                     chosen: set[int] | None) -> None:
        """The round with what a Ray run moves rounded as it rounds it (:mod:`fdam_ray.executors.transfer`): the clients
        run from the broadcast master (held here once, as every host would hold it), each group's partial sum
        goes through the rounding of its differences."""
        downlink = cast(Downlink, self.downlink)
        message, master = downlink.send(state)
        self.sent = sent_nbytes(message, master)
        for g, group in enumerate(self.groups):
            hosted = [self.clients[k] for k in group if chosen is None or k in chosen]
            if hosted:
                residual = None if self.residuals is None else self.residuals.setdefault(g, {})
                sent = compress(run_hosted(hosted, master, plan), master, downlink.precision, sampled=plan.partial,
                                residual=residual)
                fold(expand(sent, master, sampled=plan.partial))

    def rebuild(self, client_ids: Sequence[int], state: GlobalState) -> None:
        config, source, device = self._build
        for k in client_ids:  # a fresh client on the same replica (p and the stage's reference live there)
            fresh = self.clients[k] = Client(config, source, k, device=device, replica=self.clients[k].replica)
            if state.c_v is not None and state.c_alpha is not None:
                fresh.set_control_variate(state.c_v, state.c_alpha)

    def evaluate(self, state: GlobalState, split: str = "test",
                 bins: Binning | None = None) -> list[Scores] | list[ScoreHistogram]:
        if bins is not None:
            return [h for h in (c.score_histogram(state, split, bins) for c in self.clients) if h is not None]
        return [s for s in (c.evaluate(state, split) for c in self.clients) if s is not None]

    def score_sums(self, state: GlobalState) -> list[ScoreSums]:
        return [c.score_sums(state) for c in self.clients]

    def client_states(self) -> list[ClientState | None]:
        states: list[ClientState | None] = [c.get_state() for c in self.clients]
        if self.residuals is not None:
            for g, group in enumerate(self.groups):
                attach_residual([states[k] for k in group], self.residuals.get(g))
        return states

    def restore_client_states(self, states: list[ClientState | None]) -> None:
        dropped = [k for k, s in enumerate(states) if s is None]
        if dropped:
            raise ValueError(f"client(s) {dropped} were dropped from the run being resumed; the inline executor "
                             "runs every client: resume it with executor=ray")
        for c, s in zip(self.clients, states, strict=True):
            c.set_state(cast(ClientState, s))  # None refused above
        if self.residuals is not None:
            self.residuals = {g: residual_of([states[k] for k in group]) for g, group in enumerate(self.groups)}

    @property
    def active_clients(self) -> int:
        return len(self.clients)

    def shutdown(self) -> None:
        self.clients = []
        if self._threads_before is not None:
            torch.set_num_threads(self._threads_before)
            self._threads_before = None
