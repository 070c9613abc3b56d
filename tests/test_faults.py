"""Faults a cluster job meets: a second writer on a live run folder, a killed driver, SIGTERM, a foreign port.

Each test drives a real ``fdam`` process (``python -m fdam_ray``) and stops
everything it started by its own pid.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fdam_ray.checkpoint import load_checkpoint
from fdam_ray.cli import main

SMALL = ["dataset=synthetic", "model=mlp", "model.width=8", "num_clients=2", "samples_per_client=100",
         "local_steps=2", "stage_length=100000", "eval_every=40", "tensorboard=false"]


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
    done = load_checkpoint(run / "checkpoint.pt")["loop"]["state"]["iteration"]
    assert main(["train", "--resume", str(run), f"iterations={done + 20}", "--quiet"]) == 0
    lines = records(run)
    assert lines[-1]["iteration"] == done + 20
    assert [r["iteration"] for r in lines] == sorted({r["iteration"] for r in lines})  # no duplicate, no stray line
