"""The consortium's server on Flower's message flow (in-process grid): the study shipped in the run config, the
run folder the server writes, a study resumed from it after the server stopped mid-round (bit for bit the
uninterrupted study), and sites that read their own chest X-rays."""

from __future__ import annotations

import json
import os
import re

import numpy as np
import pytest
import yaml
from chestxray_fixtures import write_chexpert, write_nih
from flower_helpers import HAVE_FLOWER, RecordingGrid, write_three_sites

import fdam_ray
from fdam_ray.config import ConfigError

pytestmark = pytest.mark.skipif(not HAVE_FLOWER, reason="Flower is not installed (the flower extra)")
if HAVE_FLOWER:
    from fdam_ray.flower.client_app import app as client_app
    from fdam_ray.flower.inprocess import InProcessGrid, server_context
    from fdam_ray.flower.server_app import main, run_federation, study_values
else:
    InProcessGrid = object

os.environ["FLWR_TELEMETRY_ENABLED"] = "0"

# 8 rounds of 3 steps, a stage every 3 rounds (rounds 4 and 7 begin stages 2 and 3), eta_g 1.3, control variates
STUDY = dict(algorithm="codasca", model="linear", batch_size=8, seed=3, executor="inline", local_steps=3,
             iterations=24, lr=0.2, global_lr=1.3, prox_weight=0.01, stage_length=9, eval_every=6, num_clients=3)
RUN_FILES = ["checkpoint.pt", "config.yaml", "metrics.csv", "metrics.jsonl", "model.pt", "summary.json"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_three_sites(tmp_path_factory.mktemp("server-data"))


def node_configs(folder, state_dir=None):
    return [{"site": k, "data": str(folder / f"site{k}.npz"), **({"state-dir": str(state_dir)} if state_dir else {})}
            for k in range(3)]


def study(folder, **more):
    return {**STUDY, **more, "flower": {"test_data": str(folder / "test.npz")}}


class ServerLost(RuntimeError):
    """The server process ends here (the sites have handled the message; no reply reaches the server)."""


class StoppingGrid(RecordingGrid):
    """Stops the server at the ``stop_at``-th train round: ``delivered``, after the sites ran it (their uncounted
    pending states written), else as it sends it (the sites hold the previous round's state, counted and
    checkpointed, but not yet told so)."""

    def __init__(self, *args, stop_at, delivered, **kwargs):
        super().__init__(*args, **kwargs)
        self.stop_at, self.delivered, self.rounds = stop_at, delivered, 0

    def push_messages(self, messages):
        messages = list(messages)
        training = any(m.metadata.message_type == "train.round" for m in messages)
        self.rounds += training
        if training and self.rounds == self.stop_at and not self.delivered:
            raise ServerLost(f"the server stopped sending round {self.rounds}")
        ids = super().push_messages(messages)
        if training and self.rounds == self.stop_at:
            raise ServerLost(f"the server stopped in round {self.rounds}")
        return ids


def vectors_equal(a, b):
    for name, x in a.state.vectors().items():
        y = b.state.vectors()[name]
        assert (x is None) == (y is None), name
        if x is not None:
            np.testing.assert_array_equal(x, y, err_msg=name)


def records_of(run_dir):
    """metrics.jsonl without its timings (wall time, throughput)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [{k: v for k, v in r.items() if k not in ("wall_s", "samples_per_s")} for r in rows]


def test_the_run_config_carries_the_study_as_text_and_the_server_checks_it(data, tmp_path):
    folder = data[2]
    values = study(folder)
    assert study_values({"study": yaml.safe_dump(values)}) == values
    assert study_values({"study": json.dumps(values)}) == values  # JSON is YAML
    (tmp_path / "study.yaml").write_text(yaml.safe_dump(values))
    assert study_values({"config": str(tmp_path / "study.yaml")}) == values  # a file on this host (one machine)
    with pytest.raises(ConfigError, match=r"must carry the study.*not neither"):
        study_values({"study": "", "config": ""})
    with pytest.raises(ConfigError, match="not both"):
        study_values({"study": "lr: 1", "config": str(tmp_path / "study.yaml")})
    with pytest.raises(ConfigError, match="must hold a mapping of field: value, not list"):
        study_values({"study": "[1, 2]"})
    with pytest.raises(ConfigError, match="unknown config field 'lrr'"):  # fdam's own check, on the server
        main(InProcessGrid(client_app, node_configs(folder)), server_context(run_config={
            "study": yaml.safe_dump({**values, "lrr": 0.1}), "run-dir": str(tmp_path / "never")}))
    assert not (tmp_path / "never").exists()


def test_the_server_writes_its_run_folder_and_the_result(data, tmp_path):
    clients, test, folder = data
    run_dir, out = tmp_path / "runs" / "study1", tmp_path / "result.npz"
    main(InProcessGrid(client_app, node_configs(folder)), server_context(run_config={
        "study": yaml.safe_dump(study(folder)), "run-dir": str(run_dir), "result": str(out)}))
    assert set(RUN_FILES) <= {p.name for p in run_dir.iterdir()}
    summary = json.loads((run_dir / "summary.json").read_text())
    inline = fdam_ray.train_arrays(STUDY, clients, test)
    assert summary["final_test_auc"] == inline.summary["final_test_auc"]
    assert [r["test_auc"] for r in records_of(run_dir)] == [h["test_auc"] for h in inline.history]
    np.testing.assert_array_equal(np.load(out)["v"], inline.state.v)


@pytest.mark.parametrize("stop_at, delivered, restart_nodes", [(6, False, False), (4, True, True)],
                         ids=["sending-round-6-nodes-kept", "in-round-4-a-stage-start-every-node-restarted"])
def test_a_study_stopped_mid_round_and_resumed_from_its_folder_equals_the_uninterrupted_study(
        data, tmp_path, stop_at, delivered, restart_nodes):
    """The server stops as it sends round 6 (in stage 2: the sites hold round 5's state, which the server counted
    but never said so), or after the sites ran round 4 (the round that begins stage 2: they applied its new centre
    and c^k reset and hold an uncounted round); a new server given the same run folder resumes. Kept nodes keep
    their states in memory; restarted ones read their state files."""
    _, _, folder = data
    values = study(folder)
    whole = run_federation(InProcessGrid(client_app, node_configs(folder, tmp_path / "whole-state")),
                           server_context(run_id=7), values, run_dir=tmp_path / "whole")

    states, run_dir = tmp_path / "state", tmp_path / "stopped"
    grid = StoppingGrid(client_app, node_configs(folder, states), stop_at=stop_at, delivered=delivered)
    with pytest.raises(ServerLost):
        run_federation(grid, server_context(run_id=1), values, run_dir=run_dir)
    assert json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])["round"] < stop_at
    if restart_nodes:
        grid = RecordingGrid(client_app, node_configs(folder, states))  # new SuperNodes: node states empty
    else:
        grid.stop_at = -1
    resumed = run_federation(grid, server_context(run_id=2), values, run_dir=run_dir)  # a new `flwr run`
    vectors_equal(resumed, whole)
    assert resumed.history == [dict(h, wall_s=r["wall_s"], samples_per_s=r["samples_per_s"])
                               for h, r in zip(whole.history, resumed.history, strict=True)]
    assert records_of(run_dir) == records_of(tmp_path / "whole")
    assert json.loads((run_dir / "summary.json").read_text())["iterations"] == STUDY["iterations"]


def test_a_finished_study_is_not_run_again_and_a_changed_study_is_refused(data, tmp_path):
    _, _, folder = data
    values, run_dir = study(folder), tmp_path / "done"
    first = run_federation(InProcessGrid(client_app, node_configs(folder)), server_context(), values,
                           run_dir=run_dir)
    grid = RecordingGrid(client_app, node_configs(folder))
    again = run_federation(grid, server_context(run_id=2), values, run_dir=run_dir)
    assert grid.sent == [] and again.summary["final_test_auc"] == first.summary["final_test_auc"]
    with pytest.raises(ConfigError, match=r"cannot resume .* with a different config \(lr: 0\.2 -> 0\.3\)"):
        run_federation(grid, server_context(run_id=3), {**values, "lr": 0.3}, run_dir=run_dir)


# -- image sites -------------------------------------------------------------------------------------------------
IMAGES = dict(dataset="chestxray", chestxray_sources=["chexpert", "nih"], num_clients=2, image_size=16, model="cnn",
              model_width=4, seed=0, batch_size=4, executor="inline", local_steps=2, iterations=8, stage_length=4,
              eval_every=4, lr=0.1, chestxray_test_fraction=0.3, augment=True)


def test_image_sites_read_their_own_chest_xrays_and_equal_the_inline_study(tmp_path):
    """Each site reads only its organisation's files in the publisher's layout; the run is the inline run of
    the same study whose clients read both folders (the same images, test patients and augmentation)."""
    roots = {"chexpert": write_chexpert(tmp_path / "a"), "nih": write_nih(tmp_path / "b")}
    inline = fdam_ray.train({**IMAGES, **{f"chestxray_{n}_root": str(r) for n, r in roots.items()}}, save=False)
    nodes = [{"site": 0, "chestxray-root": str(roots["chexpert"]), "image-size": 16},
             {"site": 1, "chestxray-root": str(roots["nih"]), "image-size": 16}]
    flower = run_federation(InProcessGrid(client_app, nodes), server_context(), IMAGES)  # no root in the study
    vectors_equal(flower, inline)
    assert [h["test_auc"] for h in flower.history] == [h["test_auc"] for h in inline.history]
    with pytest.raises(RuntimeError, match=r"resizes its images to 32 .* the study's image_size is 16"):
        run_federation(InProcessGrid(client_app, [dict(n, **{"image-size": 32}) for n in nodes]), server_context(),
                       IMAGES)


# -- the deployment files and the guide ----------------------------------------------------------------------------
def _commands(text, program):
    """Every command line of ``program`` in ``text`` (comment marks dropped, continuation lines joined)."""
    joined = re.sub(r"\\\n\s*", "", re.sub(r"(?m)^#", "", text))
    return [line[line.index(program):] for line in joined.splitlines() if program + " --" in line]


def test_every_option_the_units_and_the_guide_give_flower_is_one_the_installed_flower_takes():
    from pathlib import Path

    from flwr.superlink.cli.flower_superlink import _parse_args_run_superlink
    from flwr.supernode.cli.flower_supernode import _parse_args_run_supernode

    root = Path(__file__).resolve().parents[2]
    files = [root / "deploy" / "consortium" / n for n in ("fdam-superlink.service", "fdam-supernode.service",
                                                         "Dockerfile")] + [root / "docs" / "how-to" / "consortium.md"]
    texts = [f.read_text() for f in files]
    for program, parser in (("flower-superlink", _parse_args_run_superlink),
                            ("flower-supernode", _parse_args_run_supernode)):
        taken = set(parser()._option_string_actions)
        lines = [c for t in texts for c in _commands(t, program)]
        assert len(lines) == 3, (program, lines)  # its unit, the Dockerfile's example and the guide
        given = {o for c in lines for o in re.findall(r"(?<![\w-])--[a-z][a-z-]+", c)}
        assert given <= taken, (program, sorted(given - taken))
        if program == "flower-superlink":  # TLS, node authentication, reachable from outside, state kept
            assert all({"--enable-supernode-auth", "--ssl-certfile", "--database"} <= set(c.split())
                       and "--host 0.0.0.0" in c for c in lines)
        else:
            assert all({"--auth-supernode-private-key", "--root-certificates"} <= set(c.split()) for c in lines)
