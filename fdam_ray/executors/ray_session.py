"""Getting a Ray instance: reuse the one this process has, connect to a cluster, or start a local one.

Order: a Ray instance already running in this process (a test session, a Ray
Tune trial, a ``ray job submit`` driver) is reused, so start-up is paid once;
otherwise ``address`` (config field / ``fdam train --address``) or the
``RAY_ADDRESS`` variable names a cluster to connect to; otherwise a local Ray
is started with its dashboard bound to 127.0.0.1.

Token authentication (on by default since Ray 2.5x): a cluster started with
``RAY_AUTH_MODE=token`` (or by ``ray.init()``/``ray start`` on a machine that
has ``~/.ray/auth_token``) refuses callers that do not send its token. A
driver connecting by explicit address does not switch token mode on by
itself, and Ray then fails after a long wait with "Failed to connect". So
before connecting we ask the cluster's GCS once, and on an authentication
refusal say what to set: ``RAY_AUTH_MODE=token`` plus the token in
``RAY_AUTH_TOKEN``, a file named by ``RAY_AUTH_TOKEN_PATH``, or
``~/.ray/auth_token`` (``ray get-auth-token`` prints it on the head node).
"""

from __future__ import annotations

import logging
import math
import os
import socket

import ray

from fdam_ray.executors.errors import ClusterConnectionError

log = logging.getLogger(__name__)

AUTH_HELP = (
    "set RAY_AUTH_MODE=token and give this process the cluster's token: RAY_AUTH_TOKEN=<token>, "
    "RAY_AUTH_TOKEN_PATH=<file holding it>, or the file ~/.ray/auth_token (print the token on the head node "
    "with `ray get-auth-token`)"
)


def _host_port(address: str) -> tuple[str, int] | None:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        return None
    return host.strip("[]") or "127.0.0.1", int(port)


def check_cluster_access(address: str, *, connect_timeout_s: float = 5.0) -> None:
    """Fail fast, with what to change, when the cluster at ``address`` cannot be joined as things are set.

    Checks that something listens at ``host:port`` and that the cluster's GCS
    accepts this process's credentials. ``ray://`` (Ray Client) and ``auto``
    addresses are left to Ray.
    """
    if address in ("auto", "local") or "://" in address:
        return
    hp = _host_port(address)
    if hp is None:
        raise ClusterConnectionError(f"address {address!r} is not of the form host:port (e.g. 10.0.0.5:6379)")
    try:
        socket.create_connection(hp, timeout=connect_timeout_s).close()
    except OSError as exc:
        raise ClusterConnectionError(
            f"no Ray cluster answers at {address} ({exc}); start one with `ray start --head` or check the address"
        ) from None
    try:
        from ray._raylet import GcsClient
        from ray.exceptions import AuthenticationError
    except ImportError:  # a Ray without these internals: let ray.init report problems itself
        return
    try:
        GcsClient(address=address).internal_kv_get(b"fdam-probe", None, timeout=connect_timeout_s)
    except AuthenticationError:
        mode = os.environ.get("RAY_AUTH_MODE", "")
        if mode.lower() != "token":
            raise ClusterConnectionError(
                f"the Ray cluster at {address} requires token authentication but RAY_AUTH_MODE is "
                f"{mode or 'unset'}: {AUTH_HELP}"
            ) from None
        raise ClusterConnectionError(
            f"the Ray cluster at {address} refused this process's token (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH "
            "or ~/.ray/auth_token holds a different one); give it the cluster's token (`ray get-auth-token` "
            "on the head node)"
        ) from None
    except Exception as exc:  # any other failure: ray.init says more
        log.debug("probe of %s failed: %s", address, exc)


def ensure_ray(*, address: str | None, cpus_needed: float) -> bool:
    """Make sure this process is connected to Ray; returns True when this call started a local instance.

    Args:
        address: a cluster address (``host:port``, ``ray://...``, ``auto``); None uses ``RAY_ADDRESS``
            if set, else starts a local Ray.
        cpus_needed: logical CPUs the clients reserve; a local Ray declares at least this many (each
            client runs one torch thread, so more clients than cores still run).
    """
    if ray.is_initialized():
        if address:
            log.info("reusing the Ray instance this process already runs (address=%s not used)", address)
        return False
    address = address or os.environ.get("RAY_ADDRESS") or None
    if address:
        check_cluster_access(address)
        log.info("connecting to the Ray cluster at %s", address)
        ray.init(address=address)
        return False
    num_cpus = max(os.cpu_count() or 1, math.ceil(cpus_needed))
    log.info("starting a local Ray instance (%d CPUs, dashboard on 127.0.0.1)", num_cpus)
    ray.init(num_cpus=num_cpus, dashboard_host="127.0.0.1")
    return True
