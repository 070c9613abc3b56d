"""Starting a private local Ray within bounds fdam controls, and stopping what it left.

Ray's own start-up waits are fixed (30 s for its GCS, 30 s for the raylet), which a busy machine overruns.
Here an attempt may take ``START_TIMEOUT_S``, a line says so every ``SAY_EVERY_S``, a failed attempt has every
process it started stopped by pid and is tried once more, and a second failure is one line saying what to do
(:func:`start_private_ray`). Ray's server processes get sessions of their own
(:func:`~fdam_ray.executors.ray.compat.bounded_start`), so a scheduler's SIGTERM to the job's process group reaches
the driver only (which stops at a round end with a checkpoint); what is left of those sessions after Ray's
shutdown (the raylet's agents) is ended by pid at exit (:func:`end_private_sessions`).

A stop asked for while Ray starts or is joined (:func:`raise_if_stopped`, :func:`keeping_sigterm_handler`) ends
the run there, in one line: nothing has been trained. :mod:`~fdam_ray.executors.ray.session` decides whether a
private instance is started at all.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import ray

from fdam_ray.executors.errors import ClusterConnectionError
from fdam_ray.executors.ray import compat
from fdam_ray.features import interrupts
from fdam_ray.features.interrupts import RunStopped, stop_requested
from fdam_ray.settings.redact import redact

log = logging.getLogger(__name__)


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
            with keeping_sigterm_handler("while a private local Ray started"):
                _start_attempt(num_cpus, attempt)
            return
        except Exception as exc:
            if not _timed_out(exc):
                if isinstance(exc, (RayStartError, ClusterConnectionError)) or type(exc).__module__.startswith(
                        "fdam_ray"):
                    raise
                raise RayStartError(f"a private local Ray failed to start ({_first_line(exc)}); every process it "
                                    f"started is stopped; {START_HINT}") from exc
            raise_if_stopped("while a private local Ray started")
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


def raise_if_stopped(when: str) -> None:
    """Act on a stop asked for (SIGTERM under ``fdam train``) while getting a cluster: nothing has run yet."""
    reason = stop_requested()
    if reason is not None:
        raise RunStopped(f"{reason}: stopped {when}; nothing was trained", None)


@contextlib.contextmanager
def keeping_sigterm_handler(when: str = "while Ray started") -> Iterator[None]:
    """``ray.init`` makes SIGTERM exit the driver at once (a C++ abort follows); keep a handler the caller set
    (``fdam train`` stops at a round end with a checkpoint). A SIGTERM that arrives during ``ray.init`` (Ray's
    handler: ``SystemExit``) stops the run there, in one line, where the caller had a handler of its own."""
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
