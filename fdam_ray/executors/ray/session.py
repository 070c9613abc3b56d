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

A private instance is started with bounds fdam controls (:func:`start_private_ray`): Ray's own start-up
waits are fixed at 30 s, which a busy machine overruns; here an attempt may take ``START_TIMEOUT_S``, a line
says so every minute, a failed attempt has what it started stopped by pid and is tried once more, and a second
failure is one line saying what to do. Its server processes get sessions of their own, so a scheduler's
SIGTERM to the job's process group reaches the driver only (which stops at a round end with a checkpoint);
what is left of those sessions after Ray's shutdown (the raylet's agents) is ended by pid at exit.

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

import atexit
import contextlib
import logging
import math
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import ray

from fdam_ray import interrupts
from fdam_ray.executors.errors import ClusterConnectionError
from fdam_ray.executors.ray import compat, ownership
from fdam_ray.redact import redact, redact_handlers, short

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
            _raise_if_stopped(f"while joining the Ray cluster at {redact(address)}")
        log.info("connecting to the Ray cluster at %s", redact(address))
        with _keeping_sigterm_handler(f"while joining the Ray cluster at {redact(address)}"):
            ray.init(address=address, **_shipped())  # never with start-up arguments: Ray refuses them when joining
        return False
    num_cpus = max(os.cpu_count() or 1, math.ceil(cpus_needed))
    log.info("starting a private local Ray instance (%d CPUs, every port on 127.0.0.1)", num_cpus)
    start_private_ray(num_cpus)
    return True


class RayStartError(RuntimeError):
    """A private local Ray could not be started (what was started is stopped); the message says what to do."""


START_TIMEOUT_S = 120.0  # longest wait for a private local Ray to start, per attempt (Ray's own waits are 30 s)
SAY_EVERY_S = 60.0  # while it starts, a line this often
START_HINT = ("run with executor=inline (every client in this process, no Ray), or with fewer Ray actors "
              "(clients_per_actor=M hosts M clients in one actor)")


def start_private_ray(num_cpus: int) -> None:
    """Start a private local Ray (every port on 127.0.0.1, token authentication as Ray's default), its server
    processes in a session of their own (a scheduler's SIGTERM to the job's process group leaves them to the
    driver, which stops at a round end with its checkpoint; :func:`compat.bounded_start`).

    Ray's own start-up waits are fixed (30 s for its GCS, 30 s for the raylet), which a busy machine overruns.
    Here an attempt may take ``START_TIMEOUT_S``, with a line every ``SAY_EVERY_S`` while it waits; a failed
    attempt has every process it started stopped by pid, and the start is tried once more. A second failure is
    one :class:`RayStartError` line saying what to do.
    """
    for attempt in (1, 2):
        try:
            with _keeping_sigterm_handler("while a private local Ray started"):
                _start_attempt(num_cpus, attempt)
            return
        except Exception as exc:
            if not _timed_out(exc):
                if isinstance(exc, (RayStartError, ClusterConnectionError)) or type(exc).__module__.startswith(
                        "fdam_ray"):
                    raise
                raise RayStartError(f"a private local Ray failed to start ({_first_line(exc)}); every process it "
                                    f"started is stopped; {START_HINT}") from exc
            _raise_if_stopped("while a private local Ray started")
            if attempt == 1:
                log.warning("a private local Ray did not start within %g s (this machine is busy); every process "
                            "it started is stopped; trying once more", START_TIMEOUT_S)
                continue
            raise RayStartError(f"a private local Ray did not start within {START_TIMEOUT_S:g} s, twice (this machine "
                                f"is busy; every process it started is stopped): {START_HINT}") from None


def _start_attempt(num_cpus: int, attempt: int) -> None:
    """One attempt at starting a private local Ray; on any failure every process it started is stopped."""
    started: list[Any] = []  # the Popen of each server process Ray started
    before = _children()
    begun = time.monotonic()
    done = threading.Event()

    def say() -> None:
        while not done.wait(SAY_EVERY_S):
            log.warning("still starting a private local Ray (attempt %d of 2, %.0f s so far, giving up after %g s); "
                        "this machine is busy", attempt, time.monotonic() - begun, START_TIMEOUT_S)

    sayer = threading.Thread(target=say, name="fdam-ray-start", daemon=True)
    sayer.start()
    _end_sessions_at_exit()  # before Ray's own exit-time shutdown is registered, so it runs after it
    try:
        with compat.bounded_start(begun + START_TIMEOUT_S, started):
            compat.start_loopback_ray(num_cpus=num_cpus, dashboard_host="127.0.0.1")
        _sessions.extend(p.pid for p in started if _leads_own_group(p.pid))
    except BaseException:
        with contextlib.suppress(Exception):
            ray.shutdown()  # where the start got as far as connecting
        _stop_processes(started, _children() - before)
        raise
    finally:
        done.set()


_sessions: list[int] = []  # the session of each server process of a private Ray this process started
_registered: list[bool] = []


def _leads_own_group(pid: int) -> bool:
    try:
        return os.getpgid(pid) == pid != os.getpgid(0)
    except ProcessLookupError:
        return False


def _end_sessions_at_exit() -> None:
    """Once per process: at exit, after Ray's own shutdown (registered later, so run earlier), and on a second
    stop signal (which skips that shutdown): end what is left of the sessions of the private Ray's processes.
    Ray ends the processes it started itself, but not their children: the raylet's agents, which otherwise wait
    for a GCS that is gone (about a minute), and workers."""
    if _registered:
        return
    _registered.append(True)
    atexit.register(end_private_sessions)
    interrupts.before_exit_now(end_private_sessions)


def end_private_sessions() -> None:
    """Stop, by pid, every process left in the sessions of the private Ray's server processes (see
    :func:`_end_sessions_at_exit`); quick, and quiet."""
    if not _sessions:
        return
    sessions = set(_sessions)
    _sessions.clear()
    for pid, _, sid in list(_processes()):
        if sid in sessions:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


def _timed_out(exc: BaseException) -> bool:
    """Whether ``exc`` is a start-up wait that ran out (ours, or one of Ray's fixed ones)."""
    text = str(exc).lower()
    return isinstance(exc, TimeoutError) or "timed out" in text or "timeout" in text


def _first_line(exc: BaseException) -> str:
    line = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {redact(line)[:200]}".rstrip(": ")


def _processes() -> Iterator[tuple[int, int, int]]:
    """``(pid, parent pid, session id)`` of every process of this machine (read from /proc; none where there is
    no /proc)."""
    with contextlib.suppress(OSError):
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                with open(f"/proc/{entry.name}/stat", "rb") as f:
                    stat = f.read()
            except OSError:
                continue
            fields = stat[stat.rfind(b")") + 2:].split()  # after the command name: state, ppid, pgrp, session
            if len(fields) > 3:
                yield int(entry.name), int(fields[1]), int(fields[3])


def _children() -> set[int]:
    """The pids of this process's children."""
    me = os.getpid()
    return {pid for pid, parent, _ in _processes() if parent == me}


def _stop_processes(popens: list[Any], pids: set[int]) -> None:
    """Stop what a failed start started, by pid: each process Ray started (``popens``) with the session it leads
    (the raylet's workers and agents), and every other child of this process that appeared meanwhile (``pids``);
    then reap them."""
    by_pid = {p.pid: p for p in popens}
    for pid in {*by_pid, *pids}:
        popen = by_pid.get(pid)
        if popen is not None and popen.returncode is not None:
            continue  # ended and reaped: its pid may be another process's by now
        try:
            if os.getpgid(pid) == pid and pid != os.getpgid(0):
                os.killpg(pid, signal.SIGKILL)  # the session Ray's process leads: what it started too
            else:
                os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            continue
        except PermissionError:  # not ours after all
            continue
    deadline = time.monotonic() + 10
    for pid in {*by_pid, *pids}:
        popen = by_pid.get(pid)
        with contextlib.suppress(Exception):
            if popen is not None:
                popen.wait(timeout=max(0.1, deadline - time.monotonic()))
            else:
                _reap(pid, deadline)


def _reap(pid: int, deadline: float) -> None:
    while time.monotonic() < deadline:
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done:
            return
        time.sleep(0.02)


def _shipped() -> dict[str, Any]:
    """``runtime_env`` for a cluster joined by address: the modules of the current folder a ``module:attr``
    factory was found in (:func:`~fdam_ray.factories.current_folder_modules`), as Ray's ``py_modules``, so that
    workers on other machines import them as this driver does."""
    from fdam_ray.factories import current_folder_modules

    modules = current_folder_modules()
    if not modules:
        return {}
    log.info("shipping %s of the current folder to the cluster (Ray's runtime_env py_modules)",
             ", ".join(os.path.basename(m) for m in modules))
    return {"runtime_env": {"py_modules": modules}}


def _remember_recorded(address: str | None) -> None:
    global _joined_recorded
    _joined_recorded = address


def _raise_if_stopped(when: str) -> None:
    """Act on a stop asked for (SIGTERM under ``fdam train``) while getting a cluster: nothing has run yet."""
    from fdam_ray.outputs.run_folder import RunStopped, stop_requested

    reason = stop_requested()
    if reason is not None:
        raise RunStopped(f"{reason}: stopped {when}; nothing was trained", None)


@contextlib.contextmanager
def _keeping_sigterm_handler(when: str = "while Ray started") -> Iterator[None]:
    """``ray.init`` makes SIGTERM exit the driver at once (a C++ abort follows); keep a handler the caller set
    (``fdam train`` stops at a round end with a checkpoint). A SIGTERM that arrives during ``ray.init`` (Ray's
    handler: ``SystemExit``) stops the run there, in one line, where the caller had a handler of its own."""
    from fdam_ray.outputs.run_folder import RunStopped

    main = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGTERM) if main else None
    try:
        yield
    except SystemExit as exc:
        if exc.code != signal.SIGTERM or not callable(previous):
            raise
        raise RunStopped(f"received SIGTERM: stopped {when}; nothing was trained", None) from None
    finally:
        if main and callable(previous):
            signal.signal(signal.SIGTERM, previous)


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
