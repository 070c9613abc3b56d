"""No credential leaks: a run given passwords in its tracking URI and in a typed address shows them nowhere.

``fdam train`` runs as a user runs it, in a process of its own, with a password
planted in ``MLFLOW_TRACKING_URI`` (a server on 127.0.0.1 at a closed port, so the
tracker fails to start and says so) and another in the ``address`` field. Then
every file the run wrote and everything it printed is searched for either password.
The one typed into a field stays only where the run must keep it to be resumed or
rerun (``config.yaml`` and ``checkpoint.pt``, both readable by the owner only).
"""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mlflow")

ENV_SECRET = "PLANTEDenvPW7731"
TYPED_SECRET = "PLANTEDtypedPW4419"
KEPT_FOR_RESUME = {"config.yaml", "checkpoint.pt"}


def closed_port() -> int:
    """A port on 127.0.0.1 that nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def files_holding(root: Path, secret: str) -> list[str]:
    found = []
    for path in root.rglob("*"):
        if path.is_file() and secret.encode() in path.read_bytes():
            found.append(str(path.relative_to(root)))
    return sorted(found)


def test_fdam_train_shows_and_writes_no_planted_password(tmp_path):
    port = closed_port()
    env = {**os.environ,
           "PYTHONPATH": str(Path(__file__).resolve().parents[2]) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "MLFLOW_TRACKING_URI": f"http://fdam:{ENV_SECRET}@127.0.0.1:{port}/",
           "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "5",
           "HOME": str(tmp_path / "home")}
    (tmp_path / "home").mkdir()
    args = ["dataset=synthetic", "model=mlp", "model_width=8", "num_clients=2", "samples_per_client=80",
            "batch_size=16", "local_steps=3", "iterations=6", "stage_length=3", "eval_every=3",
            f"out_dir={tmp_path / 'runs'}", "run_name=leak", "executor=inline", "tensorboard=false",
            "trackers=mlflow", f"address=ray://fdam:{TYPED_SECRET}@127.0.0.1:{port}"]
    done = subprocess.run([sys.executable, "-m", "fdam_ray", "-v", "train", *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    printed = done.stdout + done.stderr
    for secret in (ENV_SECRET, TYPED_SECRET):
        assert secret not in printed
    # the tracker did reach for the URI, and says so with the URI redacted (a warning when the run goes on
    # without it, or the one-line error of a run that a tracker failing to start stops)
    assert f"http://fdam:***@127.0.0.1:{port}" in printed, printed[-3000:]
    assert files_holding(tmp_path, ENV_SECRET) == []
    assert set(files_holding(tmp_path, TYPED_SECRET)) <= {f"runs/leak/{name}" for name in KEPT_FOR_RESUME}
    run_dir = tmp_path / "runs" / "leak"
    if done.returncode == 0:
        assert (run_dir / "model.pt").is_file()
        log = (run_dir / "train.log").read_text()
        assert "mlflow tracker: starting its run failed" in log and f"fdam:***@127.0.0.1:{port}" in log
    else:
        assert "Traceback" not in done.stderr, done.stderr[-3000:]
    for name in ("train.log", *KEPT_FOR_RESUME):
        if (run_dir / name).exists():
            assert stat.S_IMODE((run_dir / name).stat().st_mode) & 0o077 == 0, name


def test_config_values_sent_to_mlflow_as_parameters_are_redacted(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    from fdam_ray.assembly.recipe import run
    from fdam_ray.config import build_config

    monkeypatch.chdir(tmp_path)  # MLflow's artifacts under ./mlruns
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    config = build_config(dataset="synthetic", model="mlp", model_width=8, num_clients=2, samples_per_client=80,
                          batch_size=16, local_steps=3, iterations=6, stage_length=3, eval_every=3,
                          out_dir=str(tmp_path / "runs"), run_name="params", executor="inline", tensorboard=False,
                          trackers=["mlflow"], tracker_project="secrets",
                          address=f"ray://fdam:{TYPED_SECRET}@127.0.0.1:1")
    run(config)
    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name("secrets")
    (only,) = client.search_runs([experiment.experiment_id])
    assert only.data.params["address"] == "ray://fdam:***@127.0.0.1:1"
    assert only.data.params["lr"] == "0.1"  # other values as they are
    assert TYPED_SECRET not in str(only.data.params)
