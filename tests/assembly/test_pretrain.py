"""The two-stage recipe: BCE pre-training, then the AUC run from the pre-trained body with a fresh head."""

from __future__ import annotations

import numpy as np
import torch

import fdam_ray
from fdam_ray.assembly.pretrain import FirstClientSource, pretrain_config
from fdam_ray.assembly.weights import head_keys
from fdam_ray.config import build_config
from fdam_ray.data import make_source
from fdam_ray.loop.federation import Federation
from fdam_ray.metrics import task_aucs
from fdam_ray.models import build_model

BASE = dict(dataset="digits", executor="inline", num_clients=2, imratio=0.2, model="cnn", model_width=6,
            batch_size=32, algorithm="codasca", iterations=30, local_steps=5, lr=0.1, eval_every=30, seed=0)


def spy_starts(monkeypatch) -> list[dict]:
    starts = []
    original = Federation._start

    def spy(self, *args):
        state = original(self, *args)
        starts.append({"algorithm": self.algorithm.preset.name, "num_clients": self.source.num_clients,
                       "model": self.replica.flat.model_state_dict(), "state": state})
        return state

    monkeypatch.setattr(Federation, "_start", spy)
    return starts


def test_main_run_starts_from_the_pretrained_body_with_a_fresh_head(monkeypatch):
    starts = spy_starts(monkeypatch)
    cfg = build_config(BASE, pretrain={"iterations": 40, "lr": 0.2})
    result = fdam_ray.train(cfg, save=False)
    pre = result.pretrain
    assert pre is not None and pre.config.algorithm == "fedavg" and pre.config.objective == "bce"
    assert pre.config.num_clients == 2 and pre.state.iteration == 40 and pre.config.lr == 0.2
    assert [s["algorithm"] for s in starts] == ["fedavg", "codasca"]
    main_start = starts[1]["model"]
    fresh_model = build_model("cnn", (1, 8, 8), 1, width=6, seed=0)
    fresh, head = fresh_model.state_dict(), set(head_keys(fresh_model))
    assert head == {"11.weight", "11.bias"}
    for key, value in main_start.items():
        expected = fresh[key] if key in head else pre.model_state[key]
        assert torch.equal(value, expected), key
    assert not torch.equal(pre.model_state["11.weight"], fresh["11.weight"])  # the head did change in stage 1
    state = starts[1]["state"]
    assert not state.alpha.any() and not state.v[-2:].any()  # a, b, alpha start at 0
    # the recipe's model beats an untrained one on the test set
    test = make_source(cfg).test_set()
    untrained = build_model("cnn", (1, 8, 8), 1, width=6, seed=0).eval()
    with torch.no_grad():
        untrained_auc = task_aucs(untrained(test.x).numpy(), test.y.numpy())[0]
    assert result.summary["final_test_auc"] > max(untrained_auc + 0.1, 0.85)
    # and the same AUC run without pre-training (0.81 here vs 0.97)
    assert result.summary["final_test_auc"] > fdam_ray.train(build_config(BASE), save=False).summary[
        "final_test_auc"] + 0.05


def test_pretraining_on_one_source(monkeypatch):
    starts = spy_starts(monkeypatch)
    cfg = build_config(BASE, iterations=5, pretrain={"iterations": 5, "federated": False, "batch_size": 8})
    pcfg = pretrain_config(cfg)
    assert (pcfg.algorithm, pcfg.num_clients, pcfg.batch_size, pcfg.lr) == ("centralized", 1, 8, cfg.lr)
    source = make_source(cfg)
    one = FirstClientSource(source)
    np.testing.assert_array_equal(one.client_shard(0).train.x.numpy(), source.client_shard(0).train.x.numpy())
    result = fdam_ray.train(cfg, save=False)
    assert result.pretrain.config.num_clients == 1
    assert [s["num_clients"] for s in starts] == [1, 2]


def test_no_pretraining_by_default(monkeypatch):
    starts = spy_starts(monkeypatch)
    result = fdam_ray.train(build_config(BASE, iterations=5), save=False)
    assert result.pretrain is None and len(starts) == 1
