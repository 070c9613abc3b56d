"""The clients' optimiser choice and batch draw: momentum, Adam in pre-training, balanced positive sampling.

Momentum 0 and natural sampling are the plain run bit for bit; the momentum
buffer, Adam's moments and the balanced sampler's position are client state, so
a run interrupted and resumed equals the uninterrupted one.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from interrupted import crash_in_round

from fdam_ray.assembly.pretrain import pretrain_config
from fdam_ray.assembly.recipe import resume, run
from fdam_ray.checkpoint import load_checkpoint
from fdam_ray.config import ConfigError, build_config
from fdam_ray.data.balanced import BalancedIndexStream, index_stream, make_sampler
from fdam_ray.data.base import IndexStream, Split

STATE = ("v", "alpha", "buffers", "counters", "c_v", "c_alpha")


def cfg(tmp_path, **kw):
    base = dict(dataset="synthetic", model="mlp", model_width=16, num_clients=3, samples_per_client=120,
                imratio=0.1, batch_size=16, algorithm="codasca", local_steps=3, iterations=60, stage_length=20,
                eval_every=9, checkpoint_every=4, out_dir=str(tmp_path), run_name="run", executor="inline",
                tensorboard=False)
    base.update(kw)
    return build_config(base)


def assert_same_state(a, b):
    for name in STATE:
        np.testing.assert_array_equal(getattr(a.state, name), getattr(b.state, name), err_msg=name)


def test_momentum_zero_and_natural_sampling_are_the_plain_run_and_keep_no_client_moments(tmp_path):
    plain = run(cfg(tmp_path / "a"))
    explicit = run(cfg(tmp_path / "b", momentum=0.0, positive_sampling="natural", local_optimizer="sgd"))
    assert_same_state(plain, explicit)
    states = load_checkpoint(tmp_path / "b" / "run" / "checkpoint.pt").clients
    assert all("moments" not in s for s in states)
    moved = run(cfg(tmp_path / "c", momentum=0.9))
    assert not np.array_equal(moved.state.v, plain.state.v)  # momentum does act
    assert np.isfinite(moved.history[-1]["test_auc"])


@pytest.mark.parametrize("extra", [{"momentum": 0.9}, {"positive_sampling": "balanced", "positive_share": 0.5},
                                   {"momentum": 0.5, "positive_sampling": "balanced", "algorithm": "coda_plus"}])
def test_a_resumed_run_with_momentum_or_balanced_batches_equals_the_uninterrupted_one(tmp_path, monkeypatch, extra):
    full = run(cfg(tmp_path / "a", **extra))
    with crash_in_round(monkeypatch, 11):
        run(cfg(tmp_path / "b", **extra))
    saved = load_checkpoint(tmp_path / "b" / "run" / "checkpoint.pt")
    assert saved.loop.state.round == 8
    if "momentum" in extra:
        assert all(np.abs(s["moments"][0]).sum() > 0 for s in saved.clients)  # the buffers are in it
    resumed = resume(tmp_path / "b" / "run")
    assert_same_state(resumed, full)
    assert [h["test_auc"] for h in resumed.history] == [h["test_auc"] for h in full.history]


def labels_of(n_pos, n):
    y = torch.zeros(n, 1)
    y[torch.randperm(n, generator=torch.Generator().manual_seed(0))[:n_pos]] = 1
    return y


def test_balanced_batches_hold_the_set_share_of_positives_and_repeat_the_few():
    y = labels_of(5, 200)  # 2.5 % positives
    split = Split(torch.arange(200, dtype=torch.float32).reshape(-1, 1), y)
    for share, want in ((0.5, 16), (0.25, 8), (0.01, 1), (0.99, 31)):
        sampler = make_sampler(split, 32, seed=1, device=torch.device("cpu"), positive_sampling="balanced",
                               positive_share=share)
        seen = set()
        for _ in range(20):
            x, yb = sampler.next()
            assert x.shape[0] == 32 and int(yb.sum()) == want
            seen.update(int(i) for i in x[yb[:, 0] == 1, 0])
        assert seen == {int(i) for i in y[:, 0].nonzero()[:, 0]}  # every positive, each drawn many times
    natural = make_sampler(split, 32, seed=1, device=torch.device("cpu"))
    assert sum(int(natural.next()[1].sum()) for _ in range(20)) < 20 * 8  # the natural draw rarely has a positive


def test_balanced_stream_state_restores_the_same_batches_and_multi_label_counts_any_positive():
    y = torch.tensor([[1, 0], [0, 0], [0, 1], [0, float("nan")], [0, 0], [0, 0]])
    stream = index_stream(y, 4, seed=3, positive_sampling="balanced", positive_share=0.5)
    assert isinstance(stream, BalancedIndexStream) and set(stream.pos_index.tolist()) == {0, 2}
    stream.next()
    saved = stream.get_state()
    ahead = [stream.next() for _ in range(5)]
    stream.set_state(saved)
    assert all(torch.equal(a, stream.next()) for a in ahead)


def test_balanced_batches_give_the_objective_their_share_as_p_unless_positive_ratio_is_set(tmp_path):
    natural = run(cfg(tmp_path / "a", iterations=6))
    share = run(cfg(tmp_path / "b", iterations=6, positive_sampling="balanced", positive_share=0.4))
    fixed = run(cfg(tmp_path / "c", iterations=6, positive_sampling="balanced", positive_ratio=0.2))
    assert natural.summary["positive_ratio"] == [0.1]  # the data's: imratio 0.1 on every client
    assert share.summary["positive_ratio"] == [0.4] and fixed.summary["positive_ratio"] == [0.2]


def test_a_client_with_one_class_draws_naturally_with_a_warning(caplog):
    stream = index_stream(torch.zeros(10, 1), 4, seed=0, positive_sampling="balanced", who="client 3")
    assert isinstance(stream, IndexStream) and "client 3 has no positive" in caplog.text


@pytest.mark.parametrize("values,words", [
    ({"momentum": 1.0}, "'momentum': 1.0"),
    ({"positive_sampling": "dual"}, "'positive_sampling'"),
    ({"positive_share": 0}, "'positive_share'"),
    ({"positive_sampling": "balanced", "batch_size": "full"}, "'batch_size'"),
    ({"local_optimizer": "adam"}, "'local_optimizer'"),
    ({"pretrain_optimizer": "lbfgs"}, "'pretrain_optimizer'"),
    ({"positive_sampling": "balanced", "algorithm": "coda"}, "natural with algorithm coda"),
])
def test_bad_values_are_one_line_config_errors(values, words):
    with pytest.raises(ConfigError, match=words) as info:
        build_config({"dataset": "synthetic", **values})
    assert "\n" not in str(info.value)


def test_adam_pretraining_takes_adams_step_and_resumes_exactly(tmp_path, monkeypatch):
    base = dict(algorithm="coda_plus", pretrain_iterations=24, pretrain_optimizer="adam", pretrain_lr=0.01,
                iterations=24)
    stage1 = pretrain_config(cfg(tmp_path, **base))
    assert (stage1.local_optimizer, stage1.objective, stage1.momentum) == ("adam", "bce", 0.0)
    adam = run(cfg(tmp_path / "adam", **base))
    sgd = run(cfg(tmp_path / "sgd", **{**base, "pretrain_optimizer": "sgd"}))
    assert not np.array_equal(adam.state.v, sgd.state.v)
    # the Adam moments are client state: a pre-training stopped half-way and resumed ends where the full one does
    full = run(cfg(tmp_path / "full", algorithm="fedavg", objective="bce", local_optimizer="adam"))
    with crash_in_round(monkeypatch, 7):
        run(cfg(tmp_path / "cut", algorithm="fedavg", objective="bce", local_optimizer="adam"))
    assert_same_state(resume(tmp_path / "cut" / "run"), full)


def test_the_adam_step_is_torchs_adam():
    from fdam_ray.algorithms.drift import DRIFT_CORRECTIONS
    from fdam_ray.algorithms.local import LocalSolver
    from fdam_ray.core.flat import FlatModel
    from fdam_ray.objectives import Objective

    torch.manual_seed(0)
    x, y = torch.randn(16, 4), (torch.rand(16) < 0.3).float()
    model, twin = torch.nn.Linear(4, 1), torch.nn.Linear(4, 1)
    twin.load_state_dict(model.state_dict())
    objective = Objective("bce", num_tasks=1)
    flat = FlatModel(twin, aux_size=0)
    solver = LocalSolver(flat, objective, correction=DRIFT_CORRECTIONS["none"].client(flat), prox_weight=0.0,
                         weight_decay=0.01, grad_clip=None)
    solver.set_local_step("adam", 0.0)
    solver.bind_moments(solver.new_moments())
    adam = torch.optim.Adam(model.parameters(), lr=0.05, weight_decay=0.01, foreach=False)
    for _ in range(5):
        adam.zero_grad()
        objective(model(x), y, None, None, None).backward()
        adam.step()
        solver.loss(x, y).backward()
        solver.apply(0.05)
    want = torch.cat([model.weight.reshape(-1), model.bias]).detach()
    torch.testing.assert_close(flat.v, want, rtol=1e-6, atol=1e-7)


def test_the_readme_custom_loop_runs_in_at_most_16_lines_and_learns():
    from pathlib import Path

    from sklearn.metrics import roc_auc_score

    readme = (Path(__file__).resolve().parents[2] / "docs/tutorials/own-loop.md").read_text()
    section = readme.split("# AUC losses in your own loop", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    assert len(code.strip().splitlines()) <= 16
    torch.manual_seed(0)
    space: dict = {}
    exec(compile(code, "docs/tutorials/own-loop.md", "exec"), space)
    with torch.no_grad():
        scores = space["model"](space["x"]).reshape(-1).numpy()
    assert roc_auc_score(space["y"].numpy(), scores) > 0.9
    assert space["optimizer"].stage == 4 and space["loss_fn"].alpha.item() >= 0


def test_the_sampling_momentum_benchmark_in_quick_miniature(tmp_path):
    import re
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import sampling_momentum

    out = tmp_path / "sm.md"
    line = sampling_momentum.main(["--quick", "--clients", "2", "--iterations", "16", "--local-steps", "4",
                                   "--seeds", "0", "1", "--out", str(out)])
    assert re.fullmatch(r"RESULT( \w+=(-?[0-9.e+-]+|nan))+", line), line
    values = {k: float(v) for k, v in (item.split("=") for item in line.split()[1:])}
    assert set(values) == {"plain", "balanced", "momentum", "balanced_gain", "momentum_gain"}
    assert values["balanced_gain"] == pytest.approx(values["balanced"] - values["plain"], abs=1e-3)
    text = out.read_text()
    assert "Command: `python benchmarks/sampling_momentum.py --quick" in text
    assert "| natural, momentum 0 |" in text and "balanced (share 0.5)" in text and "momentum 0.9, lr 0.03" in text


def test_balanced_batches_read_from_a_dataset_hold_the_share_and_resume_at_the_same_batch():
    from fdam_ray.data.base import DatasetSplit

    y = labels_of(6, 60)
    dataset = torch.utils.data.TensorDataset(torch.arange(60, dtype=torch.float32).reshape(-1, 1), y)
    split = DatasetSplit(dataset, y.numpy())
    sampler = make_sampler(split, 8, seed=2, device=torch.device("cpu"), positive_sampling="balanced",
                           positive_share=0.25)
    for _ in range(3):
        assert int(sampler.next()[1].sum()) == 2
    saved = sampler.get_state()
    ahead = [sampler.next()[0] for _ in range(4)]
    twin = make_sampler(split, 8, seed=99, device=torch.device("cpu"), positive_sampling="balanced",
                        positive_share=0.25)
    twin.set_state(saved)
    assert all(torch.equal(a, twin.next()[0]) for a in ahead)
