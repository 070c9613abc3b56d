"""``fdam_ray.load_model`` trusts nothing a run folder says: a model file names no code to import or call (only
the built-in networks are built by name; your own factory only when you give it), its sizes are bounded before
anything is built, and every damaged record or file is one ValueError naming the file and the key."""

from __future__ import annotations

import os
import resource
import sys
import time

import pytest
import torch
import yaml

import fdam_ray
import fdam_ray.api
from fdam_ray import models
from fdam_ray.models import build_model

NETWORK = {"model": "cnn", "model_width": 4, "seed": 0, "input_shape": [1, 8, 8], "num_tasks": 1}
STATE = build_model("cnn", (1, 8, 8), 1, width=4).state_dict()  # built before any test replaces the builders


def payload(**network):
    return {"model": dict(STATE), "task_names": ["positive"], "network": {**NETWORK, **network}}


def folder_with(tmp_path, content, name="model.pt"):
    folder = tmp_path / "run"
    folder.mkdir(exist_ok=True)
    torch.save(content, folder / name)
    return folder


def refused(folder, *keys, **kw):
    """The one-line ValueError of ``load_model(folder)``: it names the file (or folder) and each of ``keys``."""
    with pytest.raises(ValueError) as caught:
        fdam_ray.load_model(folder, **kw)
    message = str(caught.value)
    assert type(caught.value) is ValueError or isinstance(caught.value, fdam_ray.ConfigError), message
    assert "\n" not in message and str(folder) in message, message
    for key in keys:
        assert key in message, (key, message)
    return message


@pytest.fixture
def nothing_built(monkeypatch):
    """Any network built (for real, or laid out without memory) fails the test at once."""

    def spy(*args, **kwargs):
        raise AssertionError(f"a network was built: {args[:3]}")

    monkeypatch.setattr(fdam_ray.api, "build_model", spy)
    for name in list(models.BUILDERS):
        monkeypatch.setitem(models.BUILDERS, name, spy)


@pytest.fixture
def marker_module(tmp_path, monkeypatch):
    """A module that would leave a marker file when imported (and print when its factory is called), on sys.path
    and in the current folder."""
    marker = tmp_path / "imported.marker"
    code = tmp_path / "code"
    code.mkdir()
    (code / "fdam_trust_marker.py").write_text(
        f"open({str(marker)!r}, 'w').close()\n"
        "def make(input_shape, num_tasks):\n"
        "    print('factory called')\n"
        "    import torch\n"
        "    return torch.nn.Linear(1, num_tasks)\n")
    monkeypatch.syspath_prepend(str(code))
    monkeypatch.chdir(code)
    sys.modules.pop("fdam_trust_marker", None)
    yield marker
    sys.modules.pop("fdam_trust_marker", None)


def test_a_recorded_import_path_imports_and_calls_nothing(tmp_path, marker_module, capsys):
    folder = folder_with(tmp_path, payload(model="fdam_trust_marker:make"))
    message = refused(folder, "fdam_trust_marker:make", "model=")
    assert "does not choose" in message
    refused(folder, "not 'own_fixtures:bn_net'", model=__import__("own_fixtures").bn_net)  # another factory
    refused(folder, "not 'mlp'", model="mlp")
    assert not marker_module.exists() and "fdam_trust_marker" not in sys.modules
    had_this = "this" in sys.modules
    for record in ("this:x", "builtins:print", "os:system"):
        folder_with(tmp_path, payload(model=record))
        refused(folder, record)
    assert capsys.readouterr().out == ""
    assert had_this or "this" not in sys.modules


def test_an_old_model_pt_whose_config_yaml_names_code_imports_nothing(tmp_path, marker_module, capsys):
    content = payload()
    del content["network"]
    folder = folder_with(tmp_path, content)
    config = {"dataset": "digits", "model": "fdam_trust_marker:make", "model_width": 4}
    (folder / "config.yaml").write_text(yaml.safe_dump(config))
    refused(folder, "config.yaml", "fdam_trust_marker:make")
    (folder / "config.yaml").write_text(yaml.safe_dump({**config, "model": "cnn", "dataset": "fdam_trust_marker:make"}))
    refused(folder, "config.yaml", "dataset", "fdam_trust_marker:make")
    assert not marker_module.exists() and "fdam_trust_marker" not in sys.modules
    assert capsys.readouterr().out == ""


def test_a_factory_is_built_when_the_caller_gives_it_or_names_it(tmp_path):
    import own_fixtures

    net = build_model("own_fixtures:bn_net", (20,), 1, width=6)
    content = {"model": net.state_dict(), "network": {"model": "own_fixtures:bn_net", "model_width": 6, "seed": 0,
                                                       "input_shape": [20], "num_tasks": 1}}
    folder = folder_with(tmp_path, content)
    x = torch.randn(5, 20)
    with torch.no_grad():
        expected = net.eval()(x)
        for given in (own_fixtures.bn_net, "own_fixtures:bn_net"):
            assert torch.equal(fdam_ray.load_model(folder, model=given)(x), expected)
    refused(folder, "model=", model=3)


@pytest.mark.parametrize(("key", "value"), [
    ("input_shape", [400_000_000]),
    ("input_shape", [3, 20_000, 20_000]),
    ("input_shape", [1] * 40),
    ("input_shape", []),
    ("input_shape", [1, 0, 8]),
    ("input_shape", [1, -8, 8]),
    ("input_shape", [1, 8.5, 8]),
    ("input_shape", [1, True, 8]),
    ("input_shape", "1x8x8"),
    ("input_shape", 64),
    ("model_width", 10**6),
    ("model_width", 0),
    ("model_width", -4),
    ("model_width", 4.0),
    ("model_width", "4"),
    ("num_tasks", 10**9),
    ("num_tasks", 0),
    ("num_tasks", 1.5),
    ("num_tasks", None),
    ("seed", "0"),
    ("seed", 0.5),
    ("seed", -1),
    ("seed", 2**70),
    ("model", 5),
    ("model", ["cnn"]),
    ("model", "x" * 5000),
    ("model", "no such model"),
])
def test_sizes_and_types_are_bounded_before_anything_is_built(tmp_path, nothing_built, key, value):
    folder = folder_with(tmp_path, payload(**{key: value}))
    before, started = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, time.perf_counter()
    refused(folder, str(folder / "model.pt"), f"'{key}'")
    assert time.perf_counter() - started < 2
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 200_000  # KiB: no big tensor


def test_a_network_bigger_than_its_weights_is_never_built(tmp_path, monkeypatch):
    def spy(*args, **kwargs):
        raise AssertionError("built")

    monkeypatch.setattr(fdam_ray.api, "build_model", spy)
    state = build_model("mlp", (20,), 1, width=8).state_dict()
    record = {"model": "mlp", "model_width": 50_000, "seed": 0, "input_shape": [20], "num_tasks": 1}
    folder = folder_with(tmp_path, {"model": state, "network": record})
    refused(folder, "does not fit the network 'mlp'")


@pytest.mark.parametrize("damage", [
    "not a mapping", "no model", "model not a mapping", "model values not tensors", "model keys not text",
    "model empty", "network not a mapping", "network None", "network junk key", "no model key", "no input_shape",
    "no num_tasks", "no model_width", "task_names not a list",
])
def test_every_damaged_record_is_one_line_naming_the_file_and_the_key(tmp_path, damage):
    content = payload()
    network = content["network"]
    key = {"no model key": "model", "no input_shape": "input_shape", "no num_tasks": "num_tasks",
           "no model_width": "model_width"}.get(damage)
    if damage == "not a mapping":
        content, key = [1, 2, 3], "model"
    elif damage == "no model":
        del content["model"]
        key = "model"
    elif damage == "model not a mapping":
        content["model"], key = "junk", "model"
    elif damage == "model values not tensors":
        content["model"] = {k: 1.0 for k in content["model"]}
        key = "model"
    elif damage == "model keys not text":
        content["model"] = {i: v for i, v in enumerate(content["model"].values())}
        key = "model"
    elif damage == "model empty":
        content["model"], key = {}, "model"
    elif damage == "network not a mapping":
        content["network"], key = ["cnn", 4], "network"
    elif damage == "network None":
        content["network"], key = None, "network"
    elif damage == "network junk key":
        network["evil"], key = "builtins:print", "evil"
    elif damage == "task_names not a list":
        content["task_names"], key = 7, "task_names"
        del content["network"]
    else:
        del network[key]
    folder = folder_with(tmp_path, content)
    if damage == "task_names not a list":
        (folder / "config.yaml").write_text(yaml.safe_dump({"dataset": "digits", "model": "cnn", "model_width": 4}))
    refused(folder, str(folder / "model.pt"), f"'{key}'")


def test_damaged_records_of_best_model_pt_and_its_model_pt_name_their_file(tmp_path):
    content = payload()
    folder = folder_with(tmp_path, {"model": content["model"]}, "best_model.pt")
    folder_with(tmp_path, payload(num_tasks="one"))
    refused(folder, str(folder / "model.pt"), "'num_tasks'", best=True)
    folder_with(tmp_path, {"model": {"w": "junk"}, "network": NETWORK}, "best_model.pt")
    refused(folder, str(folder / "best_model.pt"), "'model'", best=True)


@pytest.mark.parametrize("field", ["model", "model_width", "dataset"])
def test_a_damaged_config_yaml_of_an_old_model_pt_is_one_line(tmp_path, field):
    content = payload()
    del content["network"]
    folder = folder_with(tmp_path, content)
    config = {"dataset": "digits", "model": "cnn", "model_width": 4}
    config[field] = {"model": ["cnn", "mlp"], "model_width": 10**6, "dataset": {"a": 1}}[field]
    (folder / "config.yaml").write_text(yaml.safe_dump(config))
    refused(folder, "config.yaml", field)


def test_a_model_pt_that_is_not_a_regular_file_is_named_as_such(tmp_path):
    folder = tmp_path / "run"
    (folder / "model.pt").mkdir(parents=True)
    message = refused(folder, str(folder / "model.pt"), "is a folder")
    assert "not finished" not in message
    (folder / "best_model.pt").mkdir()
    message = refused(folder, str(folder / "best_model.pt"), "is a folder", best=True)
    assert "no best_model.pt" not in message
    other = tmp_path / "fifo"
    other.mkdir()
    os.mkfifo(other / "model.pt")
    message = refused(other, str(other / "model.pt"), "not a regular file")
    assert "not finished" not in message
    (other / "model.pt").unlink()
    (other / "model.pt").symlink_to(other / "nowhere.pt")
    message = refused(other, str(other / "model.pt"), "link")
    assert "not finished" not in message


@pytest.mark.parametrize("shape", [(1, 8, 8), (1, 28, 28), (3, 32, 32), (3, 224, 224), (3, 320, 320), (3, 1024, 1024),
                                   (20,), (5000,), (12, 40), (1, 64, 128, 128)])
def test_every_network_of_the_projects_data_is_within_the_bounds(shape):
    for name in models.MODEL_NAMES:
        for width, tasks in ((1, 1), (32, 14), (4096, 100)):
            record = {"model": name, "model_width": width, "seed": 2**31, "input_shape": list(shape),
                      "num_tasks": tasks}
            assert models.read_network_record(record, "here").input_shape == shape
