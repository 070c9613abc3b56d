"""What a consortium's operators read: a site that is down before the study starts is named in one line saying it
did not answer (not blamed on its config, no traceback), and the study's progress is in Flower's own log."""

from __future__ import annotations

import importlib.util
import io
import logging
import os
import time

import numpy as np
import pytest

os.environ["FLWR_TELEMETRY_ENABLED"] = "0"  # before flwr is imported: nothing leaves 127.0.0.0/8
pytestmark = pytest.mark.skipif(importlib.util.find_spec("flwr") is None, reason="Flower is not installed")

CODASCA = dict(algorithm="codasca", model="linear", batch_size=8, seed=3, executor="inline", local_steps=2,
               iterations=12, lr=0.2, global_lr=1.3, prox_weight=0.01, stage_length=6, eval_every=6)
UNAVAILABLE = "Error: Node Unavailable - The destination node failed to report a heartbeat within 2 x its interval."


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("flower-ops-sites")
    rng = np.random.default_rng(0)
    for k, n in enumerate((30, 40, 36)):
        x, x_test = rng.normal(size=(n, 4)).astype(np.float32), rng.normal(size=(20, 4)).astype(np.float32)
        np.savez(folder / f"site{k}.npz", x=x, y=(x[:, 0] > 0).astype(np.float32), x_test=x_test,
                 y_test=(x_test[:, 0] > 0).astype(np.float32))
    return folder


def configs(folder):
    return [{"site": k, "data": str(folder / f"site{k}.npz")} for k in range(3)]


def run(grid, config=CODASCA, observers=(), **flower):
    from fdam_ray.flower.inprocess import server_context
    from fdam_ray.flower.server_app import run_federation

    return run_federation(grid, server_context(), {**config, "num_clients": 3, "flower": flower}, observers=observers)


def stops_in_one_line(grid, timeout=1.0):
    """Run the study with a short connect timeout; the exception, its message, and how long it took."""
    from fdam_ray.flower.executor import SiteSilent

    start = time.monotonic()
    with pytest.raises(SiteSilent) as caught:
        run(grid, connect_timeout_s=timeout, round_timeout_s=1)
    return caught.value, str(caught.value), time.monotonic() - start


# -- a site that is down before the study starts -----------------------------------------------------------------
def test_a_site_whose_supernode_never_came_up_is_named_as_not_answering_within_the_timeout(folder, caplog):
    from fdam_ray.flower.client_app import app
    from fdam_ray.flower.inprocess import InProcessGrid

    grid = InProcessGrid(app, configs(folder))
    grid.offline.add(grid.node_of_site(2))  # never listed: its SuperNode is down
    with caplog.at_level(logging.ERROR):
        _, message, took = stops_in_one_line(grid, timeout=1.0)
    assert "\n" not in message
    assert message.startswith("site 2 did not answer within flower.connect_timeout_s=1 s (2 of 3 sites did)")
    assert "config" not in message and "start its SuperNode" in message
    assert 1.0 <= took < 10  # it waited its timeout, and no longer
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == [message]


def test_a_listed_node_the_superlink_reports_unavailable_is_not_blamed_on_its_config(folder):
    from flwr.app import Error, Message

    from fdam_ray.flower.client_app import app
    from fdam_ray.flower.inprocess import InProcessGrid

    def down_at_site_1(msg, context):  # what the SuperLink answers for a node that stopped heartbeating
        if context.node_config["site"] == 1:
            return Message(Error(code=5, reason=UNAVAILABLE), reply_to=msg)
        return app(msg, context)

    grid = InProcessGrid(down_at_site_1, configs(folder))
    _, message, _ = stops_in_one_line(grid)
    node = grid.node_of_site(1)
    assert "\n" not in message and message.startswith("site 1 did not answer within flower.connect_timeout_s=1 s")
    assert f"node {node} was listed but did not answer: Error: Node Unavailable" in message
    assert "fix that node's config" not in message


def test_a_listed_node_that_never_replies_is_named_as_silent(folder):
    from fdam_ray.flower.client_app import app
    from fdam_ray.flower.inprocess import InProcessGrid

    grid = InProcessGrid(app, configs(folder))
    silent = grid.node_of_site(0)
    grid.lose_reply = lambda msg: msg.metadata.dst_node_id == silent
    _, message, _ = stops_in_one_line(grid)
    assert message.startswith("site 0 did not answer")
    assert f"node {silent} was listed but did not answer: no reply within flower.round_timeout_s=1 s" in message


def test_two_sites_down_are_both_named(folder):
    from fdam_ray.flower.client_app import app
    from fdam_ray.flower.inprocess import InProcessGrid

    grid = InProcessGrid(app, configs(folder))
    grid.offline.update({grid.node_of_site(0), grid.node_of_site(2)})
    _, message, _ = stops_in_one_line(grid, timeout=0.5)
    assert message.startswith("sites 0, 2 did not answer within flower.connect_timeout_s=0.5 s (1 of 3 sites did)")
    assert "start their SuperNodes" in message


def flower_output(emit) -> str:
    """What Flower's logger prints while ``emit`` runs (a handler of our own on it, as its console handler)."""
    from fdam_ray.flower.server_app import FLOWER_LOG

    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    FLOWER_LOG.addHandler(handler)
    try:
        emit()
    finally:
        FLOWER_LOG.removeHandler(handler)
    return stream.getvalue()


def test_flower_logs_a_refusal_as_its_line_and_any_other_exception_with_its_traceback():
    from fdam_ray.config import ConfigError
    from fdam_ray.flower.executor import SiteSilent
    from fdam_ray.flower.server_app import FLOWER_LOG, _OneLine, quiet_refusals

    def raised(exc):
        try:
            raise exc
        except Exception as caught:
            return caught

    quiet_refusals()
    quiet_refusals()  # once only
    try:
        assert sum(isinstance(f, _OneLine) for f in FLOWER_LOG.filters) == 1
        for refusal in (SiteSilent("site 2 did not answer within flower.connect_timeout_s=120 s"),
                        ConfigError("config field 'lr': -1 is not allowed (> 0)")):
            # as flwr's run_serverapp logs an exception that ended the ServerApp
            caught = raised(refusal)
            out = flower_output(lambda c=caught: FLOWER_LOG.error("%s raised an exception", "ServerApp", exc_info=c))
            assert out == f"ERROR ServerApp stopped: {refusal}\n"
        out = flower_output(lambda: FLOWER_LOG.error("%s raised an exception", "ServerApp",
                                                     exc_info=raised(ValueError("a bug"))))
        assert out.startswith("ERROR ServerApp raised an exception\nTraceback") and "ValueError: a bug" in out
    finally:
        FLOWER_LOG.filters[:] = [f for f in FLOWER_LOG.filters if not isinstance(f, _OneLine)]


# -- training progress in Flower's log ------------------------------------------------------------------------------
def test_the_server_logs_one_line_per_evaluation_to_flowers_logger(folder):
    from fdam_ray.flower.client_app import app
    from fdam_ray.flower.inprocess import InProcessGrid
    from fdam_ray.flower.server_app import FlowerLog

    grid = InProcessGrid(app, configs(folder))
    result = {}
    out = flower_output(lambda: result.setdefault("run", run(grid, observers=(FlowerLog(),))))
    history = result["run"].history
    lines = [line for line in out.splitlines() if "test AUC" in line]
    assert len(history) == 3  # the initial evaluation and iterations 6 and 12
    assert lines == [f"INFO fdam-ray: round {h['round']}, iteration {h['iteration']} of 12: test AUC "
                     f"{h['test_auc']:.4f}" for h in history]
    assert "INFO fdam-ray: started at round 0, iteration 0 of 12" in out


def test_under_dp_the_progress_line_carries_epsilon():
    from fdam_ray.flower.server_app import FlowerLog

    progress = FlowerLog()
    progress.iterations = 400
    record = {"round": 7, "iteration": 140, "test_auc": 0.81234, "dp_epsilon": 1.23456, "dp_delta": 1e-5}
    out = flower_output(lambda: progress.record(record, lambda: None))
    assert out == "INFO fdam-ray: round 7, iteration 140 of 400: test AUC 0.8123, epsilon 1.235 (delta 1e-05)\n"


def test_the_serverapps_main_shows_progress_and_the_final_line_in_flowers_log(folder, tmp_path):
    import json

    import yaml

    from fdam_ray.flower.client_app import app
    from fdam_ray.flower.inprocess import InProcessGrid, server_context
    from fdam_ray.flower.server_app import main

    run_dir = tmp_path / "study"
    study = {**CODASCA, "num_clients": 3}
    out = flower_output(lambda: main(InProcessGrid(app, configs(folder)), server_context(run_config={
        "study": yaml.safe_dump(study), "run-dir": str(run_dir)})))
    summary = json.loads((run_dir / "summary.json").read_text())
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    shown = [line for line in out.splitlines() if "test AUC" in line and "final" not in line]
    assert len(shown) == len([r for r in rows if "test_auc" in r]) == 3
    assert shown[-1].endswith(f"iteration 12 of 12: test AUC {summary['final_test_auc']:.4f}")
    assert f"final test AUC {summary['final_test_auc']:.4f}; run folder {run_dir}" in out
