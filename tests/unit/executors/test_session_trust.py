"""Starting fdam's private local Ray on a busy machine, without starting Ray: the start call is replaced by one
that behaves as Ray's does there (starts server processes, then runs out of a fixed wait)."""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import signal
import subprocess
import sys
import time

import pytest

from fdam_ray.executors.ray import compat, session, startup

SLEEPER = [sys.executable, "-c", "import time; time.sleep(600)"]
RAY_TIMEOUT = ("The current node timed out during startup. This could happen because some of the raylet failed to "
               "startup or the GCS has become overloaded.")


def gone(pid: int) -> bool:
    """Whether ``pid`` is gone (a zombie nobody reaped is not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.fixture
def spawned():
    """The pids a test's start spawned; any still there at the end is ended (a failing test leaves nothing)."""
    pids: list[int] = []
    yield pids
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, ChildProcessError):
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)


@pytest.fixture
def services():
    return importlib.import_module("ray._private.services")


def test_a_private_ray_that_does_not_start_is_retried_once_its_processes_stopped_and_ends_in_one_line(
        monkeypatch, services, caplog, spawned):
    popen_before, get_node_before = services.ConsolePopen, services.get_node

    def start_on_a_busy_machine(**kwargs):
        assert kwargs["dashboard_host"] == "127.0.0.1"
        spawned.append(services.ConsolePopen(SLEEPER).pid)  # as Ray starts its GCS and raylet
        spawned.append(subprocess.Popen(SLEEPER).pid)  # any other process the start left
        time.sleep(0.4)
        raise Exception(RAY_TIMEOUT)  # Ray's fixed raylet wait

    monkeypatch.setattr(compat, "start_loopback_ray", start_on_a_busy_machine)
    monkeypatch.setattr(startup, "SAY_EVERY_S", 0.15, raising=False)
    caplog.set_level(logging.WARNING, logger="fdam_ray")
    with pytest.raises(RuntimeError) as failed:
        session.ensure_ray(address="local", cpus_needed=2)
    message = str(failed.value)
    assert "\n" not in message and "executor=inline" in message and "fewer Ray actors" in message, message
    assert "twice" in message
    assert len(spawned) == 4  # tried once more, and no more
    assert all(gone(pid) for pid in spawned), [p for p in spawned if not gone(p)]
    said = [r.getMessage() for r in caplog.records]
    assert any("still starting a private local Ray (attempt 1 of 2" in m for m in said), said
    assert any("trying once more" in m for m in said), said
    assert services.ConsolePopen is popen_before and services.get_node is get_node_before
    assert "RAY_gcs_server_port_wait_time_s" not in os.environ


def test_the_raylet_wait_is_bounded_by_fdam_not_by_rays_fixed_30_s(monkeypatch, services):
    asked: list[float] = []

    def not_registered(*args, **kwargs):
        asked.append(time.monotonic())
        raise RuntimeError("node not found")

    monkeypatch.setattr(services, "get_node", not_registered)
    monkeypatch.setattr(startup, "START_TIMEOUT_S", 0.6, raising=False)
    monkeypatch.setattr(compat, "start_loopback_ray", lambda **kw: services.get_node("127.0.0.1:1", "id"))
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"did not start within 0.6 s, twice"):
        session.ensure_ray(address="local", cpus_needed=1)
    assert 1.0 < time.monotonic() - started < 10 and len(asked) > 2
    assert services.get_node is not_registered


def test_a_start_that_fails_otherwise_is_not_retried_and_is_one_line(monkeypatch, services, spawned):

    def broken(**kwargs):
        spawned.append(services.ConsolePopen(SLEEPER).pid)
        raise OSError("[Errno 28] No space left on device: '/tmp/ray/session_x'")

    monkeypatch.setattr(compat, "start_loopback_ray", broken)
    with pytest.raises(RuntimeError, match=r"^a private local Ray failed to start \(OSError: .*No space"):
        session.ensure_ray(address="local", cpus_needed=1)
    assert len(spawned) == 1 and gone(spawned[0])


def test_rays_server_processes_get_a_session_of_their_own(monkeypatch, services):
    """A scheduler's SIGTERM to the job's process group must reach the driver only: Ray's processes (GCS, raylet
    and, through the raylet, the actors) end a run that is still writing its checkpoint."""
    procs: list = []

    def start(**kwargs):
        procs.append(services.ConsolePopen(SLEEPER))

    monkeypatch.setattr(compat, "start_loopback_ray", start)
    monkeypatch.setattr(startup, "_sessions", [], raising=False)
    monkeypatch.setattr(startup, "_registered", [True], raising=False)  # no exit-time clean-up in this process
    session.ensure_ray(address="local", cpus_needed=1)
    try:
        (proc,) = procs
        assert os.getpgid(proc.pid) == proc.pid != os.getpgid(0)
        assert os.getsid(proc.pid) == proc.pid
    finally:
        procs[0].kill()
        procs[0].wait()


def test_what_is_left_of_the_private_rays_sessions_is_ended_at_exit(monkeypatch, services):
    """Ray's shutdown ends the processes it started, not theirs: the raylet's agents waited a minute for a GCS
    that was gone. At exit (and on a second stop signal) what is left in their sessions is ended by pid."""
    procs: list = []
    script = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']);" \
             " print('ok', flush=True); time.sleep(600)"

    def start(**kwargs):
        procs.append(services.ConsolePopen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True))

    monkeypatch.setattr(compat, "start_loopback_ray", start)
    monkeypatch.setattr(startup, "_sessions", [], raising=False)
    monkeypatch.setattr(startup, "_registered", [True], raising=False)
    session.ensure_ray(address="local", cpus_needed=1)
    (raylet,) = procs
    try:
        assert raylet.stdout.readline().strip() == "ok"
        raylet.kill()  # as Ray's shutdown does
        raylet.wait()
        (agent,) = [int(p) for p in os.listdir("/proc") if p.isdigit() and _session_of(int(p)) == raylet.pid]
        startup.end_private_sessions()
        deadline = time.monotonic() + 5
        while _session_of(agent) == raylet.pid and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _session_of(agent) != raylet.pid
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(raylet.pid, signal.SIGKILL)


def _session_of(pid: int) -> int | None:
    try:
        return os.getsid(pid)
    except ProcessLookupError:
        return None
