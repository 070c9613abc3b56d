"""Clients in Ray actors: the executor that wires placement, the fleet of actors and a transport.

Hosting: ``clients_per_actor`` = M clients share an actor (one model replica;
each client keeps its own shard, control variate and sampler position):
client k lives on actor k // M, so there are A = ceil(K / M) actors. M = 1
(the default) is one actor per client.

The parts (ARCHITECTURE.md, "One round, as data"):

- :mod:`~fdam_ray.executors.ray.placement`: one bundle per actor in a
  placement group (or the enclosing Tune trial's), site pinning;
- :mod:`~fdam_ray.executors.ray.fleet`: the actors, the clients each hosts,
  calls on every actor with the failure policy (retry, drop, abort), lost
  nodes and the events kept;
- :mod:`~fdam_ray.executors.ray.transports`: how a round's state reaches the
  actors and their partial sums come back, chosen from the config's
  ``transport`` and ``reduce`` (star, node, compiled).

Scoring, checkpoints and set-up are classic calls on every actor through the
fleet, whatever the transport; before each the transport may rest
(:meth:`~fdam_ray.executors.ray.transports.base.Transport.rest`). A lost actor
whose bundle cannot be placed again within ``placement_timeout_s`` stops the
run with a :class:`PlacementError`; its clients stay hosted (not dropped), so
:meth:`RayExecutor.client_states` marks them for a rebuild in the checkpoint
the federation then writes.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, cast

import numpy as np
import ray

from fdam_ray.algorithms.server import PartialSum
from fdam_ray.core.state import ClientInfo, ClientState, GlobalState, RoundPlan, ScoreHistogram, Scores, ScoreSums
from fdam_ray.data import DataSource
from fdam_ray.executors.base import Executor, ExecutorSection, ExecutorSetup, RoundsRun, RunsOfRounds, actor_groups
from fdam_ray.executors.deadlines import Deadline
from fdam_ray.executors.ray.fleet import Fleet
from fdam_ray.executors.ray.placement import Placement
from fdam_ray.executors.ray.session import ensure_ray
from fdam_ray.executors.ray.transports import Round, Transport, transport_for
from fdam_ray.executors.ray.transports.compiled import CompiledRounds, CompiledTransport
from fdam_ray.executors.ray.transports.pending import held_ref
from fdam_ray.executors.ray_section import RayExecutorSection
from fdam_ray.executors.transfer import Downlink, decoding, sent_nbytes
from fdam_ray.features.sites import client_label
from fdam_ray.scores.histogram import Binning

log = logging.getLogger(__name__)


def _between_rounds(kind: str) -> Callable:
    """Work between rounds (scoring, checkpoints): let the transport rest first (:meth:`Transport.rest`), and
    keep how long this kind of work took."""

    def wrap(method: Callable) -> Callable:
        @functools.wraps(method)
        def run(self: RayExecutor, *args: Any, **kwargs: Any) -> Any:
            if self.transport is not None:
                self.transport.rest(self.took.get(kind, 0.0))
            started = time.monotonic()
            try:
                return method(self, *args, **kwargs)
            finally:
                self.took[kind] = time.monotonic() - started

        return run

    return wrap


class RayExecutor(Executor, RunsOfRounds):
    """Runs the clients in Ray actors, ``clients_per_actor`` to an actor (see the module docstring).

    Attributes:
        placement: the actors' bundles and placement group.
        fleet: the actors, their clients, the failure policy and its events.
        transport: how rounds travel (set by :meth:`start`).
        took: seconds the last scoring / checkpoint call of each kind took.
    """

    fleet_type: ClassVar[type[Fleet]] = Fleet
    section: ClassVar[type[ExecutorSection]] = RayExecutorSection

    def __init__(self) -> None:
        self.placement: Placement | None = None
        self.fleet: Fleet | None = None
        self.transport: Transport | None = None
        self.downlink: Downlink | None = None
        self.num_clients = 0
        self.took: dict[str, float] = {}
        self._put_state: GlobalState | None = None
        self._put_ref: Any = None
        self.deadline: Deadline | None = None
        self._deadline_in_runs = False  # the transport keeps the deadline inside its runs of rounds
        self.late: dict[int, Any] = {}  # actor -> the roll-back queued behind its late round call
        self.fold_order: list[int] = []  # with a deadline: the actors whose sums the last round folded, in order

    # -- what tests and diagnostics read -------------------------------------------------------
    @property
    def actors(self) -> dict[int, Any]:
        """Actor index -> actor handle (live actors only)."""
        return {} if self.fleet is None else self.fleet.actors

    @property
    def hosted(self) -> dict[int, list[int]]:
        """Actor index -> the live clients it hosts."""
        return {} if self.fleet is None else self.fleet.hosted

    @property
    def events(self) -> list[dict]:
        """One dict per failure (client, actor, clients, round, action, error, outcome)."""
        return [] if self.fleet is None else self.fleet.events

    @property
    def where_of(self) -> dict[int, dict]:
        """Actor index -> where it runs."""
        return {} if self.fleet is None else self.fleet.where_of

    @property
    def lost_nodes(self) -> list[dict]:
        """One dict per node lost during the run."""
        return [] if self.fleet is None else self.fleet.lost_nodes

    @property
    def bundle_of(self) -> dict[int, int]:
        """Actor index -> placement group bundle index."""
        return {} if self.placement is None else self.placement.bundle_of

    @property
    def placement_group(self) -> Any:
        return None if self.placement is None else self.placement.placement_group

    @property
    def graph(self) -> CompiledRounds | None:
        """The compiled graph of ``transport: compiled``, else None."""
        return self.transport.graph if isinstance(self.transport, CompiledTransport) else None

    # -- set-up ---------------------------------------------------------------------------
    def start(self, setup: ExecutorSetup, source: DataSource) -> list[ClientInfo]:
        client_section = setup.client
        self.deadline = Deadline.of(setup.deadline)
        self.downlink = Downlink.of(setup.transfer)  # transfer_precision bf16/fp16 (fdam_ray/executors/transfer.py)
        self.config = config = cast(RayExecutorSection, setup.executor)
        self.timeout = config.ray_timeout_s
        transport = transport_for(config.transport, config.reduce)
        self.num_clients = num_clients = source.num_clients
        groups = actor_groups(num_clients, config.clients_per_actor)
        if config.device == "cuda" and not config.gpus_per_actor:
            raise ValueError("device=cuda with executor=ray needs gpus_per_actor > 0 (the GPU share of each actor)")
        started_here = ensure_ray(address=config.address, cpus_needed=len(groups) * config.cpus_per_actor)
        gpus = ray.cluster_resources().get("GPU", 0)
        if gpus and not config.gpus_per_actor and config.device != "cpu":
            per_gpu = -(-len(groups) // max(1, int(gpus)))  # the actors spread evenly over the GPUs
            log.warning("the Ray cluster has %g GPU(s) but gpus_per_actor=0, so the clients train on CPUs; set "
                        "gpus_per_actor (e.g. %g for %d actors per GPU) to use them, or device=cpu to silence this",
                        gpus, round(1.0 / per_gpu, 4), per_gpu)
        self.placement = Placement(config, self.timeout)
        self.fleet = self.fleet_type(config, client_section, self.placement, self.timeout, face=setup.face)
        self.transport = transport(self.fleet, config)
        if self.downlink is not None and self.transport.takes_transfer(self.downlink.precision,
                                                                      self.downlink.error_feedback):
            self.downlink = None
        self.placement.place(groups, local=started_here)
        infos = self.fleet.start(groups, source)
        self.transport.started(setup.algorithm, infos)
        self._deadline_in_runs = self.deadline is not None and self.transport.takes_deadline(self.deadline)
        return infos

    def _state_ref(self, state: GlobalState) -> Any:
        """The object-store copy of ``state`` for the scoring calls that follow a round (evaluation on the
        clients' splits and on the test set, CODA's score sums): put once for all of them. A round puts its
        state afresh, since the driver changes a state in place only between scoring and the next round. The
        state after a run of collective rounds that the driver has not read is scored from the object the
        group's lowest rank returned (:mod:`.transports.pending`): it is not read to be put again."""
        held = held_ref(state)
        if held is not None:
            return held
        if self._put_state is not state:
            self._put_state, self._put_ref = state, ray.put(state)
        return self._put_ref

    def _all(self, action: str, submit: Callable[[int, Any], Any]) -> None:
        for _ in self._fleet.each(action, submit):
            pass

    @property
    def _fleet(self) -> Fleet:
        if self.fleet is None:
            raise RuntimeError("the Ray executor has not been started")
        return self.fleet

    # -- the Executor interface ---------------------------------------------------------------
    def configure(self, positive_ratio: np.ndarray) -> None:
        fleet = self._fleet
        fleet.positive_ratio = p = np.asarray(positive_ratio)
        self._all("configure", lambda a, actor: actor.configure.remote(p))

    def begin_stage(self, reference: np.ndarray, reset_control_variates: bool) -> None:
        self._fleet.reference_ref = ref = ray.put(reference)
        self._all("begin_stage", lambda a, actor: actor.begin_stage.remote(ref, reset_control_variates))

    def run_round(self, state: GlobalState, plan: RoundPlan, fold: Callable[[PartialSum], None],
                  clients: Sequence[int] | None = None) -> None:
        fleet = self._fleet
        fleet.round = plan.round
        self._put_state = None
        put: list = []  # the round's object-store copy of the state: made by its first classic call (never when
        # the compiled graph carries the round), always fresh, since the driver changes a state in place only
        # between scoring and the next round
        chosen = set(fleet.live) if clients is None else set(clients) & set(fleet.live)
        chosen -= self._still_late()

        def work(a: int) -> tuple[list[int], list[int]]:
            """Actor ``a``'s clients in this round, and those of them that first adopt the global c."""
            ids = [k for k in fleet.hosted.get(a, ()) if k in chosen]
            return ids, [k for k in ids if k in fleet.adopt_global_c]

        message: Any = state
        if self.downlink is not None:  # rounded differences go down; what comes up is expanded before the fold
            message, master = self.downlink.send(state)
            message.full = ray.put(master)  # fetched only by an actor without the previous master
            self.sent = sent_nbytes(message, master)
            fold = decoding(fold, master, plan.partial)

        def call(a: int, actor: Any) -> Any:
            if not put:
                put.append(ray.put(message))
            if self.deadline is None:
                return actor.local_round.remote(put[0], plan, *work(a))  # at call time: a replacement adopts c
            return actor.local_round.remote(put[0], plan, *work(a), undoable=True)

        # an actor with no client in the round is not called
        targets = [a for a in fleet.actors if any(k in chosen for k in fleet.hosted.get(a, ()))]
        assert self.transport is not None
        self.fold_order = []
        if not targets:  # no client to run (an empty Poisson draw: the reducer applies the noise alone)
            return
        if self.deadline is not None:  # which actors' sums were folded, for round_changes
            owner = {k: a for a, ids in fleet.hosted.items() for k in ids}
            unnoted = fold

            def fold(partial: PartialSum) -> None:
                self.fold_order.extend(owner[s.client_id] for s in partial.stats)
                unnoted(partial)

        round = Round(state, plan, fold, targets, work, call, self.deadline)
        self.transport.run_round(round)
        for a in round.late:  # queued behind the late call: the actor's clients as they were before the round
            if a in fleet.actors:
                self.late[a] = fleet.actors[a].discard_round.remote(plan.round)

    def rounds_ahead(self) -> int:
        if self.transport is None or self.downlink is not None or (self.deadline and not self._deadline_in_runs):
            return 1
        return self.transport.rounds_ahead()

    def runs_every_round(self) -> bool:
        return self._deadline_in_runs

    def run_rounds(self, state: GlobalState, plans: Sequence[tuple[RoundPlan, Sequence[int] | None]],
                   average: bool, *, read: bool = True) -> RoundsRun:
        fleet = self._fleet
        fleet.round = plans[0][0].round
        late = self._still_late()
        chosen = [(set(fleet.live) if clients is None else set(clients) & set(fleet.live)) - late
                  for _, clients in plans]
        assert self.transport is not None
        self.fold_order = []
        return self.transport.run_rounds(state, [plan for plan, _ in plans], chosen, average, read=read)

    def take_rebuilt(self) -> dict[int, list[int]]:
        got, self._fleet.rebuilt = self._fleet.rebuilt, {}
        return got

    def round_changes(self, round_index: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """After a round with a deadline that some client missed: each actor that made it sends the weighted sum
        of its clients' changes of c^k (:meth:`ClientShell.round_changes`), in the order their partial sums were
        folded, so the round folds as a round of the clients that made it would."""
        fleet = self._fleet
        actors = list(dict.fromkeys(a for a in self.fold_order if a in fleet.actors))
        refs = [fleet.actors[a].round_changes.remote(round_index) for a in actors]
        return [got for got in ray.get(refs, timeout=self.timeout) if got is not None]

    def _still_late(self) -> set[int]:
        """The clients of actors whose late call of an earlier round (and its roll-back) has not ended: they sit
        this round out too (the actor is not asked twice at once)."""
        if not self.late:
            return set()
        ready, _ = ray.wait(list(self.late.values()), num_returns=len(self.late), timeout=0)
        for a, ref in list(self.late.items()):
            if ref in ready or a not in self._fleet.actors:
                del self.late[a]
        return {k for a in self.late for k in self._fleet.hosted.get(a, ())}

    @_between_rounds("evaluate")
    def evaluate(self, state: GlobalState, split: str = "test",
                 bins: Binning | None = None) -> list[Scores] | list[ScoreHistogram]:
        ref = self._state_ref(state)
        hosted = self._fleet.hosted
        if bins is None:  # the call as before histograms existed
            scores = self._fleet.per_client("evaluate", lambda a, actor: actor.evaluate.remote(ref, hosted[a], split))
        else:
            scores = self._fleet.per_client("evaluate",
                                            lambda a, actor: actor.evaluate.remote(ref, hosted[a], split, bins))
        return [s for s in scores if s is not None]

    @_between_rounds("score_test_set")
    def score_test_set(self, state: GlobalState) -> Scores | None:
        """With ``eval_on: clients``: every live actor scores a slice of the global test set, pooled here."""
        fleet = self._fleet
        if self.config.eval_on != "clients" or fleet.test_size == 0:
            return None
        while True:
            actors = sorted(fleet.actors)
            bounds = np.linspace(0, fleet.test_size, min(len(actors), fleet.test_size) + 1).astype(int)
            slices = {a: (int(lo), int(hi)) for a, lo, hi in zip(actors, bounds[:-1], bounds[1:], strict=False)}
            ref = self._state_ref(state)

            def call(a: int, actor: Any, slices: dict = slices, ref: Any = ref) -> Any:
                return actor.score_test_slice.remote(ref, *slices[a])

            parts = list(fleet.each("evaluate", call, list(slices)))
            if all(a in fleet.actors for a in slices):  # an actor dropped mid-call: slice again
                parts.sort(key=lambda p: slices[p[0]][0])
                return Scores(-1, np.concatenate([s.scores for _, s in parts]),
                              np.concatenate([s.labels for _, s in parts]))

    @_between_rounds("score_sums")
    def score_sums(self, state: GlobalState) -> list[ScoreSums]:
        ref = self._state_ref(state)
        hosted = self._fleet.hosted
        return self._fleet.per_client("score_sums", lambda a, actor: actor.score_sums.remote(ref, hosted[a]))

    @_between_rounds("client_states")
    def client_states(self) -> list[ClientState | None]:
        """Every client's state; None for a client that was dropped, and a ``rebuild`` marker
        for one whose actor is lost and not placed again (the run stops with a :class:`PlacementError`): a
        resume rebuilds it from its shard with the global control variate, as a replaced actor's clients are."""
        fleet = self._fleet
        got = {s.client_id: s for s in fleet.per_client(
            "client_states", lambda a, actor: actor.get_state.remote(fleet.hosted[a]))}
        unplaced = {k for a, ids in fleet.hosted.items() if a not in fleet.actors for k in ids}
        return [ClientState(k, rebuild=True) if k in unplaced else got.get(k) for k in range(self.num_clients)]

    def restore_client_states(self, states: list[ClientState | None]) -> None:
        fleet = self._fleet
        gone = [k for k, s in enumerate(states) if s is None and k in fleet.live]
        for k in gone:
            log.warning("client %s was dropped before the checkpoint; it stays out",
                        client_label(k, fleet.client_section.client_names))
        if gone:
            fleet.drop(gone)
        self._all("restore_client_states",
                  lambda a, actor: actor.set_state.remote([states[k] for k in fleet.hosted[a]]))

    @property
    def active_clients(self) -> int:
        return 0 if self.fleet is None else len(self.fleet.live)

    def placement_lines(self) -> list[str]:
        """One line per live actor: its clients, its node id and the node's address (logged in the run)."""
        return [] if self.fleet is None else self.fleet.placement_lines()

    def client_info(self) -> dict[int, dict]:
        """Process id, node, placement group and device of the actor of every live client."""
        fleet = self._fleet
        where = dict(fleet.each("where", lambda a, actor: actor.where.remote()))
        return {k: where[a] for a in sorted(where) for k in fleet.hosted[a]}

    def shutdown(self) -> None:
        fleet = self.fleet
        if fleet is not None:
            abandoned = [*fleet.in_flight, *self.late.values()]
            if self.transport is not None:
                self.transport.close(fleet.end)
            else:
                fleet.end()
            fleet.settle(abandoned)
        if self.placement is not None:
            self.placement.release()
