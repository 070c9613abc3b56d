"""``dp: sample`` wired into a client's local step: the GroupNorm network, the per-step noise keys, the refusals.

Pinned here without a federation: ``cnn`` is the network it was (rebuilt independently) and ``cnn_gn`` shares
its weights; each step's noise is the one its key (noise seed, round, site, step) names, recomputed from NumPy's
SeedSequence; with sigma = 0 and a clip that never binds one client step equals the plain step to float32
rounding (per-sample gradients summed by an einsum, not one batch backward pass); a tiny clip moves the weights
less; every combination that breaks the guarantee is refused in one line naming what to change.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from fdam_ray.assembly.plugs import site_face
from fdam_ray.clients.client import Client, ClientSection
from fdam_ray.config import build_config
from fdam_ray.data import make_source
from fdam_ray.features.precision import Precision
from fdam_ray.models import build_model
from fdam_ray.privacy.dpsgd import SAMPLE_NOISE_DOMAIN, SampleNoise, check_private_batch, check_private_replica

CPU = torch.device("cpu")


def old_cnn(channels: int, num_tasks: int, width: int) -> nn.Module:
    """The ``cnn`` of before ``cnn_gn`` existed, written out again."""

    def block(c_in: int, c_out: int, stride: int) -> list[nn.Module]:
        return [nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU()]

    return nn.Sequential(*block(channels, width, 1), *block(width, 2 * width, 2), *block(2 * width, 2 * width, 2),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2 * width, num_tasks))


def test_cnn_is_the_network_it_was_and_cnn_gn_has_its_weights_with_group_norm():
    torch.manual_seed(7)
    reference = old_cnn(3, 2, 8).state_dict()
    cnn = build_model("cnn", (3, 16, 16), 2, width=8, seed=7).state_dict()
    assert list(cnn) == list(reference)
    for name in reference:
        assert torch.equal(cnn[name], reference[name]), name
    gn = build_model("cnn_gn", (3, 16, 16), 2, width=8, seed=7)
    norms = [m for m in gn.modules() if isinstance(m, nn.GroupNorm)]
    assert [(m.num_groups, m.num_channels) for m in norms] == [(8, 8), (16, 16), (16, 16)]  # gcd(32, c) groups
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in gn.modules())
    assert list(gn.buffers()) == []
    for name, p in gn.named_parameters():  # convolutions and head as cnn's; norms at weight 1, bias 0
        assert torch.equal(p, cnn[name]), name
    assert math.gcd(32, 96) == 32 and build_model("cnn_gn", (1, 8, 8), 1, width=48, seed=0)[4].num_groups == 32


def noise_of(noise: SampleNoise, n: int = 5) -> torch.Tensor:
    return torch.randn(n, generator=noise.next_generator())


def test_each_step_draws_from_the_generator_its_key_names():
    noise = SampleNoise(11, 2, device=CPU)
    noise.begin_round(4)
    first, second = noise_of(noise), noise_of(noise)
    for step, drawn in enumerate((first, second)):
        key = (SAMPLE_NOISE_DOMAIN, 4, 3, step)  # site 2 is keyed 3 (0 is nobody's)
        seed = int(np.random.SeedSequence(entropy=11, spawn_key=key).generate_state(1, np.uint64)[0])
        assert torch.equal(drawn, torch.randn(5, generator=torch.Generator().manual_seed(seed)))
    assert not torch.equal(first, second)
    again = SampleNoise(11, 2, device=CPU)
    again.begin_round(4)
    assert torch.equal(noise_of(again), first)  # a replay, with no generator state carried
    for seed, site, round_index in ((12, 2, 4), (11, 1, 4), (11, 2, 5)):
        other = SampleNoise(seed, site, device=CPU)
        other.begin_round(round_index)
        assert not torch.equal(noise_of(other), first)


def test_without_a_noise_seed_each_site_draws_fresh_entropy_it_never_shows():
    a, b = SampleNoise(None, 0, device=CPU), SampleNoise(None, 0, device=CPU)
    assert not torch.equal(noise_of(a), noise_of(b))
    assert repr(a) == "SampleNoise(site=0, round=0, step=1)"
    with pytest.raises(ValueError, match="dp_noise_seed -1"):
        SampleNoise(-1, 0, device=CPU)


def digits_config(**kw):
    base = dict(dataset="digits", model="cnn_gn", model_width=4, num_clients=2, batch_size=8, algorithm="codasca",
                local_steps=2, iterations=4, positive_ratio=0.25, executor="inline", tensorboard=False)
    base.update(kw)
    return build_config(base)


def one_client(config, client_id: int = 0) -> Client:
    source = make_source(config)
    client = Client(ClientSection.of(config), source, client_id, device=CPU, face=site_face(config))
    client.configure(np.full(source.num_tasks, 0.25))
    client.replica.bind(client)
    client.solver.set_reference(client.flat.v.detach().cpu().numpy())
    return client


def steps(client: Client, n: int = 3, lr: float = 0.1, batches: list | None = None) -> np.ndarray:
    torch.manual_seed(0)
    for i in range(n):
        x, y = client.sampler.next() if batches is None else batches[i]
        client.replica.train_step(x, y, lr)
    return torch.cat([client.flat.v, client.flat.alpha]).detach().numpy().copy()


@pytest.fixture(scope="module")
def plain_steps() -> tuple[np.ndarray, np.ndarray]:
    client = one_client(digits_config())  # dp: off, fed the batches a dp: sample client draws (dp_noise_seed 0)
    private = one_client(digits_config(dp="sample", dp_noise_multiplier=0.0, dp_noise_seed=0, dp_sampling="fixed"))
    start = torch.cat([client.flat.v, client.flat.alpha]).detach().numpy().copy()
    return start, steps(client, batches=[private.sampler.next() for _ in range(3)])


def test_no_noise_and_a_clip_that_never_binds_is_the_plain_step_to_float32_rounding(plain_steps):
    start, plain = plain_steps
    private = steps(one_client(digits_config(dp="sample", dp_noise_multiplier=0.0, dp_clip=1e6, dp_noise_seed=0,
                                                      dp_sampling="fixed")))  # B exactly: the plain step's mean
    assert np.abs(plain - start).max() > 1e-3  # the steps moved
    np.testing.assert_allclose(private, plain, rtol=0, atol=2e-6)


def test_noise_and_a_tiny_clip_act_on_the_step(plain_steps):
    start, plain = plain_steps
    noised = steps(one_client(digits_config(dp="sample", dp_noise_multiplier=1.0, dp_noise_seed=1)))
    assert np.abs(noised - plain).max() > 1e-3
    tiny = steps(one_client(digits_config(dp="sample", dp_noise_multiplier=0.0, dp_clip=1e-4)))
    moved, moved_plain = np.linalg.norm(tiny - start), np.linalg.norm(plain - start)
    assert 0 < moved < moved_plain / 100  # each sample adds at most C = 1e-4 per step: lr * C * 3 steps at most
    assert moved <= 0.1 * 1e-4 * 3 * (1 + 1e-5) + 1e-7


def test_the_site_draws_noise_from_its_own_noise_seed_never_the_run_seed():
    a = steps(one_client(digits_config(dp="sample", dp_noise_multiplier=1.0, dp_noise_seed=5)))
    b = steps(one_client(digits_config(dp="sample", dp_noise_multiplier=1.0, dp_noise_seed=5, seed=1)), 3)
    c = steps(one_client(digits_config(dp="sample", dp_noise_multiplier=1.0, dp_noise_seed=6)))
    same = steps(one_client(digits_config(dp="sample", dp_noise_multiplier=1.0, dp_noise_seed=5)))
    np.testing.assert_array_equal(a, same)
    assert not np.array_equal(a, c)
    assert not np.array_equal(a, b)  # another run seed: another network and batches, same noise key
    fresh = [steps(one_client(digits_config(dp="sample", dp_noise_multiplier=1.0))) for _ in range(2)]
    assert not np.array_equal(*fresh)  # no noise seed: fresh entropy on each build


@pytest.mark.parametrize(("kw", "match"), [
    (dict(model="cnn"), r"'model': 'cnn' is not allowed \(cnn_gn"),
    (dict(positive_sampling="balanced", positive_share=0.5), "'positive_sampling': 'balanced' is not allowed"),
    (dict(batch_size=1000), "client 0 has 417 training samples, fewer than batch_size=1000"),
])
def test_what_breaks_the_guarantee_is_refused_at_client_start_in_one_line(kw, match):
    with pytest.raises(ValueError, match=match) as caught:  # a ConfigError (a ValueError) for the first two
        one_client(digits_config(dp="sample", dp_noise_multiplier=1.0, **kw))
    assert "\n" not in str(caught.value)


def test_fp16_and_an_unresolved_sigma_are_refused():
    model = build_model("mlp", (4,), 1, width=4, seed=0)
    with pytest.raises(ValueError, match="fp32 or bf16, not fp16"):
        check_private_replica(model, Precision("fp16", CPU), positive_sampling="natural", noise_multiplier=1.0)
    with pytest.raises(ValueError, match="no dp_noise_multiplier"):
        check_private_replica(model, Precision("fp32", CPU), positive_sampling="natural", noise_multiplier=None)
    check_private_replica(model, Precision("bf16", CPU), positive_sampling="natural", noise_multiplier=0.0)
    check_private_batch(0, 5, "client 0")  # 'full': B = n_k
    check_private_batch(5, 5, "client 0")
