"""Which Ray cluster fdam joins when given no address, what it sends there, and where its private Ray listens.

The shared address record (``ray_current_cluster`` in Ray's temp folder) can be
written by any user of the machine: a record, or a listener at the address it
names, that is not this user's is ignored without a byte sent to it, and the
private Ray started instead listens on 127.0.0.1 only.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import pytest

from fdam_ray.executors.errors import ClusterConnectionError
from fdam_ray.executors.ray import compat, ownership, session


class Listener:
    """A plain TCP server on 127.0.0.1 that counts the connections it accepts (a planted 'cluster')."""

    def __init__(self) -> None:
        self.server = socket.socket()
        self.server.bind(("127.0.0.1", 0))
        self.server.listen(8)
        self.port = self.server.getsockname()[1]
        self.accepted: list[socket.socket] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                self.accepted.append(self.server.accept()[0])
            except OSError:
                return

    def close(self) -> None:
        try:
            self.server.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread, which holds the socket open
        except OSError:
            pass
        self.server.close()
        for conn in self.accepted:
            conn.close()


@pytest.fixture
def planted(tmp_path, monkeypatch):
    """A record naming a listener of this test, where fdam looks for Ray's record."""
    listener = Listener()
    record = tmp_path / "ray_current_cluster"
    record.write_text(f"127.0.0.1:{listener.port}")
    monkeypatch.setattr(compat, "ray_address_file", lambda: str(record))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    yield record, listener
    listener.close()


@pytest.fixture
def no_ray_start(monkeypatch):
    """Stand-ins for joining and starting Ray, and for switching token mode on: what was asked is recorded."""
    asked: dict[str, list] = {"join": [], "private": [], "token": []}
    monkeypatch.setattr(session.ray, "is_initialized", lambda: False)
    monkeypatch.setattr(session.ray, "init", lambda **kw: asked["join"].append(kw))
    monkeypatch.setattr(compat, "start_loopback_ray", lambda **kw: asked["private"].append(kw))
    monkeypatch.setattr(compat, "enable_token_auth", lambda: asked["token"].append(True) or True)
    monkeypatch.setattr(session, "_token_at_hand", lambda: True)
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    return asked


def test_a_record_of_another_user_is_ignored_and_its_address_never_contacted(planted, no_ray_start, monkeypatch,
                                                                             caplog):
    record, listener = planted
    monkeypatch.setattr(ownership, "this_user", lambda: os.getuid() + 4242)  # the record and listener: another's
    with caplog.at_level(logging.WARNING, logger="fdam_ray.executors.ray.session"):
        assert session.ensure_ray(address=None, cpus_needed=2) is True
    assert no_ray_start["join"] == [] and no_ray_start["token"] == []  # no join, no token
    assert len(no_ray_start["private"]) == 1
    time.sleep(0.3)
    assert listener.accepted == []  # not even a connection to see whether it answers
    assert f"the cluster record {record} is not trusted: it belongs to user id {os.getuid()}" in caplog.text
    assert "starting a private local Ray" in caplog.text


def test_a_record_of_this_user_naming_another_users_listener_is_ignored(planted, no_ray_start, monkeypatch, caplog):
    _, listener = planted
    real = ownership._proc_listeners
    monkeypatch.setattr(ownership, "_proc_listeners",
                        lambda port: [(addr, uid + 4242) for addr, uid in real(port) or []])
    with caplog.at_level(logging.WARNING, logger="fdam_ray.executors.ray.session"):
        assert session.ensure_ray(address=None, cpus_needed=2) is True
    assert no_ray_start["join"] == [] and no_ray_start["token"] == []
    time.sleep(0.3)
    assert listener.accepted == []
    assert f"runs as user id {os.getuid() + 4242}, not as this user" in caplog.text


SYSTEM_PYTHON = "/usr/bin/python3"  # one that another user may run (a virtual environment may be private)


@pytest.mark.skipif(os.getuid() != 0 or not os.path.exists(SYSTEM_PYTHON),
                    reason="starting a listener as another user needs root and a python that user may run")
def test_a_listener_really_run_by_another_user_is_ignored(planted, no_ray_start):
    record, _ = planted
    code = ("import socket, sys, time\ns = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen(4)\n"
            "print(s.getsockname()[1], flush=True)\ns.settimeout(20)\n"
            "try:\n    s.accept(); print('contacted', flush=True)\nexcept OSError:\n    pass\n")
    other = subprocess.Popen([SYSTEM_PYTHON, "-c", code], stdout=subprocess.PIPE, text=True, user=65534, cwd="/",
                             env={"PATH": "/usr/bin:/bin"})
    try:
        port = int(other.stdout.readline())
        record.write_text(f"127.0.0.1:{port}")
        assert session.local_cluster() is None
        assert session.ensure_ray(address=None, cpus_needed=2) is True
        assert no_ray_start["join"] == [] and no_ray_start["token"] == []
    finally:
        other.kill()
    assert "contacted" not in other.stdout.read()


def test_a_record_of_this_user_with_its_listener_is_joined_without_being_contacted_first(planted):
    _, listener = planted
    assert session.local_cluster() == f"127.0.0.1:{listener.port}"
    assert listener.accepted == []


def test_a_record_that_is_a_link_or_names_no_listener_is_not_joined(planted, tmp_path):
    record, listener = planted
    target = tmp_path / "elsewhere"
    target.write_text(record.read_text())
    record.unlink()
    record.symlink_to(target)
    assert session.recorded_cluster()[0] is None and "not a regular file" in session.recorded_cluster()[1]
    record.unlink()
    listener.close()
    record.write_text(f"127.0.0.1:{listener.port}")  # a cluster killed without `ray stop`
    assert session.recorded_cluster() == (None, f"the cluster recorded in {record} at 127.0.0.1:{listener.port} is "
                                                "not joined: nothing listens there")
    record.write_text("10.255.255.1:6379")  # not an address of this machine: its listener's owner is unknown
    assert "is not an address of this machine" in session.recorded_cluster()[1]


def test_address_auto_with_an_untrusted_record_is_refused_in_one_line(planted, no_ray_start, monkeypatch):
    _, listener = planted
    monkeypatch.setattr(ownership, "this_user", lambda: os.getuid() + 4242)
    with pytest.raises(ClusterConnectionError, match=r"^address=auto: the cluster record .* is not trusted"):
        session.ensure_ray(address="auto", cpus_needed=1)
    assert no_ray_start["join"] == [] and no_ray_start["private"] == [] and listener.accepted == []


def test_a_named_address_gets_the_token_only_as_the_user_set_it(planted, no_ray_start, monkeypatch):
    """An address the user named is joined as given: token mode is not switched on by fdam."""
    monkeypatch.setattr(session, "check_cluster_access", lambda address: None)
    session.ensure_ray(address="127.0.0.1:1", cpus_needed=1)
    assert no_ray_start["join"] == [{"address": "127.0.0.1:1"}] and no_ray_start["token"] == []


# -- the private instance listens on the loopback interface only ------------------------------------------------
LISTENING_SCRIPT = textwrap.dedent("""
    import os, socket, sys, threading
    from pathlib import Path
    import ray
    from fdam_ray.executors.ray import compat, ownership, session

    server = socket.socket(); server.bind(("127.0.0.1", 0)); server.listen(4)
    contacted = []
    threading.Thread(target=lambda: contacted.append(server.accept()), daemon=True).start()
    record = Path(sys.argv[1]) / "ray_current_cluster"
    record.write_text(f"127.0.0.1:{server.getsockname()[1]}")
    compat.ray_address_file = lambda: str(record)
    ownership.this_user = lambda: os.getuid() + 4242  # the planted record is another user's
    assert session.ensure_ray(address=None, cpus_needed=2) is True

    @ray.remote(num_cpus=1)
    class Probe:
        def pid(self):
            return os.getpid()

    probe = Probe.remote()
    ray.get(probe.pid.remote())

    def descendants(root):
        children = {}
        for proc in Path("/proc").iterdir():
            if proc.name.isdigit():
                try:
                    ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
                except (OSError, IndexError, ValueError):
                    continue
                children.setdefault(ppid, []).append(int(proc.name))
        out, todo = [], [root]
        while todo:
            for child in children.get(todo.pop(), []):
                out.append(child)
                todo.append(child)
        return out

    listening = {}
    for table in ("tcp", "tcp6"):
        for line in Path("/proc/net", table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A":
                listening[int(fields[9])] = ownership._proc_address(fields[1].split(":")[0])
    found = []
    for pid in [os.getpid(), *descendants(os.getpid())]:
        try:
            fds = list(Path(f"/proc/{pid}/fd").iterdir())
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:[") and int(target[8:-1]) in listening:
                found.append((pid, str(listening[int(target[8:-1])])))
    ray.shutdown()
    print("CONTACTED" if contacted else "NOT CONTACTED")
    for pid, address in found:
        print("LISTEN", pid, address)
""")


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads /proc/net/tcp")
def test_the_private_ray_started_instead_listens_on_127_0_0_1_only():
    temp = tempfile.mkdtemp(prefix="fdt", dir="/tmp")  # short: Ray's socket paths live under it
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env["RAY_TMPDIR"] = temp
    try:
        out = subprocess.run([sys.executable, "-c", LISTENING_SCRIPT, temp], capture_output=True, text=True,
                             timeout=240, env=env)
    finally:
        shutil.rmtree(temp, ignore_errors=True)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "NOT CONTACTED" in out.stdout
    listens = [line.split() for line in out.stdout.splitlines() if line.startswith("LISTEN")]
    assert len(listens) >= 5, out.stdout  # GCS, raylet, agents, the driver's and the actor's servers
    assert all(address == "127.0.0.1" for _, _, address in listens), out.stdout


# -- joining an address where something speaks gRPC but never answers as a GCS -------------------------------
class MuteGrpc(Listener):
    """Answers the HTTP/2 preface with a SETTINGS frame, as a gRPC server does, and then says nothing."""

    def _serve(self) -> None:
        while True:
            try:
                conn = self.server.accept()[0]
            except OSError:
                return
            self.accepted.append(conn)
            threading.Thread(target=self._mute, args=(conn,), daemon=True).start()

    @staticmethod
    def _mute(conn: socket.socket) -> None:
        try:
            conn.recv(4096)
            conn.sendall(b"\x00\x00\x00\x04\x00\x00\x00\x00\x00")
            while conn.recv(4096):
                pass
        except OSError:
            pass


JOIN = ["train", "--no-progress", "executor=ray", "dataset=synthetic", "model=mlp", "num_clients=1",
        "iterations=2"]


def _fdam(args: list[str], tmp_path: Path) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    return subprocess.Popen([sys.executable, "-m", "fdam_ray", "-v", *args, f"out_dir={tmp_path / 'runs'}"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow  # in CI's slow tier: 8 s; the other refused addresses stay in the default run
def test_an_address_that_speaks_grpc_but_is_no_gcs_fails_within_seconds_in_one_line(tmp_path):
    mute = MuteGrpc()
    try:
        t0 = time.monotonic()
        proc = _fdam([*JOIN, "--address", f"127.0.0.1:{mute.port}"], tmp_path)
        try:
            err = proc.communicate(timeout=120)[1]
        finally:
            if proc.poll() is None:
                proc.kill()
        took = time.monotonic() - t0
    finally:
        mute.close()
    assert proc.returncode == 2, err[-3000:]
    assert f"fdam: error: the program at 127.0.0.1:{mute.port} did not answer as a Ray cluster's GCS within 5 s" \
        in err
    assert took < 60 and "Traceback" not in err and not (tmp_path / "runs").exists()


@pytest.mark.slow
def test_sigterm_while_joining_an_address_is_acted_on(tmp_path):
    mute = MuteGrpc()
    try:
        proc = _fdam([*JOIN, "--address", f"127.0.0.1:{mute.port}"], tmp_path)
        try:
            deadline = time.monotonic() + 90
            while not mute.accepted and time.monotonic() < deadline:  # fdam is at the address
                time.sleep(0.2)
            assert mute.accepted, "fdam never reached the address"
            time.sleep(1.0)
            proc.send_signal(signal.SIGTERM)
            t0 = time.monotonic()
            err = proc.communicate(timeout=60)[1]
            took = time.monotonic() - t0
        finally:
            if proc.poll() is None:
                proc.kill()
    finally:
        mute.close()
    assert proc.returncode == 143, err[-3000:]
    assert f"fdam: received SIGTERM: stopped while joining the Ray cluster at 127.0.0.1:{mute.port}; nothing was " \
           "trained" in err
    assert took < 15, took  # the address is asked with 5 s limits; Ray alone would wait for minutes
