"""Signals under Ray, as a scheduler sends them: SIGTERM to the whole process group of a run whose clients are Ray
actors with DataLoader workers (Slurm's scancel, a batch system's preemption).

Each run is a real ``fdam`` process in a session of its own, stopped by its own pid at the end.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from test_faults import SMALL, _pids_using, but, records, stop, wait_for
from test_signals import assert_quiet, fdam_env, start

from fdam_ray.checkpoint import load_checkpoint


@pytest.mark.fault  # a private Ray each time, about 40 s; three times, since it failed one run in two
@pytest.mark.parametrize("attempt", [1, 2, 3])
def test_process_group_sigterm_under_ray_with_data_workers_checkpoints_and_prints_the_resume_line(tmp_path, attempt):
    """The private Ray's processes (GCS, raylet, its workers: the actors) must not get the job's SIGTERM: they
    used to, and the run then ended rc 1 with Ray's traceback before its round-end checkpoint."""
    run = tmp_path / "cut"
    args = ["train", f"out_dir={tmp_path}", "run_name=cut", "executor=ray", "cpus_per_actor=0.5",
            "dataset=own_fixtures:client_dataset", "model=own_fixtures:bn_net", "model_width=4", "num_clients=2",
            "batch_size=8", "local_steps=2", "iterations=100000", "eval_every=10", "stage_length=100000",
            "data_workers=1", "checkpoint_every=100000", "tensorboard=false"]
    log = tmp_path / "cut.log"
    proc = start(args, tmp_path, log, fdam_env())
    try:
        wait_for(lambda: len(records(run)) >= 2, proc, log, timeout_s=240)
        os.killpg(proc.pid, signal.SIGTERM)  # the driver, and whatever else sits in its process group
        rc = proc.wait(timeout=120)
    finally:
        stop(proc)
    output = log.read_text()
    assert rc == 143, output[-3000:]
    assert "received SIGTERM: stopped after round" in output and f"fdam train --resume {run}" in output, output[-3000:]
    assert_quiet(output)
    assert load_checkpoint(run / "checkpoint.pt").loop.state.iteration >= 10


@pytest.mark.fault  # benchmarks/fault_tests.py; a private Ray, about 40 s
def test_a_second_ctrl_c_under_the_classic_transport_exits_at_once(tmp_path):
    """The docs say a second Ctrl+C exits at once; under the classic transport it used to take 25 s."""
    run = tmp_path / "cut"
    log = tmp_path / "cut.log"
    proc = start(["train", f"out_dir={tmp_path}", "run_name=cut", "executor=ray", "cpus_per_actor=0.5",
                  "transport=classic", *but(SMALL, "eval_every"), "iterations=100000", "eval_every=10",
                  "checkpoint_every=10"],
                 tmp_path, log, fdam_env())
    try:
        wait_for(lambda: len(records(run)) >= 2, proc, log, timeout_s=240)
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl+C: the terminal signals the whole foreground group
        time.sleep(0.5)
        alive = proc.poll() is None
        os.killpg(proc.pid, signal.SIGINT)
        second = time.monotonic()
        rc = proc.wait(timeout=60)
        took = time.monotonic() - second
    finally:
        stop(proc)
    output = log.read_text()
    assert alive, output[-3000:]
    assert rc == 130 and took < 5, (rc, took, output[-3000:])
    assert_quiet(output)


@pytest.mark.fault  # benchmarks/fault_tests.py; a private Ray, about 40 s
def test_no_process_of_the_private_ray_outlives_a_compiled_run(tmp_path):
    """Ray's agents (children of the raylet) used to outlive a compiled run by a minute."""
    ray_tmp = Path(tempfile.mkdtemp(prefix="fdo", dir="/tmp"))  # short: Ray's socket paths live under it
    try:
        got = subprocess.run([sys.executable, "-m", "fdam_ray", "train", f"out_dir={tmp_path}", "executor=ray",
                              "cpus_per_actor=0.5", "transport=compiled", *SMALL, "iterations=20", "--quiet"],
                             cwd=tmp_path, env=fdam_env(RAY_TMPDIR=str(ray_tmp)), capture_output=True, text=True,
                             timeout=300)
        assert got.returncode == 0, got.stderr[-3000:]
        deadline = time.monotonic() + 5
        while _pids_using(ray_tmp) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = {pid: Path(f"/proc/{pid}/cmdline").read_bytes()[:120] for pid in _pids_using(ray_tmp)}
        assert not left, left
    finally:
        for pid in _pids_using(ray_tmp):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(ray_tmp, ignore_errors=True)
