"""fdam-ray on Flower (fdam_ray.flower): a Flower run is the inline run, on Flower's message flow and on its
deployment engine; SecAgg+ within its quantisation; sites that drop out, return or restart.

Without Flower installed (fdam-ray's ``flower`` extra) only the first test runs: fdam_ray imports and
trains without it.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from flower_helpers import RecordingGrid, write_three_sites

import fdam_ray
from fdam_ray.config import ConfigError, build_config

ROOT = Path(__file__).resolve().parents[2]


def test_fdam_ray_runs_without_flower_and_the_bridge_says_what_to_install():
    code = textwrap.dedent("""
        import sys
        sys.modules["flwr"] = None  # as if Flower were not installed
        import numpy as np
        import fdam_ray
        x = np.random.default_rng(0).normal(size=(20, 3)).astype("float32")
        y = (x[:, 0] > 0).astype("float32")
        fdam_ray.train_arrays(dict(model="linear", batch_size="full", iterations=2, local_steps=1, eval_every=2,
                                   executor="inline"), [(x, y), (x, y)], (x, y))
        try:  # the study's flower section is checked without Flower
            fdam_ray.config.build_config({"flower": {"round_timeout_s": float("nan")}})
        except fdam_ray.config.ConfigError as exc:
            print("checked:", exc)
        try:
            import fdam_ray.flower.server_app
        except ImportError as exc:
            print("refused:", exc)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-2000:]
    from fdam_ray.files.extras import extra_hint

    assert f"refused: fdam_ray.flower needs Flower: {extra_hint('flower', 'flwr')}" in out.stdout
    assert "checked: config field 'flower.round_timeout_s': nan is not allowed" in out.stdout


def test_a_simulation_reads_the_same_config_file_and_ignores_its_flower_section():
    assert build_config({"algorithm": "codasca", "flower": {"secagg": True}}) == build_config({"algorithm": "codasca"})
    with pytest.raises(ConfigError, match="unknown config field 'flowr_secagg'"):
        build_config({"flowr": {"secagg": True}})


os.environ["FLWR_TELEMETRY_ENABLED"] = "0"  # before flwr is imported: nothing leaves 127.0.0.0/8
HAVE_FLOWER = importlib.util.find_spec("flwr") is not None
needs_flower = pytest.mark.skipif(not HAVE_FLOWER, reason="Flower is not installed (fdam-ray's flower extra): "
                                                           "the Flower bridge's tests are skipped")
if HAVE_FLOWER:
    from fdam_ray.flower import split_config
    from fdam_ray.flower.client_app import app as client_app
    from fdam_ray.flower.inprocess import InProcessGrid, server_context
    from fdam_ray.flower.server_app import run_federation
    from fdam_ray.flower.site import KeptState
else:  # the classes below subclass the in-process grid; without Flower their tests are skipped
    InProcessGrid = object

CODASCA = dict(algorithm="codasca", model="linear", batch_size=8, seed=3, executor="inline", local_steps=3,
               iterations=24, lr=0.2, global_lr=1.3, prox_weight=0.01, stage_length=9, eval_every=6)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """The three sites' data and the test set, as arrays and as the .npz files the sites and the server read."""
    return write_three_sites(tmp_path_factory.mktemp("flower-data"))


def node_configs(folder, state_dir=None, **more):
    return [{"site": k, "data": str(folder / f"site{k}.npz"), **({"state-dir": str(state_dir)} if state_dir else {}),
             **more} for k in range(3)]


def flower_run(folder, config, grid=None, **flower):
    grid = grid or InProcessGrid(client_app, node_configs(folder))
    return run_federation(grid, server_context(), {**config, "num_clients": 3,
                                                   "flower": {"test_data": str(folder / "test.npz"), **flower}})


def max_difference(a, b):
    out = 0.0
    for name, x in a.state.vectors().items():
        y = b.state.vectors()[name]
        assert (x is None) == (y is None), name
        if x is not None and x.size:
            out = max(out, float(np.abs(x.astype(np.float64) - y).max()))
    return out


@needs_flower
@pytest.mark.parametrize("case", [
    dict(CODASCA),
    dict(CODASCA, algorithm="coda_plus"),
    dict(CODASCA, algorithm="coda"),  # CODA's closed-form alpha from the sites' score sums at every stage end
    dict(CODASCA, clients_per_round=2, client_weighting="samples"),  # s.3b: sampled rounds, weights n_k
], ids=["codasca-stages-eta_g", "coda_plus", "coda", "codasca-sampled-weighted"])
def test_a_flower_run_equals_the_inline_run(data, case):
    clients, test, folder = data
    inline = fdam_ray.train_arrays(case, clients, test)
    flower = flower_run(folder, case)
    assert max({h["stage"] for h in flower.history}) == 3  # the run crossed two stage ends
    assert max_difference(inline, flower) <= 1e-6  # in fact bit for bit: the same sums in the same order
    assert [h["test_auc"] for h in flower.history] == [h["test_auc"] for h in inline.history]
    assert flower.summary["bytes_up"] == inline.summary["bytes_up"]


# Measured on this data (8 rounds, defaults clip 8 and 2**24 levels): at most 5e-6 on any value of the final
# state, the test AUC unchanged. Each value carries at most 2 * 8 / 2**24 = 9.5e-7 per site and round.
SECAGG_TOLERANCE = 2e-5


@needs_flower
@pytest.mark.parametrize("case", [dict(CODASCA), dict(CODASCA, algorithm="coda_plus"),
                                  dict(CODASCA, clients_per_round=2, client_weighting="samples")],
                         ids=["codasca", "coda_plus", "codasca-sampled-weighted"])
def test_under_secagg_the_server_sees_only_sums_and_the_run_is_within_the_quantisation(data, case):
    clients, test, folder = data
    inline = fdam_ray.train_arrays(case, clients, test)
    grid = RecordingGrid(client_app, node_configs(folder))
    flower = flower_run(folder, case, grid, secagg=True)
    assert 0 < max_difference(inline, flower) <= SECAGG_TOLERANCE
    assert abs(flower.history[-1]["test_auc"] - inline.history[-1]["test_auc"]) <= 1e-3
    assert "train.round" not in grid.sent  # no update travelled in the clear
    trained = [r for r in grid.replies if r.metadata.message_type == "train"]
    assert trained and all(not len(a) for r in trained for a in r.content.array_records.values())


@needs_flower
def test_a_site_that_requires_secagg_refuses_a_round_in_the_clear(data):
    *_, folder = data
    grid = InProcessGrid(client_app, node_configs(folder, **{"require-secagg": True}))
    with pytest.raises(RuntimeError, match=r"site 0 \(node 101\) takes part only in rounds under secure aggregation"):
        flower_run(folder, CODASCA, grid)  # refused before any round: nothing was sent in the clear


def round_of(msg):
    cfg = msg.content.config_records.get("config")
    return None if cfg is None or "plan_round" not in cfg else int(cfg["plan_round"])


def site_2_round(r):
    return lambda msg: (msg.metadata.message_type == "train.round" and round_of(msg) == r
                        and msg.metadata.dst_node_id == 103)


@needs_flower
def test_a_site_that_drops_mid_round_is_left_out_under_the_partial_participation_rule(data, caplog):
    """Site 2's reply of round 7 is lost (it trained, the server never heard): the round completes with sites 0
    and 1, and site 2 goes on from its state before round 7, exactly as if round 7 had never reached it."""
    *_, folder = data
    with caplog.at_level(logging.WARNING):
        lost = flower_run(folder, CODASCA, InProcessGrid(client_app, node_configs(folder),
                                                         lose_reply=site_2_round(7)))
    assert "round 7: sites [2] sent no update" in caplog.text and "partial-participation rule" in caplog.text
    assert "its update of round 7 was not counted" in caplog.text

    class Away(InProcessGrid):  # round 7's message never reaches site 2
        def push_messages(self, messages):
            messages = list(messages)
            kept = [m for m in messages if not site_2_round(7)(m)]
            ids = list(super().push_messages(kept))
            return ids + ["never"] * (len(messages) - len(kept))

    away = flower_run(folder, CODASCA, Away(client_app, node_configs(folder)))
    assert max_difference(lost, away) == 0.0
    assert max_difference(lost, fdam_ray.train_arrays(CODASCA, *data[:2])) > 1e-4  # round 7 lacked site 2


@needs_flower
def test_under_secagg_a_site_that_drops_mid_protocol_is_left_out_and_its_masks_are_recovered(data, caplog):
    """Site 2's masked vector of round 7 never arrives: SecAgg+ unmasks the sum of sites 0 and 1 from the key
    shares (threshold 2 of 3), the round completes with them, and site 2 goes on from its state before round 7."""
    clients, test, folder = data

    def lose(msg):
        cfg = msg.content.config_records.get("fitins.config")
        return (msg.metadata.message_type == "train" and cfg is not None and int(cfg["plan_round"]) == 7
                and msg.metadata.dst_node_id == 103)

    with caplog.at_level(logging.WARNING):
        result = flower_run(folder, CODASCA, InProcessGrid(client_app, node_configs(folder), lose_reply=lose),
                            secagg=True)
    assert "round 7: sites [2] sent no update" in caplog.text and "partial-participation rule" in caplog.text
    assert "site 2: its update of round 7 was not counted" in caplog.text
    assert result.state.iteration == CODASCA["iterations"]
    assert max_difference(result, fdam_ray.train_arrays(CODASCA, clients, test)) > 1e-4  # round 7 lacked site 2


@needs_flower
def test_after_a_round_a_site_dropped_out_of_c_is_the_mean_of_every_sites_c_k(data):
    """The last round (8) loses site 2's reply: c must stay the mean of all three c^k (sites 0 and 1 after
    round 8, site 2 before it), not the mean of the two that came."""
    *_, folder = data
    grid = InProcessGrid(client_app, node_configs(folder), lose_reply=site_2_round(8))
    result = flower_run(folder, CODASCA, grid)
    kept = [KeptState.from_bytes(bytes(grid.contexts[n].state.config_records["fdam_site"]["blob"]))
            for n in sorted(grid.contexts)]
    c_k = [np.asarray((s.pending if k < 2 else s.client)["c_v"], dtype=np.float64) for k, s in enumerate(kept)]
    assert kept[2].pending_round == 8  # site 2 trained round 8; the server never counted it
    assert np.abs(result.state.c_v - np.mean(c_k, axis=0)).max() <= 1e-6
    assert np.abs(result.state.c_v - np.mean(c_k[:2], axis=0)).max() > 1e-4


class RestartingGrid(InProcessGrid):
    """Site 1's SuperNode restarts (new node id, empty node state) between rounds ``after`` (3) and the next."""

    done = False
    last_round = 0
    after = 3

    def push_messages(self, messages):
        messages = list(messages)
        self.last_round = max([self.last_round, *[round_of(m) or 0 for m in messages]])
        return super().push_messages(messages)

    def get_node_ids(self):
        if self.last_round == self.after and not self.done:
            self.done = True
            self.restart_node(self.node_of_site(1))
        return super().get_node_ids()


@needs_flower
def test_a_site_keeps_its_state_across_a_supernode_restart_in_its_state_file(data, tmp_path, caplog):
    clients, test, folder = data
    grid = RestartingGrid(client_app, node_configs(folder, tmp_path / "site-state"))
    with caplog.at_level(logging.WARNING):
        restarted = flower_run(folder, CODASCA, grid)
    assert "site 1 is now node" in caplog.text or "site 1 (node" in caplog.text
    assert grid.done
    assert max_difference(restarted, fdam_ray.train_arrays(CODASCA, clients, test)) <= 1e-6
    assert sorted(p.name for p in (tmp_path / "site-state").iterdir()) == ["site-0.pt", "site-1.pt", "site-2.pt"]


@needs_flower
def test_a_site_that_lost_its_state_rejoins_as_a_replaced_client_recorded_and_replayed(data, tmp_path, caplog):
    """Site 1's node restarts without its state after round 4, mid-stage (stages of 3 rounds: the global c is not
    zero there): it rejoins as a fresh client adopting the global c in round 5 (recorded in the checkpoint's
    ``rebuilt``), and the inline run replaying that record is the Flower run, while the run without the fault
    is not."""
    from fdam_ray.checkpoint import load_checkpoint

    clients, test, folder = data
    grid = RestartingGrid(client_app, node_configs(folder))  # no state-dir: the node state was all it had
    grid.after = 4
    with caplog.at_level(logging.WARNING):
        result = run_federation(grid, server_context(), {**CODASCA, "num_clients": 3, "flower": {
            "test_data": str(folder / "test.npz")}}, run_dir=tmp_path / "run")
    assert "kept no state of this run: it rejoins as a replaced client" in caplog.text
    assert f"site 1 (node {grid.node_of_site(1)}) kept no state" in caplog.text
    assert result.state.iteration == CODASCA["iterations"]
    loop = load_checkpoint(tmp_path / "run" / "checkpoint.pt").loop
    assert loop.rebuilt == {"5": [1]} and loop.participation == {}
    assert max_difference(result, fdam_ray.train_arrays(CODASCA, clients, test)) > 1e-4
    replay = fdam_ray.train_arrays(dict(CODASCA, participation_record=str(tmp_path / "run")), clients, test)
    assert max_difference(result, replay) <= 1e-6


@needs_flower
def test_the_flower_section_is_its_own_section_of_the_same_config():
    fields, flower = split_config({**CODASCA, "flower": {"secagg": True, "round_timeout_s": 30}})
    assert fields == CODASCA and flower.secagg and flower.round_timeout_s == 30
    with pytest.raises(ConfigError, match=r"unknown field 'flower\.secag'"):
        split_config({"flower": {"secag": True}})
    with pytest.raises(ConfigError, match=r"flower\.secagg_quantization_range"):
        split_config({"flower": {"secagg_quantization_range": 2**40}})


@needs_flower
@pytest.mark.fault  # in benchmarks/fault_tests.py (about 5 min); CI's slow tier runs the consortium example below
def test_the_deployment_engine_with_tls_equals_the_inline_run(data, tmp_path):
    """A SuperLink and 3 SuperNodes on 127.0.0.1 with TLS and node authentication, started and stopped here by
    pid; ``flwr run`` submits CODASCA (2 stages, eta_g 1.3), CODA+ and CODASCA under SecAgg+ in turn. Two more
    SuperNodes try to take part: one whose key was never registered (the SuperLink does not let it in) and a
    registered one claiming site 1, whose key the study's flower.site_keys does not give site 1 (the run refuses
    it, names it, and goes on with the site's own node). Each message starts a ClientApp process, so a run takes
    minutes on 2 busy cores."""
    import re

    import yaml
    from cryptography.hazmat.primitives import serialization

    from fdam_ray.flower.deployment import Consortium, _alive, write_app

    clients, test, folder = data
    small = dict(CODASCA, iterations=6, local_steps=2, stage_length=4, eval_every=6)
    cases = [("codasca", small, {}), ("coda_plus", dict(small, algorithm="coda_plus"), {}),
             ("secagg", dict(small, iterations=2, eval_every=2), {"secagg": True})]
    app = write_app(tmp_path / "app")
    with Consortium(tmp_path / "consortium", node_configs(folder, tmp_path / "site-state")) as consortium:
        pids = [p.pid for p in consortium.processes.values()]
        stranger = consortium.add_site(node_configs(folder, tmp_path / "stranger-state")[0])  # never registered
        impostor = consortium.add_site(node_configs(folder, tmp_path / "impostor-state")[1])
        impostor_node = consortium.register(impostor)
        pids += [consortium.start_site(stranger).pid, consortium.start_site(impostor).pid]
        keys = {str(k): consortium.keys[k].fingerprint for k in range(3)}  # a config's keys are text
        for name, case, flower in cases:
            config = tmp_path / f"{name}.yaml"
            config.write_text(yaml.safe_dump({**case, "num_clients": 3, "flower": {
                "test_data": str(folder / "test.npz"), "round_timeout_s": 600, "site_keys": keys, **flower}}))
            consortium.run(app, config, tmp_path / f"{name}.npz", timeout=1200)
            got = np.load(tmp_path / f"{name}.npz")
            inline = fdam_ray.train_arrays(case, clients, test)
            gap = max(float(np.abs(got[n].astype(np.float64) - x).max())
                      for n, x in inline.state.vectors().items() if x is not None and x.size)
            assert gap <= (SECAGG_TOLERANCE if flower else 1e-6), name
            if name == "codasca":  # the ServerApp's own log of the first run
                flwr_run = (tmp_path / "consortium" / "flwr-run.log").read_text(errors="replace")
                run_id = re.search(r"started run (\d+)", flwr_run).group(1)
                server = subprocess.run([consortium._bin("flwr"), "log", run_id, "consortium", "--show"],
                                        env=consortium.env, capture_output=True, text=True, timeout=120).stdout
        logs = {p.stem: p.read_text(errors="replace") for p in (tmp_path / "consortium").glob("*.log")}
    assert "running on https://127.0.0.1:" in logs["superlink"]  # TLS, loopback only
    assert not [p for p in pids if _alive(p)]
    assert len(list((tmp_path / "site-state").iterdir())) == 3
    stranger_key = serialization.load_ssh_public_key(consortium.keys[stranger].public.read_bytes())
    body = stranger_key.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    refused = [line for line in logs["superlink"].splitlines() if "No SuperNode found" in line]
    assert refused and body.decode().splitlines()[1] in refused[0]  # the SuperLink logs the key's first line
    assert "SuperNode ID" not in logs[f"site{stranger}"]
    assert "SuperNode ID" in logs[f"site{impostor}"]  # registered: it got in, and only the run refused it
    bound = rf"(key {re.escape(keys['1'])}|node \d+ \({re.escape(keys['1'])}\))"
    impostor_fp = re.escape(consortium.keys[impostor].fingerprint)
    line = rf"site 1 is bound to {bound}; node {impostor_node} \({impostor_fp}\) claims it and is refused"
    assert re.search(line, server), server[-3000:]
    assert re.search(rf"site 1 \(node {impostor_node}\): refused by the server: {line}", logs[f"site{impostor}"])


@needs_flower
@pytest.mark.slow
def test_the_consortium_example_runs_quick(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "consortium.py"), "--quick", "--folder",
                          str(tmp_path)], capture_output=True, text=True, timeout=1800,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-3000:]
    assert "largest difference from the simulation's final state: 0.00e+00" in out.stdout
