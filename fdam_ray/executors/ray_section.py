"""What the Ray executor alone reads of a config: where its actors run and how a round travels.

These fields mean nothing to the inline executor or to a client, so they sit in
their own section: a client (a Ray actor) receives
:class:`~fdam_ray.clients.client.ClientSection` only, and the inline executor reads
:class:`~fdam_ray.executors.base.ExecutorSection`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from fdam_ray.executors.base import ExecutorSection
from fdam_ray.features.capabilities import REDUCES, reduces, refused_pairs, transports
from fdam_ray.settings.sections import AT_LEAST_ONE, POSITIVE, Section, fail, setting, shared

# Resources Ray reserves through cpus_per_actor / gpus_per_actor, never through client_resources.
BUILT_IN_RESOURCES = ("CPU", "GPU", "memory", "object_store_memory")


def _gpus_allowed(v: float) -> bool:
    return v == 0 or 0 < v <= 1 or float(v).is_integer()


@dataclasses.dataclass(frozen=True, kw_only=True)
class RaySection(Section):
    """The Ray executor's own fields: cluster, per-actor resources, placement, transport and timeouts."""

    name = "ray"

    address: str | None = setting(None, "Ray cluster to connect to (host:port, ray://host:port, auto; local = a "
                                  "private local Ray even when a `ray start` cluster runs on this machine); null = "
                                  "RAY_ADDRESS if set, else this user's `ray start` cluster of this machine, else "
                                  "start a private local Ray on 127.0.0.1 (a Ray already running in this process is "
                                  "reused).", resume=True)
    cpus_per_actor: float = setting(1.0, "CPUs Ray reserves for each actor (fractions allowed; cpus_per_client is "
                                    "read as this when clients_per_actor = 1); the actor runs max(1, int(this)) "
                                    "torch threads unless threads_per_actor says otherwise.", check=POSITIVE,
                                    resume=True)
    gpus_per_actor: float = setting(0.0, "GPUs per actor (gpus_per_client is read as this when clients_per_actor "
                                    "= 1); a fraction shares a GPU (0.25 = four actors per GPU); 0 = CPU only.",
                                    check=_gpus_allowed, allowed="0, a fraction in (0, 1], or a whole number",
                                    resume=True)
    placement_strategy: str = setting("PACK", "How the clients' placement group spreads over nodes (Ray's "
                                      "strategies).", choices=("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"),
                                      resume=True)
    client_resources: tuple[dict, ...] | None = setting(None, "Ray custom resources per client, one mapping per "
                                                        "client in client order (e.g. [{site_0: 0.01}, {site_1: "
                                                        "0.01}]): client k's actor bundle asks for them, so it runs "
                                                        "on a node that offers them; the clients of one actor must "
                                                        "ask for the same; null = any node.")
    reduce: str = setting("star", "ray executor: star (every actor's partial sum goes to the driver) or node (the "
                          "actors on one node fold their partial sums into one on that node; the driver receives "
                          "one per node).", choices=REDUCES, resume=True)
    transport: str = setting("classic", "ray executor: how a round reaches the actors and comes back: classic (one "
                             "Ray call per actor, the state through the object store) or compiled (one Ray Compiled "
                             "Graph built per federation: the state and the partial sums travel through "
                             "pre-allocated shared-memory channels; rebuilt when an actor is replaced) or "
                             "collective (the actors all-reduce their partial sums among themselves, gloo on CPU, "
                             "NCCL on GPUs, and apply the server step, several rounds a call (collective_rounds); "
                             "the driver receives the state where it needs it and sends it only when the actors' "
                             "copy is stale). Evaluation and "
                             "set-up calls stay classic in every case.", choices=tuple(transports()),
                             resume=True)
    collective_rounds: int = setting(16, "transport=collective: rounds the actors run back to back in one call "
                                     "(local round, all-reduce, server step, and on to the next), the driver "
                                     "receiving the global state only when the run ends; evaluations, checkpoints, "
                                     "stage ends and the last round always end a run. 1 = one call per round, the "
                                     "driver folding every round's reduced sum. A failure inside a run keeps the "
                                     "rounds before it.", check=AT_LEAST_ONE, resume=True)
    collective_backend: str = setting("auto", "transport=collective: how the actors all-reduce: auto (NCCL when "
                                      "every actor holds a GPU of its own; else shared memory: one block in "
                                      "/dev/shm when all the actors run on one node, and across nodes a block per "
                                      "node with one actor per node all-reducing with the other nodes' over gloo, "
                                      "16-bit with transfer_precision bf16/fp16), gloo (flat torch.distributed "
                                      "gloo over every actor whenever NCCL is not used) or device (actors that "
                                      "share one GPU sum through CUDA IPC handles on it instead of host memory; "
                                      "else as auto).",
                                      choices=("auto", "gloo", "device"), resume=True)
    channel_wait: str = setting("sleep", "transport=compiled: how the actors and the driver wait on the graph's "
                                "channels: sleep (Ray's polling for the first 50 ms of a wait, then sleeps with "
                                "pauses that grow with the wait: an idle graph costs almost no CPU, and a long wait "
                                "ends at most a few percent later) or spin (Ray's polling throughout: every waiting "
                                "actor keeps a core busy, also while the run scores or writes checkpoints).",
                                choices=("sleep", "spin"), resume=True)
    placement_timeout_s: float = setting(120.0, "Longest wait for lost actors' placement-group bundles to be placed "
                                         "again after a node is lost; then the run stops, naming the clients and "
                                         "resources that cannot be placed, with a checkpoint of the state the round "
                                         "started from (continue it with --resume).", check=POSITIVE,
                                         resume=True)
    gpu_memory_cap: bool = setting(True, "With a fractional gpus_per_actor, cap each actor's CUDA memory to that "
                                   "fraction of the GPU.", resume=True)
    fold_order: str = setting("arrival", "ray executor: fold client updates as they arrive (arrival) or in client "
                              "order (client: bit-for-bit repeatable runs, equal to the inline executor's; waits for "
                              "late clients).", choices=("arrival", "client"), resume=True)
    ray_timeout_s: float = setting(1800.0, "Longest wait for any Ray call (a client's round, a placement group); a "
                                   "client that does not answer in time counts as failed.", check=POSITIVE,
                                   resume=True)
    num_clients: int = shared()
    clients_per_actor: int = shared()
    executor: str = shared()

    def check(self) -> None:
        """A (transport, reduce) pair some transport runs (as the transports declare); client_resources: one entry
        per client, and the clients of one actor ask for the same."""
        refused = refused_pairs()  # what the transports declare (fdam_ray.features.capabilities)
        if self.executor == "ray" and (self.transport, self.reduce) in refused:
            raise fail("reduce", self.reduce, f"{', '.join(reduces(self.transport))}: "
                       f"{refused[self.transport, self.reduce]}")
        resources, k, m = self.client_resources, self.num_clients, self.clients_per_actor
        if resources is None:
            return
        if len(resources) != k:
            raise fail("client_resources", resources, f"one entry per client: {k} (num_clients), not {len(resources)}")
        for first in range(0, k, m):
            for j in range(first + 1, min(first + m, k)):
                if resources[j] != resources[first]:
                    raise fail("client_resources", resources,
                               f"the same resources for the clients of one actor (clients_per_actor={m}): client {j} "
                               f"asks for {resources[j]}, client {first} (same actor) for {resources[first]}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RayExecutorSection(ExecutorSection, RaySection):
    """What the Ray executor reads: the fields of any executor and its own."""


def resource_list(name: str, value: Any) -> tuple[dict, ...]:
    """``client_resources`` coerced: a non-empty list of mappings of custom Ray resource name -> amount > 0."""
    what = "a list with one mapping of Ray resource name: amount (> 0) per client"
    if not isinstance(value, (list, tuple)) or not value:
        raise fail(name, value, what)
    for k, entry in enumerate(value):
        if not isinstance(entry, Mapping) or not all(
            isinstance(r, str) and r and isinstance(v, (int, float)) and not isinstance(v, bool)
            and math.isfinite(v) and v > 0 for r, v in entry.items()
        ):
            raise fail(name, value, f"{what}; entry {k} ({entry!r}) is not")
        if any(r in BUILT_IN_RESOURCES for r in entry):
            raise fail(name, value, f"custom resources only; entry {k} names CPU/GPU/memory, which "
                       "cpus_per_actor / gpus_per_actor set")
    return tuple(dict(entry) for entry in value)
