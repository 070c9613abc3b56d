"""dp: sample's batch draws (fdam_ray/privacy/batches.py): Poisson with rate q = B / n_k, or B distinct uniform
samples per step, each step independent, keyed by the site's secret noise key (never the run seed).

Statistical checks use 5 standard errors over thousands of draws (a false failure has probability below 1e-5 per
check) and seeded keys, so they are deterministic; the tolerances are stated next to each.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from fdam_ray.assembly.plugs import site_face
from fdam_ray.clients.client import Client, ClientSection
from fdam_ray.config import build_config
from fdam_ray.data import make_source
from fdam_ray.data.base import DatasetSplit, IndexStream, Split, TensorSampler
from fdam_ray.objectives import Objective
from fdam_ray.privacy.batches import PrivateBatches, PrivateSampler, private_sampler
from fdam_ray.privacy.dpsgd import SAMPLE_BATCH_DOMAIN, SampleNoise, per_sample_loss, private_gradient

CPU = torch.device("cpu")


def keys(seed: int | None = 3, site: int = 0, round_index: int = 1) -> SampleNoise:
    noise = SampleNoise(seed, site, device=CPU)
    noise.begin_round(round_index)
    return noise


def draws(batches: PrivateBatches, steps: int) -> list[np.ndarray]:
    return [batches.next().numpy() for _ in range(steps)]


def counts(drawn: list[np.ndarray], n: int) -> np.ndarray:
    return np.bincount(np.concatenate(drawn), minlength=n)


def test_poisson_takes_each_sample_with_probability_b_over_n_and_b_samples_on_average():
    n, b, steps = 50, 10, 4000
    q = b / n
    drawn = draws(PrivateBatches(n, b, "poisson", keys()), steps)
    sizes = np.array([len(d) for d in drawn])
    # each sample: Binomial(steps, q) inclusions, sd sqrt(steps q (1 - q)) = 25.3 -> within 5 sd of steps q = 800
    assert np.abs(counts(drawn, n) - steps * q).max() < 5 * np.sqrt(steps * q * (1 - q))
    # batch size: Binomial(n, q), mean B, its mean over the steps within 5 standard errors (0.045 each)
    assert abs(sizes.mean() - b) < 5 * np.sqrt(n * q * (1 - q) / steps)
    assert abs(sizes.var() - n * q * (1 - q)) < 0.1 * n * q * (1 - q)  # it varies as a binomial does (var 8)
    assert all(len(np.unique(d)) == len(d) and np.all(np.diff(d) > 0) for d in drawn)  # no repeats, increasing
    both = np.mean([0 in d and 1 in d for d in drawn])  # two samples drawn independently: q^2
    assert abs(both - q * q) < 5 * np.sqrt(q * q * (1 - q * q) / steps)


def test_poisson_may_draw_an_empty_batch_and_draws_exactly_the_keyed_uniforms():
    n, b = 5, 1
    batches = PrivateBatches(n, b, "poisson", keys(seed=11, site=2, round_index=4))
    drawn = draws(batches, 400)
    empty = np.mean([len(d) == 0 for d in drawn])
    assert abs(empty - 0.8**5) < 5 * np.sqrt(0.8**5 * (1 - 0.8**5) / 400)  # P(no sample) = (1 - q)^n = 0.328
    for step in (0, 7, 399):  # independent recomputation of the key: SeedSequence -> torch CPU generator
        seed = np.random.SeedSequence(entropy=11, spawn_key=(0x4442, 4, 3, step)).generate_state(1, np.uint64)[0]
        uniforms = torch.rand(n, generator=torch.Generator().manual_seed(int(seed)), dtype=torch.float64)
        np.testing.assert_array_equal(drawn[step], np.flatnonzero(uniforms.numpy() < b / n))
    assert SAMPLE_BATCH_DOMAIN == 0x4442


def test_fixed_takes_b_distinct_samples_uniformly_and_each_step_independently():
    n, b, steps = 40, 8, 4000
    q = b / n
    drawn = draws(PrivateBatches(n, b, "fixed", keys()), steps)
    assert all(len(d) == b and len(np.unique(d)) == b and d.min() >= 0 and d.max() < n for d in drawn)
    # marginal: each sample in a step with probability B / n, Binomial(steps, q) inclusions
    assert np.abs(counts(drawn, n) - steps * q).max() < 5 * np.sqrt(steps * q * (1 - q))
    # independent steps: consecutive batches share B^2 / n = 1.6 samples on average (hypergeometric, variance
    # b q (1 - q) (n - b) / (n - 1) = 1.05); shuffled epochs would share none within an epoch
    overlap = np.array([len(np.intersect1d(x, y)) for x, y in itertools.pairwise(drawn)])
    var = b * q * (1 - q) * (n - b) / (n - 1)
    assert abs(overlap.mean() - b * q) < 5 * np.sqrt(var / len(overlap))
    assert np.mean(overlap == 0) < 0.5


def test_a_fixed_noise_seed_replays_the_draws_and_any_other_key_changes_them():
    def first(seed, site=0, round_index=1, sampling="fixed"):
        return np.concatenate(draws(PrivateBatches(100, 10, sampling, keys(seed, site, round_index)), 3))

    for sampling in ("fixed", "poisson"):
        np.testing.assert_array_equal(first(5, sampling=sampling), first(5, sampling=sampling))
        for other in (dict(seed=6), dict(site=1), dict(round_index=2), dict(seed=None)):
            assert not np.array_equal(first(**{"seed": 5, **other, "sampling": sampling}),
                                      first(5, sampling=sampling)), other
    assert not np.array_equal(first(None), first(None))  # fresh entropy per site object


def test_batch_draws_and_noise_count_their_steps_apart_and_restart_each_round():
    a, b = keys(9), keys(9)
    for _ in range(3):
        a.next_generator()  # noise drawn between batches shifts no batch key
    x = [PrivateBatches(30, 5, "fixed", a).next() for _ in range(2)]
    y = [PrivateBatches(30, 5, "fixed", b).next() for _ in range(2)]
    np.testing.assert_array_equal(torch.cat(x), torch.cat(y))
    b.begin_round(1)  # round 1 again: step 0 again
    np.testing.assert_array_equal(PrivateBatches(30, 5, "fixed", b).next(), x[0])
    noise, batch = keys(9), keys(9)
    batch.next_batch_generator()
    assert torch.equal(torch.randn(4, generator=noise.next_generator()),
                       torch.randn(4, generator=keys(9).next_generator()))
    assert repr(batch) == "SampleNoise(site=0, round=1, step=0)"  # the secret is never shown


@pytest.mark.parametrize(("n", "b", "sampling", "match"), [
    (10, 0, "fixed", "1 to n_k = 10"), (10, 11, "poisson", "1 to n_k = 10"), (0, 1, "fixed", "no training"),
    (10, 2, "shuffled", "is not one of fixed, poisson"),
])
def test_impossible_draws_are_refused(n, b, sampling, match):
    with pytest.raises(ValueError, match=match):
        PrivateBatches(n, b, sampling, keys())


class Squares(torch.utils.data.Dataset):
    """Samples read one at a time (as from disk): x = (i, i^2), y = (i odd,)."""

    def __len__(self) -> int:
        return 6

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.tensor([float(i), float(i * i)]), torch.tensor([float(i % 2)])


@pytest.mark.parametrize("sampling", ["fixed", "poisson"])
def test_the_sampler_reads_the_drawn_samples_in_memory_and_from_a_dataset(sampling):
    x = torch.arange(12, dtype=torch.float32).reshape(6, 2)
    y = (torch.arange(6) % 2).float().reshape(6, 1)
    index = np.concatenate(draws(PrivateBatches(6, 3, sampling, keys(4)), 5))
    memory = private_sampler(Split(x, y), 3, sampling, keys(4), device=CPU)
    disk = private_sampler(DatasetSplit(Squares(), y.numpy()), 3, sampling, keys(4), device=CPU)
    got = [memory.next() for _ in range(5)]
    read = [disk.next() for _ in range(5)]
    np.testing.assert_array_equal(torch.cat([g[0] for g in got]), x[index])
    np.testing.assert_array_equal(torch.cat([r[0][:, 0] for r in read]), index.astype(np.float32))
    np.testing.assert_array_equal(torch.cat([r[1] for r in read]), y[index])
    assert memory.get_state()["dp_sampling"] == sampling


def test_an_empty_draw_from_a_dataset_has_the_samples_shapes():
    sampler = PrivateSampler(DatasetSplit(Squares(), np.zeros((6, 1), np.float32)),
                             PrivateBatches(6, 1, "poisson", keys(11)), device=CPU)
    shapes = {tuple(x.shape[1:]) + tuple(y.shape[1:]) for x, y in (sampler.next() for _ in range(40))}
    assert shapes == {(2, 1)}
    sampler.batches.rate = 0.0  # force an empty draw before any sample was read by a fresh sampler
    fresh = PrivateSampler(sampler.split, sampler.batches, device=CPU)
    x, y = fresh.next()
    assert x.shape == (0, 2) and y.shape == (0, 1)


def test_an_empty_or_single_batch_takes_a_step_of_the_noise_over_the_planned_b():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    obj = Objective("auc_margin", num_tasks=1, margin=1.0)
    obj.set_positive_ratio([0.3])
    a, b, alpha = torch.tensor([0.2]), torch.tensor([0.4]), torch.tensor([0.5])
    size = sum(p.numel() for p in model.parameters()) + 3

    def grad(x, y, sigma):
        return private_gradient(model, a, b, alpha, x, y, per_sample_loss(obj), clip=0.5, noise_multiplier=sigma,
                                batch_size=8, generator=torch.Generator().manual_seed(1))

    empty = grad(torch.zeros(0, 3), torch.zeros(0, 1), 2.0)
    noise = torch.randn(size, generator=torch.Generator().manual_seed(1)) * (2.0 * 0.5) / 8
    np.testing.assert_array_equal(torch.cat([empty.v, empty.alpha]), noise)
    assert float(empty.loss) == 0.0
    assert not torch.cat([grad(torch.zeros(0, 3), torch.zeros(0, 1), 0.0).v]).any()
    x, y = torch.randn(1, 3), torch.ones(1, 1)
    one = grad(x, y, 0.0)
    norm = float(torch.cat([one.v, one.alpha]).norm())
    assert 0 < norm <= 0.5 / 8 * (1 + 1e-6)  # one clipped sample over the planned B
    plain = grad(x, y, 2.0)
    np.testing.assert_allclose(torch.cat([plain.v, plain.alpha]), torch.cat([one.v, one.alpha]) + noise, atol=1e-7)


def client(**kw) -> Client:
    base = dict(dataset="digits", model="cnn_gn", model_width=4, num_clients=2, batch_size=8, algorithm="codasca",
                local_steps=2, iterations=4, positive_ratio=0.25, executor="inline", tensorboard=False)
    config = build_config({**base, **kw})
    return Client(ClientSection.of(config), make_source(config), 1, device=CPU, face=site_face(config))


def test_a_client_draws_private_batches_only_under_dp_sample():
    off = client()
    assert isinstance(off.sampler, TensorSampler) and type(off.sampler.stream) is IndexStream
    stream = IndexStream(len(off.train), 8, 0 * 1_000_003 + 1)  # dp: off: the seeded shuffles, as before
    for _ in range(3):
        np.testing.assert_array_equal(off.sampler.next()[0], off.train.x[stream.next()])
    for sampling in ("fixed", "poisson"):
        private = client(dp="sample", dp_noise_multiplier=1.0, dp_noise_seed=3, dp_sampling=sampling)
        assert isinstance(private.sampler, PrivateSampler) and private.sampler.batches.sampling == sampling
        assert private.sampler.batches.rate == 8 / len(private.train)
        private.guard.begin_round(2)
        expected = PrivateBatches(len(private.train), 8, sampling, keys(3, site=1, round_index=2)).next()
        np.testing.assert_array_equal(private.sampler.next()[0], private.train.x[expected])
    full = client(dp="sample", dp_noise_multiplier=1.0, batch_size="full")  # fixed, q = 1: the whole set
    np.testing.assert_array_equal(full.sampler.next()[0], full.train.x)
