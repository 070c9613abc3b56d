"""A replay record (``participation_record``) is checked whole against the run that replays it, before any client
starts: every damaged, foreign or meaningless record is one line naming the field, the round and the value."""

from __future__ import annotations

import logging
import re
import shutil

import pytest
from sample_clients import gaussian_clients

import fdam_ray
from fdam_ray.assembly.pretrain import pretrain_config
from fdam_ray.checkpoint import load_checkpoint, save_checkpoint
from fdam_ray.config import ConfigError, build_config
from fdam_ray.executors.deadlines import read_record
from fdam_ray.executors.inline import InlineExecutor

CFG = dict(model="linear", batch_size="full", eval_every=1000, seed=0, executor="inline", iterations=8,
           local_steps=2, dataset="arrays", num_clients=3)  # 4 rounds


def replayed(where, config):
    """read_record of ``where`` checked against the run of ``config`` (its two sections cut as the assembly does)."""
    from fdam_ray.core.schedules import ScheduleSection
    from fdam_ray.executors.deadlines import ReplaySection

    return read_record(where, ReplaySection.of(config), ScheduleSection.of(config))


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """A saved run of 3 clients, 4 rounds, without a deadline (its checkpoint is forged into each case's record)."""
    out = tmp_path_factory.mktemp("record")
    clients, test = gaussian_clients(num_clients=3)
    first = fdam_ray.train_arrays(dict(CFG, out_dir=str(out), run_name="rec"), clients, test, save=True)
    return first.run_dir


def forge(recorded, tmp_path, participation, **config):
    """A copy of the recorded run whose checkpoint holds ``participation`` and, changed, ``config``."""
    where = tmp_path / "forged"
    shutil.copytree(recorded, where)
    checkpoint = load_checkpoint(where / "checkpoint.pt")
    checkpoint.loop.participation = participation
    checkpoint.config = {**(checkpoint.config or {}), "round_deadline": 5.0, "executor": "ray", **config}
    save_checkpoint(where / "checkpoint.pt", checkpoint)
    return str(where)


def this_run(**changes):
    return build_config(dict(CFG, **changes))


@pytest.mark.parametrize("participation, match", [
    ({"2": [0, 3]}, r"round 2 .*client 3, outside 0\.\.2 \(num_clients = 3"),
    ({"1": [-1]}, r"round 1 .*client -1, outside 0\.\.2"),
    ({"3": [1, 1]}, r"round 3 .*client 1 twice"),
    ({"2": []}, r"round 2 .*no client"),
    ([[0, 1]], r"not a mapping of round -> clients \(a list\)"),
    ({"2": "0,1"}, r"round 2: '0,1' is not a list of client ids"),
    ({"2": {"0": 1}}, r"round 2: \{'0': 1\} is not a list of client ids"),
    ({"2": [0, 1.5]}, r"round 2: 1\.5 is not a client id"),
    ({"2": [True]}, r"round 2: True is not a client id"),
    ({"two": [0]}, r"round key 'two' is not a round number"),
    ({"0": [0]}, r"round key '0' is not a round number \(an integer >= 1\)"),
    ({"9": [0, 1]}, r"round 9 .*past round 4, the last the recorded run finished"),
])
def test_a_damaged_or_foreign_record_is_one_line_naming_the_round(recorded, tmp_path, participation, match):
    where = forge(recorded, tmp_path, participation)
    with pytest.raises(ValueError, match=r"^config field 'participation_record': .*" + match) as info:
        replayed(where, this_run())
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("config, run, match", [
    (dict(num_clients=2), {}, r"recorded with num_clients = 2, this run has 3"),
    (dict(clients_per_round=2), {}, r"recorded with clients_per_round = 2, this run with null"),
    ({}, dict(clients_per_round=2), r"recorded with clients_per_round = null, this run with 2"),
    (dict(clients_per_round=2, seed=1), dict(clients_per_round=2), r"recorded with seed = 1, this run has 0"),
])
def test_a_record_of_other_sampling_or_clients_is_refused(recorded, tmp_path, config, run, match):
    where = forge(recorded, tmp_path, {"2": [0]}, **config)
    with pytest.raises(ValueError, match=r"^config field 'participation_record': .*" + match):
        replayed(where, this_run(**run))


def test_a_set_outside_the_rounds_sample_is_refused(recorded, tmp_path):
    from fdam_ray.algorithms.sampling import sample_clients

    sample = sample_clients(0, 2, 3, 2)
    outside = next(k for k in range(3) if k not in sample)
    where = forge(recorded, tmp_path, {"2": [outside]}, clients_per_round=2)
    said = rf"round 2 names client {outside}, not in the round's sample {re.escape(str(sample))}"
    with pytest.raises(ValueError, match=said):
        replayed(where, this_run(clients_per_round=2))
    inside = forge(recorded, tmp_path / "ok", {"2": [sample[0]]}, clients_per_round=2)
    assert replayed(inside, this_run(clients_per_round=2)) == {2: [sample[0]]}


def test_a_run_without_a_deadline_has_no_record_to_replay(recorded):
    with pytest.raises(ValueError, match=r"^config field 'participation_record': .* ran without round_deadline: "
                                         r"every round ran its plan, so it recorded nothing"):
        replayed(str(recorded), this_run())


def test_an_empty_record_of_a_deadline_run_and_rounds_past_this_run_are_said(recorded, tmp_path, caplog):
    empty = forge(recorded, tmp_path, {})
    longer = forge(recorded, tmp_path / "b", {"1": [0, 2], "4": [1]})
    with caplog.at_level(logging.WARNING, logger="fdam_ray.executors.deadlines"):
        assert replayed(empty, this_run()) == {}
        assert replayed(longer, this_run(iterations=4)) == {1: [0, 2], 4: [1]}  # 2 rounds: round 4 is not run
    text = caplog.text
    assert "no client missed a deadline" in text and "forces nothing" in text
    assert "round 4 is past this run's last round 2" in text


def test_a_valid_record_reads_as_before(recorded, tmp_path):
    where = forge(recorded, tmp_path, {"1": [0, 2], "3": [1]})
    assert read_record(where) == replayed(where, this_run()) == {1: [0, 2], 3: [1]}


@pytest.mark.parametrize("participation, match", [
    ({"2": [0, 5]}, r"round 2 .*client 5"),  # was dropped: the replay was not the record
    ([[0, 1]], r"not a mapping"),  # was an AttributeError traceback
    (None, r"ran without round_deadline"),  # the plain run itself: was replayed forcing nothing, without a word
])
def test_the_record_is_refused_before_any_client_starts(recorded, tmp_path, monkeypatch, participation, match):
    started = []
    monkeypatch.setattr(InlineExecutor, "start", lambda self, *a, **k: started.append(1))
    where = str(recorded) if participation is None else forge(recorded, tmp_path, participation)
    clients, test = gaussian_clients(num_clients=3)
    with pytest.raises(ValueError, match=r"^config field 'participation_record': .*" + match):
        fdam_ray.train_arrays(dict(CFG, participation_record=where), clients, test)
    assert not started


def test_a_two_stage_replay_checks_its_record_before_stage_1_which_runs_every_client(recorded, tmp_path):
    good = forge(recorded, tmp_path, {"2": [0, 2]})
    assert pretrain_config(this_run(participation_record=good, pretrain_iterations=4)).participation_record is None
    bad = forge(recorded, tmp_path / "bad", {"2": [7]})
    with pytest.raises(ValueError, match=r"round 2 names client 7, outside 0\.\.2"):
        pretrain_config(this_run(participation_record=bad, pretrain_iterations=4))


def test_min_clients_needs_a_round_deadline():
    with pytest.raises(ConfigError, match=r"^config field 'min_clients': 2 is not allowed \(1 without "
                                          r"round_deadline") as info:
        build_config(dict(min_clients=2))
    assert "\n" not in str(info.value)
    assert build_config(dict(min_clients=2, round_deadline=5, executor="ray")).min_clients == 2
