"""A tracker whose server cannot be reached fails in one line within seconds, before its library's own retries
(MLflow's take minutes), naming the tracker, the URI with its credentials shown as ***, and what to do."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from fdam_ray.outputs import trackers


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def checked_within(seconds: float, check) -> BaseException | None:
    """What ``check()`` raised, failing the test if it had not ended within ``seconds``."""
    got: list[BaseException | None] = []

    def run() -> None:
        try:
            check()
            got.append(None)
        except BaseException as exc:
            got.append(exc)

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(seconds)
    assert got, f"still waiting after {seconds} s"
    return got[0]


def test_an_mlflow_server_on_a_closed_port_fails_in_one_line_within_seconds(monkeypatch):
    pytest.importorskip("mlflow")
    port = closed_port()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://alice:s3cret@127.0.0.1:{port}/?token=abc")
    started = time.monotonic()
    error = checked_within(30, lambda: trackers.check_usable(["mlflow"]))
    assert isinstance(error, trackers.TrackerError), error
    message = str(error)
    assert time.monotonic() - started < 15
    assert "\n" not in message and message.startswith("trackers: mlflow's server at "), message
    assert f"http://alice:***@127.0.0.1:{port}/?token=*** (MLFLOW_TRACKING_URI) cannot be reached" in message
    assert "s3cret" not in message and "abc" not in message  # a password and a secret query shown as ***
    assert "leave mlflow out of trackers" in message and "sqlite:///mlflow.db" in message


def test_a_wandb_server_that_cannot_be_reached_fails_in_one_line(monkeypatch):
    pytest.importorskip("wandb")
    from wandb.sdk import wandb_setup
    from wandb.sdk.lib.wbauth import authenticate

    port = closed_port()

    class Settings:
        mode = "online"
        base_url = f"http://127.0.0.1:{port}"

    class Setup:
        settings = Settings()

    monkeypatch.setattr(wandb_setup, "singleton", lambda: Setup())
    monkeypatch.setattr(authenticate, "_use_system_auth", lambda **kw: "a key")  # logged in
    error = checked_within(30, trackers.check_wandb_login)
    assert isinstance(error, trackers.TrackerError), error
    message = str(error)
    assert "\n" not in message and f"wandb's server at http://127.0.0.1:{port} " in message, message
    assert "WANDB_MODE=offline" in message and "leave wandb out of trackers" in message


def test_a_tracker_uri_that_is_not_a_server_is_not_probed(monkeypatch):
    asked: list = []
    monkeypatch.setattr(socket, "create_connection", lambda *a, **k: asked.append(a))
    trackers.check_server_answers("mlflow", "sqlite:///mlflow.db", "MLFLOW_TRACKING_URI", "x")
    trackers.check_server_answers("mlflow", "file:///tmp/mlruns", "MLFLOW_TRACKING_URI", "x")
    assert asked == []
