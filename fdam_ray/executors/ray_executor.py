"""Clients in Ray actors: object-store broadcast, streaming reduce, GPU shares, failures survived.

Hosting: ``clients_per_actor`` = M clients share an actor (one model replica;
each client keeps its own shard, control variate and sampler position):
client k lives on actor k // M, so there are A = ceil(K / M) actors. M = 1
(the default) is one actor per client.

One round (ARCHITECTURE.md, "One round, as data"): the driver puts the global
state in the object store once (flat numpy buffers, read without a copy by
actors on the same node), calls ``local_round`` on every actor hosting a
client of the round (with the list of those clients; an actor with none is
not called), and passes each actor's partial sum (its clients' updates,
already folded) to the reducer's ``fold`` as soon as it arrives
(``ray.wait``), so the driver maps one partial sum at a time whatever K is.
Float sums depend on their order, so such a run matches the inline executor to
float32 rounding (about 1e-7 relative), not bit for bit. ``fold_order:
client`` folds in actor order instead, which is client order (a sum that
arrives early waits in the object store, not in driver memory): runs are then
bit-for-bit repeatable and equal to the inline executor's with the same M, at
the price of waiting for a late low-numbered actor.

Placement: all actors live in one placement group of A bundles (``PACK`` by
default), one bundle of ``cpus_per_actor`` / ``gpus_per_actor`` per actor.
When this code itself runs inside a placement group (a Ray Tune trial: driver
bundle 0, actor bundles 1..A), the actors go into that group's bundles 1..A
instead of a new group.

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
the actor and its clients) and the round, and kept in
:attr:`RayExecutor.events`. A lost actor whose bundle cannot be placed again
within ``placement_timeout_s`` stops the run with a :class:`PlacementError`;
its clients stay hosted (not dropped), so :meth:`RayExecutor.client_states`
marks them for a rebuild in the checkpoint the federation then writes.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import pickle
import socket
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import ray
from ray.util.placement_group import (
    PlacementGroup,
    get_current_placement_group,
    placement_group,
    remove_placement_group,
)
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from fdam_ray.algorithms.server import PartialSum
from fdam_ray.client import ClientSection
from fdam_ray.data import DataSource
from fdam_ray.executors.base import Executor, ExecutorSection, actor_groups
from fdam_ray.executors.compiled import CompiledRounds
from fdam_ray.executors.errors import ClientError, ClientInputError, PlacementError
from fdam_ray.executors.ray_actor import ClientShell
from fdam_ray.executors.ray_section import RayExecutorSection
from fdam_ray.executors.ray_session import ensure_ray
from fdam_ray.state import ClientInfo, GlobalState, Moments, RoundPlan, Scores

log = logging.getLogger(__name__)

_RemoteShell = ray.remote(ClientShell)

# Resources every node has; the others (custom resources such as site_3) are what clients can be pinned by.
_STANDARD = ("CPU", "GPU", "memory", "object_store_memory")


class NodeReducer:
    """Folds the partial sums of the actors on one node into one, on that node (``reduce: node``).

    It receives the actors' result refs inside a list, so it fetches them
    itself (node-local reads) and folds each as it arrives (in actor order with
    ``ordered``), the first two in one pass into float32 sums it keeps from
    round to round, so a round neither allocates a state nor copies one before
    adding it. An actor that failed is reported back by index with its error,
    and the driver replaces it and folds its re-run directly.
    """

    def __init__(self) -> None:
        self._kept: PartialSum | None = None

    def merge(self, refs: list, actors: list[int], ordered: bool = False
              ) -> tuple[PartialSum | None, list[tuple[int, BaseException]]]:
        held: PartialSum | None = None  # the first part to arrive, a read-only view until a second one comes
        total: PartialSum | None = None
        failed: list[tuple[int, BaseException]] = []
        for a, ref in _arrivals(dict(zip(refs, actors, strict=True)), ordered):
            try:
                part = ray.get(ref)
            except Exception as exc:  # the driver applies the failure policy
                failed.append((a, _portable(exc)))
                continue
            if held is None and total is None:
                held = part
            elif total is None:
                total, held = self._sum_of(held, part), None
            else:
                total.merge(part)
            del part
        return (held if total is None else total), failed

    def _sum_of(self, first: PartialSum, second: PartialSum) -> PartialSum:
        """``first + second`` written into the sums kept on this reducer (made again only when shapes change)."""
        if first.control_variates != second.control_variates:
            late = second if first.control_variates else first
            raise ValueError(f"the partial sum of clients {[s.client_id for s in late.stats]} holds no control "
                             "variate")
        kept = self._kept
        if kept is None or any(getattr(kept, f) is None or getattr(kept, f).shape != getattr(first, f).shape
                               for f in _SUM_FIELDS if getattr(first, f) is not None):
            kept = self._kept = dataclasses.replace(
                first, **{f: None if getattr(first, f) is None else np.empty_like(getattr(first, f))
                          for f in _SUM_FIELDS})
        out = {}
        for f in _SUM_FIELDS:
            x, y, buf = getattr(first, f), getattr(second, f), getattr(kept, f)
            if x is None:
                out[f] = None
            else:
                (np.maximum if f == "counters" else np.add)(x, y, out=buf)
                out[f] = buf
        return dataclasses.replace(first, **out, weight=first.weight + second.weight,
                                   count=first.count + second.count, bytes_up=first.bytes_up + second.bytes_up,
                                   stats=[*first.stats, *second.stats])


_SUM_FIELDS = ("v", "alpha", "buffers", "counters", "c_v", "c_alpha")


def _arrivals(pending: dict, ordered: bool, timeout: float | None = None) -> Iterator[tuple[Any, Any]]:
    """``(value, ref)`` for each ref of ``pending`` (ref -> value) as it is ready, or in the dict's order with
    ``ordered``; stops early (leaving the rest in ``pending``) when none is ready within ``timeout`` s."""
    pending_refs = list(pending)
    while pending_refs:
        if ordered:
            ref = pending_refs[0]
            ready, _ = ray.wait([ref], timeout=timeout)
        else:
            ready, _ = ray.wait(pending_refs, num_returns=1, timeout=timeout)
        if not ready:
            return
        for ref in ready:
            pending_refs.remove(ref)
            yield pending.pop(ref), ref


def _portable(exc: BaseException) -> BaseException:
    """An error that pickles back to the driver: a client's own error, else the Ray error, else its text."""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, ClientError):
        return cause
    try:
        pickle.dumps(exc)
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}")
    return exc


_RemoteReducer = ray.remote(NodeReducer)


def node_addresses() -> dict[str, str]:
    """Node id -> its IP address, for the nodes of the cluster (alive or not)."""
    return {n["NodeID"]: n.get("NodeManagerAddress", "") for n in ray.nodes()}


def raylet_answers(node_id: str, timeout_s: float = 1.0) -> bool:
    """Whether the node's raylet still accepts connections (its port open): a node going down stops at once,
    before the GCS marks it dead."""
    info = next((n for n in ray.nodes() if n["NodeID"] == node_id), None)
    if info is None or not info.get("Alive") or not info.get("NodeManagerPort"):
        return False
    try:
        with socket.create_connection((info["NodeManagerAddress"], int(info["NodeManagerPort"])), timeout=timeout_s):
            return True
    except OSError:
        return False


def custom_resources(nodes: Sequence[dict]) -> list[str]:
    """The custom resources the live ``nodes`` (``ray.nodes()`` entries) offer, sorted."""
    names = {r for n in nodes if n.get("Alive") for r in n.get("Resources", {})}
    return sorted(r for r in names if r not in _STANDARD and not r.startswith(("node:", "accelerator_type:")))


def check_offered(client_resources: Sequence[dict], nodes: Sequence[dict],
                  clients: Sequence[int] | None = None) -> None:
    """Raise a one-line :class:`PlacementError` for the first client (of ``clients``, default all) asking for a
    resource that no live node offers in that amount."""
    live = [n.get("Resources", {}) for n in nodes if n.get("Alive")]
    for k in range(len(client_resources)) if clients is None else clients:
        for r, v in client_resources[k].items():
            if not any(res.get(r, 0) + 1e-9 >= v for res in live):
                most = max((res.get(r, 0) for res in live), default=0)
                what = (f"no live node offers {r}" if not most
                        else f"no live node offers {v:g} of {r} (at most {most:g})")
                raise PlacementError(f"client {k} cannot be placed: client_resources[{k}] = {client_resources[k]} "
                                     f"but {what}; the cluster's nodes offer "
                                     f"{', '.join(custom_resources(nodes)) or 'no custom resources'}")


def _between_rounds(kind: str) -> Callable:
    """Work between rounds (scoring, checkpoints): let the compiled graph rest first when that is worth it
    (:meth:`CompiledRounds.rest`), and keep how long this kind of work took."""

    def wrap(method: Callable) -> Callable:
        @functools.wraps(method)
        def run(self: RayExecutor, *args: Any, **kwargs: Any) -> Any:
            if self.graph is not None:
                self.graph.rest(self._took.get(kind, 0.0))
            started = time.monotonic()
            try:
                return method(self, *args, **kwargs)
            finally:
                self._took[kind] = time.monotonic() - started

        return run

    return wrap


class RayExecutor(Executor):
    """Runs the clients in Ray actors, ``clients_per_actor`` to an actor (see the module docstring).

    Attributes:
        events: one dict per failure (client, actor, clients, round, action, error, outcome).
        actors: actor index -> actor handle (live actors only).
        hosted: actor index -> the live clients it hosts.
        bundle_of: actor index -> placement group bundle index.
    """

    def __init__(self) -> None:
        self.actors: dict[int, Any] = {}
        self.hosted: dict[int, list[int]] = {}
        self.live: list[int] = []
        self.events: list[dict] = []
        self.bundle_of: dict[int, int] = {}
        self.num_clients = 0
        self.placement_group: PlacementGroup | None = None
        self._own_group = False
        self._round = 0
        self._positive_ratio: np.ndarray | None = None
        self._reference_ref = None
        self._adopt_global_c: set[int] = set()
        self._test_size = 0
        self._put_state: GlobalState | None = None
        self._in_flight: dict[Any, tuple[int, float]] = {}
        self._put_ref = None
        self.where_of: dict[int, dict] = {}
        self.bundles: dict[int, dict] = {}
        self.lost_nodes: list[dict] = []
        self._reducers: dict[str, Any] = {}
        self.graph: CompiledRounds | None = None
        self._took: dict[str, float] = {}  # seconds the last scoring / checkpoint call of each kind took

    # -- set-up ---------------------------------------------------------------------------
    def start(self, config: ExecutorSection, source: DataSource) -> list[ClientInfo]:
        self._client_section = ClientSection.of(config)
        self.config = config = RayExecutorSection.of(config)
        self.timeout = config.ray_timeout_s
        if config.transport == "compiled":
            if config.reduce == "node":
                raise ValueError("transport=compiled folds every actor's partial sum at the driver; reduce=node "
                                 "needs transport=classic")
            self.graph = CompiledRounds(config.channel_wait)
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
        self._place(groups, local=started_here)
        # A recipe goes to the object store once for every client; data held in memory (train_arrays) goes
        # one client's part per client, so no actor receives another client's samples.
        shared = ray.put(source) if source.for_client(0) is source else None
        self._source_refs = {k: shared if shared is not None else ray.put(source.for_client(k))
                             for k in range(num_clients)}
        self.hosted = dict(enumerate(groups))
        self.live = list(range(num_clients))
        for a in self.hosted:
            self.actors[a] = self._new_actor(a)
        infos: list[ClientInfo] = []
        for _, (got, test_size) in self._each("start", self._setup_call):
            infos.extend(got)
            self._test_size = test_size
        if len(infos) < num_clients:
            raise RuntimeError("clients were dropped while starting; a federation starts with all its clients")
        self._locate()
        for line in self.placement_lines():
            log.info("%s", line)
        return infos

    # -- where the clients run ---------------------------------------------------------------
    def _locate(self, actors: Sequence[int] | None = None) -> None:
        """Ask ``actors`` (default: every live one) where they run; remembered in :attr:`where_of`."""
        targets = sorted(self.actors if actors is None else actors)
        self.where_of.update(self._each("where", lambda a, actor: actor.where.remote(), targets))
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
            lines.append(f"placement: clients {', '.join(map(str, self.hosted.get(a, ())))} -> actor {a} -> node "
                         f"{node} ({ips.get(node, 'address unknown')})")
        return lines

    def _setup_call(self, a: int, actor) -> Any:
        ids = self.hosted[a]
        return actor.setup.remote(ids, self._client_section, [self._source_refs[k] for k in ids],
                                  self.config.eval_on == "clients")

    def _place(self, groups: list[list[int]] | int, *, local: bool) -> None:
        """Place one bundle per actor; ``groups``: the clients of each actor (or how many actors, one client each)."""
        cfg = self.config
        if isinstance(groups, int):
            groups = [[a] for a in range(groups)]
        num_actors = len(groups)
        base = {"CPU": cfg.cpus_per_actor, **({"GPU": cfg.gpus_per_actor} if cfg.gpus_per_actor else {})}
        extra = cfg.client_resources
        self.bundles = {a: {**base, **(dict(extra[ids[0]]) if extra else {})} for a, ids in enumerate(groups)}
        current = get_current_placement_group()
        if current is not None and extra:
            raise ValueError("client_resources cannot be used inside an enclosing placement group (a Ray Tune "
                             "trial): its bundles are fixed by the trial's resources")
        if extra:
            check_offered(extra, ray.nodes())
        if current is not None:
            specs = current.bundle_specs
            if len(specs) < num_actors + 1:
                raise ValueError(f"this driver runs in a placement group of {len(specs)} bundles; a federation of "
                                 f"{num_actors} actors needs the driver's bundle 0 and actor bundles "
                                 f"1..{num_actors}")
            for i in range(1, num_actors + 1):
                if specs[i].get("CPU", 0) < cfg.cpus_per_actor or specs[i].get("GPU", 0) < cfg.gpus_per_actor:
                    raise ValueError(f"bundle {i} of the enclosing placement group ({specs[i]}) is smaller than one "
                                     f"actor (cpus_per_actor={cfg.cpus_per_actor}, "
                                     f"gpus_per_actor={cfg.gpus_per_actor})")
            self.placement_group, self._own_group = current, False
            self.bundle_of = {a: a + 1 for a in range(num_actors)}
            log.info("placing %d actors in bundles 1..%d of the enclosing placement group", num_actors, num_actors)
            return
        bundle = base
        need = {r: v * num_actors for r, v in bundle.items()}
        have = ray.cluster_resources()
        short = {r: (v, have.get(r, 0)) for r, v in need.items() if have.get(r, 0) + 1e-9 < v}
        if short:
            detail = ", ".join(f"{r}: {v:g} needed, {h:g} in the cluster" for r, (v, h) in short.items())
            if local:
                raise ValueError(f"{num_actors} actors need more than this machine offers ({detail}); lower "
                                 "cpus_per_actor / gpus_per_actor, or host more clients per actor "
                                 "(clients_per_actor)")
            log.warning("the cluster cannot hold %d actors yet (%s); waiting up to %g s for nodes to join",
                        num_actors, detail, self.timeout)
        nodes = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
        if nodes and not any(all(res.get(r, 0) + 1e-9 >= v for r, v in bundle.items()) for res in nodes):
            largest = max(nodes, key=lambda res: (res.get("GPU", 0), res.get("CPU", 0)))
            raise ValueError(f"no node of the cluster can hold one actor ({bundle}; the largest node has "
                             f"CPU {largest.get('CPU', 0):g}, GPU {largest.get('GPU', 0):g}): lower cpus_per_actor / "
                             "gpus_per_actor, or add nodes that large")
        group = placement_group([dict(self.bundles[a]) for a in range(num_actors)], strategy=cfg.placement_strategy)
        try:
            ray.get(group.ready(), timeout=self.timeout)
        except ray.exceptions.GetTimeoutError:
            remove_placement_group(group)
            raise RuntimeError(f"the placement group of {num_actors} actor bundles {bundle} "
                               f"({cfg.placement_strategy}) was not placed within ray_timeout_s={self.timeout:g} s; "
                               f"cluster resources: {ray.cluster_resources()}") from None
        self.placement_group, self._own_group = group, True
        self.bundle_of = {a: a for a in range(num_actors)}

    def _new_actor(self, a: int):
        cfg = self.config
        threads = cfg.threads_per_actor or max(1, int(cfg.cpus_per_actor))
        strategy = PlacementGroupSchedulingStrategy(self.placement_group,
                                                    placement_group_bundle_index=self.bundle_of[a])
        return _RemoteShell.options(
            num_cpus=cfg.cpus_per_actor, num_gpus=cfg.gpus_per_actor, max_restarts=0, max_task_retries=0,
            scheduling_strategy=strategy,
        ).remote(a, self.hosted[a], threads=threads, device=cfg.device, gpu_share=cfg.gpus_per_actor,
                 gpu_memory_cap=cfg.gpu_memory_cap, channel_wait=cfg.channel_wait)

    # -- calls on every actor, with failures handled ---------------------------------------
    def _each(self, action: str, submit: Callable[[int, Any], Any],
              actors: list[int] | None = None, *, ordered: bool = True,
              attempts: dict[int, int] | None = None) -> Iterator[tuple[int, Any]]:
        """Call every live actor (or ``actors``); yield ``(a, result)`` in actor order, or with
        ``ordered=False`` as results arrive. ``attempts``: failures already counted in this call (a re-run).

        In actor order, results that arrive early are fetched (an error shows at
        once) but are views into the object store, touched only when consumed.
        """
        remaining = sorted(self.actors if actors is None else actors)
        attempts = {**dict.fromkeys(remaining, 0), **(attempts or {})}
        pending: dict[Any, tuple[int, float]] = {}
        self._in_flight = pending  # what is left of it when the run stops is settled at shutdown
        results: dict[int, Any] = {}

        def launch(a: int) -> None:
            pending[submit(a, self.actors[a])] = (a, time.monotonic() + self.timeout)

        for a in remaining:
            launch(a)
        while True:
            ready = remaining[:1] if ordered else list(remaining)
            settled = [a for a in ready if a in results or a not in self.actors]
            if settled:
                for a in settled:
                    remaining.remove(a)
                    if a in results:
                        yield a, results.pop(a)
                continue
            if not remaining:
                return
            if not pending:
                raise RuntimeError(f"actor {remaining[0]} has neither a result nor a call in flight")
            now = time.monotonic()
            wait_s = max(0.0, min(d for _, d in pending.values()) - now)
            done, _ = ray.wait(list(pending), num_returns=1, timeout=wait_s)
            for ref in done:
                ad, _ = pending.pop(ref)
                try:
                    results[ad] = ray.get(ref, timeout=self.timeout)
                except (ray.exceptions.RayError, ClientError) as exc:
                    if self._failed(ad, action, exc, attempts):
                        launch(ad)
            if not done:
                now = time.monotonic()
                for ref, (ad, deadline) in list(pending.items()):
                    if deadline <= now:
                        del pending[ref]
                        late = self._late(ad, action)
                        if self._failed(ad, action, late, attempts):
                            launch(ad)

    def _late(self, a: int, action: str) -> ClientError:
        return self._actor_error(a, action, f"no answer within ray_timeout_s={self.timeout:g} s")

    def _actor_error(self, a: int, action: str, error: str, traceback: str = "") -> ClientError:
        hosted = tuple(self.hosted.get(a, ()))
        return ClientError(hosted[0] if hosted else -1, self._round, action, error, traceback, a, hosted, True)

    def _as_client_error(self, a: int, action: str, exc: BaseException) -> ClientError:
        cause = getattr(exc, "cause", None)
        err = cause if isinstance(cause, ClientError) else exc if isinstance(exc, ClientError) else None
        if err is not None:  # raised in client code (the client is named) or made here
            err.actor, err.clients = a, tuple(self.hosted.get(a, ())) or err.clients
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

    def _failed(self, a: int, action: str, exc: BaseException, attempts: dict[int, int]) -> bool:
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
                    self._event(err, "abort")
                    who = (f"client {err.client_id}" if len(err.clients) == 1
                           else f"actor {a} (clients {', '.join(map(str, err.clients))})")
                    err.add_note(f"{who} failed {attempts[a]} times in this call (on_client_failure=retry, "
                                 f"max_client_retries={cfg.max_client_retries})")
                    raise err
                # the client whose code raised, or every client of an actor that died or did not answer
                victims = list(self.hosted[a]) if err.of_actor else [err.client_id]
                self._event(err, "dropped", victims)
                self._drop(victims)
                if a not in self.actors:
                    return False
                attempts[a] = 0  # the actor's other clients go on: rebuilt below, the call re-run
            else:
                self._event(err, f"replaced (attempt {attempts[a]} of {cfg.max_client_retries})")
            if err.of_actor:
                self._note_lost_node(a)
            try:
                self._replace(a)
                return True
            except (ray.exceptions.RayError, ClientError) as again:
                exc = again

    def _note_lost_node(self, a: int) -> None:
        """When actor ``a``'s node is gone, log it once with every client that was on it."""
        node = self.where_of.get(a, {}).get("node_id")
        if node is None or any(e["node_id"] == node for e in self.lost_nodes) or raylet_answers(node):
            return  # an actor that died alone (killed, out of memory) on a node that is still there
        deadline = time.monotonic() + 10.0  # the GCS marks a node dead a moment after its raylet stops
        while True:
            alive = {n["NodeID"]: n.get("Alive", False) for n in ray.nodes()}
            if not alive.get(node, False) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        if alive.get(node, False):
            return
        self._drop_reducer(node)
        on_it = sorted(b for b, w in self.where_of.items() if w.get("node_id") == node)
        clients = sorted(k for b in on_it for k in self.hosted.get(b, ()))
        event = {"node_id": node, "address": node_addresses().get(node, ""), "round": self._round,
                 "actors": on_it, "clients": clients}
        self.lost_nodes.append(event)
        log.warning("node %s (%s) was lost in round %d with actors %s (clients %s); rebuilding them on the "
                    "surviving nodes", node, event["address"] or "address unknown", self._round,
                    ", ".join(map(str, on_it)), ", ".join(map(str, clients)))

    def _wait_placed(self, a: int) -> None:
        """Wait (at most ``placement_timeout_s``) until actor ``a``'s bundle is placed on a live node; raise a
        :class:`PlacementError` naming its clients and what they ask for when it cannot be."""
        if not self._own_group or self.placement_group is None:
            return
        from ray.util import placement_group_table

        cfg = self.config
        clients = list(self.hosted.get(a, ()))
        if cfg.client_resources:
            check_offered(cfg.client_resources, ray.nodes(), clients[:1])
        deadline = time.monotonic() + cfg.placement_timeout_s
        while True:
            table = placement_group_table(self.placement_group)
            alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
            node = table.get("bundles_to_node_id", {}).get(self.bundle_of[a])
            if table.get("state") == "CREATED" and node in alive:
                return
            if time.monotonic() > deadline:
                break
            time.sleep(0.5)
        raise PlacementError(
            f"clients {', '.join(map(str, clients))} (actor {a}) cannot be placed again within "
            f"placement_timeout_s={cfg.placement_timeout_s:g} s: their bundle {self.bundles.get(a)} fits none of "
            f"the live nodes beside the other actors (available: {ray.available_resources()}); the run stops")

    def _event(self, err: ClientError, outcome: str, dropped: list[int] | None = None) -> None:
        self.events.append({"client": err.client_id, "actor": err.actor, "clients": list(err.clients),
                            "round": err.round, "action": err.action, "error": err.error, "outcome": outcome,
                            **({"dropped": dropped} if dropped is not None else {})})
        log.warning("%s -> %s", err, outcome if dropped is None or len(err.clients) == 1
                    else f"{outcome} (clients {', '.join(map(str, dropped))})")

    def _settle(self, refs: list) -> None:
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

    def _kill(self, a: int) -> None:
        actor = self.actors.pop(a, None)
        if actor is not None:
            try:
                ray.kill(actor, no_restart=True)
            except Exception as exc:  # already gone
                log.debug("kill of actor %d: %s", a, exc)

    def _drop(self, clients: Sequence[int]) -> None:
        """Go on without ``clients``; an actor left with none is ended."""
        for k in clients:
            if k in self.live:
                self.live.remove(k)
            self._adopt_global_c.discard(k)
        for a in list(self.hosted):
            self.hosted[a] = [k for k in self.hosted[a] if k not in clients]
            if not self.hosted[a]:
                del self.hosted[a]
                self._kill(a)
        if not self.live:
            raise RuntimeError("every client has been dropped; the federation cannot go on")

    def _replace(self, a: int) -> None:
        """A new actor ``a`` rebuilding its clients (shards, p, the stage's reference, c^k = 0; global c next
        round)."""
        self._kill(a)
        self._wait_placed(a)
        actor = self.actors[a] = self._new_actor(a)
        calls = [self._setup_call(a, actor)]
        if self._positive_ratio is not None:
            calls.append(actor.configure.remote(self._positive_ratio))
        if self._reference_ref is not None:
            calls.append(actor.begin_stage.remote(self._reference_ref, True))
        for ref in calls:
            ray.get(ref, timeout=self.timeout)
        self._adopt_global_c.update(self.hosted[a])
        self.where_of[a] = ray.get(actor.where.remote(), timeout=self.timeout)
        for line in self.placement_lines([a]):
            log.warning("%s (replacement)", line)

    def _state_ref(self, state: GlobalState):
        """The object-store copy of ``state`` for the scoring calls that follow a round (evaluation on the
        clients' splits and on the test set, CODA's score sums): put once for all of them. A round puts its
        state afresh, since the driver changes a state in place only between scoring and the next round."""
        if self._put_state is not state:
            self._put_state, self._put_ref = state, ray.put(state)
        return self._put_ref

    def _per_client(self, action: str, submit: Callable[[int, Any], Any]) -> list[Any]:
        """Results of a call that returns one value per hosted client, in client order."""
        out: list[Any] = []
        for _, values in self._each(action, submit):
            out.extend(values)
        return out

    # -- the Executor interface ---------------------------------------------------------------
    def configure(self, positive_ratio: np.ndarray) -> None:
        self._positive_ratio = np.asarray(positive_ratio)
        for _ in self._each("configure", lambda a, actor: actor.configure.remote(self._positive_ratio)):
            pass

    def begin_stage(self, reference: np.ndarray, reset_control_variates: bool) -> None:
        self._reference_ref = ref = ray.put(reference)
        for _ in self._each("begin_stage", lambda a, actor: actor.begin_stage.remote(ref, reset_control_variates)):
            pass

    def run_round(self, state: GlobalState, plan: RoundPlan, fold: Callable[[PartialSum], None],
                  clients: Sequence[int] | None = None) -> None:
        self._round = plan.round
        self._put_state = None
        put: list = []  # the round's object-store copy of the state: made by its first classic call (never when
        # the compiled graph carries the round), always fresh, since the driver changes a state in place only
        # between scoring and the next round
        chosen = set(self.live) if clients is None else set(clients) & set(self.live)

        def work(a: int) -> tuple[list[int], list[int]]:
            """Actor ``a``'s clients in this round, and those of them that first adopt the global c."""
            ids = [k for k in self.hosted.get(a, ()) if k in chosen]
            return ids, [k for k in ids if k in self._adopt_global_c]

        def call(a: int, actor) -> Any:
            if not put:
                put.append(ray.put(state))
            return actor.local_round.remote(put[0], plan, *work(a))  # at call time: a replacement adopts c

        # an actor with no client in the round is not called
        targets = [a for a in self.actors if any(k in chosen for k in self.hosted.get(a, ()))]
        if self.graph is not None:
            self._round_compiled(state, plan, {a: work(a) for a in targets}, call, fold)
            return
        if self.config.reduce == "node":
            self._round_by_node(call, targets, fold)
            return
        for _, partial in self._each("local_round", call, targets, ordered=self.config.fold_order == "client"):
            self._folded(partial, fold)
            del partial

    def _round_by_node(self, call: Callable[[int, Any], Any], targets: list[int],
                       fold: Callable[[PartialSum], None]) -> None:
        """``reduce: node``: the actors on one node are merged there by its :class:`NodeReducer`; the driver folds
        one partial sum per node as each arrives (an actor alone on its node, or on a node known to be lost, is
        folded directly), then re-runs the failed actors on their replacements."""
        ordered = self.config.fold_order == "client"
        lost = {e["node_id"] for e in self.lost_nodes}
        by_node: dict[Any, list[int]] = {}
        for a in sorted(targets):
            by_node.setdefault(self.where_of.get(a, {}).get("node_id"), []).append(a)
        refs = {a: call(a, self.actors[a]) for a in sorted(targets)}
        waiting: dict[Any, tuple[Any, list[int]]] = {}  # a merge (node, its actors) or an actor's sum (None, [a])
        for node, actors in by_node.items():
            if node is None or node in lost or len(actors) == 1:
                waiting.update({refs[a]: (None, [a]) for a in actors})
            else:
                merged = self._reducer(node).merge.remote([refs[a] for a in actors], actors, ordered)
                waiting[merged] = (node, actors)
        self._in_flight = dict.fromkeys([*refs.values(), *waiting], (0, 0.0))
        failed: dict[int, BaseException] = {}
        for (node, actors), ref in _arrivals(waiting, ordered, timeout=self.timeout):
            try:
                got = ray.get(ref, timeout=self.timeout)
            except (ray.exceptions.RayError, ClientError) as exc:
                if node is None:
                    failed[actors[0]] = exc
                    continue
                # the reducer is gone (with its node, or killed): never reused; its actors' sums are fetched here
                log.warning("the reducer of node %s failed in round %d (%s); folding its actors' sums directly",
                            node, self._round, type(exc).__name__)
                self._drop_reducer(node)
                for a in actors:
                    try:
                        self._folded(ray.get(refs[a], timeout=self.timeout), fold)
                    except (ray.exceptions.RayError, ClientError) as exc_a:
                        failed[a] = exc_a
                continue
            if node is None:
                self._folded(got, fold)
            else:
                partial, errors = got
                failed.update(errors)
                if partial is not None:
                    self._folded(partial, fold)
                del partial
            del got
        for _, actors in waiting.values():  # no answer within ray_timeout_s
            for a in actors:
                failed[a] = self._late(a, "local_round")
        self._in_flight = {}
        self._rerun(failed, call, fold)

    def _round_compiled(self, state: GlobalState, plan: RoundPlan, calls: dict[int, tuple[list[int], list[int]]],
                        call: Callable[[int, Any], Any], fold: Callable[[PartialSum], None]) -> None:
        """``transport: compiled``: the round as one execution of the compiled graph, its outputs folded in
        actor order (so a compiled run equals a classic ``fold_order: client`` run bit for bit). When the graph
        breaks (an actor raised, died or did not answer), the round is recovered from the actors themselves."""
        started = time.monotonic()
        graph = self.graph
        try:
            graph.ensure(self.actors, state.nbytes, self.timeout)
            outputs = graph.run((state, plan, calls), self.timeout)
        except Exception as exc:  # Ray's task, channel and timeout errors: the actors say what happened
            log.debug("the compiled round %d broke: %s: %s", plan.round, type(exc).__name__, exc)
        else:
            for partial in outputs:
                if partial is not None:
                    self._folded(partial, fold)
            return
        self._recover_compiled(plan, sorted(calls), started, call, fold)

    def _recover_compiled(self, plan: RoundPlan, targets: list[int], started: float,
                          call: Callable[[int, Any], Any], fold: Callable[[PartialSum], None]) -> None:
        """Ask every actor of a broken compiled round how its part ended (a classic call, answered while the
        graph's thread still runs), waiting at most ``ray_timeout_s`` from the round's start for those still
        running; fold what finished, apply the failure policy to what raised, died or is late (ended first,
        so the graph can be torn down), and re-run the rest with classic calls. The graph is rebuilt next
        round."""
        deadline = started + self.timeout
        status: dict[int, tuple[str, Any]] = {}
        waiting = list(targets)
        while waiting:
            asked = {a: self.actors[a].round_status.remote(plan.round) for a in waiting}
            waiting = []
            for a, ref in asked.items():
                try:
                    status[a] = ray.get(ref, timeout=max(1.0, deadline - time.monotonic()))
                except ray.exceptions.GetTimeoutError:
                    status[a] = ("running", None)
                except ray.exceptions.RayError as exc:
                    status[a] = ("dead", exc)
                    continue
                if status[a][0] == "running" and time.monotonic() < deadline:
                    waiting.append(a)
            if waiting:
                time.sleep(0.02)
        failed: dict[int, BaseException] = {}
        again: list[int] = []
        for a in targets:
            what, value = status[a]
            if what == "running":
                failed[a] = self._late(a, "local_round")
                self._kill(a)  # before the teardown, which would otherwise wait for it
            elif what in ("failed", "dead"):
                failed[a] = value
            elif what == "not started":
                again.append(a)
        self.graph.teardown()
        for a in targets:
            what, partial = status[a]
            if what == "done" and partial is not None:
                self._folded(partial, fold)
        self._rerun(failed, call, fold, again)

    def _rerun(self, failed: dict[int, BaseException], call: Callable[[int, Any], Any],
               fold: Callable[[PartialSum], None], again: Sequence[int] = ()) -> None:
        """After a round that did not go through ``_each``: apply the failure policy to the ``failed`` actors and
        re-run the round's call on their replacements and on ``again`` (actors whose call never ran), counting
        the failures of the re-run with these."""
        attempts = dict.fromkeys(failed, 0)
        rerun = [*again, *(a for a, exc in sorted(failed.items()) if self._failed(a, "local_round", exc, attempts))]
        for _, partial in self._each("local_round", call, sorted(rerun), attempts=attempts):
            self._folded(partial, fold)

    def _folded(self, partial: PartialSum, fold: Callable[[PartialSum], None]) -> None:
        fold(partial)
        self._adopt_global_c.difference_update(s.client_id for s in partial.stats)

    def _reducer(self, node: str):
        if node not in self._reducers:
            self._reducers[node] = _RemoteReducer.options(
                num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote()
        return self._reducers[node]

    def _drop_reducer(self, node: str) -> None:
        reducer = self._reducers.pop(node, None)
        if reducer is not None:
            try:
                ray.kill(reducer, no_restart=True)
            except Exception as exc:  # already gone with its node
                log.debug("kill of the reducer of node %s: %s", node, exc)

    @_between_rounds("evaluate")
    def evaluate(self, state: GlobalState) -> list[Scores]:
        ref = self._state_ref(state)
        scores = self._per_client("evaluate", lambda a, actor: actor.evaluate.remote(ref, self.hosted[a]))
        return [s for s in scores if s is not None]

    @_between_rounds("score_test_set")
    def score_test_set(self, state: GlobalState) -> Scores | None:
        """With ``eval_on: clients``: every live actor scores a slice of the global test set, pooled here."""
        if self.config.eval_on != "clients" or self._test_size == 0:
            return None
        while True:
            actors = sorted(self.actors)
            bounds = np.linspace(0, self._test_size, min(len(actors), self._test_size) + 1).astype(int)
            slices = {a: (int(lo), int(hi)) for a, lo, hi in zip(actors, bounds[:-1], bounds[1:], strict=False)}
            ref = self._state_ref(state)

            def call(a: int, actor, slices=slices, ref=ref) -> Any:
                return actor.score_test_slice.remote(ref, *slices[a])

            parts = list(self._each("evaluate", call, list(slices)))
            if all(a in self.actors for a in slices):  # an actor dropped mid-call: slice again
                parts.sort(key=lambda p: slices[p[0]][0])
                return Scores(-1, np.concatenate([s.scores for _, s in parts]),
                              np.concatenate([s.labels for _, s in parts]))

    @_between_rounds("score_moments")
    def score_moments(self, state: GlobalState) -> list[Moments]:
        ref = self._state_ref(state)
        return self._per_client("score_moments", lambda a, actor: actor.score_moments.remote(ref, self.hosted[a]))

    @_between_rounds("client_states")
    def client_states(self) -> list[dict | None]:
        """Every client's state; None for a client that was dropped, and ``{"client_id": k, "rebuild": True}``
        for one whose actor is lost and not placed again (the run stops with a :class:`PlacementError`): a
        resume rebuilds it from its shard with the global control variate, as a replaced actor's clients are."""
        got = {s["client_id"]: s for s in self._per_client("client_states",
                                                             lambda a, actor: actor.get_state.remote(self.hosted[a]))}
        unplaced = {k for a, ids in self.hosted.items() if a not in self.actors for k in ids}
        return [{"client_id": k, "rebuild": True} if k in unplaced else got.get(k) for k in range(self.num_clients)]

    def restore_client_states(self, states: list[dict | None]) -> None:
        gone = [k for k, s in enumerate(states) if s is None and k in self.live]
        for k in gone:
            log.warning("client %d was dropped before the checkpoint; it stays out", k)
        if gone:
            self._drop(gone)
        for _ in self._each("restore_client_states",
                            lambda a, actor: actor.set_state.remote([states[k] for k in self.hosted[a]])):
            pass

    @property
    def active_clients(self) -> int:
        return len(self.live)

    def client_info(self) -> dict[int, dict]:
        """Process id, node, placement group and device of the actor of every live client."""
        where = dict(self._each("where", lambda a, actor: actor.where.remote()))
        return {k: where[a] for a in sorted(where) for k in self.hosted[a]}

    def shutdown(self) -> None:
        abandoned = list(self._in_flight)
        if self.graph is not None and not self.graph.busy:  # idle: its actors leave their loops at once
            self.graph.teardown()
        for a in list(self.actors):
            self._kill(a)
        if self.graph is not None:  # a round cut short: the actors it waited on are gone, so it ends at once
            self.graph.teardown()
        for node in list(self._reducers):
            self._drop_reducer(node)
        self._settle(abandoned)
        if self._own_group and self.placement_group is not None:
            remove_placement_group(self.placement_group)
        self.placement_group, self._own_group = None, False
