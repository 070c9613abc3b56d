"""Faults a cluster job meets: a second writer on a live run folder, a killed driver, SIGTERM, a foreign port.

Each test drives a real ``fdam`` process (``python -m fdam_ray``) and stops
everything it started by its own pid.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from raytest import free_ports
from testpath import TEST_PATH

from fdam_ray.checkpoint import load_checkpoint
from fdam_ray.cli import main

SMALL = ["dataset=synthetic", "model=mlp", "model.width=8", "num_clients=2", "samples_per_client=100",
         "local_steps=2", "stage_length=100000", "eval_every=40", "tensorboard=false"]


def but(items: list[str], *keys: str) -> list[str]:
    """``items`` without the overrides of ``keys`` (a key is given once on the command line)."""
    return [item for item in items if item.partition("=")[0] not in keys]


def start_fdam(args: list[str], cwd: Path, log: Path) -> subprocess.Popen:
    env = {**os.environ, "RAY_ADDRESS": "", "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-m", "fdam_ray", *args], cwd=cwd, env=env, stdout=log.open("w"),
                            stderr=subprocess.STDOUT, start_new_session=True)


def wait_for(condition, proc: subprocess.Popen, log: Path, timeout_s: float = 120) -> None:
    deadline = time.time() + timeout_s
    while not condition():
        assert proc.poll() is None, f"the run ended early:\n{log.read_text()[-3000:]}"
        assert time.time() < deadline, f"timed out:\n{log.read_text()[-3000:]}"
        time.sleep(0.1)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)


def records(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def test_a_second_writer_on_a_live_run_folder_is_refused_and_a_killed_runs_lock_does_not_block(tmp_path, capsys):
    run = tmp_path / "runs" / "live"
    proc = start_fdam(["train", f"out_dir={tmp_path / 'runs'}", "run_name=live", "executor=inline",
                       "iterations=200000", "checkpoint_every=1", *SMALL], tmp_path, tmp_path / "live.log")
    try:
        wait_for(lambda: len(records(run)) >= 2, proc, tmp_path / "live.log")
        before = (run / "metrics.jsonl").read_text()
        holder = f"process {proc.pid} on host {socket.gethostname()}"
        assert main(["train", "--resume", str(run)]) == 2
        err = capsys.readouterr().err
        assert f"run folder '{run}' is in use by {holder}" in err and err.count("\n") == 1
        assert main(["train", f"out_dir={tmp_path / 'runs'}", "run_name=live", "executor=inline", *SMALL]) == 2
        assert f"is in use by {holder}" in capsys.readouterr().err
        assert (run / "metrics.jsonl").read_text().startswith(before)  # the live run's records are untouched
    finally:
        stop(proc)  # SIGKILL: the lock file stays, with the dead process in it
    assert str(proc.pid) in (run / ".lock").read_text()
    done = load_checkpoint(run / "checkpoint.pt").loop.state.iteration
    assert main(["train", "--resume", str(run), f"iterations={done + 20}", "--quiet"]) == 0
    lines = records(run)
    assert lines[-1]["iteration"] == done + 20
    assert [r["iteration"] for r in lines] == sorted({r["iteration"] for r in lines})  # no duplicate, no stray line


@dataclasses.dataclass
class Head:
    env: dict  # the environment of a process of this cluster's machine (its RAY_TMPDIR, its HOME)
    address: str  # the GCS address ray start recorded
    dashboard: str | None  # the job submission address, when the dashboard runs


@pytest.fixture
def ray_head(request):
    """A `ray start --head` cluster of this machine, on free ports, recorded in a temp folder of its own.

    RAY_TMPDIR points Ray (and the fdam processes given ``env``) at that folder, so the
    test neither sees nor disturbs other Ray instances of the machine; HOME points into it
    too. Indirect parameter ``True``: with the dashboard (for ``ray job submit``). Stopped by pid.
    """
    import tempfile

    tmp = Path(tempfile.mkdtemp(prefix="fdr", dir="/tmp"))  # short: Ray's socket paths live under it
    (tmp / "home" / ".ray").mkdir(parents=True)
    token = Path.home() / ".ray" / "auth_token"
    if token.exists():  # the machine's token, so that clients of this cluster find it in the new HOME
        (tmp / "home" / ".ray" / "auth_token").write_bytes(token.read_bytes())
    env = {**os.environ, "RAY_TMPDIR": str(tmp), "RAY_ADDRESS": "", "PYTHONUNBUFFERED": "1",
           "HOME": str(tmp / "home")}
    ports = ["--port", "--ray-client-server-port", "--dashboard-agent-listen-port", "--dashboard-agent-grpc-port",
             "--runtime-env-agent-port", "--metrics-export-port", "--node-manager-port", "--object-manager-port"]
    dashboard = None
    chosen = free_ports(len(ports) + 1)  # the last one: the dashboard's
    if getattr(request, "param", False):
        dashboard = f"http://127.0.0.1:{chosen[-1]}"
        ports_and_dashboard = ["--include-dashboard=true", "--dashboard-host=127.0.0.1",
                               f"--dashboard-port={dashboard.rsplit(':', 1)[1]}"]
    else:
        ports_and_dashboard = ["--include-dashboard=false"]
    ray_cli = str(Path(sys.executable).with_name("ray"))
    head = subprocess.Popen([ray_cli, "start", "--head", "--block", *ports_and_dashboard, "--num-cpus=2",
                             "--disable-usage-stats",
                             *(f"{p}={port}" for p, port in zip(ports, chosen[:-1], strict=True))],
                            env=env, cwd=tmp, stdout=(tmp / "head.log").open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    recorded = tmp / "ray" / "ray_current_cluster"
    try:
        deadline = time.time() + 120
        while not (recorded.exists() and recorded.read_text().strip()):
            assert head.poll() is None and time.time() < deadline, (tmp / "head.log").read_text()[-2000:]
            time.sleep(0.2)
        yield Head(env, recorded.read_text().strip(), dashboard)
    finally:
        if head.poll() is None:
            os.killpg(head.pid, signal.SIGTERM)
            try:
                head.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        for pid in _pids_using(tmp):  # what the head started and left: the group, and any process under tmp
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if head.poll() is None:
            head.wait(timeout=30)


def _pids_using(folder: Path) -> list[int]:
    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if str(folder) in (proc / "cmdline").read_bytes().decode(errors="replace"):
                    pids.append(int(proc.name))
            except OSError:
                continue
    return pids


@pytest.mark.slow  # about a minute: a Ray head, two drivers
def test_a_ray_start_cluster_of_this_machine_is_joined_and_address_local_starts_a_private_one(ray_head, tmp_path):
    env, address = ray_head.env, ray_head.address
    args = [sys.executable, "-m", "fdam_ray", "train", "executor=ray", *but(SMALL, "local_steps"), "iterations=10",
            "local_steps=5", f"out_dir={tmp_path}", "--quiet"]
    joined = subprocess.run(args, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert joined.returncode == 0, joined.stderr[-3000:]
    assert f"joining the Ray cluster already running on this machine at {address}" in joined.stderr
    assert "num_cpus" not in joined.stderr
    private = subprocess.run([*args, "address=local"], env=env, cwd=tmp_path, capture_output=True, text=True,
                             timeout=240)
    assert private.returncode == 0, private.stderr[-3000:]
    assert "joining" not in private.stderr


@pytest.mark.slow
def test_an_address_where_something_else_listens_fails_fast_saying_what_answered(tmp_path):
    import threading

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    port = server.getsockname()[1]
    held = []

    def accept_and_say_nothing() -> None:
        while True:
            try:
                held.append(server.accept()[0])
            except OSError:
                return

    threading.Thread(target=accept_and_say_nothing, daemon=True).start()
    try:
        t0 = time.time()
        out = subprocess.run([sys.executable, "-m", "fdam_ray", "train", "--address", f"127.0.0.1:{port}",
                              "executor=ray", *SMALL, "iterations=10", f"out_dir={tmp_path / 'runs'}"],
                             env={**os.environ, "RAY_ADDRESS": ""}, capture_output=True, text=True, timeout=60)
        took = time.time() - t0
    finally:
        server.close()
        for conn in held:
            conn.close()
    assert out.returncode == 2 and took < 30, (took, out.stderr[-2000:])
    err = [line for line in out.stderr.splitlines() if line.startswith("fdam:")]
    assert err == [f"fdam: error: 127.0.0.1:{port} is not a Ray cluster: a program that accepted the connection "
                   "but sent nothing back within 5 s answered there; give the address of the head node's GCS "
                   "(host:6379 by default; `ray start --head` prints it, `ray status` on the head shows it)"]
    assert not (tmp_path / "runs").exists()


def test_a_web_server_at_the_address_is_named_as_one():
    import http.server
    import threading

    from fdam_ray.executors.errors import ClusterConnectionError
    from fdam_ray.executors.ray.session import check_cluster_access

    server = http.server.HTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with pytest.raises(ClusterConnectionError, match=r"is not a Ray cluster: a web server \('"):
            check_cluster_access(f"127.0.0.1:{server.server_address[1]}")
    finally:
        server.shutdown()
        server.server_close()


# no periodic checkpoint
STOPPABLE = [*but(SMALL, "eval_every"), "iterations=2000", "eval_every=250", "checkpoint_every=100000"]


def stop_with_sigterm_and_resume(tmp_path: Path, executor: list[str]) -> None:
    import numpy as np
    import torch

    assert main(["train", f"out_dir={tmp_path}", "run_name=whole", "executor=inline", *STOPPABLE, "--quiet"]) == 0
    run = tmp_path / "cut"
    proc = start_fdam(["train", f"out_dir={tmp_path}", "run_name=cut", *executor, *STOPPABLE], tmp_path,
                      tmp_path / "cut.log")
    try:
        wait_for(lambda: len(records(run)) >= 2, proc, tmp_path / "cut.log", timeout_s=180)
        proc.send_signal(signal.SIGTERM)  # to the driver alone, as a scheduler's first notice
        rc = proc.wait(timeout=120)
    finally:
        stop(proc)
    output = (tmp_path / "cut.log").read_text()
    assert rc == 143, output[-3000:]
    assert "received SIGTERM: stopped after round" in output and f"fdam train --resume {run}" in output
    assert "Traceback" not in output and "core dumped" not in output.lower()
    log = (run / "train.log").read_text()
    assert "run stopped: received SIGTERM: stopped after round" in log
    stopped_at = load_checkpoint(run / "checkpoint.pt").loop.state.iteration
    assert 0 < stopped_at < 2000 and not (run / "model.pt").exists()
    assert main(["train", "--resume", str(run), "executor=inline", "--quiet"]) == 0
    whole, resumed = (torch.load(tmp_path / n / "model.pt", weights_only=True) for n in ("whole", "cut"))
    for key, value in whole["model"].items():
        np.testing.assert_array_equal(resumed["model"][key].numpy(), value.numpy(), err_msg=key)
    for key in ("a", "b", "alpha"):
        np.testing.assert_array_equal(resumed[key].numpy(), whole[key].numpy(), err_msg=key)
    timing = {"wall_s", "samples_per_s"}
    assert ([{k: v for k, v in r.items() if k not in timing} for r in records(run)]
            == [{k: v for k, v in r.items() if k not in timing} for r in records(tmp_path / "whole")])


@pytest.mark.slow  # in CI's slow tier: the default run keeps the SIGINT case below
def test_sigterm_stops_an_inline_run_at_a_round_end_with_a_checkpoint_and_resume_ends_bit_identical(tmp_path):
    stop_with_sigterm_and_resume(tmp_path, ["executor=inline"])


@pytest.mark.parametrize("transport", [  # classic: CI's one fault case; the others in benchmarks/fault_tests.py
    pytest.param("classic", marks=pytest.mark.slow), pytest.param("compiled", marks=pytest.mark.fault),
    pytest.param("collective", marks=pytest.mark.fault)])
def test_sigterm_stops_a_ray_run_the_same_way(tmp_path, transport):
    # fold_order=client (and the compiled transport's actor order) make the Ray run the inline run bit for bit,
    # so the inline reference holds
    stop_with_sigterm_and_resume(tmp_path, ["executor=ray", "fold_order=client", "cpus_per_actor=0.5",
                                            f"transport={transport}"])


@pytest.mark.slow
def test_sigint_stops_a_run_and_resume_from_its_last_checkpoint_ends_bit_identical(tmp_path):
    import numpy as np
    import torch

    steps = [*but(SMALL, "eval_every"), "iterations=2000", "eval_every=250", "checkpoint_every=20"]
    assert main(["train", f"out_dir={tmp_path}", "run_name=whole", "executor=inline", *steps, "--quiet"]) == 0
    run = tmp_path / "cut"
    proc = start_fdam(["train", f"out_dir={tmp_path}", "run_name=cut", "executor=inline", *steps], tmp_path,
                      tmp_path / "cut.log")
    try:
        wait_for(lambda: len(records(run)) >= 2, proc, tmp_path / "cut.log", timeout_s=180)
        proc.send_signal(signal.SIGINT)  # Ctrl+C
        rc = proc.wait(timeout=120)
    finally:
        stop(proc)
    output = (tmp_path / "cut.log").read_text()
    assert rc == 130 and "fdam: interrupted" in output and "Traceback" not in output, output[-3000:]
    assert 0 < load_checkpoint(run / "checkpoint.pt").loop.state.iteration < 2000
    assert not (run / "model.pt").exists()
    assert main(["train", "--resume", str(run), "executor=inline", "--quiet"]) == 0
    whole, resumed = (torch.load(tmp_path / n / "model.pt", weights_only=True) for n in ("whole", "cut"))
    for key, value in whole["model"].items():
        np.testing.assert_array_equal(resumed["model"][key].numpy(), value.numpy(), err_msg=key)


DAMAGED_RUN = """
import sys
import time
from sample_clients import gaussian_clients
from raytest import DamagedSource
from fdam_ray.config import build_config
from fdam_ray.data.arrays import ArraysSource
from fdam_ray.assembly.recipe import run

clients, test = gaussian_clients(num_clients=4)
config = build_config(dict(model="mlp", model_width=8, batch_size=4, eval_every=2, seed=2, lr=0.2, local_steps=2,
                           cpus_per_actor=0.5, dataset="arrays", num_clients=4, executor="ray", iterations=200,
                           transport=sys.argv[1]))
try:
    run(config, source=DamagedSource(ArraysSource(clients, test)), save=False)
except ValueError as exc:
    print("stopped:", str(exc).splitlines()[0], file=sys.stderr)
    time.sleep(4)  # a process that goes on (a notebook, a sweep): Ray reports unfetched errors meanwhile
    sys.exit(2)
"""


@pytest.mark.parametrize("transport", ["classic", "compiled", "collective"])
@pytest.mark.fault  # in benchmarks/fault_tests.py, not the CI tiers
def test_a_clients_data_error_mid_round_under_ray_prints_one_error_and_no_unhandled_ray_tracebacks(tmp_path,
                                                                                                   transport):
    # every client's files turn out damaged within a few rounds: the first error stops the run, and the calls
    # of the other clients still in flight (which fail the same way) must not reach stderr as Ray's
    # "Unhandled error" tracebacks
    path = os.pathsep.join([TEST_PATH, os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "RAY_ADDRESS": "", "PYTHONPATH": path}
    proc = subprocess.run([sys.executable, "-c", DAMAGED_RUN, transport], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 2, proc.stderr[-3000:]
    # whichever client's error reaches the driver first stops the run (several fail in the same round)
    assert re.search(r"stopped: client [0-3] failed in round \d+", proc.stderr), proc.stderr[-3000:]
    assert "the file is truncated" in proc.stderr
    assert "Unhandled error" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-3000:]


@pytest.mark.slow  # about a minute: a Ray head with its dashboard, one job
@pytest.mark.parametrize("ray_head", [True], indirect=True)
def test_a_run_submitted_as_a_ray_job_with_a_working_dir_writes_where_the_user_finds_it(ray_head, tmp_path):
    # `ray job submit --working-dir` runs the driver in Ray's temporary copy of that folder, deleted after
    # the job: a relative out_dir must not land there
    work = tmp_path / "checkout"
    work.mkdir()
    (work / "notes.txt").write_text("a working directory to ship")
    env = {**ray_head.env, "RAY_AUTH_MODE": "token"}
    ray_cli = str(Path(sys.executable).with_name("ray"))
    deadline = time.time() + 120
    while True:  # the dashboard's job agent starts a few seconds after the head
        job = subprocess.run([ray_cli, "job", "submit", "--address", ray_head.dashboard, "--working-dir", str(work),
                              "--", sys.executable, "-m", "fdam_ray", "train", "executor=ray", *SMALL,
                              "iterations=20", "cpus_per_actor=0.5", "run_name=job"],
                             env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
        if "No available agent" not in job.stderr + job.stdout or time.time() > deadline:
            break
        time.sleep(3)
    out = job.stdout + job.stderr
    assert job.returncode == 0, out[-3000:]
    home = Path(ray_head.env["HOME"])
    assert (home / "runs" / "job" / "metrics.jsonl").is_file()
    assert f"run folder: {home / 'runs' / 'job'} (on host " in out
    assert "which Ray deletes after the job: out_dir=runs is relative" in out
