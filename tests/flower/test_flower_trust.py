"""The Flower bridge trusts no setting and no site it should not: the flower section's numbers are checked (by `fdam
train` too), a consortium's timeouts come from one setting and end in one line, and a site that cannot take part
(secure aggregation it requires, a damaged state file, a site number two nodes claim) is named on the server and
on the site, with what to do, instead of being left out round after round."""

from __future__ import annotations

import importlib.util
import logging
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from fdam_ray.config import ConfigError, build_config

ROOT = Path(__file__).resolve().parents[2]
os.environ["FLWR_TELEMETRY_ENABLED"] = "0"  # before flwr is imported: nothing leaves 127.0.0.0/8
pytestmark = pytest.mark.skipif(importlib.util.find_spec("flwr") is None, reason="Flower is not installed")

NUMBERS = ["connect_timeout_s", "round_timeout_s", "secagg_clipping_range", "secagg_quantization_range",
           "secagg_num_shares", "secagg_reconstruction_threshold"]
BAD = [float("nan"), float("inf"), float("-inf"), 0, -1, True, "5", None, [1]]


# -- the flower section ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("field", NUMBERS)
@pytest.mark.parametrize("value", BAD, ids=repr)
def test_every_number_of_the_flower_section_refuses_nan_inf_and_out_of_range_in_one_line(field, value):
    from fdam_ray.flower import split_config

    with pytest.raises(ConfigError) as caught:
        split_config({"flower": {field: value}})
    message = str(caught.value)
    assert f"'flower.{field}'" in message and "\n" not in message and "not allowed" in message


@pytest.mark.parametrize("values, field", [
    ({"secagg_quantization_range": 2**40}, "secagg_quantization_range"),
    ({"secagg_num_shares": 2}, "secagg_num_shares"),  # a count of shares must be >= 3 (Flower's rule)
    ({"secagg_num_shares": 1.5}, "secagg_num_shares"),  # neither a fraction nor a whole count
    ({"secagg_num_shares": 1e9}, "secagg_num_shares"),  # more shares than the modulus holds
    ({"secagg_reconstruction_threshold": 2.5}, "secagg_reconstruction_threshold"),
    ({"secagg_num_shares": 4, "secagg_reconstruction_threshold": 4}, "secagg_reconstruction_threshold"),
    ({"test_data": 5}, "test_data"),
    ({"secagg": "yes"}, "secagg"),
])
def test_the_flower_section_refuses_values_out_of_range_naming_the_field(values, field):
    from fdam_ray.flower import split_config

    with pytest.raises(ConfigError, match=rf"^config field 'flower\.{field}': .* is not allowed \(.+\)$"):
        split_config({"flower": values})


def test_valid_flower_sections_are_kept_as_given():
    from fdam_ray.flower import split_config

    _, section = split_config({"flower": {"secagg_num_shares": 5, "secagg_reconstruction_threshold": 3,
                                          "round_timeout_s": 30, "secagg_clipping_range": 0.5}})
    assert (section.secagg_num_shares, section.secagg_reconstruction_threshold) == (5, 3)
    _, section = split_config({"flower": {"secagg_num_shares": 1.0, "secagg_reconstruction_threshold": 0.5}})
    assert section.round_timeout_s == 600.0


@pytest.mark.parametrize("section, field", [
    ({"round_timeout_s": float("nan")}, "flower.round_timeout_s"),
    ({"secagg_clipping_range": float("inf")}, "flower.secagg_clipping_range"),
    ({"secag": True}, "flower.secag"),
    (3, "flower"),
])
def test_fdam_train_checks_the_flower_section_it_ignores(section, field):
    """A simulation ignores the section, but a broken one is the same study's error: it is refused before anything
    runs (build_config is what `fdam train` and train_arrays read a config with)."""
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")) as caught:
        build_config({"algorithm": "codasca", "flower": section})
    assert "\n" not in str(caught.value)
    assert build_config({"algorithm": "codasca", "flower": {"secagg": True}}) == build_config({"algorithm": "codasca"})
    assert build_config({"algorithm": "codasca", "flower": None}) == build_config({"algorithm": "codasca"})


# -- the consortium's timeouts ----------------------------------------------------------------------------------
def fake_flwr(folder: Path, seconds: float, result: Path | None = None) -> str:
    """A `flwr` that takes ``seconds`` to submit (a busy machine), then writes ``result`` if given."""
    script = folder / "flwr"
    write = f"np.savez({str(result)!r}, v=np.zeros(1))" if result else "pass"
    script.write_text(f"#!{sys.executable}\nimport time, numpy as np\ntime.sleep({seconds})\n{write}\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return str(script)


def test_a_consortium_run_waits_as_long_as_its_timeout_says_and_its_expiry_is_one_line(tmp_path, monkeypatch):
    from fdam_ray.flower import deployment
    from fdam_ray.flower.deployment import Consortium

    consortium = Consortium(tmp_path / "c", [])
    (tmp_path / "study.yaml").write_text("lr: 0.1\n")  # the study travels in the run config: it is read first
    slow = fake_flwr(tmp_path, 30)
    monkeypatch.setattr(consortium, "_bin", lambda name: slow)
    start = time.monotonic()
    with pytest.raises(TimeoutError) as caught:
        consortium.run(tmp_path, tmp_path / "study.yaml", tmp_path / "result.npz", timeout=1.5)
    assert time.monotonic() - start < 10  # the submission counts against the run's timeout, not 120 s of its own
    message = str(caught.value)
    assert "\n" not in message and "1.5 s" in message and "timeout" in message and str(tmp_path / "c") in message

    seen = {}
    real_run = subprocess.run

    def record(*args, **kwargs):
        seen["timeout"] = kwargs.get("timeout")
        return real_run(*args, **kwargs)

    monkeypatch.setattr(deployment.subprocess, "run", record)
    monkeypatch.setattr(consortium, "_bin", lambda name: fake_flwr(tmp_path, 0, tmp_path / "result.npz"))
    consortium.run(tmp_path, tmp_path / "study.yaml", tmp_path / "result.npz", timeout=900)
    assert seen["timeout"] is not None and 120 < seen["timeout"] <= 900  # the setting, not a hard-coded 120 s


def test_the_consortium_example_ends_a_timeout_in_one_line(monkeypatch, capsys):
    spec = importlib.util.spec_from_file_location("consortium_example", ROOT / "examples" / "consortium.py")
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    seen = {}

    def expire(folder, *, quick, secagg, timeout):
        seen["timeout"] = timeout
        raise TimeoutError("the consortium's run wrote no result within timeout=3 s; see the logs in /x")

    monkeypatch.setattr(example, "run", expire)
    monkeypatch.setattr(sys, "argv", ["consortium.py", "--quick", "--timeout", "3"])
    with pytest.raises(SystemExit) as caught:
        example.main()
    assert seen["timeout"] == 3.0
    assert caught.value.code not in (0, None)
    assert str(caught.value.code).count("\n") == 0 and "within timeout=3 s" in str(caught.value.code)


# -- sites that cannot take part -------------------------------------------------------------------------------
CODASCA = dict(algorithm="codasca", model="linear", batch_size=8, seed=3, executor="inline", local_steps=2,
               iterations=12, lr=0.2, global_lr=1.3, prox_weight=0.01, stage_length=6, eval_every=6)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("flower-sites")
    rng = np.random.default_rng(0)
    for k, n in enumerate((30, 40, 36)):
        x, x_test = rng.normal(size=(n, 4)).astype(np.float32), rng.normal(size=(20, 4)).astype(np.float32)
        np.savez(folder / f"site{k}.npz", x=x, y=(x[:, 0] > 0).astype(np.float32), x_test=x_test,
                 y_test=(x_test[:, 0] > 0).astype(np.float32))
    return folder


def configs(folder, more=None):
    """The three sites' node configs; ``more`` adds keys by site."""
    return [{"site": k, "data": str(folder / f"site{k}.npz"), **(more or {}).get(k, {})} for k in range(3)]


def run(grid, config=CODASCA, **flower):
    from fdam_ray.flower.inprocess import server_context
    from fdam_ray.flower.server_app import run_federation

    return run_federation(grid, server_context(), {**config, "num_clients": 3, "flower": flower})


def one_line_errors(caplog):
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


def test_a_site_whose_require_secagg_disagrees_with_the_server_stops_the_run_naming_it(folder, caplog):
    from fdam_ray.flower.client_app import app
    from fdam_ray.flower.inprocess import InProcessGrid

    grid = InProcessGrid(app, configs(folder, {2: {"require-secagg": True}}))
    with caplog.at_level(logging.WARNING), pytest.raises(RuntimeError) as caught:
        run(grid)
    message, node = str(caught.value), grid.node_of_site(2)
    assert "\n" not in message
    assert "site 2" in message and f"node {node}" in message and "require-secagg" in message
    assert "flower.secagg: true" in message
    site_lines = [m for m in one_line_errors(caplog) if m != message]
    assert any("site 2" in m and f"node {node}" in m and "require-secagg" in m for m in site_lines), site_lines
    assert "sent no update" not in caplog.text  # not left out round after round: stopped before the first


def test_a_site_that_requires_secagg_takes_part_when_the_server_runs_it(folder):
    from fdam_ray.flower.client_app import app
    from fdam_ray.flower.inprocess import InProcessGrid

    grid = InProcessGrid(app, configs(folder, {k: {"require-secagg": True} for k in range(3)}))
    result = run(grid, dict(CODASCA, iterations=2, eval_every=2), secagg=True)
    assert result.state.iteration == 2


@pytest.mark.parametrize("when", ["at-start", "mid-run"])
def test_two_nodes_claiming_one_site_stop_the_run_naming_both(folder, caplog, when):
    from fdam_ray.flower.client_app import app
    from fdam_ray.flower.inprocess import InProcessGrid

    class Grid(InProcessGrid):
        extra = None

        def push_messages(self, messages):
            messages = list(messages)
            if self.extra is None and any(m.metadata.message_type == "train.round" for m in messages):
                self.extra = self.add_node({"site": 1, "data": str(folder / "site1.npz")})  # joins after round 1
            return super().push_messages(messages)

    grid = Grid(app, configs(folder)) if when == "mid-run" else InProcessGrid(app, configs(folder))
    first = grid.node_of_site(1)
    if when == "at-start":
        grid.extra = grid.add_node({"site": 1, "data": str(folder / "site1.npz")})
    start = time.monotonic()
    with caplog.at_level(logging.WARNING), pytest.raises(RuntimeError) as caught:
        run(grid)
    assert time.monotonic() - start < 20
    message, extra = str(caught.value), grid.extra
    assert "\n" not in message and "site 1" in message and f"nodes {first} and {extra} both" in message
    assert "its own site" in message  # what to do
    for node in (first, extra):  # each claimant is told, on its side
        assert any(f"node {node}" in m and "site 1" in m for m in one_line_errors(caplog) if m != message)
    assert "is now node" not in caplog.text  # no taking turns


class DamagingGrid:
    """Site 1's SuperNode restarts after round 3, and its state file is found damaged."""

    def __new__(cls, folder, state_dir, damage: bytes):
        from fdam_ray.flower.client_app import app
        from fdam_ray.flower.inprocess import InProcessGrid

        class Grid(InProcessGrid):
            done = False
            trained: list

            def push_messages(self, messages):
                messages = list(messages)
                for m in messages:
                    cfg = m.content.config_records.get("config")
                    if m.metadata.message_type == "train.round" and cfg is not None:
                        self.trained.append((int(cfg["plan_round"]), m.metadata.dst_node_id))
                return super().push_messages(messages)

            def get_node_ids(self):
                if not self.done and any(r == 3 for r, _ in self.trained):
                    self.done = True
                    (state_dir / "site-1.pt").write_bytes(damage)
                    self.restart_node(self.node_of_site(1))
                return super().get_node_ids()

        grid = Grid(app, [dict(c, **{"state-dir": str(state_dir)}) for c in configs(folder)])
        grid.trained = []
        return grid


def damaged(kind: str) -> bytes:
    import io

    import torch

    if kind == "text":
        return b"not a state file"
    if kind == "zip":
        return b"PK\x03\x04" + b"\0" * 40
    buf = io.BytesIO()  # a readable file that is not a site's state
    torch.save({"run_key": 5, "client": [1, 2]} if kind == "record" else {"weights": torch.zeros(3)}, buf)
    return buf.getvalue()


@pytest.mark.parametrize("damage", ["text", "zip", "record", "other"])
def test_a_site_with_a_damaged_state_file_says_so_and_rejoins_as_a_replaced_client(folder, tmp_path, caplog, damage):
    grid = DamagingGrid(folder, tmp_path, damaged(damage))
    with caplog.at_level(logging.WARNING):
        result = run(grid)
    assert grid.done and result.state.iteration == CODASCA["iterations"]
    node = grid.node_of_site(1)
    assert any(r > 3 and n == node for r, n in grid.trained)  # site 1 took part again
    text = caplog.text
    assert "weights_only" not in text and "Traceback" not in text  # no advice to load it unsafely
    path = str(tmp_path / "site-1.pt")
    site_line = [r.getMessage() for r in caplog.records if path in r.getMessage() and "damaged" in r.getMessage()]
    assert site_line and f"node {node}" in site_line[0] and "site 1" in site_line[0]
    assert any(f"site 1 (node {node})" in r.getMessage() and "replaced client" in r.getMessage()
               and "damaged" in r.getMessage() for r in caplog.records)
    assert list(tmp_path.glob("site-1.pt.damaged*"))  # kept aside to look at, not loaded


def failing_site(site: int, message_type: str = "train.round"):
    """The ClientApp, except that site ``site`` fails every ``message_type`` message (its code raises)."""
    from fdam_ray.flower.client_app import app

    def client_app(msg, context):
        if msg.metadata.message_type == message_type and int(context.node_config["site"]) == site:
            raise OSError(f"site {site}'s disk is full\nmore lines of a traceback")
        return app(msg, context)

    return client_app


def test_a_site_that_fails_every_round_stops_the_run_after_its_retries_naming_it(folder, caplog):
    from fdam_ray.flower.inprocess import InProcessGrid

    grid = InProcessGrid(failing_site(2), configs(folder))
    with caplog.at_level(logging.WARNING), pytest.raises(RuntimeError) as caught:
        run(grid, dict(CODASCA, iterations=40, stage_length=40, eval_every=40))
    message, node = str(caught.value), grid.node_of_site(2)
    assert "\n" not in message
    assert f"site 2 (node {node}): train.round failed: OSError: site 2's disk is full" in message
    assert "max_client_retries=2" in message and "on_client_failure: drop" in message  # what to do
    assert caplog.text.count("sent no update") == 2  # rounds 1 and 2 went on without it; round 3 stopped the run


def test_a_site_that_fails_every_round_is_dropped_once_under_on_client_failure_drop(folder, caplog):
    from fdam_ray.flower.inprocess import InProcessGrid

    grid = InProcessGrid(failing_site(2), configs(folder))
    with caplog.at_level(logging.WARNING):
        result = run(grid, dict(CODASCA, on_client_failure="drop", max_client_retries=0))
    assert result.state.iteration == CODASCA["iterations"]
    dropped = [r.getMessage() for r in caplog.records if "it is dropped" in r.getMessage()]
    assert len(dropped) == 1 and f"site 2 (node {grid.node_of_site(2)})" in dropped[0]
    assert "sent no update" not in caplog.text  # said once, when it was dropped; the rounds are quiet


@pytest.mark.parametrize("bad", [{"site": 7}, {"data": "/nonexistent/site1.npz"}], ids=["site-7", "no-data"])
def test_a_node_that_cannot_be_a_site_stops_the_start_at_once_naming_it(folder, caplog, bad):
    from fdam_ray.flower.client_app import app
    from fdam_ray.flower.inprocess import InProcessGrid

    nodes = configs(folder)
    nodes[1] = dict(nodes[1], **bad)
    grid = InProcessGrid(app, nodes)
    start = time.monotonic()
    with pytest.raises(RuntimeError) as caught:
        run(grid, connect_timeout_s=60)
    assert time.monotonic() - start < 10  # not the 60 s of connect_timeout_s
    message = str(caught.value)
    assert "\n" not in message and "sites [1] have not connected" in message and "node 102" in message
    assert ("site 7" if "site" in bad else "nonexistent") in message
