"""A sweep stopped part-way (Ctrl+C) resumes with `fdam tune --resume DIR` and finishes every trial.

In a module of its own: no Ray instance of the test process is alive while the
sweep's own driver process starts and stops its Ray.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_tune import read_rows, write_space

# Long enough that a fast machine cannot finish the sweep between the fourth
# report and the Ctrl+C.
ITERATIONS = 6000


def reports(sweep: Path) -> int:
    """The highest checkpoint number any trial wrote (Tune keeps only the latest two per trial)."""
    return max((int(p.name.split("_")[-1]) for p in sweep.glob("trial_*/checkpoint_*")), default=0)


@pytest.mark.fault  # in benchmarks/fault_tests.py, not the CI tiers
def test_a_stopped_sweep_resumes_and_finishes_every_trial(tmp_path):
    space = write_space(tmp_path, {"lr": {"grid": [0.2, 0.05, 0.01, 0.002]}},
                        {"name": "stopme", "driver_cpus": 1, "max_concurrent_trials": 2},
                        base={"iterations": ITERATIONS, "eval_every": 200, "stage_length": 1000})
    sweep = tmp_path / "sweeps" / "stopme"
    env = {**os.environ, "RAY_ADDRESS": "", "PYTHONUNBUFFERED": "1"}
    log = open(tmp_path / "first.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "fdam_ray", "tune", str(space)], cwd=tmp_path, env=env,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.time() + 240
        # The first report is the untrained round 0; by the fourth (checkpoint_000003), Tune has registered one past it.
        while time.time() < deadline and proc.poll() is None and reports(sweep) < 3:
            time.sleep(0.1)
        output = (tmp_path / "first.log").read_text()[-3000:]
        assert reports(sweep) >= 3, f"no trial reported in time:\n{output}"
        time.sleep(0.5)
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl+C: Tune saves the experiment state and exits
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    unfinished = [d for d in sweep.glob("trial_*") if not _finished(d)]
    assert unfinished, "the sweep finished before it was stopped"
    output = (tmp_path / "first.log").read_text()
    assert proc.returncode == 130, output[-3000:]  # not a success
    assert f"trials unfinished, so it has no best config yet; continue it with: fdam tune --resume {sweep}" in output
    assert not (sweep / "best_config.yaml").exists()
    rc = subprocess.run([sys.executable, "-m", "fdam_ray", "tune", "--resume", str(sweep)], cwd=tmp_path, env=env,
                        capture_output=True, text=True, timeout=400)
    assert rc.returncode == 0, rc.stderr[-2000:]
    assert (sweep / "best_config.yaml").exists()
    rows = read_rows(sweep)
    assert len(rows) == 4 and all(r["iterations"] == str(ITERATIONS) for r in rows)
    resumed = [d for d in unfinished if "resumed at round" in (d / "run" / "train.log").read_text()]
    assert resumed, "no trial continued from its checkpoint"


def _finished(trial_dir: Path) -> bool:
    log = trial_dir / "run" / "train.log"
    return log.exists() and f"iteration {ITERATIONS} " in log.read_text()
