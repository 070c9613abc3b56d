"""Refusing, before any client is built, more clients than this machine's memory can hold (a run's recipe asks)."""

from __future__ import annotations

import os

from fdam_ray.config import Config

# A model replica holds about this many copies of the model state (weights, gradient, proximal centre, round
# start, update, partial sum), a client one more (its control variate); under a local Ray each actor (one
# replica, clients_per_actor clients) is a process of its own.
_STATE_COPIES = 8
_CLIENT_STATE_COPIES = 1
_ACTOR_PROCESS_BYTES = 150e6


def _available_memory() -> float | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def check_capacity(config: Config, state_size: int) -> None:
    """Refuse, before any client is built, more clients than this machine's memory can hold.

    Counted for clients that run here: ``executor=inline``, or Ray without an address (a local instance).
    A cluster's own limits are the placement group's to report.
    """
    local_ray = config.executor == "ray" and not (config.address and config.address != "local") and not (
        os.environ.get("RAY_ADDRESS"))
    if config.executor != "inline" and not local_ray:
        return
    available = _available_memory()
    if available is None:
        return
    replicas = 1 if config.executor == "inline" else -(-config.num_clients // config.clients_per_actor)
    per_replica = state_size * 4 * _STATE_COPIES + (_ACTOR_PROCESS_BYTES if local_ray else 0)
    per_client = state_size * 4 * _CLIENT_STATE_COPIES
    if config.dataset == "synthetic":
        per_client += (config.samples_per_client + max(100, config.samples_per_client // 2)) * (
            config.num_features + 1) * 4
    need = replicas * per_replica + config.num_clients * per_client
    if need > available:
        where = (f"{replicas} Ray actor processes of {per_replica / 1e6:.3g} MB" if local_ray
                 else f"a model replica of {per_replica / 1e6:.3g} MB")
        raise ValueError(
            f"num_clients={config.num_clients} needs about {need / 1e9:.3g} GB of memory on this machine "
            f"({where}, {per_client / 1e6:.3g} MB per client) but {available / 1e9:.3g} GB are available; "
            "lower num_clients, host more clients per actor (clients_per_actor), or run the clients on a cluster "
            "(--address)")
