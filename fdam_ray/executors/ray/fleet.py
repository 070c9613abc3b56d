"""The actors of a federation, the clients each hosts, and what happens when one fails.

Hosting: ``clients_per_actor`` = M clients share an actor (one model replica;
each client keeps its own shard, control variate and sampler position):
client k lives on actor k // M, so there are A = ceil(K / M) actors.

Failures: an actor that dies (its process killed, ``ray.kill``, lost node),
raises, or does not answer within ``ray_timeout_s`` is replaced by a new
actor that rebuilds every client it hosted (their shards, p, the current
stage's reference point and zero control variates) and re-runs the call; in a
round each of them first sets its c^k to the round's global c.
``on_client_failure`` says what happens when an actor fails more than
``max_client_retries`` times within one call: ``retry`` stops the run with the
error, ``drop`` goes on without the failing client (the one whose code raised;
every client of the actor when the actor itself died or did not answer),
``abort`` stops at the first failure. A ``ValueError`` in client code (bad
data or config) is never retried. Every event is logged with the client (or
the actor and its clients) and the round, and kept in :attr:`Fleet.events`.
A lost actor whose bundle cannot be placed again within
``placement_timeout_s`` stops the run with a :class:`PlacementError`; its
clients stay hosted (not dropped).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import ray

from fdam_ray.algorithms.server import PartialSum
from fdam_ray.clients.client import ClientSection
from fdam_ray.clients.face import NO_FACE, ClientFace
from fdam_ray.core.state import ClientInfo
from fdam_ray.data import DataSource
from fdam_ray.executors.errors import ClientError, ClientInputError
from fdam_ray.executors.ray.actor import ClientShell
from fdam_ray.executors.ray.placement import Placement, node_addresses, node_is_lost
from fdam_ray.executors.ray_section import RayExecutorSection
from fdam_ray.features.sites import client_label, client_labels

log = logging.getLogger(__name__)

_RemoteShell = ray.remote(ClientShell)

Submit = Callable[[int, Any], Any]  # (actor index, actor handle) -> the object ref of a call on it
Fold = Callable[[PartialSum], None]


class _Calls:
    """One call on several actors: what is in flight (ref -> (actor, deadline)), what came back, and the
    failures counted per actor (``attempts``)."""

    def __init__(self, fleet: Fleet, action: str, submit: Submit, actors: list[int],
                 attempts: dict[int, int]) -> None:
        self.fleet, self.action, self.submit, self.attempts = fleet, action, submit, attempts
        self.pending: dict[Any, tuple[int, float]] = {}
        fleet.in_flight = self.pending  # what is left of it when the run stops is settled at shutdown
        self.results: dict[int, Any] = {}
        for a in actors:
            self.launch(a)

    def launch(self, a: int) -> None:
        self.pending[self.submit(a, self.fleet.actors[a])] = (a, time.monotonic() + self.fleet.timeout)

    def wait(self, first: int) -> None:
        """Wait for the next result or deadline: fetch what arrived; apply the failure policy to calls that
        failed or are late, re-launching those whose actor was replaced. ``first``: the actor waited for."""
        if not self.pending:
            raise RuntimeError(f"actor {first} has neither a result nor a call in flight")
        wait_s = max(0.0, min(d for _, d in self.pending.values()) - time.monotonic())
        done, _ = ray.wait(list(self.pending), num_returns=1, timeout=wait_s)
        for ref in done:
            a, _ = self.pending.pop(ref)
            try:
                self.results[a] = ray.get(ref, timeout=self.fleet.timeout)
            except (ray.exceptions.RayError, ClientError) as exc:
                self._retry(a, exc)
        if not done:
            self._expire()

    def _expire(self) -> None:
        now = time.monotonic()
        for ref, (a, deadline) in list(self.pending.items()):
            if deadline <= now:
                del self.pending[ref]
                self._retry(a, self.fleet.late(a, self.action))

    def _retry(self, a: int, exc: BaseException) -> None:
        if self.fleet.failed(a, self.action, exc, self.attempts):
            self.launch(a)


class Fleet:
    """The actors (index -> handle), the clients each hosts, and the failure policy over calls on them.

    Attributes:
        actors: actor index -> actor handle (live actors only).
        hosted: actor index -> the live clients it hosts.
        live: the clients that take part in rounds.
        events: one dict per failure (client, actor, clients, round, action, error, outcome).
        where_of: actor index -> where it runs (:meth:`ClientShell.where`).
        lost_nodes: one dict per node lost during the run (node_id, address, round, actors, clients).
        on_node_lost: called with a node's id when a node is found lost (before it is logged).
    """

    def __init__(self, config: RayExecutorSection, client_section: ClientSection, placement: Placement,
                 timeout_s: float, *, face: ClientFace = NO_FACE) -> None:
        self.config = config
        self.face = face  # a plug's client face, handed to every actor as it is
        self.placement = placement
        self.timeout = timeout_s
        self.client_section = client_section  # all an actor receives of the config
        self.actors: dict[int, Any] = {}
        self.hosted: dict[int, list[int]] = {}
        self.live: list[int] = []
        self.events: list[dict] = []
        self.where_of: dict[int, dict] = {}
        self.lost_nodes: list[dict] = []
        self.on_node_lost: list[Callable[[str], None]] = []
        self.round = 0
        self.positive_ratio: np.ndarray | None = None
        self.reference_ref: Any = None
        self.adopt_global_c: set[int] = set()  # replacement clients that set c^k to the global c next round
        self.rebuilt: dict[int, list[int]] = {}  # round -> clients folded as replacements' first (take_rebuilt)
        self.in_flight: dict[Any, tuple[int, float]] = {}
        self.source_refs: dict[int, Any] = {}
        self.test_size = 0

    # -- set-up -----------------------------------------------------------------------------
    def start(self, groups: list[list[int]], source: DataSource) -> list[ClientInfo]:
        """One actor per group of clients, each building its clients from ``source``; their infos."""
        num_clients = source.num_clients
        # A recipe goes to the object store once for every client; data held in memory (train_arrays) goes
        # one client's part per client, so no actor receives another client's samples.
        shared = ray.put(source) if source.for_client(0) is source else None
        self.source_refs = {k: shared if shared is not None else ray.put(source.for_client(k))
                            for k in range(num_clients)}
        self.hosted = dict(enumerate(groups))
        self.live = list(range(num_clients))
        for a in self.hosted:
            self.actors[a] = self.new_actor(a)
        infos: list[ClientInfo] = []
        for _, (got, test_size) in self.each("start", self.setup_call):
            infos.extend(got)
            self.test_size = test_size
        if len(infos) < num_clients:
            raise RuntimeError("clients were dropped while starting; a federation starts with all its clients")
        self.locate()
        for line in self.placement_lines():
            log.info("%s", line)
        return infos

    def new_actor(self, a: int) -> Any:
        cfg = self.config
        threads = cfg.threads_per_actor or max(1, int(cfg.cpus_per_actor))
        return _RemoteShell.options(
            num_cpus=cfg.cpus_per_actor, num_gpus=cfg.gpus_per_actor, max_restarts=0, max_task_retries=0,
            scheduling_strategy=self.placement.strategy(a),
        ).remote(a, self.hosted[a], threads=threads, device=cfg.device, gpu_share=cfg.gpus_per_actor,
                 gpu_memory_cap=cfg.gpu_memory_cap, channel_wait=cfg.channel_wait)

    def setup_call(self, a: int, actor: Any) -> Any:
        ids = self.hosted[a]
        return actor.setup.remote(ids, self.client_section, [self.source_refs[k] for k in ids],
                                  self.config.eval_on == "clients", self.face)

    # -- where the clients run ----------------------------------------------------------------
    def locate(self, actors: Sequence[int] | None = None) -> None:
        """Ask ``actors`` (default: every live one) where they run; remembered in :attr:`where_of`."""
        targets = sorted(self.actors if actors is None else actors)
        self.where_of.update(self.each("where", lambda a, actor: actor.where.remote(), targets))
        for a in list(self.where_of):
            if a not in self.actors:
                del self.where_of[a]

    def placement_lines(self, actors: Sequence[int] | None = None) -> list[str]:
        """One line per actor (default: every live one): its clients, its node id and the node's address."""
        ips = node_addresses()
        lines = []
        for a in sorted(self.where_of if actors is None else actors):
            where = self.where_of.get(a)
            if where is None:
                continue
            node = where["node_id"]
            hosted = client_labels(self.hosted.get(a, ()), self.client_section.client_names)
            lines.append(f"placement: clients {hosted} -> actor {a} -> node "
                         f"{node} ({ips.get(node, 'address unknown')})")
        return lines

    # -- calls on every actor, with failures handled ---------------------------------------------
    def each(self, action: str, submit: Submit, actors: list[int] | None = None, *, ordered: bool = True,
             attempts: dict[int, int] | None = None) -> Iterator[tuple[int, Any]]:
        """Call every live actor (or ``actors``); yield ``(a, result)`` in actor order, or with
        ``ordered=False`` as results arrive. ``attempts``: failures already counted in this call (a re-run).

        In actor order, results that arrive early are fetched (an error shows at
        once) but are views into the object store, touched only when consumed.
        """
        remaining = sorted(self.actors if actors is None else actors)
        calls = _Calls(self, action, submit, remaining, {**dict.fromkeys(remaining, 0), **(attempts or {})})
        while remaining:
            ready = remaining[:1] if ordered else list(remaining)
            settled = [a for a in ready if a in calls.results or a not in self.actors]
            if not settled:
                calls.wait(remaining[0])
                continue
            for a in settled:
                remaining.remove(a)
                if a in calls.results:
                    yield a, calls.results.pop(a)

    def per_client(self, action: str, submit: Submit) -> list[Any]:
        """Results of a call that returns one value per hosted client, in client order."""
        out: list[Any] = []
        for _, values in self.each(action, submit):
            out.extend(values)
        return out

    def folded(self, partial: PartialSum, fold: Fold) -> None:
        """Hand a round's partial sum to ``fold``; its clients have now adopted the global c."""
        fold(partial)
        self.adopted(self.round, [s.client_id for s in partial.stats])

    def adopted(self, round_index: int, clients: list[int]) -> None:
        """Round ``round_index`` folded these clients' updates: a replacement among them has adopted the global c
        (its first round as a rebuilt client, recorded)."""
        first = sorted(k for k in clients if k in self.adopt_global_c)
        if first:
            self.rebuilt[round_index] = sorted(set(self.rebuilt.get(round_index, [])) | set(first))
            self.adopt_global_c.difference_update(first)

    def rerun(self, failed: dict[int, BaseException], call: Submit, fold: Fold, again: Sequence[int] = ()) -> None:
        """After a round that did not go through :meth:`each`: apply the failure policy to the ``failed`` actors
        and re-run the round's call on their replacements and on ``again`` (actors whose call never ran),
        counting the failures of the re-run with these."""
        attempts = dict.fromkeys(failed, 0)
        rerun = [*again, *(a for a, exc in sorted(failed.items()) if self.failed(a, "local_round", exc, attempts))]
        for _, partial in self.each("local_round", call, sorted(rerun), attempts=attempts):
            self.folded(partial, fold)

    # -- failures ----------------------------------------------------------------------------
    def late(self, a: int, action: str) -> ClientError:
        return self._actor_error(a, action, f"no answer within ray_timeout_s={self.timeout:g} s")

    def _actor_error(self, a: int, action: str, error: str, traceback: str = "") -> ClientError:
        hosted = tuple(self.hosted.get(a, ()))
        err = ClientError(hosted[0] if hosted else -1, self.round, action, error, traceback, a, hosted, True)
        err.names = self.client_section.client_names
        return err

    def _as_client_error(self, a: int, action: str, exc: BaseException) -> ClientError:
        cause = getattr(exc, "cause", None)
        err = cause if isinstance(cause, ClientError) else exc if isinstance(exc, ClientError) else None
        if err is not None:  # raised in client code (the client is named) or made here
            err.actor, err.clients = a, tuple(self.hosted.get(a, ())) or err.clients
            err.names = self.client_section.client_names
            return err
        if isinstance(exc, ray.exceptions.RayActorError):
            what, text = "its actor process died", str(exc)
        elif isinstance(exc, ray.exceptions.RayTaskError) and cause is not None:
            what, text = type(cause).__name__, str(cause)  # e.g. arguments that cannot be unpickled there
        else:
            what, text = type(exc).__name__, str(exc)
        lines = text.strip().splitlines()
        first = lines[0] if lines else ""
        return self._actor_error(a, action, f"{what}: {first}".rstrip(": "), "\n".join(lines[1:]))

    def failed(self, a: int, action: str, exc: BaseException, attempts: dict[int, int]) -> bool:
        """Apply the failure policy to actor ``a``; True: it was replaced (re-run the call), False: it is gone."""
        cfg = self.config
        while True:
            err = self._as_client_error(a, action, exc)
            attempts[a] += 1
            if isinstance(err, ClientInputError) or cfg.on_client_failure == "abort":
                self._event(err, "abort")
                raise err
            if attempts[a] > cfg.max_client_retries:
                if cfg.on_client_failure != "drop":
                    self._give_up(a, err, attempts[a])
                # the client whose code raised, or every client of an actor that died or did not answer
                victims = list(self.hosted[a]) if err.of_actor else [err.client_id]
                self._event(err, "dropped", victims)
                self.drop(victims)
                if a not in self.actors:
                    return False
                attempts[a] = 0  # the actor's other clients go on: rebuilt below, the call re-run
            else:
                self._event(err, f"replaced (attempt {attempts[a]} of {cfg.max_client_retries})")
            if err.of_actor:
                self._note_lost_node(a)
            try:
                self.replace(a)
                return True
            except (ray.exceptions.RayError, ClientError) as again:
                exc = again

    def _give_up(self, a: int, err: ClientError, attempts: int) -> None:
        """``on_client_failure: retry`` and the retries used up: stop the run with the error."""
        self._event(err, "abort")
        who = (f"client {client_label(err.client_id, err.names)}" if len(err.clients) == 1
               else f"actor {a} (clients {client_labels(err.clients, err.names)})")
        err.add_note(f"{who} failed {attempts} times in this call (on_client_failure=retry, "
                     f"max_client_retries={self.config.max_client_retries})")
        raise err

    def _note_lost_node(self, a: int) -> None:
        """When actor ``a``'s node is gone, log it once with every client that was on it."""
        node = self.where_of.get(a, {}).get("node_id")
        if node is None or any(e["node_id"] == node for e in self.lost_nodes) or not node_is_lost(node):
            return
        for hook in self.on_node_lost:
            hook(node)
        on_it = sorted(b for b, w in self.where_of.items() if w.get("node_id") == node)
        clients = sorted(k for b in on_it for k in self.hosted.get(b, ()))
        event = {"node_id": node, "address": node_addresses().get(node, ""), "round": self.round,
                 "actors": on_it, "clients": clients}
        self.lost_nodes.append(event)
        log.warning("node %s (%s) was lost in round %d with actors %s (clients %s); rebuilding them on the "
                    "surviving nodes", node, event["address"] or "address unknown", self.round,
                    ", ".join(map(str, on_it)), client_labels(clients, self.client_section.client_names))

    def _event(self, err: ClientError, outcome: str, dropped: list[int] | None = None) -> None:
        self.events.append({"client": err.client_id, "actor": err.actor, "clients": list(err.clients),
                            "round": err.round, "action": err.action, "error": err.error, "outcome": outcome,
                            **({"dropped": dropped} if dropped is not None else {})})
        log.warning("%s -> %s", err, outcome if dropped is None or len(err.clients) == 1
                    else f"{outcome} (clients {client_labels(dropped, err.names)})")

    # -- actors coming and going --------------------------------------------------------------------
    def kill(self, a: int) -> None:
        actor = self.actors.pop(a, None)
        if actor is not None:
            try:
                ray.kill(actor, no_restart=True)
            except Exception as exc:  # already gone
                log.debug("kill of actor %d: %s", a, exc)

    def drop(self, clients: Sequence[int]) -> None:
        """Go on without ``clients``; an actor left with none is ended."""
        for k in clients:
            if k in self.live:
                self.live.remove(k)
            self.adopt_global_c.discard(k)
        for a in list(self.hosted):
            self.hosted[a] = [k for k in self.hosted[a] if k not in clients]
            if not self.hosted[a]:
                del self.hosted[a]
                self.kill(a)
        if not self.live:
            raise RuntimeError("every client has been dropped; the federation cannot go on")

    def replace(self, a: int) -> None:
        """A new actor ``a`` rebuilding its clients (shards, p, the stage's reference, c^k = 0; global c next
        round)."""
        self.kill(a)
        self.placement.wait_placed(a, self.hosted.get(a, ()))
        actor = self.actors[a] = self.new_actor(a)
        calls = [self.setup_call(a, actor)]
        if self.positive_ratio is not None:
            calls.append(actor.configure.remote(self.positive_ratio))
        if self.reference_ref is not None:
            calls.append(actor.begin_stage.remote(self.reference_ref, True))
        for ref in calls:
            ray.get(ref, timeout=self.timeout)
        self.adopt_global_c.update(self.hosted[a])
        self.where_of[a] = ray.get(actor.where.remote(), timeout=self.timeout)
        for line in self.placement_lines([a]):
            log.warning("%s (replacement)", line)

    def settle(self, refs: list) -> None:
        """Fetch calls left in flight when a run stopped (another client's error, Ctrl+C), ignoring their
        outcome: Ray would otherwise print an "Unhandled error" traceback for each one that failed."""
        if not refs:
            return
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=5.0)
        for ref in done:
            try:
                ray.get(ref, timeout=0)
            except Exception as exc:  # the run has already stopped for another reason
                log.debug("a call abandoned when the run stopped ended with %s", type(exc).__name__)

    def end(self) -> None:
        """End every actor."""
        for a in list(self.actors):
            self.kill(a)
