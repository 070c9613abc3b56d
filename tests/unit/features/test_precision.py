"""Mixed precision, channels-last, host-device traffic per round and data_workers=auto (all on the CPU)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import fdam_ray
from fdam_ray.clients.client import Client
from fdam_ray.config import ConfigError, build_config
from fdam_ray.core.flat import HostLink
from fdam_ray.core.state import RoundPlan
from fdam_ray.data import DatasetSplit, make_source
from fdam_ray.data import base as data_base
from fdam_ray.data.base import MAX_AUTO_WORKERS, LoaderSampler, loader_workers
from fdam_ray.features.precision import Precision, PrecisionSection, wants_channels_last
from fdam_ray.models import build_model

CPU = torch.device("cpu")
RUN = dict(dataset="digits", num_clients=2, model="cnn", model_width=8, iterations=80, local_steps=5, batch_size=32,
           eval_every=40, executor="inline", tensorboard=False, lr=0.1, seed=1)


def train(**kw):
    return fdam_ray.run(build_config(dict(RUN, **kw)), save=False)


def client(**kw) -> Client:
    cfg = build_config(dict(RUN, **kw))
    c = Client(cfg, make_source(cfg), 0, device=CPU)
    c.configure(np.array([0.1]))
    return c


def start_state(c: Client):
    state = c.flat.initial_state()
    if c.replica.algorithm.control_variates:
        state.c_v, state.c_alpha = np.zeros_like(state.v), np.zeros_like(state.alpha)
    c.begin_stage(state.v.copy(), True)
    return state


def first_conv(c: Client) -> torch.nn.Conv2d:
    return next(m for m in c.flat.model.modules() if isinstance(m, torch.nn.Conv2d))


def inner_conv(c: Client) -> torch.nn.Conv2d:
    """A convolution with several input channels (with one, both memory formats have the same strides)."""
    return next(m for m in c.flat.model.modules() if isinstance(m, torch.nn.Conv2d) and m.in_channels > 1)


def seen_by(module: torch.nn.Module, fn) -> dict:
    """What ``module`` saw in its last call during ``fn()``: input and output tensors' dtype and layout."""
    seen = {}

    def hook(_, inputs, output):
        seen.update(in_dtype=inputs[0].dtype, out_dtype=output.dtype,
                    in_channels_last=inputs[0].is_contiguous(memory_format=torch.channels_last)
                    and not inputs[0].is_contiguous())

    handle = module.register_forward_hook(hook)
    try:
        fn()
    finally:
        handle.remove()
    return seen


# -- config -------------------------------------------------------------------------------------
def test_the_new_fields_parse_and_bad_values_name_the_field():
    cfg = build_config()
    assert (cfg.precision, cfg.channels_last, cfg.data_workers) == ("fp32", "auto", 0)
    cfg = build_config(precision="bf16", channels_last=True, data_workers="auto")
    assert (cfg.precision, cfg.channels_last, cfg.data_workers) == ("bf16", True, "auto")
    for field, value, allowed in [("precision", "fp8", "one of fp32, bf16, fp16"),
                                  ("channels_last", "yes", "true, false or 'auto'"),
                                  ("data_workers", "many", ">= 0 or 'auto'"), ("data_workers", -1, ">= 0 or 'auto'")]:
        with pytest.raises(ConfigError, match=f"config field '{field}': .* is not allowed \\({allowed}\\)"):
            build_config({field: value})


# -- precision ----------------------------------------------------------------------------------
def test_bf16_trains_close_to_fp32_and_keeps_the_state_float32():
    fp32, bf16 = train(), train(precision="bf16")
    auc32, auc16 = fp32.history[-1]["test_auc"], bf16.history[-1]["test_auc"]
    assert auc16 > 0.75 and abs(auc16 - auc32) < 0.03
    assert not np.array_equal(fp32.state.v, bf16.state.v)  # autocast is on: the arithmetic differs
    drift = np.linalg.norm(bf16.state.v - fp32.state.v) / np.linalg.norm(fp32.state.v)
    assert drift < 0.05
    for name in ("v", "alpha", "buffers", "c_v", "c_alpha"):
        assert getattr(bf16.state, name).dtype == np.float32, name


def test_bf16_runs_the_network_in_bf16_and_everything_else_in_float32():
    c = client(precision="bf16", algorithm="codasca")
    state = start_state(c)
    c.solver.begin(state)
    x, y = c.sampler.next()
    losses = []
    seen = seen_by(first_conv(c), lambda: losses.append(c.replica.train_step(x, y, 0.1)))
    assert seen["out_dtype"] == torch.bfloat16 and x.dtype == torch.float32
    assert losses[0].dtype == torch.float32 and c.flat.forward(x).dtype == torch.float32
    flat = c.flat
    for t in (flat.v, flat.grad, flat.a, flat.b, flat.alpha, flat.alpha.grad, flat.buffers, c.solver.correction.c_v,
              c.solver.correction.corr_v, c.solver.prox_ref, c.replica.objective.p):
        assert t.dtype == torch.float32
    assert all(p.dtype == torch.float32 for p in flat.model.parameters()) and flat.bound()
    update = c.local_round(state, RoundPlan(1, 1, 3, 0.1, 0))
    assert all(a.dtype == np.float32 for a in (update.v, update.alpha, update.buffers, update.c_v, update.c_alpha))
    # scoring runs the same forward pass
    assert seen_by(first_conv(c), lambda: c.replica.score(c.train))["out_dtype"] == torch.bfloat16
    plain = client()
    assert seen_by(first_conv(plain), lambda: plain.replica.score(plain.train))["out_dtype"] == torch.float32


def test_fp16_skips_a_step_whose_gradients_overflow_and_lowers_the_scale():
    c = client(precision="fp16")
    state = start_state(c)
    scaler = c.flat.precision.scaler
    assert scaler is not None and c.flat.precision.scale == 65536.0
    scaler.load_state_dict({**scaler.state_dict(), "scale": 2.0**126})  # fp16 gradients overflow at this scale
    update = c.local_round(state, RoundPlan(1, 1, 1, 0.1, 0))
    np.testing.assert_array_equal(update.v, state.v)  # the step was skipped
    assert c.flat.precision.scale == 2.0**125
    scaler.load_state_dict({**scaler.state_dict(), "scale": 1024.0})
    update = c.local_round(state, RoundPlan(2, 1, 2, 0.1, 0))
    assert np.abs(update.v - state.v).max() > 1e-4 and c.flat.precision.scale == 1024.0


def test_fp16_scaler_state_travels_with_the_client_state():
    a, b = client(precision="fp16", algorithm="codasca"), client(precision="fp16", algorithm="codasca")
    state = start_state(a)
    start_state(b)
    scaler = a.flat.precision.scaler
    scaler.load_state_dict({**scaler.state_dict(), "scale": 256.0, "growth_interval": 3})
    a.local_round(state, RoundPlan(1, 1, 4, 0.1, 0))
    saved = a.get_state()
    assert saved["scaler"]["scale"] == 512.0 and saved["scaler"]["_growth_tracker"] == 1
    b.set_state(saved)
    assert b.flat.precision.scaler.state_dict() == saved["scaler"]
    plan = RoundPlan(2, 1, 3, 0.1, 4)
    ua, ub = a.local_round(state, plan), b.local_round(state, plan)
    np.testing.assert_array_equal(ua.v, ub.v)
    np.testing.assert_array_equal(ua.c_v, ub.c_v)
    assert a.flat.precision.scale == b.flat.precision.scale == 1024.0
    assert client().get_state()["scaler"] is None  # fp32 and bf16 have no scaler


def test_an_unknown_precision_is_refused():
    with pytest.raises(ValueError, match="precision 'fp8' is not one of fp32, bf16, fp16"):
        Precision("fp8", CPU)


# -- channels-last ------------------------------------------------------------------------------
def test_channels_last_on_the_cpu_gives_the_same_run_and_keeps_the_flat_views():
    c = client(channels_last=True)
    assert c.flat.precision.channels_last
    state = start_state(c)
    x = c.train.x[:16]
    assert seen_by(inner_conv(c), lambda: c.flat.forward(x))["in_channels_last"]
    plain = client()
    assert not seen_by(inner_conv(plain), lambda: plain.flat.forward(x))["in_channels_last"]
    ours = c.local_round(state, RoundPlan(1, 1, 3, 0.1, 0))
    assert c.flat.bound()  # parameters, gradients and BatchNorm statistics are still views of the flat vectors
    assert not plain.flat.precision.channels_last  # auto is off on the CPU
    start_state(plain)
    theirs = plain.local_round(state, RoundPlan(1, 1, 3, 0.1, 0))
    assert np.abs(ours.v - state.v).max() > 1e-3  # the round moved the model ...
    np.testing.assert_allclose(ours.v, theirs.v, rtol=0, atol=1e-5)  # ... the same way in either format
    np.testing.assert_allclose(ours.buffers, theirs.buffers, rtol=0, atol=1e-5)
    a, b = train(), train(channels_last=True)  # 80 steps: rounding differences grow, but stay small
    assert np.linalg.norm(a.state.v - b.state.v) / np.linalg.norm(a.state.v) < 1e-2
    assert b.history[-1]["test_auc"] == pytest.approx(a.history[-1]["test_auc"], abs=5e-3)


def test_bound_sees_a_weight_converted_to_channels_last():
    c = client()
    assert c.flat.bound()
    c.flat.model.to(memory_format=torch.channels_last)  # what Precision does not do: it re-lays the conv weights
    assert not c.flat.bound()


def test_channels_last_auto_and_cudnn_autotuning_follow_the_device(monkeypatch):
    cnn, mlp = build_model("cnn", (1, 8, 8), 1, width=4), build_model("mlp", (1, 8, 8), 1, width=4)
    cuda = torch.device("cuda")
    assert wants_channels_last("auto", cnn, cuda) and not wants_channels_last("auto", cnn, CPU)
    assert wants_channels_last(True, cnn, CPU) and not wants_channels_last(False, cnn, cuda)
    assert not wants_channels_last(True, mlp, cuda)  # not a convolutional network
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    Precision.of(PrecisionSection(precision="bf16", channels_last="auto", deterministic=True), cnn, cuda)
    assert torch.backends.cudnn.benchmark is False  # deterministic kernels asked for
    Precision.of(PrecisionSection(precision="bf16", channels_last="auto", deterministic=False), cnn, CPU)
    assert torch.backends.cudnn.benchmark is False  # not on the CPU
    p = Precision.of(PrecisionSection(precision="bf16", channels_last="auto", deterministic=False), cnn, cuda)
    assert torch.backends.cudnn.benchmark is True and p.channels_last and p.dtype == torch.bfloat16


# -- host-device traffic ------------------------------------------------------------------------
@pytest.mark.parametrize("algorithm", ["codasca", "coda_plus"])
def test_a_round_moves_each_state_vector_once_each_way(algorithm):
    c = client(algorithm=algorithm, clients_per_round=1)
    assert not c.flat.link.pinned and HostLink(torch.device("cuda")).pinned  # pinned staging only on a GPU
    state = start_state(c)
    n, m, nb = c.flat.state_size, c.flat.aux_size, c.flat.buffers.numel()
    cv = c.replica.algorithm.control_variates
    for partial in (False, True):
        before = c.control_variate()
        c.flat.link.log.clear()
        update = c.local_round(state, RoundPlan(1, 1, 3, 0.1, 0, partial=partial))
        up = [k for d, k in c.flat.link.log if d == "up"]
        down = [k for d, k in c.flat.link.log if d == "down"]
        assert up == [n, nb, m, *([n, m] if cv else [])]
        assert down == [n, m, nb, *([n, m] if cv else [])]
        if cv and partial:  # the change of c^k, formed on the device
            after = c.control_variate()
            np.testing.assert_array_equal(update.c_v, after[0] - before[0])
            np.testing.assert_array_equal(update.c_alpha, after[1] - before[1])
            assert np.abs(update.c_v).max() > 0
        elif cv:
            np.testing.assert_array_equal(update.c_v, c.control_variate()[0])
    c.flat.link.log.clear()
    c.replica.scores_of(state, c.train)  # scoring loads the model, not the control variates
    assert c.flat.link.log == [("up", n), ("up", nb), ("up", m)]


# -- data_workers=auto --------------------------------------------------------------------------
def test_auto_workers_are_the_cpus_of_the_process_less_one_and_bounded(monkeypatch):
    assert loader_workers(3) == 3 and loader_workers(0) == 0
    for cpus, want in [(1, 0), (2, 1), (4, 3), (64, MAX_AUTO_WORKERS)]:
        monkeypatch.setattr(data_base.os, "sched_getaffinity", lambda _pid, c=cpus: set(range(c)))
        assert loader_workers("auto") == want


def test_auto_workers_reach_the_dataloader(monkeypatch):
    monkeypatch.setattr(data_base, "client_cpus", lambda: 3.0)
    xs, ys = torch.randn(20, 2), (torch.arange(20) % 2).float()
    split = DatasetSplit(torch.utils.data.TensorDataset(xs, ys.reshape(-1, 1)), ys.numpy(), num_workers="auto")
    sampler = LoaderSampler(split, 4, seed=0, device=CPU)
    x, _ = sampler.next()
    assert sampler._iter._num_workers == 2 and x.shape == (4, 2)
    del sampler
