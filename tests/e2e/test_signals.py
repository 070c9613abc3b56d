"""Faults a cluster job meets, continued: signals and what a scheduler sends (SIGTERM to the driver or to the
whole process group, a second Ctrl+C), a live sweep resumed twice, trackers that would record nothing.

Each test drives a real ``fdam`` process (``python -m fdam_ray``) in a session of its own and stops what it
started by its own pid; nothing here starts Ray in the test process.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_faults import SMALL, but, records, start_fdam, stop, wait_for
from test_tune import write_space
from testpath import TEST_PATH

from fdam_ray.checkpoint import load_checkpoint
from fdam_ray.cli import main
from fdam_ray.files.runlock import RunLock
from fdam_ray.tuning.space import SPACE_FILE

TESTS = Path(__file__).resolve().parents[1]


def fdam_env(**extra: str) -> dict[str, str]:
    """The environment of an ``fdam`` subprocess: no cluster address, this test folder importable (the own
    dataset factories), unbuffered output."""
    path = os.pathsep.join(p for p in (TEST_PATH, os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "RAY_ADDRESS": "", "PYTHONUNBUFFERED": "1", "PYTHONPATH": path, **extra}


def start(args: list[str], cwd: Path, log: Path, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "fdam_ray", *args], cwd=cwd, env=env, stdout=log.open("w"),
                            stderr=subprocess.STDOUT, start_new_session=True)


def assert_quiet(output: str) -> None:
    """Nothing a user should not see: no traceback, no crash report."""
    for noise in ("Traceback", "core dumped", "Segmentation fault", "Fatal Python error", "Exception ignored"):
        assert noise not in output, output[-3000:]


# -- SIGTERM to a process group whose DataLoader workers read the clients' data ----------------------------
@pytest.mark.slow  # in CI's slow tier: an fdam process group signalled, 9 s
def test_sigterm_to_the_process_group_with_dataloader_workers_checkpoints_and_exits_143(tmp_path):
    """Slurm signals every process of the job: the DataLoader workers must outlive the signal so that the
    driver stops at a round end with its checkpoint, as for a SIGTERM to the driver alone."""
    run = tmp_path / "cut"
    args = ["train", f"out_dir={tmp_path}", "run_name=cut", "executor=inline", "dataset=own_fixtures:client_dataset",
            "model=own_fixtures:bn_net", "model_width=4", "num_clients=2", "batch_size=8", "local_steps=2",
            "iterations=100000", "eval_every=20", "stage_length=100000", "data_workers=1", "checkpoint_every=100000",
            "tensorboard=false"]
    proc = start(args, tmp_path, tmp_path / "cut.log", fdam_env())
    try:
        wait_for(lambda: len(records(run)) >= 2, proc, tmp_path / "cut.log", timeout_s=180)
        os.killpg(proc.pid, signal.SIGTERM)  # the driver and its DataLoader workers alike
        rc = proc.wait(timeout=120)
    finally:
        stop(proc)
    output = (tmp_path / "cut.log").read_text()
    assert rc == 143, output[-3000:]
    assert "received SIGTERM: stopped after round" in output and f"fdam train --resume {run}" in output
    assert_quiet(output)
    stopped_at = load_checkpoint(run / "checkpoint.pt").loop.state.iteration
    assert stopped_at >= 20 and not (run / "model.pt").exists()
    resumed = subprocess.run([sys.executable, "-m", "fdam_ray", "train", "--resume", str(run), "iterations=" +
                              str(stopped_at + 20), "--quiet"], cwd=tmp_path, env=fdam_env(), capture_output=True,
                             text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert (run / "model.pt").exists()


# -- a second Ctrl+C ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("transport", ["classic", "compiled"])
@pytest.mark.fault  # about a minute each (benchmarks/fault_tests.py): a private Ray, then an inline resume
def test_a_second_ctrl_c_exits_at_once_quietly_and_the_first_ones_checkpoint_resumes(tmp_path, transport):
    """The second Ctrl+C lands while Ray shuts down at exit: it used to print Ray's KeyboardInterrupt traceback
    and, with the compiled transport, crash the process (rc 139)."""
    run = tmp_path / "cut"
    steps = [*but(SMALL, "eval_every"), "iterations=2000", "eval_every=250", "checkpoint_every=20"]
    proc = start_fdam(["train", f"out_dir={tmp_path}", "run_name=cut", "executor=ray", "cpus_per_actor=0.5",
                       f"transport={transport}", *steps], tmp_path, tmp_path / "cut.log")
    try:
        wait_for(lambda: len(records(run)) >= 2, proc, tmp_path / "cut.log", timeout_s=240)
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl+C: the terminal signals the whole foreground group
        time.sleep(0.5)
        alive = proc.poll() is None
        os.killpg(proc.pid, signal.SIGINT)  # and again, impatient
        rc = proc.wait(timeout=60)
    finally:
        stop(proc)
    output = (tmp_path / "cut.log").read_text()
    assert alive, f"the first Ctrl+C ended the run before the second came:\n{output[-3000:]}"
    assert rc == 130 and "fdam: interrupted" in output, (rc, output[-3000:])
    assert_quiet(output)
    assert 0 < load_checkpoint(run / "checkpoint.pt").loop.state.iteration < 2000
    assert main(["train", "--resume", str(run), "executor=inline", "--quiet"]) == 0
    assert (run / "model.pt").exists()


# -- fdam tune: SIGTERM, and a second driver on a live sweep -------------------------------------------------
def tune_reports(sweep: Path) -> int:
    return max((int(p.name.split("_")[-1]) for p in sweep.glob("trial_*/checkpoint_*")), default=0)


@pytest.mark.fault  # a few minutes: a sweep stopped, a resume refused, the sweep resumed to its end
def test_sigterm_stops_fdam_tune_with_the_resume_line_and_a_live_sweep_is_not_resumed_twice(tmp_path):
    space = write_space(tmp_path, {"lr": {"grid": [0.2, 0.05]}}, {"name": "live", "driver_cpus": 1,
                                                                    "max_concurrent_trials": 1},
                        base={"iterations": 4000, "eval_every": 200, "stage_length": 1000})
    sweep = tmp_path / "sweeps" / "live"
    proc = start(["tune", str(space)], tmp_path, tmp_path / "first.log", fdam_env())
    try:
        wait_for(lambda: tune_reports(sweep) >= 2, proc, tmp_path / "first.log", timeout_s=300)
        second = subprocess.run([sys.executable, "-m", "fdam_ray", "tune", "--resume", str(sweep)], cwd=tmp_path,
                                env=fdam_env(), capture_output=True, text=True, timeout=120)
        assert proc.poll() is None, "the sweep ended before its second driver was refused"
        proc.send_signal(signal.SIGTERM)  # to the driver alone, as a scheduler's first notice
        rc = proc.wait(timeout=180)
    finally:
        stop(proc)
    assert second.returncode == 2, second.stderr[-3000:]
    assert second.stderr.count("\n") == 1 and f"sweep folder '{sweep}' is in use by process {proc.pid}" in (
        second.stderr), second.stderr
    output = (tmp_path / "first.log").read_text()
    assert rc == 143, output[-3000:]
    assert f"continue it with: fdam tune --resume {sweep}" in output
    assert_quiet(output)
    assert not (sweep / "best_config.yaml").exists()
    resumed = subprocess.run([sys.executable, "-m", "fdam_ray", "tune", "--resume", str(sweep)], cwd=tmp_path,
                             env=fdam_env(), capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert (sweep / "best_config.yaml").exists() and "failed" not in resumed.stderr


def test_a_resume_of_a_sweep_another_driver_holds_is_refused_in_one_line_and_deletes_nothing(tmp_path, capsys):
    sweep = tmp_path / "sweeps" / "held"
    sweep.mkdir(parents=True)
    (sweep / SPACE_FILE).write_text(write_space(tmp_path, {"lr": {"grid": [0.2]}}, {"name": "held"}).read_text())
    (sweep / "best_config.yaml").write_text("lr: 0.2\n")
    (sweep / "sweep_results.csv").write_text("trial,lr\nt,0.2\n")
    lock = RunLock(sweep)  # a live driver of this sweep (its own open file: a lock of its own)
    try:
        rc = main(["tune", "--resume", str(sweep)])
    finally:
        lock.release()
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1, err
    assert f"sweep folder '{sweep}' is in use by process {os.getpid()}" in err and "--resume" in err
    assert (sweep / "best_config.yaml").read_text() == "lr: 0.2\n"
    assert (sweep / "sweep_results.csv").read_text() == "trial,lr\nt,0.2\n"


# -- trackers that would record nothing ----------------------------------------------------------------------
def test_wandb_without_credentials_outside_offline_mode_stops_before_training(tmp_path):
    pytest.importorskip("wandb")
    home = tmp_path / "home"  # no ~/.netrc, no W&B settings
    home.mkdir()
    env = {k: v for k, v in fdam_env().items()
           if not k.startswith("WANDB_") and k not in ("NETRC", "XDG_CONFIG_HOME")}
    env.update(HOME=str(home), WANDB_DIR=str(tmp_path / "wandb"))
    got = subprocess.run([sys.executable, "-m", "fdam_ray", "train", f"out_dir={tmp_path / 'runs'}",
                          "run_name=keyless", "executor=inline", "trackers=wandb", *SMALL, "iterations=40"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert got.returncode == 2, got.stderr[-3000:]
    assert got.stderr.count("\n") == 1 and "wandb has no API key" in got.stderr, got.stderr
    assert "wandb login" in got.stderr and "WANDB_MODE=offline" in got.stderr
    assert not (tmp_path / "runs" / "keyless").exists()


def test_a_wandb_install_that_fails_to_import_stops_fdam_tune_in_one_line(tmp_path):
    fake = tmp_path / "site" / "wandb"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise RuntimeError('this wandb install is broken')\n")
    space = write_space(tmp_path, {"lr": {"grid": [0.2]}}, {"name": "broken"}, base={"trackers": ["wandb"]})
    env = fdam_env()
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path / "site"), env["PYTHONPATH"]])
    got = subprocess.run([sys.executable, "-m", "fdam_ray", "tune", str(space)], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert got.returncode == 2, got.stderr[-3000:]
    assert got.stderr.count("\n") == 1, got.stderr
    assert "trackers: wandb is installed but fails to import (RuntimeError: this wandb install is broken)" in (
        got.stderr)
    assert_quiet(got.stderr)
    assert not (tmp_path / "sweeps" / "broken").exists()


def test_sigterm_while_a_tracker_waits_for_its_server_ends_the_wait_at_once(tmp_path):
    """A tracking server that accepts connections and never answers: MLflow would wait minutes (a timeout per
    request, several retries) before the run could stop at a round end."""
    pytest.importorskip("mlflow")
    import socket

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    silent.settimeout(120)
    env = fdam_env(MLFLOW_TRACKING_URI=f"http://127.0.0.1:{silent.getsockname()[1]}",
                   MLFLOW_HTTP_REQUEST_MAX_RETRIES="0")
    proc = start(["train", f"out_dir={tmp_path}", "run_name=tracked", "executor=inline", "trackers=mlflow", *SMALL,
                  "iterations=40"], tmp_path, tmp_path / "tracked.log", env)
    try:
        conn, _ = silent.accept()  # the tracker asks, and gets no answer
        time.sleep(0.5)
        assert proc.poll() is None, (tmp_path / "tracked.log").read_text()[-3000:]
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=30)  # MLflow's own request timeout is 120 s
        conn.close()
    finally:
        stop(proc)
        silent.close()
    output = (tmp_path / "tracked.log").read_text()
    assert rc == 143 and "fdam: interrupted" in output, (rc, output[-3000:])
    assert_quiet(output)


def test_a_stop_signal_ends_a_compiled_graphs_teardown_wait():
    """Ray's teardown of a compiled graph waits for the actors' loops (up to its own timeout): the first stop
    signal ends that wait at once instead of at the next round end."""
    import threading

    from fdam_ray.executors.ray.transports.compiled import CompiledRounds
    from fdam_ray.features import interrupts

    class StuckGraph:
        ended = False

        def teardown(self):
            time.sleep(30)  # actors that never leave their loops
            StuckGraph.ended = True

    rounds = CompiledRounds()
    rounds.graph = StuckGraph()
    stops: list[int] = []
    assert interrupts.install(stops.append)  # a first SIGTERM elsewhere would only ask for a stop
    try:
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGTERM)).start()
        started = time.monotonic()
        with pytest.raises(interrupts.Interrupted) as stopped:
            rounds.teardown()
        assert time.monotonic() - started < 10 and stopped.value.signum == signal.SIGTERM
        assert rounds.graph is None and not StuckGraph.ended and stops == []
        assert interrupts.received() == signal.SIGTERM
    finally:
        interrupts.uninstall()
    assert signal.getsignal(signal.SIGTERM) is not interrupts._handle
