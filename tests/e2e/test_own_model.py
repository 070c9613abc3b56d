"""Your own model: ``model: module:attr`` in a config, ``model=factory`` in Python, and what is refused."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import own_fixtures
import pytest
import torch
import yaml
from sample_clients import gaussian_clients
from torch import nn

import fdam_ray
from fdam_ray.cli import main
from fdam_ray.config import ConfigError, build_config, describe_fields
from fdam_ray.models import build_model
from fdam_ray.tuning import load_space

# 6 rounds of 2 local steps over 3 Gaussian clients, full batch: deterministic and fast
FAST = dict(executor="inline", batch_size="full", local_steps=2, iterations=12, eval_every=4, stage_length=6,
            lr=1.0, seed=3)


def arrays_run(model, **cfg):
    clients, test = gaussian_clients()
    return fdam_ray.train_arrays({**FAST, **cfg, "model": model}, clients, test)


def assert_same_run(a, b):
    """The same final network and the same AUC at every iteration both runs evaluated (a resumed run evaluated
    where its first part ended, too)."""
    assert a.model_state.keys() == b.model_state.keys()
    for key in a.model_state:
        np.testing.assert_array_equal(a.model_state[key].numpy(), b.model_state[key].numpy(), err_msg=key)
    auc_a, auc_b = ({h["iteration"]: h["test_auc"] for h in r.history} for r in (a, b))
    common = sorted(auc_a.keys() & auc_b.keys())
    assert common[-1] == a.state.iteration and [auc_a[i] for i in common] == [auc_b[i] for i in common]


def test_a_factory_named_by_import_path_trains_as_the_built_in_network_it_builds():
    own = arrays_run("own_fixtures:same_as_linear")
    assert own.config.model == "own_fixtures:same_as_linear"
    assert_same_run(own, arrays_run("linear"))
    assert own.history[-1]["test_auc"] > 0.75


def test_batchnorm_buffers_of_a_factory_are_federated_and_width_is_passed():
    got = arrays_run("own_fixtures:bn_net", model_width=5, batch_size=8)
    state = got.model_state
    assert state["1.weight"].shape == (5, 5)  # the width came from model_width (gaussian_clients: d=5)
    assert int(state["2.num_batches_tracked"]) == 12  # the max over clients of their 12 steps each
    assert float(state["2.running_var"].sub(1).abs().max()) > 1e-3  # the averaged statistics moved
    # the same network given in Python (by value) gives the same run
    assert_same_run(arrays_run(lambda shape, t, width: own_fixtures.bn_net(shape, t, width), model_width=5,
                               batch_size=8), got)


def test_one_dimensional_logits_are_accepted_for_one_task():
    got = arrays_run("own_fixtures:one_dim_logits")
    assert got.history[-1]["test_auc"] > 0.75


def test_a_factory_given_in_python_is_kept_by_value_recorded_by_name_and_needed_again_to_resume(tmp_path):
    def local_factory(input_shape, num_tasks):  # not importable by name
        return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), num_tasks))

    clients, test = gaussian_clients()
    cfg = {**FAST, "out_dir": str(tmp_path), "run_name": "local", "checkpoint_every": 1}
    first = fdam_ray.train_arrays({**cfg, "iterations": 6, "model": local_factory}, clients, test, save=True)
    assert first.config.model is local_factory
    recorded = yaml.safe_load((first.run_dir / "config.yaml").read_text())["model"]
    assert recorded == "python:test_own_model.test_a_factory_given_in_python_is_kept_by_value_recorded_by_name_" \
                       "and_needed_again_to_resume.<locals>.local_factory"
    source = fdam_ray.data.arrays.ArraysSource(clients, test)
    with pytest.raises(ConfigError, match=r"was trained with a model factory given in Python \(python:.*"
                                          r"local_factory\).*fdam_ray.resume\("):
        fdam_ray.resume(first.run_dir, {"iterations": 12}, source=source)
    with pytest.raises(ConfigError, match=r"different config \(model: 'python:.*local_factory' -> 'linear'\)"):
        fdam_ray.resume(first.run_dir, {"iterations": 12}, source=source, model="linear")
    resumed = fdam_ray.resume(first.run_dir, {"iterations": 12}, source=source, model=local_factory)
    uninterrupted = fdam_ray.train_arrays({**FAST, "model": local_factory}, clients, test)
    assert_same_run(resumed, uninterrupted)


def test_an_importable_callable_is_recorded_by_path_and_its_run_resumes_from_the_folder(tmp_path):
    clients, test = gaussian_clients()
    cfg = {**FAST, "out_dir": str(tmp_path), "run_name": "imported", "checkpoint_every": 1, "iterations": 6}
    first = fdam_ray.train_arrays(cfg, clients, test, save=True, model=own_fixtures.same_as_linear)
    assert first.config.model == "own_fixtures:same_as_linear"
    assert yaml.safe_load((first.run_dir / "config.yaml").read_text())["model"] == "own_fixtures:same_as_linear"
    resumed = fdam_ray.resume(first.run_dir, {"iterations": 12}, source=fdam_ray.data.arrays.ArraysSource(
        clients, test))
    assert_same_run(resumed, arrays_run("linear"))


def test_train_takes_a_factory_in_python():
    cfg = dict(FAST, dataset="synthetic", num_clients=2, samples_per_client=40, num_features=4, batch_size=8)
    got = fdam_ray.train(cfg, model=lambda shape, t: own_fixtures.same_as_linear(shape, t), save=False)
    assert callable(got.config.model)
    assert_same_run(got, fdam_ray.train(dict(cfg, model="linear"), save=False))


def test_the_cli_trains_a_factory_named_on_the_command_line(tmp_path, capsys):
    rc = main(["train", f"out_dir={tmp_path}", "model=own_fixtures:same_as_linear", "dataset=synthetic",
               "num_clients=2", "samples_per_client=40", "num_features=4", "executor=inline", "iterations=4",
               "local_steps=2", "eval_every=2", "tensorboard=false"])
    out = capsys.readouterr().out
    assert rc == 0 and "model own_fixtures:same_as_linear" in out
    (run,) = list(Path(tmp_path).iterdir())
    assert yaml.safe_load((run / "config.yaml").read_text())["model"] == "own_fixtures:same_as_linear"


BAD_PATHS = [
    ("nowhere_pkg.models:build", "cannot import module 'nowhere_pkg.models' of 'nowhere_pkg.models:build' "
                                 "(ModuleNotFoundError: No module named 'nowhere_pkg')"),
    ("own_fixtures:nothing_here", "module 'own_fixtures' has no attribute 'nothing_here'"),
    ("own_fixtures:NOT_CALLABLE", "'own_fixtures:NOT_CALLABLE' is a int, not a callable factory"),
    ("own_fixtures.build", "one of linear, mlp, cnn, cnn_gn, resnet20, densenet121, densenet161, or your own factory "
                           "as an import path module:attr"),
]


@pytest.mark.parametrize("value,message", BAD_PATHS, ids=[b[0] for b in BAD_PATHS])
def test_a_bad_import_path_is_one_line_naming_the_field_before_anything_runs(value, message, tmp_path, capsys):
    with pytest.raises(ConfigError, match="config field 'model'") as info:
        build_config(model=value)
    assert message in str(info.value) and "\n" not in str(info.value)
    rc = main(["train", f"out_dir={tmp_path / 'runs'}", f"model={value}", "executor=inline"])
    err = capsys.readouterr().err
    assert rc == 2 and message in err and err.count("\n") == 1
    assert not (tmp_path / "runs").exists()


def test_a_bad_import_path_in_a_tune_space_fails_when_the_space_is_read(tmp_path):
    space = tmp_path / "space.yaml"
    space.write_text("base: {dataset: synthetic}\nsearch:\n  model: {choice: [linear, own_fixtures:bn_net, "
                     "own_fixtures:gone]}\n")
    with pytest.raises(ConfigError, match="config field 'model': module 'own_fixtures' has no attribute 'gone'"):
        load_space(str(space))
    space.write_text("base: {dataset: synthetic}\nsearch:\n  model: {choice: [linear, own_fixtures:bn_net]}\n")
    assert load_space(str(space)).search["model"] == {"choice": ["linear", "own_fixtures:bn_net"]}


REFUSED = [  # (factory, its message for a batch of 3 samples of 6 features, what a run on 5 features says)
    ("own_fixtures:wrong_logits", "model 'own_fixtures:wrong_logits' returned logits of shape (3, 2) for a batch "
                                  "of 3 samples; expected (3, 1) or (3,): one logit per task (num_tasks=1)",
     "returned logits of shape (100, 2) for a batch of 100 samples; expected (100, 1) or (100,)"),
    ("own_fixtures:not_a_module", "model 'own_fixtures:not_a_module' returned a dict, not a torch.nn.Module",
     "returned a dict, not a torch.nn.Module"),
    ("own_fixtures:frozen", "model 'own_fixtures:frozen': parameter '1.weight' does not require grad; every "
                            "parameter is trained", "parameter '1.weight' does not require grad"),
    ("own_fixtures:bool_buffer", "model 'own_fixtures:bool_buffer': buffer 'mask' (torch.bool, shape (6,)) has no "
                                 "federation rule", "buffer 'mask' (torch.bool, shape (5,))"),
    ("own_fixtures:two_args_only", "model 'own_fixtures:two_args_only': a model factory is called as "
                                   "factory(input_shape, num_tasks)", "a model factory is called as"),
]


@pytest.mark.parametrize("model,message,in_run", REFUSED, ids=[r[0].split(":")[1] for r in REFUSED])
def test_a_network_the_federation_cannot_carry_is_refused_in_one_line(model, message, in_run):
    with pytest.raises(ValueError) as info:
        net = build_model(model, (6,), 1)
        net(torch.zeros(3, 6))
    assert message in str(info.value) and "\n" not in str(info.value)
    with pytest.raises(ValueError) as info:  # a run stops with the same line before its first round
        arrays_run(model)
    assert in_run in str(info.value) and "\n" not in str(info.value)


def test_the_output_check_runs_on_the_first_batch_only():
    net = build_model("own_fixtures:same_as_linear", (6,), 2)
    assert net(torch.zeros(4, 6)).shape == (4, 2)
    assert not net._forward_hooks  # checked once, then the hook is gone
    assert len(build_model("cnn", (1, 8, 8), 1, width=4)._forward_hooks) == 1


def test_fields_document_the_factory_forms():
    table = {line.split()[0]: line for line in describe_fields().splitlines()}
    assert "factory(input_shape, num_tasks)" in table["model"] and "or module:attr" in table["model"]
    assert "factory(client_id, num_clients, split)" in table["dataset"]
    assert "width=" in table["model_width"]
