"""DenseNet-161, and initial weights from a local file: loading, clear errors, head re-initialisation."""

from __future__ import annotations

import logging

import pytest
import torch

import fdam_ray
from fdam_ray.assembly.weights import head_keys, load_weights, read_weights
from fdam_ray.config import build_config
from fdam_ray.loop.federation import Federation
from fdam_ray.models import build_model


def test_densenet161_gives_one_logit_per_task_and_adapts_input_channels():
    model = build_model("densenet161", (1, 32, 32), 5, seed=0)
    assert model.features.conv0.in_channels == 1 and model.features.conv0.out_channels == 96
    model.eval()
    with torch.no_grad():
        assert model(torch.zeros(2, 1, 32, 32)).shape == (2, 5)
    assert head_keys(model) == ["classifier.weight", "classifier.bias"]
    assert model.classifier.out_features == 5


def equal_states(a: dict, b: dict, keys) -> bool:
    return all(torch.equal(a[k], b[k]) for k in keys)


def test_a_saved_state_dict_loads_and_starts_the_run(tmp_path):
    source_model = build_model("cnn", (1, 8, 8), 1, width=4, seed=7)
    path = tmp_path / "w.pt"
    torch.save(source_model.state_dict(), path)
    starts = []
    original = Federation._start

    def spy(self, *args):
        state = original(self, *args)
        starts.append(self.replica.flat.model_state_dict())
        return state

    Federation._start = spy
    try:
        fdam_ray.train(dict(executor="inline", model="cnn", model_width=4, iterations=2, local_steps=2,
                            eval_every=2, **{"model.weights": str(path)}), save=False)
    finally:
        Federation._start = original
    assert equal_states(starts[0], source_model.state_dict(), source_model.state_dict())
    fresh = build_model("cnn", (1, 8, 8), 1, width=4, seed=0)
    assert not torch.equal(starts[0]["0.weight"], fresh.state_dict()["0.weight"])


def test_run_outputs_and_wrapped_files_load(tmp_path):
    model = build_model("mlp", (5,), 2, width=6, seed=1)
    torch.save({"model": model.state_dict(), "alpha": torch.zeros(2)}, tmp_path / "model.pt")
    torch.save({"state_dict": {f"module.{k}": v for k, v in model.state_dict().items()}}, tmp_path / "ddp.pt")
    for name in ("model.pt", "ddp.pt"):
        target = build_model("mlp", (5,), 2, width=6, seed=2)
        assert load_weights(target, read_weights(tmp_path / name)) == []
        assert equal_states(target.state_dict(), model.state_dict(), model.state_dict())


def test_old_densenet_key_names_are_mapped(tmp_path):
    state = {"features.denseblock1.denselayer1.norm.1.weight": torch.ones(3),
             "features.denseblock1.denselayer1.conv.2.weight": torch.ones(1)}
    torch.save(state, tmp_path / "old.pt")
    assert set(read_weights(tmp_path / "old.pt")) == {"features.denseblock1.denselayer1.norm1.weight",
                                                     "features.denseblock1.denselayer1.conv2.weight"}


def test_missing_and_unreadable_files_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match=r"model_weights: '.*nowhere.pt' is not a file .*never downloaded"):
        fdam_ray.train(dict(executor="inline", model_weights=str(tmp_path / "nowhere.pt"), iterations=1),
                       save=False)
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match=r"cannot be read with torch.load\(weights_only=True\)"):
        read_weights(tmp_path / "junk.pt")
    torch.save({"step": 3}, tmp_path / "nostate.pt")
    with pytest.raises(ValueError, match="does not hold a state_dict"):
        read_weights(tmp_path / "nostate.pt")


class Payload:  # an arbitrary object: weights_only refuses to unpickle it
    pass


def test_files_that_would_run_code_are_refused(tmp_path):
    torch.save({"w": torch.ones(1), "obj": Payload()}, tmp_path / "obj.pt")
    with pytest.raises(ValueError, match="weights_only"):
        read_weights(tmp_path / "obj.pt")


def test_mismatched_weights_name_the_keys():
    cnn = build_model("cnn", (1, 8, 8), 1, width=4, seed=0)
    wider = build_model("cnn", (1, 8, 8), 1, width=6, seed=0).state_dict()
    with pytest.raises(ValueError, match=r"shapes differ: 0.weight \(file 6x1x3x3, model 4x1x3x3\)"):
        load_weights(cnn, wider, source="model_weights 'w.pt'")
    resnet = build_model("resnet20", (1, 8, 8), 1, seed=0).state_dict()
    with pytest.raises(ValueError, match=r"the file lacks .* 0.weight.*the model has no key\(s\) stem.0.weight"):
        load_weights(cnn, resnet)
    before = {k: v.clone() for k, v in cnn.state_dict().items()}
    partial = dict(before)
    del partial["1.running_mean"]
    with pytest.raises(ValueError, match=r"the file lacks 1 key\(s\): 1.running_mean"):
        load_weights(cnn, partial)
    assert equal_states(cnn.state_dict(), before, before)  # nothing copied on error


def test_a_head_of_another_size_is_reinitialised_with_a_notice(caplog):
    imagenet_like = build_model("resnet20", (3, 32, 32), 1000, seed=3).state_dict()
    model = build_model("resnet20", (3, 32, 32), 5, seed=0)
    fresh_head = {k: v.clone() for k, v in model.state_dict().items() if k.startswith("head.")}
    with caplog.at_level(logging.WARNING, logger="fdam_ray.assembly.weights"):
        assert load_weights(model, imagenet_like, source="w.pt") == ["head.bias", "head.weight"]
    assert "classifier head head.bias, head.weight re-initialised" in caplog.text
    state = model.state_dict()
    assert equal_states(state, imagenet_like, [k for k in state if not k.startswith("head.")])
    assert equal_states(state, fresh_head, fresh_head)
    # a file without a head (a feature extractor) works the same way
    body = {k: v for k, v in imagenet_like.items() if not k.startswith("head.")}
    assert load_weights(build_model("resnet20", (3, 32, 32), 5, seed=0), body) == ["head.bias", "head.weight"]


def test_config_rejects_bad_pretrain_values():
    from fdam_ray.config import ConfigError

    with pytest.raises(ConfigError, match="pretrain_iterations"):
        build_config({"pretrain": {"iterations": -1}})
    with pytest.raises(ConfigError, match="pretrain_lr"):
        build_config({"pretrain": {"lr": 0}})
    assert build_config({"pretrain": {"batch_size": "full"}}).pretrain_batch_size == 0
