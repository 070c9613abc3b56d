"""``fdam_ray.load_model(run_dir)``: a finished run's network rebuilt from what its folder records, its weights
loaded, in eval mode; older model.pt files, best_model.pt, own factories and the one-line errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import yaml
from sklearn.metrics import roc_auc_score

import fdam_ray
from fdam_ray.assembly.recipe import run
from fdam_ray.config import build_config
from fdam_ray.data import make_source
from fdam_ray.models import build_model


def finished(tmp_path, **kw):
    base = dict(dataset="digits", model="cnn", model_width=4, num_clients=2, local_steps=3, iterations=6,
                eval_every=6, executor="inline", out_dir=str(tmp_path), run_name="r", tensorboard=False)
    return run(build_config({**base, **kw}))


@pytest.fixture(scope="module")
def digits_run(tmp_path_factory):
    return finished(tmp_path_factory.mktemp("runs"))


def outputs(net, x):
    with torch.no_grad():
        return net(x)


def test_the_loaded_network_scores_as_the_runs_final_global_model(digits_run):
    r = digits_run
    net = fdam_ray.load_model(r.run_dir)
    assert isinstance(net, torch.nn.Module) and not net.training
    final = build_model("cnn", (1, 8, 8), 1, width=4)
    final.load_state_dict(r.model_state)
    final.eval()
    untrained = build_model("cnn", (1, 8, 8), 1, width=4).eval()
    x = torch.randn(32, 1, 8, 8, generator=torch.Generator().manual_seed(1))
    assert torch.equal(outputs(net, x), outputs(final, x))
    assert not torch.equal(outputs(net, x), outputs(untrained, x))  # the weights (and BN statistics) are loaded
    test = make_source(r.config).test_set()
    batch = r.config.eval_batch_size  # scored as the run scored its test set: sigmoid scores, in its batches
    scores = torch.cat([torch.sigmoid(outputs(net, test.x[i : i + batch])) for i in range(0, len(test), batch)])
    scores = scores.numpy().ravel()
    assert roc_auc_score(test.y.numpy().ravel(), scores) == pytest.approx(r.summary["final_test_auc"], abs=1e-6)


def test_model_pt_records_the_network_it_holds(digits_run):
    saved = torch.load(digits_run.run_dir / "model.pt", weights_only=True)
    assert saved["network"] == {"model": "cnn", "model_width": 4, "seed": 0, "input_shape": [1, 8, 8],
                                "num_tasks": 1}


def test_a_model_pt_written_before_it_recorded_its_network_still_loads(tmp_path, digits_run):
    old = tmp_path / "old"
    old.mkdir()
    payload = torch.load(digits_run.run_dir / "model.pt", weights_only=True)
    del payload["network"]
    torch.save(payload, old / "model.pt")
    (old / "config.yaml").write_text((digits_run.run_dir / "config.yaml").read_text())
    x = torch.randn(8, 1, 8, 8)
    assert torch.equal(outputs(fdam_ray.load_model(old), x), outputs(fdam_ray.load_model(digits_run.run_dir), x))


def test_best_loads_best_model_pt_and_its_absence_is_one_line(tmp_path, digits_run):
    with pytest.raises(ValueError, match=r"has no best_model\.pt") as caught:
        fdam_ray.load_model(digits_run.run_dir, best=True)
    assert "\n" not in str(caught.value)
    folder = tmp_path / "best"
    folder.mkdir()
    payload = torch.load(digits_run.run_dir / "model.pt", weights_only=True)
    torch.save(payload, folder / "model.pt")
    best = {"model": {k: torch.zeros_like(v) for k, v in payload["model"].items()}}  # no network record of its own
    torch.save(best, folder / "best_model.pt")
    net = fdam_ray.load_model(folder, best=True)
    assert all(torch.count_nonzero(t) == 0 for t in net.state_dict().values())


def test_an_own_factory_is_built_when_given_and_one_that_cannot_be_imported_is_one_line(tmp_path):
    import own_fixtures

    r = finished(tmp_path, dataset="synthetic", model="own_fixtures:bn_net", model_width=6, samples_per_client=40)
    with pytest.raises(ValueError, match=r"records the model factory 'own_fixtures:bn_net'.*model=") as caught:
        fdam_ray.load_model(r.run_dir)  # a model file does not choose code: the factory is given, or named
    assert "\n" not in str(caught.value)
    x = torch.randn(5, 20)
    final = build_model("own_fixtures:bn_net", (20,), 1, width=6)
    final.load_state_dict(r.model_state)
    for given in (own_fixtures.bn_net, "own_fixtures:bn_net"):
        assert torch.equal(outputs(fdam_ray.load_model(r.run_dir, model=given), x), outputs(final.eval(), x))
    payload = torch.load(r.run_dir / "model.pt", weights_only=True)
    payload["network"]["model"] = "no_such_module_here:make"
    torch.save(payload, r.run_dir / "model.pt")
    with pytest.raises(ValueError, match="cannot import module 'no_such_module_here'") as caught:
        fdam_ray.load_model(r.run_dir, model="no_such_module_here:make")
    assert "\n" not in str(caught.value) and str(r.run_dir) in str(caught.value)


def test_a_factory_given_in_python_is_given_again(tmp_path):
    def own(input_shape, num_tasks):
        return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(int(np.prod(input_shape)), num_tasks))

    r = finished(tmp_path, dataset="synthetic", model=own, samples_per_client=40)
    with pytest.raises(ValueError, match=r"model factory given in Python .* give it again"):
        fdam_ray.load_model(r.run_dir)
    net = fdam_ray.load_model(r.run_dir, model=own)
    x = torch.randn(4, 20)
    final = own((20,), 1)
    final.load_state_dict(r.model_state)
    assert torch.equal(outputs(net, x), outputs(final, x))


def test_weights_that_do_not_fit_and_folders_that_are_not_runs_are_one_line(tmp_path, digits_run):
    with pytest.raises(ValueError, match="is not a run folder"):
        fdam_ray.load_model(tmp_path / "nothing")
    (tmp_path / "unfinished").mkdir()
    with pytest.raises(ValueError, match=r"has no model\.pt"):
        fdam_ray.load_model(tmp_path / "unfinished")
    wrong = tmp_path / "wrong"
    wrong.mkdir()
    payload = torch.load(digits_run.run_dir / "model.pt", weights_only=True)
    payload["network"]["model_width"] = 8
    torch.save(payload, wrong / "model.pt")
    with pytest.raises(ValueError, match="does not fit the network 'cnn'") as caught:
        fdam_ray.load_model(wrong)
    assert "\n" not in str(caught.value)
    (wrong / "model.pt").write_bytes(b"not a torch file")
    with pytest.raises(ValueError, match="cannot be read"):
        fdam_ray.load_model(wrong)


def test_resume_reads_a_config_yaml_that_carries_versions(tmp_path):
    r = finished(tmp_path, dataset="synthetic", model="mlp", model_width=8, samples_per_client=40)
    assert "versions" in yaml.safe_load((r.run_dir / "config.yaml").read_text())
    longer = fdam_ray.resume(r.run_dir, {"iterations": 9})
    assert longer.history[-1]["iteration"] == 9
    x = torch.randn(3, 20)
    final = build_model("mlp", (20,), 1, width=8)
    final.load_state_dict(longer.model_state)
    assert torch.equal(outputs(fdam_ray.load_model(r.run_dir), x), outputs(final.eval(), x))
