"""A consortium on one machine: TLS certificates, a SuperLink and one SuperNode per site on loopback.

What a real consortium runs on several machines (the SuperLink at the
coordinating centre, a SuperNode at each hospital, ``flwr run`` from a study
member's laptop), started here as local processes for the example and the
tests. Every process listens on a loopback address only (127.0.0.1 unless given
one: ``superlink_host``, ``site_hosts``) and every connection is TLS with
certificates this module makes (a throw-away certificate authority and a server
certificate for 127.0.0.1, localhost and the SuperLink's address). Node authentication is on, as a real
consortium runs it: the SuperLink admits only registered SuperNodes
(``--enable-supernode-auth``), each site gets its own EC key pair, its public key
is registered (``flwr supernode register``) and its SuperNode signs with the
private key (``--auth-supernode-private-key``). Processes are stopped by their
pid.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from fdam_ray.files.extras import extra_hint
from fdam_ray.flower import certs
from fdam_ray.flower.certs import Certificates, NodeKey

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
APP_NAME = "fdam-consortium"
STOP_GRACE_S = 20.0  # a process stopped with SIGTERM gets this long (or the consortium's timeout if shorter)


def make_certificates(folder: str | Path, ips: Sequence[str] = ()) -> Certificates:
    """A new certificate authority and a server certificate for 127.0.0.1, localhost and ``ips`` signed by it,
    valid one day, in ``folder`` (which must not hold them already; :func:`fdam_ray.flower.certs.make_certificates`
    makes a real consortium's)."""
    return certs.make_certificates(folder, dns=["localhost"], ips=list(dict.fromkeys([LOOPBACK, *ips])), days=1)


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port free on ``host`` (a loopback address) now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def write_app(folder: str | Path) -> Path:
    """A Flower App whose components are fdam-ray's ServerApp and ClientApp (the code is the installed fdam_ray)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "pyproject.toml").write_text(f"""[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "{APP_NAME}"
version = "1.0.0"
dependencies = []

[tool.hatch.build.targets.wheel]
packages = ["."]

[tool.flwr.app]
publisher = "fdam-ray"

[tool.flwr.app.components]
serverapp = "fdam_ray.flower.server_app:app"
clientapp = "fdam_ray.flower.client_app:app"

[tool.flwr.app.config]
study = ""
config = ""
run-dir = ""
result = ""
""", encoding="utf-8")
    (folder / "README.md").write_text("fdam-ray's CODASCA / CODA+ as a Flower App.\n", encoding="utf-8")
    return folder


def node_config_text(values: Mapping[str, Any]) -> str:
    """``--node-config`` text: ``key=value`` pairs, strings quoted."""
    def one(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, (int, float)):
            return str(v)
        return "'" + str(v).replace("'", "") + "'"

    return " ".join(f"{k}={one(v)}" for k, v in values.items())


class Consortium:
    """A SuperLink and one SuperNode per site, on 127.0.0.1 with TLS, in ``folder`` (logs, certificates, state).

    Args:
        folder: where everything this consortium writes goes.
        sites: one node config per site (``site``, ``data`` or ``source``, ``state-dir``, ...).
        timeout: seconds; every wait of the consortium comes from it: the SuperLink starting to listen, and a run
            (``flwr run`` submitting it, then the run writing its result; :meth:`run` may give its own). Its expiry
            is one :class:`TimeoutError` line naming it and the logs.
        node_auth: the SuperLink admits only SuperNodes whose public key was registered (each site's key pair is
            made here, in ``credentials-*/keys``, and registered when the consortium starts). False: any SuperNode
            that trusts the certificate authority gets in.
        superlink_host: the loopback address the SuperLink listens on (the certificate covers it).
        site_hosts: each site's SuperNode's loopback address (default: 127.0.0.1 for every site).
        host_env: (address, environment) -> the environment of a process of that address (e.g. one that makes
            it send from that address); None: every process gets the consortium's environment.
        database: the SuperLink's state file (``flower-superlink --database``): its registered keys, nodes and
            runs outlive a SuperLink restart (:meth:`restart_superlink`). None: in memory.

    Nothing differs on the nodes with SecAgg+ (the ClientApp always carries the SecAgg+ mod).
    """

    def __init__(self, folder: str | Path, sites: Sequence[Mapping[str, Any]], *, timeout: float = 900.0,
                 node_auth: bool = True, superlink_host: str = LOOPBACK, site_hosts: Sequence[str] = (),
                 host_env: Callable[[str, dict[str, str]], dict[str, str]] | None = None,
                 database: str | Path | None = None) -> None:
        self.timeout = _seconds(timeout)
        self.host, self.site_hosts, self.host_env = superlink_host, list(site_hosts), host_env
        self.database = None if database is None else Path(database)
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.node_auth = node_auth
        self.credentials = Path(tempfile.mkdtemp(prefix="credentials-", dir=self.folder))  # new ones every time
        self.certs = make_certificates(self.credentials / "tls", ips=[superlink_host])
        self.sites: list[dict[str, Any]] = []
        self.keys: list[NodeKey | None] = []
        self.node_ids: dict[int, int] = {}  # site index -> the node id its registration got
        self.port = free_port(superlink_host)
        self.processes: dict[str, subprocess.Popen] = {}
        self.home = self.folder / "flwr-home"
        bin_dir = str(Path(sys.executable).parent)  # Flower's processes start Flower's other commands by name
        self.env = {**os.environ, "FLWR_HOME": str(self.home), "PYTHONUNBUFFERED": "1", "FLWR_TELEMETRY_ENABLED": "0",
                    "PATH": bin_dir + os.pathsep + os.environ.get("PATH", "")}
        self.env.pop("RAY_ADDRESS", None)
        self._write_connection()
        for site in sites:
            self.add_site(site)

    def add_site(self, node_config: Mapping[str, Any], host: str | None = None) -> int:
        """Another SuperNode (its key pair made now, under node authentication) on ``host`` (default: its entry of
        ``site_hosts``, else 127.0.0.1); its index for :meth:`register` and :meth:`start_site`."""
        index = len(self.sites)
        if host is not None:
            self.site_hosts = [self.site_host(i) for i in range(index)] + [host]
        self.sites.append(dict(node_config))
        self.keys.append(certs.make_node_key(self.credentials / "keys", f"node{index}") if self.node_auth else None)
        return index

    def register(self, index: int) -> int:
        """``flwr supernode register`` the public key of SuperNode ``index`` with the running SuperLink; its node
        id."""
        key = self.keys[index]
        if key is None:
            raise ValueError("this consortium runs without node authentication: there is nothing to register")
        try:
            out = subprocess.run([self._bin("flwr"), "supernode", "register", str(key.public), "consortium",
                                  "--format", "json"], env=self.env, cwd=self.folder, capture_output=True, text=True,
                                 timeout=self.timeout)
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"flwr supernode register did not answer within the consortium's timeout="
                               f"{self.timeout:g} s; see {self.folder / 'superlink.log'}") from None
        try:
            node = int(json.loads(out.stdout)["node-id"])
        except (ValueError, KeyError, TypeError):
            raise RuntimeError(f"flwr supernode register {key.public} failed (exit code {out.returncode}): "
                               f"{_last_line(out.stderr + out.stdout)}") from None
        self.node_ids[index] = node
        log.info("SuperNode %d registered: node %d, key %s", index, node, key.fingerprint)
        return node

    def _write_connection(self) -> None:
        self.home.mkdir(parents=True, exist_ok=True)
        (self.home / "config.toml").write_text(f"""[superlink]
default = "consortium"

[superlink.consortium]
address = "{self.host}:{self.port}"
root-certificates = "{self.certs.ca}"
""", encoding="utf-8")

    def _bin(self, name: str) -> str:
        here = Path(sys.executable).parent / name
        found = str(here) if here.exists() else shutil.which(name)
        if found is None:
            raise FileNotFoundError(f"'{name}' is not installed: {extra_hint('flower', 'flwr')}")
        return found

    def site_host(self, index: int) -> str:
        return self.site_hosts[index] if index < len(self.site_hosts) else LOOPBACK

    def _start(self, key: str, args: list[str], host: str = LOOPBACK) -> subprocess.Popen:
        logfile = open(self.folder / f"{key}.log", "ab")  # the process holds it; closed here after the start
        env = self.env if self.host_env is None else self.host_env(host, dict(self.env))
        proc = subprocess.Popen(args, stdout=logfile, stderr=subprocess.STDOUT, env=env, cwd=self.folder,
                                start_new_session=True)
        logfile.close()
        self.processes[key] = proc
        log.info("%s started (pid %d)", key, proc.pid)
        return proc

    def superlink_args(self) -> list[str]:
        database = [] if self.database is None else ["--database", str(self.database)]
        return [self._bin("flower-superlink"), "--host", self.host, "--port", str(self.port), "--ssl-ca-certfile",
                str(self.certs.ca), "--ssl-certfile", str(self.certs.server_cert), "--ssl-keyfile",
                str(self.certs.server_key), *database, *(["--enable-supernode-auth"] if self.node_auth else [])]

    def start_superlink(self) -> None:
        self._start("superlink", self.superlink_args(), self.host)
        self._wait_port(self.port)

    def restart_superlink(self) -> None:
        """Start the SuperLink again on its port (after it stopped or was killed: :meth:`kill_process`); with a
        ``database`` it finds its registered keys there, else the sites are registered again."""
        self.stop_process("superlink")
        self.start_superlink()
        if self.node_auth and self.database is None:
            for i in list(self.node_ids):
                self.register(i)

    def site_args(self, index: int) -> list[str]:
        site, key, host = self.sites[index], self.keys[index], self.site_host(index)
        auth = [] if key is None else ["--auth-supernode-private-key", str(key.private)]
        return [self._bin("flower-supernode"), "--superlink", f"{self.host}:{self.port}", "--root-certificates",
                str(self.certs.ca), "--host", host, "--port", str(free_port(host)), *auth, "--node-config",
                node_config_text(site)]

    def start_site(self, index: int) -> subprocess.Popen:
        """Start SuperNode ``index`` (with its private key under node authentication; registered or not)."""
        return self._start(f"site{index}", self.site_args(index), self.site_host(index))

    def start(self) -> Consortium:
        self.start_superlink()
        for i in range(len(self.sites)):
            if self.node_auth:
                self.register(i)
            self.start_site(i)
        return self

    def stop_process(self, key: str, timeout: float | None = None) -> None:
        """Stop one process and the processes it started, each by its pid (SIGTERM, SIGKILL after ``timeout``;
        default: :data:`STOP_GRACE_S`, or the consortium's timeout if shorter).

        Flower starts some of its helpers detached, in sessions of their own, so they are found by their parent
        pid before anything is stopped."""
        proc = self.processes.pop(key, None)
        if proc is None:
            return
        timeout = min(STOP_GRACE_S, self.timeout) if timeout is None else timeout
        pids = [*_descendants(proc.pid), proc.pid] if proc.poll() is None else []
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and any(_alive(p) for p in pids):
            proc.poll()
            time.sleep(0.2)
        for pid in pids:
            if _alive(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(min(5.0, timeout))

    def kill_process(self, key: str) -> list[int]:
        """SIGKILL one process and every process below it at once (a crash, not a stop); the pids killed."""
        proc = self.processes.pop(key, None)
        if proc is None:
            return []
        pids = [proc.pid, *_descendants(proc.pid)]
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(10.0)
        return pids

    def stop(self) -> None:
        """Stop every process; then any process of this consortium that outlived the one that started it (a
        SuperNode that crashed leaves its detached SuperExec behind), found by this consortium's FLWR_HOME."""
        for key in [k for k in self.processes if k != "superlink"]:
            self.stop_process(key)
        self.stop_process("superlink")
        for pid in self.strays():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def strays(self, also: str = "") -> list[int]:
        """Live processes whose environment holds this consortium's FLWR_HOME (and the entry ``also``, e.g.
        ``NAME=value``) and that no process it holds started."""
        marks = [f"FLWR_HOME={self.home}".encode(), *([also.encode()] if also else [])]
        held = {p for proc in self.processes.values() if proc.poll() is None
                for p in (proc.pid, *_descendants(proc.pid))}
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) in held or int(entry.name) == os.getpid():
                continue
            with contextlib.suppress(OSError):
                env = (entry / "environ").read_bytes().split(b"\0")
                if _alive(int(entry.name)) and all(m in env for m in marks):
                    found.append(int(entry.name))
        return found

    def __enter__(self) -> Consortium:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _wait_port(self, port: int) -> None:
        timeout = self.timeout
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for key, proc in self.processes.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"{key} exited with code {proc.returncode}; see {self.folder / (key + '.log')}")
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                if s.connect_ex((self.host, port)) == 0:
                    return
            time.sleep(0.5)
        raise TimeoutError(f"nothing listens on {self.host}:{port} within the consortium's timeout={timeout:g} s; see "
                           f"{self.folder / 'superlink.log'} (on a busy machine, give a longer timeout)")

    def run(self, app: str | Path, config: str | Path, result: str | Path, *, timeout: float | None = None,
            run_dir: str | Path | None = None) -> None:
        """``flwr run`` the app with the study the config file holds, shipped in the run config (its text, not its
        path: :func:`write_run_config`); wait until the result file is written. ``run_dir``: the server's run
        folder (one that holds a checkpoint: the study continues from it).

        ``timeout`` (default: the consortium's) bounds the whole run, the submission included: past it, one
        :class:`TimeoutError` line names it and the logs."""
        timeout = self.timeout if timeout is None else _seconds(timeout)
        deadline = time.monotonic() + timeout
        overrides = write_run_config(self.folder / "run-config.toml", config, result=Path(result).resolve(),
                                     run_dir=None if run_dir is None else Path(run_dir).resolve())
        log_path = self.folder / "flwr-run.log"
        try:
            out = subprocess.run([self._bin("flwr"), "run", str(app), "consortium", "--run-config", str(overrides)],
                                 env=self.env, cwd=self.folder, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            log_path.write_text(_text(exc.stdout) + _text(exc.stderr), encoding="utf-8")
            raise TimeoutError(self._expired(timeout, "`flwr run` had not submitted the run")) from None
        log_path.write_text(out.stdout + out.stderr, encoding="utf-8")
        if out.returncode != 0:
            raise RuntimeError(f"flwr run failed (exit code {out.returncode}): {_last_line(out.stderr + out.stdout)}; "
                               f"see {log_path}")
        while not Path(result).exists():
            if time.monotonic() > deadline:
                raise TimeoutError(self._expired(timeout, "the run was submitted"))
            if self.processes.get("superlink") is not None and self.processes["superlink"].poll() is not None:
                raise RuntimeError(f"the SuperLink exited; see {self.folder / 'superlink.log'}")
            time.sleep(min(1.0, max(0.0, deadline - time.monotonic()) + 0.01))

    def _expired(self, timeout: float, where: str) -> str:
        return (f"the consortium's run wrote no result within timeout={timeout:g} s ({where}); see the logs in "
                f"{self.folder} (on a busy machine, give a longer timeout)")


def write_run_config(path: str | Path, config: str | Path, *, result: str | Path | None = None,
                     run_dir: str | Path | None = None) -> Path:
    """The run config file ``flwr run --run-config`` reads: the study config's text (``study``), the server's run
    folder (``run-dir``) and result file (``result``), each a path on the SuperLink host."""
    import tomli_w  # Flower's own dependency

    try:
        study = Path(config).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"the study's config file '{config}' cannot be read ({type(exc).__name__}: "
                         f"{getattr(exc, 'strerror', None) or exc})") from None
    values = {"study": study, "result": "" if result is None else str(result),
              "run-dir": "" if run_dir is None else str(run_dir)}
    path = Path(path)
    path.write_text(tomli_w.dumps(values, multiline_strings=True), encoding="utf-8")
    return path


def _seconds(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"timeout: {value!r} is not allowed (a finite number of seconds > 0)")
    return float(value)


def _text(value: str | bytes | None) -> str:
    if value is None:
        return ""
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1][-300:] if lines else "no output"


def _children() -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        out.setdefault(ppid, []).append(int(entry.name))
    return out


def _descendants(pid: int) -> list[int]:
    """The pids of every process below ``pid`` (children first listed deepest last)."""
    children, found, todo = _children(), [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"
