"""Getting a Ray instance: reuse the one this process has, connect to a cluster, or start a local one.

Order: a Ray instance already running in this process (a test session, a Ray
Tune trial, a ``ray job submit`` driver) is reused, so start-up is paid once;
otherwise ``address`` (config field / ``fdam train --address``) or the
``RAY_ADDRESS`` variable names a cluster to connect to; otherwise, as Ray's own
``ray.init()`` does, a cluster started on this machine with ``ray start`` (the
address Ray records in ``<ray temp dir>/ray_current_cluster``) is joined, with
one line saying so, but only when that record and the process listening at the
address it names are this user's (:mod:`~fdam_ray.executors.ray.ownership`;
the folder is writable by every user, so anyone could plant a record there);
otherwise, or with ``address=local``, a private local Ray is started, every
one of its processes (GCS, raylet, workers, agents, dashboard) listening on
127.0.0.1 only. Only a private instance is given start-up arguments (CPUs);
Ray refuses them when joining a cluster. ``address=auto`` means the recorded
cluster, under the same check.

A private instance is started with bounds fdam controls (:mod:`~fdam_ray.executors.ray.startup`): an
attempt may take longer than Ray's own fixed 30 s waits, a failed one has what it started stopped by pid and
is tried once more, and its server processes get sessions of their own, ended by pid at exit.

Before connecting by address, the port is asked what it is: Ray's GCS speaks
gRPC (HTTP/2), and anything else that answers (a web server, the dashboard's
port, ssh) or nothing at all is reported in one line within seconds, where
Ray itself would wait for minutes.

Token authentication (on by default since Ray 2.5x): a cluster started with
``RAY_AUTH_MODE=token`` (or by ``ray.init()``/``ray start`` on a machine that
has ``~/.ray/auth_token``) refuses callers that do not send its token. A
driver connecting by explicit address does not switch token mode on by
itself, and Ray then fails after a long wait with "Failed to connect". So
before connecting we ask the cluster's GCS once, and on an authentication
refusal say what to set: ``RAY_AUTH_MODE=token`` plus the token in
``RAY_AUTH_TOKEN``, a file named by ``RAY_AUTH_TOKEN_PATH``, or
``~/.ray/auth_token`` (``ray get-auth-token`` prints it on the head node).
Token mode is switched on here only for the recorded cluster of this machine
once it is found to be this user's (its processes can read the token file
anyway); an address nobody named never gets the token.
"""

from __future__ import annotations

import logging
import math
import os
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import ray

from fdam_ray.executors.errors import ClusterConnectionError
from fdam_ray.executors.ray import compat, ownership
from fdam_ray.executors.ray.startup import keeping_sigterm_handler, raise_if_stopped, start_private_ray
from fdam_ray.settings.redact import redact, redact_handlers, short

log = logging.getLogger(__name__)
T = TypeVar("T")

# The address of the cluster this process joined because `ray start` recorded it on this machine (no address
# given), for messages that suggest a private instance instead; None otherwise.
_joined_recorded: str | None = None


def joined_recorded_cluster() -> str | None:
    """The address of the ``ray start`` cluster of this machine this process joined without being given an
    address (:func:`ensure_ray`), else None."""
    return _joined_recorded if ray.is_initialized() else None

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


_HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"  # + empty SETTINGS


def what_answers(host: str, port: int, *, timeout_s: float = 5.0) -> str | None:
    """None when a gRPC (HTTP/2) server answers at ``host:port``, as Ray's GCS does; else what answered."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as conn:
            conn.sendall(_HTTP2_PREFACE)
            conn.settimeout(timeout_s)
            reply = conn.recv(256)
    except TimeoutError:
        return f"a program that accepted the connection but sent nothing back within {timeout_s:g} s"
    except OSError as exc:
        return f"a program that dropped the connection ({exc.strerror or exc})"
    if len(reply) >= 9 and reply[3] == 0x04:  # an HTTP/2 SETTINGS frame: gRPC, as a Ray GCS speaks
        return None
    if not reply:
        return "a program that closed the connection without a word"
    text = reply.decode("latin-1").splitlines()[0].strip() if reply.strip() else repr(reply[:40])
    if text.startswith("HTTP/") or text.lower().startswith(("<!doctype html", "<html")):
        return f"a web server ('{text[:60]}'; 8265 is Ray's dashboard and job port, not the one a driver joins)"
    return f"a program that is not Ray ('{text[:60]}')"


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
        raise ClusterConnectionError(f"address {short(address)} is not of the form host:port (e.g. 10.0.0.5:6379)")
    try:
        socket.create_connection(hp, timeout=connect_timeout_s).close()
    except OSError as exc:
        raise ClusterConnectionError(
            f"no Ray cluster answers at {redact(address)} ({redact(exc)}); start one with `ray start --head` or "
            "check the address"
        ) from None
    if os.environ.get("RAY_USE_TLS", "0").lower() not in ("1", "true"):  # a TLS GCS answers only after a handshake
        other = what_answers(*hp, timeout_s=connect_timeout_s)
        if other is not None:
            raise ClusterConnectionError(
                f"{redact(address)} is not a Ray cluster: {other} answered there; give the address of the head "
                "node's GCS (host:6379 by default; `ray start --head` prints it, `ray status` on the head shows it)")
    try:
        from ray.exceptions import AuthenticationError
    except ImportError:  # a Ray without token authentication: let ray.init report problems itself
        return
    probe = compat.gcs_probe(address, connect_timeout_s)
    if probe is None:  # a Ray without this client: let ray.init report problems itself
        return
    try:
        probe()
    except AuthenticationError:
        mode = os.environ.get("RAY_AUTH_MODE", "")
        if mode.lower() != "token":
            raise ClusterConnectionError(
                f"the Ray cluster at {redact(address)} requires token authentication but RAY_AUTH_MODE is "
                f"{mode or 'unset'}: {AUTH_HELP}"
            ) from None
        raise ClusterConnectionError(
            f"the Ray cluster at {redact(address)} refused this process's token (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH "
            "or ~/.ray/auth_token holds a different one); give it the cluster's token (`ray get-auth-token` "
            "on the head node)"
        ) from None
    except ray.exceptions.RpcError as exc:  # it speaks gRPC but not as a GCS does: Ray would wait for minutes
        first = (str(exc).strip().splitlines() or [""])[0][:200]
        raise ClusterConnectionError(
            f"the program at {address} did not answer as a Ray cluster's GCS within {connect_timeout_s:g} s "
            f"({first}); give the address of the head node's GCS (`ray status` on the head shows it)") from None
    except Exception as exc:  # any other failure: ray.init says more
        log.debug("probe of %s failed: %s", redact(address), redact(exc))


def ensure_ray(*, address: str | None, cpus_needed: float) -> bool:
    """Make sure this process is connected to Ray; returns True when this call started a local instance.

    Args:
        address: a cluster address (``host:port``, ``ray://...``, ``auto``); None uses ``RAY_ADDRESS``
            if set, else this user's ``ray start`` cluster of this machine, else starts a private local Ray.
        cpus_needed: logical CPUs the clients reserve; a local Ray declares at least this many (each
            client runs one torch thread, so more clients than cores still run).
    """
    redact_handlers(logging.getLogger("ray"))  # Ray's own log lines may name the address, password and all
    if ray.is_initialized():
        if address:
            log.info("reusing the Ray instance this process already runs (address=%s not used)", redact(address))
        return False
    address = address or os.environ.get("RAY_ADDRESS") or None
    _remember_recorded(None)
    if address == "auto":  # Ray would read the shared record itself, unchecked
        address, why = recorded_cluster()
        if address is None:
            raise ClusterConnectionError(f"address=auto: {why}; give the cluster's host:port, or leave address "
                                         "unset for a private local Ray")
    elif address is None:
        running = local_cluster()
        if running is not None:
            log.warning("joining the Ray cluster already running on this machine at %s (started by `ray start` "
                        "as this user); address=local starts a private Ray instead", running)
            address = running
            _remember_recorded(running)
            if not os.environ.get("RAY_AUTH_MODE") and _token_at_hand():
                _enable_token_mode()  # as Ray's own ray.init() does; the cluster's processes are this user's
    if address and address != "local":
        try:
            check_cluster_access(address)
        finally:  # a stop asked for meanwhile comes first
            raise_if_stopped(f"while joining the Ray cluster at {redact(address)}")
        log.info("connecting to the Ray cluster at %s", redact(address))
        with keeping_sigterm_handler(f"while joining the Ray cluster at {redact(address)}"):
            ray.init(address=address, **_shipped())  # never with start-up arguments: Ray refuses them when joining
        return False
    num_cpus = max(os.cpu_count() or 1, math.ceil(cpus_needed))
    log.info("starting a private local Ray instance (%d CPUs, every port on 127.0.0.1)", num_cpus)
    start_private_ray(num_cpus)
    return True


def _shipped() -> dict[str, Any]:
    """``runtime_env`` for a cluster joined by address: the modules of the current folder a ``module:attr``
    factory was found in (:func:`~fdam_ray.settings.factories.current_folder_modules`), as Ray's ``py_modules``, so that
    workers on other machines import them as this driver does."""
    from fdam_ray.settings.factories import current_folder_modules

    modules = current_folder_modules()
    if not modules:
        return {}
    log.info("shipping %s of the current folder to the cluster (Ray's runtime_env py_modules)",
             ", ".join(os.path.basename(m) for m in modules))
    return {"runtime_env": {"py_modules": modules}}


def _remember_recorded(address: str | None) -> None:
    global _joined_recorded
    _joined_recorded = address


def _enable_token_mode() -> None:
    """RAY_AUTH_MODE=token for this process, and Ray's cached config told so (it reads the variable once)."""
    if not compat.enable_token_auth():
        os.environ["RAY_AUTH_MODE"] = "token"


def _token_at_hand() -> bool:
    return bool(os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH")
                or (Path.home() / ".ray" / "auth_token").is_file())


def recorded_cluster() -> tuple[str | None, str]:
    """The address Ray recorded for the cluster started on this machine by ``ray start``, if that record and the
    process listening there are this user's (else None), and why not. The address is not connected to.

    Ray records it in ``ray_current_cluster`` in its temp folder (``RAY_TMPDIR``/ray, else /tmp/ray), which
    ``ray stop`` removes; a file left by a cluster that was killed names an address where nothing listens.
    """
    recorded = compat.ray_address_file()
    if recorded is None:
        return None, "this Ray does not say where it records the cluster of this machine"
    if not os.path.lexists(recorded):
        return None, f"no Ray cluster is recorded in {recorded}"
    problem = ownership.record_owner_problem(recorded)
    if problem is not None:
        return None, f"the cluster record {recorded} is not trusted: {problem}"
    try:
        address = Path(recorded).read_text(errors="replace")[:300].strip()
    except OSError as exc:
        return None, f"the cluster record {recorded} cannot be read ({exc.strerror or exc})"
    hp = _host_port(address)
    if hp is None:
        return None, f"the cluster record {recorded} holds no host:port"
    problem = ownership.listener_owner_problem(*hp)
    if problem is not None:
        return None, f"the cluster recorded in {recorded} at {address} is not joined: {problem}"
    return address, ""


def local_cluster() -> str | None:
    """The address of this user's cluster last started on this machine with ``ray start``, else None (saying
    why in a line when a record exists but is not trusted)."""
    address, why = recorded_cluster()
    if address is None and why.endswith("nothing listens there"):  # a cluster killed without `ray stop`
        log.info("%s; starting a private local Ray", why)
    elif address is None and not why.startswith("no Ray cluster is recorded"):
        log.warning("%s; starting a private local Ray (give --address to join a cluster)", why)
    return address


def run_task(fn: Callable[..., T], *args: Any, address: str | None, cpus_needed: float, timeout_s: float) -> T:
    """``fn(*args)`` as a Ray task of its own (no CPU reserved), on the instance :func:`ensure_ray` gives.

    Raises TimeoutError when it has not answered within ``timeout_s``.
    """
    ensure_ray(address=address, cpus_needed=cpus_needed)
    task = ray.remote(num_cpus=0, max_retries=0)(fn)
    try:
        return ray.get(task.remote(*args), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise TimeoutError(f"no answer within {timeout_s:g} s") from None


def assigned_cpus() -> float | None:
    """The CPUs Ray assigned to the actor this process runs, or None (no Ray, not in an actor, none given)."""
    if not ray.is_initialized():
        return None
    ctx = ray.get_runtime_context()
    if ctx.get_actor_id() is None:
        return None
    cpus = ctx.get_assigned_resources().get("CPU")
    return None if cpus is None else float(cpus)
