"""Where the actors run: one bundle per actor in a placement group, site pinning, the nodes of the cluster.

All actors live in one placement group of A bundles (``PACK`` by default),
one bundle of ``cpus_per_actor`` / ``gpus_per_actor`` per actor, plus the
custom resources ``client_resources`` pins the actor's first client to (a
site). When this code itself runs inside a placement group (a Ray Tune trial:
driver bundle 0, actor bundles 1..A), the actors go into that group's bundles
1..A instead of a new group. A lost actor's bundle is placed again by Ray;
:meth:`Placement.wait_placed` waits for that at most ``placement_timeout_s``
and otherwise stops the run with a :class:`PlacementError` naming the clients.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Sequence
from typing import Any

import ray
from ray.util.placement_group import (
    PlacementGroup,
    get_current_placement_group,
    placement_group,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from fdam_ray.executors.errors import PlacementError
from fdam_ray.executors.ray_section import RayExecutorSection

log = logging.getLogger(__name__)

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


def check_capacity(bundle: dict[str, float], num_actors: int, *, local: bool, timeout_s: float) -> None:
    """Fail at once when ``num_actors`` bundles can never be placed: a local Ray short of resources (nothing
    will join), or no live node as large as one bundle; warn when the cluster is short now (nodes may join)."""
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
                    num_actors, detail, timeout_s)
    nodes = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
    if nodes and not any(all(res.get(r, 0) + 1e-9 >= v for r, v in bundle.items()) for res in nodes):
        largest = max(nodes, key=lambda res: (res.get("GPU", 0), res.get("CPU", 0)))
        raise ValueError(f"no node of the cluster can hold one actor ({bundle}; the largest node has "
                         f"CPU {largest.get('CPU', 0):g}, GPU {largest.get('GPU', 0):g}): lower cpus_per_actor / "
                         "gpus_per_actor, or add nodes that large")


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
        check_capacity(base, len(groups), local=local, timeout_s=self.timeout)
        self._own(base, len(groups))

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

    def _own(self, bundle: dict[str, float], num_actors: int) -> None:
        """A placement group of our own, one bundle per actor, placed within ``ray_timeout_s``."""
        cfg = self.config
        group = placement_group([dict(self.bundles[a]) for a in range(num_actors)], strategy=cfg.placement_strategy)
        try:
            ray.get(group.ready(), timeout=self.timeout)
        except ray.exceptions.GetTimeoutError:
            remove_placement_group(group)
            raise RuntimeError(f"the placement group of {num_actors} actor bundles {bundle} "
                               f"({cfg.placement_strategy}) was not placed within ray_timeout_s={self.timeout:g} s; "
                               f"cluster resources: {ray.cluster_resources()}") from None
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

        cfg = self.config
        clients = list(clients)
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

    def release(self) -> None:
        """Remove the placement group if it is this federation's own (an enclosing one stays)."""
        if self.own_group and self.placement_group is not None:
            remove_placement_group(self.placement_group)
        self.placement_group, self.own_group = None, False
