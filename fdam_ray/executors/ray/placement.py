"""Where the actors run: one bundle per actor in a placement group, site pinning, the nodes of the cluster.

All actors live in one placement group of A bundles (``PACK`` by default),
one bundle of ``cpus_per_actor`` / ``gpus_per_actor`` per actor, plus the
custom resources ``client_resources`` pins the actor's first client to (a
site). When this code itself runs inside a placement group (a Ray Tune trial:
driver bundle 0, actor bundles 1..A), the actors go into that group's bundles
1..A instead of a new group. A lost actor's bundle is placed again by Ray;
:meth:`Placement.wait_placed` waits for that at most ``placement_timeout_s``
and otherwise stops the run with a :class:`PlacementError` naming the clients.

A group the cluster as it is can never hold (:func:`check_capacity`, and Ray's
own verdict ``INFEASIBLE`` while waiting) fails within seconds, naming the
bundles, the strategy and the nodes, unless an autoscaler may add nodes
(:func:`~fdam_ray.executors.ray.compat.autoscaler_configured`). Every wait
polls: a stop asked for (SIGTERM under ``fdam train``) and a cluster whose GCS
went away end it at once, in one line. The GCS queries a wait makes run in a
helper thread (:func:`ask_gcs`): a GCS killed between a check and a query
would otherwise hold the query for Ray's minute of reconnecting and then end
the process.
"""

from __future__ import annotations

import logging
import math
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import ray
from ray.util.placement_group import (
    PlacementGroup,
    get_current_placement_group,
    placement_group,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from fdam_ray.executors.errors import PlacementError
from fdam_ray.executors.ray import compat
from fdam_ray.executors.ray_section import RayExecutorSection

log = logging.getLogger(__name__)
T = TypeVar("T")

# Resources every node has; the others (custom resources such as site_3) are what clients can be pinned by.
_STANDARD = ("CPU", "GPU", "memory", "object_store_memory")


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


def node_is_lost(node_id: str, wait_s: float = 10.0) -> bool:
    """Whether node ``node_id`` is gone: its raylet no longer answers and the GCS marks it dead (which it does
    a moment after the raylet stops; waited for at most ``wait_s``)."""
    if raylet_answers(node_id):
        return False  # an actor that died alone (killed, out of memory) on a node that is still there
    deadline = time.monotonic() + wait_s
    while True:
        alive = {n["NodeID"]: n.get("Alive", False) for n in ray.nodes()}
        if not alive.get(node_id, False) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    return not alive.get(node_id, False)


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


def _node_line(nodes: Sequence[dict]) -> str:
    """What the live nodes offer, one ``node <ip>: CPU 4, GPU 1`` part each (at most 8 named)."""
    live = [n for n in nodes if n.get("Alive")]
    parts = []
    for n in live[:8]:
        res = n.get("Resources", {})
        offered = ", ".join(f"{r} {res.get(r, 0):g}" for r in ("CPU", "GPU") if r == "CPU" or res.get(r))
        extra = custom_resources([n])
        parts.append(f"node {n.get('NodeManagerAddress', '?')}: {offered}" + (f", {', '.join(extra)}" if extra else ""))
    more = f" and {len(live) - 8} more" if len(live) > 8 else ""
    return f"{len(live)} live node{'s' if len(live) != 1 else ''} ({'; '.join(parts)}{more})"


def check_capacity(bundle: dict[str, float], num_actors: int, *, grows: bool, timeout_s: float,
                   strategy: str = "PACK") -> None:
    """Fail at once when ``num_actors`` bundles can never be placed on the cluster as it is: more than its
    nodes hold together, no live node as large as one bundle, or a strict strategy its nodes cannot meet;
    ``grows``: an autoscaler may add nodes, so a cluster short in total is waited for (with a warning)."""
    nodes = ray.nodes()
    live = [n.get("Resources", {}) for n in nodes if n.get("Alive")]
    if not grows and live and not any(all(res.get(r, 0) + 1e-9 >= v for r, v in bundle.items()) for res in live):
        largest = max(live, key=lambda res: (res.get("GPU", 0), res.get("CPU", 0)))
        raise ValueError(f"no node of the cluster can hold one actor ({bundle}; the largest node has "
                         f"CPU {largest.get('CPU', 0):g}, GPU {largest.get('GPU', 0):g}): lower cpus_per_actor / "
                         "gpus_per_actor, or add nodes that large")
    need = {r: v * num_actors for r, v in bundle.items()}
    have = ray.cluster_resources()
    short = {r: (v, have.get(r, 0)) for r, v in need.items() if have.get(r, 0) + 1e-9 < v}
    if short:
        detail = ", ".join(f"{r}: {v:g} needed, {h:g} in the cluster" for r, (v, h) in short.items())
        if not grows:
            raise ValueError(f"{num_actors} actors need more than the cluster offers ({detail}; {_node_line(nodes)}, "
                             f"no autoscaler); lower cpus_per_actor / gpus_per_actor{_fitting(short, num_actors)}, "
                             f"or host more clients per actor (clients_per_actor){_private_instead()}")
        log.warning("the cluster cannot hold %d actors yet (%s); waiting up to %g s for its autoscaler to add "
                    "nodes", num_actors, detail, timeout_s)
    if not grows:
        _check_strict(strategy, need, num_actors, nodes)


def _fitting(short: dict[str, tuple[float, float]], num_actors: int) -> str:
    """`` (cpus_per_actor=0.5 fits)``: the per-actor shares of the short resources that the cluster holds for
    ``num_actors`` actors together ('' where one of them is not there at all)."""
    fits = []
    for resource, field in (("CPU", "cpus_per_actor"), ("GPU", "gpus_per_actor")):
        if resource in short:
            have = short[resource][1]
            if have <= 0:
                return ""
            fits.append(f"{field}={math.floor(have / num_actors * 100) / 100:g}")
    return f" ({' and '.join(fits)} fits)" if fits and all(not f.endswith("=0") for f in fits) else ""


def _private_instead() -> str:
    """What to do instead when the cluster was joined only because ``ray start`` recorded it on this machine."""
    from fdam_ray.executors.ray.session import joined_recorded_cluster

    if not joined_recorded_cluster():
        return ""
    return ("; it is the cluster `ray start` left running on this machine, joined because no address was given: "
            "address=local starts a private Ray sized for the run instead")


def _check_strict(strategy: str, need: dict[str, float], num_actors: int, nodes: Sequence[dict]) -> None:
    """Fail when a strict strategy cannot be met by the live ``nodes`` (``need``: all the bundles together)."""
    live = [n.get("Resources", {}) for n in nodes if n.get("Alive")]
    if strategy == "STRICT_SPREAD" and num_actors > len(live):
        raise ValueError(f"placement_strategy=STRICT_SPREAD puts each of the {num_actors} actors on a node of its "
                         f"own, but the cluster has {_node_line(nodes)} and no autoscaler; use PACK or SPREAD, or "
                         "host more clients per actor (clients_per_actor)")
    if strategy == "STRICT_PACK" and live and not any(
            all(res.get(r, 0) + 1e-9 >= v for r, v in need.items()) for res in live):
        raise ValueError(f"placement_strategy=STRICT_PACK puts all {num_actors} actors ({need}) on one node, but "
                         f"the cluster has {_node_line(nodes)} and no autoscaler; use PACK or SPREAD")


def wait_for_group(group: PlacementGroup, *, what: str, timeout_s: float, grows: bool, poll_s: float = 0.5) -> None:
    """Wait until ``group`` is placed, checking every ``poll_s``: a stop asked for (SIGTERM), the cluster going
    away, and Ray finding the group infeasible on a cluster without an autoscaler each end the wait at once;
    otherwise a line says what is waited for (again each minute), and ``timeout_s`` ends it. ``what``: the
    group's bundles and strategy, as the messages name them. The caller removes the group on an error."""
    from fdam_ray.features.interrupts import RunStopped, stop_requested

    def check() -> None:
        reason = stop_requested()
        if reason is not None:
            raise RunStopped(f"{reason}: stopped while waiting for the cluster to place {what}; nothing was "
                             "trained", None)
        gone = cluster_gone(what)
        if gone is not None:
            raise gone

    started = time.monotonic()
    ready = group.ready()
    said = 0.0
    while True:
        done, _ = ray.wait([ready], timeout=poll_s)
        if done:
            try:
                ray.get(ready, timeout=poll_s)
                return
            except ray.exceptions.RayError as exc:  # e.g. TaskPlacementGroupRemoved: its cluster went away
                raise cluster_gone_or(exc, what) from None
        check()
        from ray.util import placement_group_table

        stats = ask_gcs(lambda: placement_group_table(group), check).get("stats") or {}
        if stats.get("scheduling_state") == "INFEASIBLE" and not grows:
            nodes = ask_gcs(ray.nodes, check)
            raise ValueError(f"the cluster can never place {what}: {_node_line(nodes)}, no autoscaler; lower "
                             "cpus_per_actor / gpus_per_actor, use placement_strategy PACK or SPREAD, or add nodes")
        waited = time.monotonic() - started
        if waited > timeout_s:
            raise TimeoutError(waited)
        if waited - said >= (60.0 if said else 2.0):
            said = waited
            free = ask_gcs(ray.available_resources, check)
            log.warning("waiting %.0f s so far (up to %g s) for the cluster to place %s: %s; free now: CPU %g, GPU %g",
                        waited, timeout_s, what, "an autoscaler may add nodes" if grows else "busy with other work",
                        free.get("CPU", 0), free.get("GPU", 0))


def gcs_answers() -> bool:
    """Whether the GCS of the cluster this process joined still accepts connections (Ray's own calls would wait
    for it for a minute and then end the process)."""
    gcs = ray.get_runtime_context().gcs_address
    host, _, port = gcs.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=2.0).close()
        return True
    except (OSError, ValueError):
        return False


def ask_gcs(query: Callable[[], T], check: Callable[[], None], poll_s: float = 0.25) -> T:
    """``query()`` (a call Ray answers from the GCS), run in a helper thread while this one runs ``check()``
    every ``poll_s`` until the answer comes: a check that raises (a stop asked for, the GCS gone) ends the wait
    at once. A GCS that dies mid-query holds the query for Ray's minute of reconnecting; the helper thread is a
    daemon, so the process can still leave."""
    box: dict[str, Any] = {}

    def ask() -> None:
        try:
            box["answer"] = query()
        except BaseException as exc:  # handed to the waiting thread
            box["error"] = exc

    helper = threading.Thread(target=ask, name="fdam-gcs-query", daemon=True)
    helper.start()
    while True:
        helper.join(poll_s)
        if not helper.is_alive():
            break
        check()
    if "error" in box:
        raise box["error"]
    return box["answer"]


def cluster_gone(what: str) -> PlacementError | None:
    """A one-line :class:`PlacementError` when the cluster's GCS no longer accepts connections, else None."""
    if gcs_answers():
        return None
    gcs = ray.get_runtime_context().gcs_address
    return PlacementError(f"the Ray cluster at {gcs} went away while placing {what} (its GCS no longer "
                          "answers); nothing was trained")


def cluster_gone_or(exc: BaseException, what: str) -> BaseException:
    """The cluster's disappearance as a :class:`PlacementError`, else ``exc`` (a group removed otherwise) in one
    line as one."""
    gone = cluster_gone(what)
    if gone is not None:
        return gone
    first = (str(exc).strip().splitlines() or [""])[0]
    return PlacementError(f"the placement of {what} failed: {type(exc).__name__}: {first[:200]}")


class Placement:
    """The bundles of a federation's actors and the placement group that holds them.

    Attributes:
        placement_group: the group the actors run in (None before :meth:`place` and after :meth:`release`).
        bundle_of: actor index -> its bundle's index in that group.
        bundles: actor index -> the resources of its bundle.
    """

    def __init__(self, config: RayExecutorSection, timeout_s: float) -> None:
        self.config = config
        self.timeout = timeout_s
        self.placement_group: PlacementGroup | None = None
        self.own_group = False
        self.bundle_of: dict[int, int] = {}
        self.bundles: dict[int, dict] = {}

    def place(self, groups: list[list[int]] | int, *, local: bool) -> None:
        """Place one bundle per actor; ``groups``: the clients of each actor (or how many actors, one client
        each); ``local``: this process started the Ray instance (nothing will join it)."""
        cfg = self.config
        if isinstance(groups, int):
            groups = [[a] for a in range(groups)]
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
            self._enter(current, len(groups))
            return
        grows = not local and compat.autoscaler_configured()
        check_capacity(base, len(groups), grows=grows, timeout_s=self.timeout, strategy=cfg.placement_strategy)
        self._own(base, len(groups), grows=grows)

    def _enter(self, current: PlacementGroup, num_actors: int) -> None:
        """Take bundles 1..A of the enclosing placement group (bundle 0 is the driver's)."""
        cfg = self.config
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
        self.placement_group, self.own_group = current, False
        self.bundle_of = {a: a + 1 for a in range(num_actors)}
        log.info("placing %d actors in bundles 1..%d of the enclosing placement group", num_actors, num_actors)

    def _own(self, bundle: dict[str, float], num_actors: int, *, grows: bool) -> None:
        """A placement group of our own, one bundle per actor, placed within ``ray_timeout_s`` (failing at once
        when it never can be and the cluster cannot grow: :func:`wait_for_group`)."""
        cfg = self.config
        group = placement_group([dict(self.bundles[a]) for a in range(num_actors)], strategy=cfg.placement_strategy)
        what = f"{num_actors} actor bundles {bundle} ({cfg.placement_strategy})"
        try:
            wait_for_group(group, what=what, timeout_s=self.timeout, grows=grows)
        except TimeoutError:
            _remove(group)
            raise RuntimeError(f"the placement group of {what} was not placed within ray_timeout_s={self.timeout:g} "
                               f"s; cluster resources: {ray.cluster_resources()}") from None
        except BaseException:
            _remove(group)
            raise
        self.placement_group, self.own_group = group, True
        self.bundle_of = {a: a for a in range(num_actors)}

    def strategy(self, a: int) -> Any:
        """The scheduling strategy that puts actor ``a`` in its bundle."""
        if self.placement_group is None:
            raise RuntimeError("the actors' placement group is not placed yet (Placement.place comes first)")
        return PlacementGroupSchedulingStrategy(self.placement_group, placement_group_bundle_index=self.bundle_of[a])

    def wait_placed(self, a: int, clients: Sequence[int]) -> None:
        """Wait (at most ``placement_timeout_s``) until actor ``a``'s bundle is placed on a live node; raise a
        :class:`PlacementError` naming its ``clients`` and what they ask for when it cannot be."""
        if not self.own_group or self.placement_group is None:
            return
        from ray.util import placement_group_table

        from fdam_ray.features.interrupts import stop_requested

        cfg = self.config
        clients = list(clients)
        if cfg.client_resources:
            check_offered(cfg.client_resources, ray.nodes(), clients[:1])
        deadline = time.monotonic() + cfg.placement_timeout_s
        what = f"the bundle of actor {a} (clients {', '.join(map(str, clients))})"
        group = self.placement_group

        def check() -> None:
            reason = stop_requested()
            if reason is not None:  # mid-round: the federation checkpoints the round's start
                raise PlacementError(f"{reason}: stopped while waiting for the cluster to place {what} again")
            gone = cluster_gone(what)
            if gone is not None:
                raise gone

        while True:
            check()
            table = ask_gcs(lambda: placement_group_table(group), check)
            alive = {n["NodeID"] for n in ask_gcs(ray.nodes, check) if n.get("Alive")}
            node = table.get("bundles_to_node_id", {}).get(self.bundle_of[a])
            if table.get("state") == "CREATED" and node in alive:
                return
            if time.monotonic() > deadline:
                break
            time.sleep(0.5)
        free = ask_gcs(ray.available_resources, check)
        raise PlacementError(
            f"clients {', '.join(map(str, clients))} (actor {a}) cannot be placed again within "
            f"placement_timeout_s={cfg.placement_timeout_s:g} s: their bundle {self.bundles.get(a)} fits none of "
            f"the live nodes beside the other actors (available: {free}); the run stops")

    def release(self) -> None:
        """Remove the placement group if it is this federation's own (an enclosing one stays)."""
        if self.own_group and self.placement_group is not None:
            _remove(self.placement_group)
        self.placement_group, self.own_group = None, False


def _remove(group: PlacementGroup) -> None:
    """Remove ``group``; a cluster that went away has removed it already."""
    if not gcs_answers():
        return
    try:
        remove_placement_group(group)
    except Exception as exc:  # the GCS is gone: nothing is left to remove
        log.debug("removing a placement group: %s", exc)
