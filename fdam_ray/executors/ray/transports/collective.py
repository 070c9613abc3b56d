"""``transport: collective``: the actors all-reduce their partial sums among themselves, as the paper's code does.

The fleet's actors form one collective group (``torch.distributed``: gloo
between CPU actors, NCCL when every actor holds a GPU of its own; NCCL takes
one rank per GPU, so actors sharing a GPU use gloo), built once per set of
actors and built again when that set changes (a replacement, a dropped actor,
a lost node). A round is one call per actor: its local round, then
:meth:`~fdam_ray.executors.ray.transports.group.GroupMember.reduce`: the
all-reduce of the weighted partial sums (every vector with its rule: sums for
v, alpha, BatchNorm statistics and control variates, max for integer
buffers), then the server step on every actor. The driver receives each
actor's step statistics and, from the lowest rank only, the round's reduced
sums, which it folds once (its reducer then computes the state every actor
already holds, bit for bit). The driver sends the global state only when the
actors' copy is not the one it holds (the first round, a new stage, a rebuilt
group, a resume; :func:`~fdam_ray.executors.ray.transports.group.state_key`),
so a round moves one state up and none down instead of K up and K down. The
driver still receives that one reduced sum every round, not only on
evaluation and checkpoint rounds: the federation loop holds the global state
after every round (the stage's running average, the finiteness check), and a
driver that received only metrics would need that loop to hold the state
lazily; the transport leaves the loop as it is.

Sampled-out actors are in the group and contribute zeros. The group is the
fleet's actors, not the round's: building a group costs a rendezvous (far
more than an all-reduce of zeros), and every actor then holds the new global
state, so whichever actors the next round samples start from it without the
driver sending it. Hosted clients (``clients_per_actor`` > 1) are folded
into their actor's partial sum first, as under the other transports.

The all-reduce sums in the group's order, not the driver's, so a run equals
a classic ``fold_order: client`` run to float32 rounding (about 1e-7
relative), not bit for bit. ``reduce: node`` is refused: the actors reduce
among themselves, so there is nothing left for a node's reducer to fold.

Failures. Every wait is bounded by ``ray_timeout_s``: the driver's wait for
a round, and every collective call inside the group (the group's timeout). An
actor whose client raised flags it in the first (small) all-reduce, so every
member stops before the large one and the group stays sound; an actor that
dies breaks its peers' all-reduce at once (gloo sees the connection close),
and they return. An actor that does not answer in time is told from the
peers it blocks by the group's store, where each member checks in before its
all-reduce: the late one is ended (which releases the others) and counts as
failed. Then, as under the other transports, the failure policy
(``on_client_failure``) applies to the failed actors, the group is built
again over the actors now live, and the round is finished: the actors whose
local round is done all-reduce the partial sums they kept, the replacements
run theirs first, and the state is sent again.
"""

from __future__ import annotations

import datetime
import logging
import time
from typing import Any

import numpy as np
import ray

from fdam_ray.algorithms import AlgorithmSection, build_algorithm
from fdam_ray.algorithms.server import RoundReducer
from fdam_ray.executors.errors import ClientError
from fdam_ray.executors.ray import compat
from fdam_ray.executors.ray.placement import node_addresses
from fdam_ray.executors.ray.transports.base import Round, Transport
from fdam_ray.executors.ray.transports.group import RoundShare, ServerStep, state_key
from fdam_ray.state import ClientInfo, GlobalState

log = logging.getLogger(__name__)

JOIN_TIMEOUT_S = 120.0  # at most this (and ray_timeout_s) for the members to meet when a group is built
BUILD_TRIES = 3  # builds of one group that fail with every member alive before the run stops

_FAILURES = (ray.exceptions.RayError, ClientError)


class CollectiveTransport(Transport):
    """The actors all-reduce their partial sums and apply the server step; one call per actor per round.

    Attributes:
        builds: groups built (the first, and one per change of the set of actors or broken round).
        rounds_sent: rounds that sent the global state to the actors (the others used the actors' copy).
        backend: the group's backend (``gloo`` or ``nccl``; '' before the first build).
    """

    name = "collective"
    serves = ("collective", "star")

    def __init__(self, fleet, config) -> None:
        super().__init__(fleet, config)
        self.key: tuple = ()
        self.held_key: tuple | None = None
        self.builds = 0
        self.rounds_sent = 0
        self.backend = ""
        self.step: ServerStep | None = None
        self.total_weight = 0.0
        self._store: Any = None
        self._tries = 0

    def started(self, config: Any, infos: list[ClientInfo]) -> None:
        """The server step the actors apply: the algorithm's reducer settings, and the clients' total weight
        (the denominator of a sampled round's control variate). An algorithm with a reducer of its own keeps
        the server step on the driver: the state is then sent every round."""
        algorithm = build_algorithm(AlgorithmSection.of(config))
        weights = algorithm.weights([i.num_train for i in infos])
        self.total_weight = float(len(infos) if weights is None else weights.sum())
        tiny = GlobalState(v=np.zeros(1, np.float32), alpha=np.zeros(1, np.float32),
                           buffers=np.zeros(0, np.float32), counters=np.zeros(0, np.int64))
        probe = algorithm.reducer(tiny, weights=weights)
        self.step = (ServerStep(probe.global_lr, probe.alpha_nonnegative, probe.control_variates)
                     if type(probe) is RoundReducer else None)

    # -- a round ---------------------------------------------------------------------------
    def run_round(self, round: Round) -> None:
        fleet = self.fleet
        kept: set[int] = set()  # actors whose local round is done, its partial sum kept on the actor
        attempts: dict[int, int] = {}
        for _ in range(BUILD_TRIES * (1 + self.config.max_client_retries) * max(1, len(fleet.actors))):
            self._ensure_group(attempts)
            members = sorted(fleet.actors)
            send = self.held_key is None or self.held_key != state_key(round.state, round.plan.stage)
            shares, failed = self._attempt(round, members, kept, send)
            if not failed and all(not shares[a].broken for a in members):
                self._fold(round, members, shares)
                return
            kept = {a for a in shares if a not in failed}
            self._forget()
            for a, exc in sorted(failed.items()):
                attempts.setdefault(a, 0)
                fleet.failed(a, "local_round", exc, attempts)  # raises when the policy stops the run
        raise RuntimeError(f"round {round.plan.round}: the collective all-reduce kept breaking with every actor "
                           "alive")

    def _attempt(self, round: Round, members: list[int], kept: set[int], send: bool
                 ) -> tuple[dict[int, RoundShare], dict[int, BaseException]]:
        """One try of the round on the group: every member's share, and the members that failed."""
        fleet = self.fleet
        token = f"{round.plan.round}.{self._tries}"
        self._tries += 1
        state_ref = ray.put(round.state) if send else None
        self.rounds_sent += send
        partial_total = self.total_weight if round.plan.partial else None
        refs = {}
        for a in members:
            ids, adopt = round.work(a)
            refs[a] = fleet.actors[a].collective_round.remote(state_ref, round.plan, ids, adopt, a in kept,
                                                              partial_total, token)
        deadline = time.monotonic() + fleet.timeout
        fleet.in_flight = {ref: (a, deadline) for a, ref in refs.items()}
        shares: dict[int, RoundShare] = {}
        failed: dict[int, BaseException] = {}
        try:
            pending = self._collect(refs, deadline, shares, failed)
            if pending:
                arrived = self._arrived(token, members, pending)
                late = [a for a in pending if a not in arrived] or list(pending)
                for a in late:
                    failed[a] = fleet.late(a, "local_round")
                    fleet.kill(a)  # ends its connections, which releases the members waiting for it
                    del pending[a]
                for a in self._collect(pending, time.monotonic() + fleet.timeout, shares, failed):
                    failed[a] = fleet.late(a, "local_round")
                    fleet.kill(a)
        finally:
            fleet.in_flight = {}
        return shares, failed

    def _collect(self, refs: dict[int, Any], deadline: float, shares: dict[int, RoundShare],
                 failed: dict[int, BaseException]) -> dict[int, Any]:
        """Fetch the shares that arrive before ``deadline`` (errors into ``failed``); those still pending."""
        pending = dict(refs)
        while pending:
            done, _ = ray.wait(list(pending.values()), num_returns=len(pending),
                               timeout=max(0.0, deadline - time.monotonic()))
            if not done:
                break
            for a in [a for a, ref in pending.items() if ref in done]:
                try:
                    shares[a] = ray.get(pending.pop(a), timeout=self.fleet.timeout)
                except _FAILURES as exc:
                    failed[a] = exc
            if time.monotonic() >= deadline:
                break
        return pending

    def _arrived(self, token: str, members: list[int], pending: dict[int, Any]) -> set[int]:
        """The pending members that checked in for the all-reduce of try ``token`` (waiting for the others)."""
        if self._store is None:
            return set()
        out = set()
        for a in pending:
            try:
                if self._store.check([f"{token}/{members.index(a)}"]):
                    out.add(a)
            except Exception as exc:  # the store lives in the lowest rank: gone with it
                log.debug("the group's store did not answer: %s", exc)
                return set()
        return out

    def _fold(self, round: Round, members: list[int], shares: dict[int, RoundShare]) -> None:
        """Hand the round's reduced sums to the driver's fold once, with every client's statistics in actor
        order; remember which state the actors now hold."""
        total = shares[members[0]].total
        if total is None:
            raise RuntimeError("the lowest rank of the collective group returned no sums")
        total.stats = [s for a in members for s in shares[a].stats]
        keys = {shares[a].key for a in members}
        self.held_key = keys.pop() if len(keys) == 1 else None
        self.fleet.folded(total, round.fold)

    # -- the group ---------------------------------------------------------------------------
    def _ensure_group(self, attempts: dict[int, int]) -> None:
        """A group over exactly the fleet's live actors (built again when they changed); members that die while
        it is built go through the failure policy."""
        fleet = self.fleet
        for _ in range(BUILD_TRIES):
            key = tuple((a, compat.actor_id(fleet.actors[a])) for a in sorted(fleet.actors))
            if key == self.key:
                return
            self._forget()
            failed = self._build(sorted(fleet.actors))
            if not failed:
                self.key = key
                return
            for a, exc in sorted(failed.items()):
                if isinstance(exc, ray.exceptions.RayActorError):
                    attempts.setdefault(a, 0)
                    fleet.failed(a, "local_round", exc, attempts)
        raise RuntimeError(f"the collective group of actors {', '.join(map(str, sorted(fleet.actors)))} could "
                           f"not be formed in {BUILD_TRIES} tries (ray_timeout_s={fleet.timeout:g})")

    def _build(self, members: list[int]) -> dict[int, BaseException]:
        """Build the group over ``members`` (rank = position); the members that failed to join."""
        import torch.distributed as dist

        fleet = self.fleet
        host, backend = self._host(members), self._backend(members)
        wait_s = min(fleet.timeout, JOIN_TIMEOUT_S)
        try:
            port = ray.get(fleet.actors[members[0]].open_group.remote(host, wait_s), timeout=fleet.timeout)
        except _FAILURES as exc:
            return {members[0]: exc}
        refs = {a: fleet.actors[a].join_group.remote(host, port, rank, len(members), backend, fleet.timeout,
                                                      self.step) for rank, a in enumerate(members)}
        shares: dict[int, Any] = {}
        failed: dict[int, BaseException] = {}
        for a in self._collect(refs, time.monotonic() + wait_s + 5.0, shares, failed):
            failed[a] = fleet.late(a, "local_round")
        if failed:
            return failed
        self._store = dist.TCPStore(host, port, None, False, timeout=datetime.timedelta(seconds=wait_s))
        self.backend = backend
        self.builds += 1
        log.debug("collective group %d over actors %s (%s, store %s:%d)", self.builds,
                  ", ".join(map(str, members)), backend, host, port)
        return {}

    def _host(self, members: list[int]) -> str:
        """Where the group's store listens: the loopback when every member is on one node, else the lowest
        rank's node address."""
        nodes = {self.fleet.where_of.get(a, {}).get("node_id") for a in members}
        if len(nodes) == 1:
            return "127.0.0.1"
        return node_addresses().get(self.fleet.where_of.get(members[0], {}).get("node_id", ""), "") or "127.0.0.1"

    def _backend(self, members: list[int]) -> str:
        """NCCL when every member holds a GPU and no two share one (NCCL takes one rank per GPU), else gloo."""
        gpus = []
        for a in members:
            where = self.fleet.where_of.get(a, {})
            if not str(where.get("device", "cpu")).startswith("cuda") or not where.get("gpu_ids"):
                return "gloo"
            gpus.append((where.get("node_id"), tuple(where["gpu_ids"])))
        return "nccl" if len(set(gpus)) == len(gpus) else "gloo"

    def _forget(self) -> None:
        """Drop the group on the driver's side (the members leave it when they join the next one, or end)."""
        self.key, self.held_key, self._store = (), None, None

    def close(self, end_actors) -> None:
        end_actors()
        self._forget()
