"""Cluster use: the deploy config passes Ray's validation; a real local cluster runs federations by address
and by ``ray job submit``, with token authentication, and is stopped afterwards."""

from __future__ import annotations

import copy
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
BIN = os.path.dirname(sys.executable)
SMALL_RUN = ["--no-progress", "num_clients=2", "cpus_per_client=0.5", "iterations=20", "eval_every=10",
             "local_steps=5", "model=mlp"]


def test_deploy_config_passes_rays_own_validation():
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = yaml.safe_load((ROOT / "deploy" / "aws-gpu.yaml").read_text())
    prepared = prepare_config(copy.deepcopy(config))
    validate_config(prepared)  # what `ray up` checks
    workers = prepared["available_node_types"]["gpu_worker"]
    assert workers["node_config"]["InstanceType"].startswith("g")  # GPU instances
    assert any("pip install" in c and "fdam-ray" in c for c in prepared["setup_commands"])
    assert all("RAY_AUTH_MODE=token" in " ".join(prepared[k]) for k in ("head_start_ray_commands",
                                                                           "worker_start_ray_commands"))
    broken = copy.deepcopy(config)
    broken["available_node_types"]["gpu_worker"]["max_worker"] = 4  # a typo
    with pytest.raises(Exception, match="max_worker"):
        validate_config(prepare_config(broken))


def _free_port() -> int:
    return _free_ports(1)[0]


def _free_ports(n: int) -> list[int]:
    """``n`` free ports on 127.0.0.1, all different: the sockets are held open together while they are chosen
    (chosen one at a time, a port just closed can come back, and Ray refuses two components on one port)."""
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


def _ours(temp: str) -> list[int]:
    out = subprocess.run(["ps", "-eo", "pid=,args="], capture_output=True, text=True).stdout
    return [int(line.split(None, 1)[0]) for line in out.splitlines() if temp in line]


@pytest.fixture(scope="module")
def cluster():
    """A head node on 127.0.0.1 with its own temp dir and ports, token auth on; stopped afterwards."""
    temp = tempfile.mkdtemp(prefix="fdr", dir="/tmp")  # short: Ray's socket paths live under it
    token = secrets.token_hex(16)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env["PATH"] = BIN + os.pathsep + env.get("PATH", "")
    env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token)
    named = ("ray-client-server-port", "node-manager-port", "object-manager-port", "metrics-export-port",
             "dashboard-agent-listen-port", "dashboard-agent-grpc-port", "runtime-env-agent-port")
    gcs, dashboard, *others = _free_ports(2 + len(named))
    ports = {"port": gcs, "dashboard-port": dashboard, **dict(zip(named, others, strict=True))}
    cmd = [os.path.join(BIN, "ray"), "start", "--head", "--block", "--node-ip-address=127.0.0.1", "--num-cpus=2",
           f"--temp-dir={temp}", "--dashboard-host=127.0.0.1", "--disable-usage-stats",
           *[f"--{k}={v}" for k, v in ports.items()]]
    with open(os.path.join(temp, "ray-start.log"), "w") as log:
        head = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        while not (_listening(gcs) and _listening(dashboard)):
            assert head.poll() is None, Path(temp, "ray-start.log").read_text()
            assert time.monotonic() < deadline, "the local cluster did not come up in 90 s"
            time.sleep(0.3)
        yield {"address": f"127.0.0.1:{gcs}", "dashboard": f"http://127.0.0.1:{dashboard}", "env": env,
               "temp": temp}
    finally:
        head.send_signal(signal.SIGTERM)  # `ray start --block` stops the node's processes on SIGTERM
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            head.kill()
        time.sleep(1)
        for pid in _ours(temp):  # anything of this cluster that outlived its head
            os.kill(pid, signal.SIGKILL)
        assert not _ours(temp)
        shutil.rmtree(temp, ignore_errors=True)


def _fdam(args: list[str], env: dict, timeout: int = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fdam_ray", *args], env=env, capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


def test_a_driver_without_the_token_is_told_what_to_set_at_once(cluster):
    env = {k: v for k, v in cluster["env"].items() if not k.startswith("RAY_AUTH")}
    t0 = time.monotonic()
    r = _fdam(["train", "--address", cluster["address"], *SMALL_RUN, f"out_dir={cluster['temp']}/runs"], env)
    assert r.returncode == 2, r.stderr
    assert "requires token authentication" in r.stderr and "RAY_AUTH_MODE=token" in r.stderr
    assert "RAY_AUTH_TOKEN" in r.stderr and "ray get-auth-token" in r.stderr
    assert time.monotonic() - t0 < 20  # Ray alone waits ~20 s and says only "Failed to connect"
    assert not Path(cluster["temp"], "runs").exists()


@pytest.mark.slow
def test_a_driver_connecting_by_address_trains_on_the_cluster(cluster):
    r = _fdam(["train", "--address", cluster["address"], *SMALL_RUN, f"out_dir={cluster['temp']}/runs",
               "run_name=by-address"], cluster["env"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "executor ray" in r.stdout and "Connecting to existing Ray cluster" in r.stderr
    summary = json.loads(Path(cluster["temp"], "runs", "by-address", "summary.json").read_text())
    assert summary["rounds"] == 4 and summary["iterations"] == 20


@pytest.mark.slow
def test_ray_job_submit_runs_a_federation_on_the_cluster(cluster):
    out = Path(cluster["temp"], "runs")
    cmd = [os.path.join(BIN, "ray"), "job", "submit", "--address", cluster["dashboard"], "--",
           "fdam", "train", *SMALL_RUN, f"out_dir={out}", "run_name=job"]
    r = subprocess.run(cmd, env=cluster["env"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    assert "succeeded" in r.stdout + r.stderr
    summary = json.loads((out / "job" / "summary.json").read_text())
    assert summary["rounds"] == 4


@pytest.mark.slow  # in CI's slow tier: a private Ray, 10 s
def test_without_an_address_a_local_ray_starts_with_its_dashboard_on_localhost():
    code = (
        "import ray\n"
        "from fdam_ray.executors.ray.session import ensure_ray\n"
        "assert ensure_ray(address=None, cpus_needed=3) is True\n"
        "assert ensure_ray(address=None, cpus_needed=3) is False  # the second call reuses it\n"
        "print(ray.cluster_resources()['CPU'], ray.get_runtime_context().gcs_address)\n"
        "print(ray._private.worker.global_worker.node.address_info['webui_url'])\n"
        "ray.shutdown()\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    cpus, webui = out.stdout.split("\n")[0].split()[0], out.stdout.split("\n")[1]
    assert float(cpus) >= 3  # at least what the clients reserve, even on a 2-core machine
    assert webui.startswith("127.0.0.1:")


def test_ray_address_from_the_environment_is_checked_before_connecting():
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env["RAY_ADDRESS"] = f"127.0.0.1:{_free_port()}"  # nothing listens there
    t0 = time.monotonic()
    r = _fdam(["train", *SMALL_RUN, "out_dir=/nonexistent/never"], env, timeout=120)
    assert r.returncode == 2 and f"no Ray cluster answers at {env['RAY_ADDRESS']}" in r.stderr, r.stderr[-2000:]
    assert time.monotonic() - t0 < 30
