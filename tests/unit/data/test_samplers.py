"""Minibatch samplers: seeded epochs over a shard, in memory or through a DataLoader."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fdam_ray.data import DatasetSplit, LoaderSampler, Split, TensorSampler, iter_batches


class Indexed(torch.utils.data.Dataset):
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.tensor([float(i)]), torch.tensor([float(i % 2)])


def drain(sampler, k):
    return [sampler.next()[0].ravel().tolist() for _ in range(k)]


def continues_after_restore(make, sampler, k) -> tuple[bool, list]:
    """Save ``sampler``'s state, draw k batches, restore the state into a fresh ``make()`` sampler: does it
    draw the same k batches? Also returns the batches drawn."""
    state = sampler.get_state()
    rest = drain(sampler, k)
    fresh = make()
    fresh.set_state(state)
    return drain(fresh, k) == rest, rest


@pytest.mark.parametrize("kind", ["tensor", "loader"])
def test_every_sample_once_per_epoch_and_seeded(kind):
    n = 10

    def make(seed):
        if kind == "tensor":
            return TensorSampler(Split(torch.arange(n, dtype=torch.float32).reshape(-1, 1),
                                       torch.tensor([i % 2 for i in range(n)], dtype=torch.float32)), 5, seed=seed)
        split = DatasetSplit(Indexed(n), np.array([i % 2 for i in range(n)]))
        return LoaderSampler(split, 5, seed=seed, device=torch.device("cpu"))

    a = drain(make(1), 4)
    assert sorted(a[0] + a[1]) == list(range(n)) and sorted(a[2] + a[3]) == list(range(n))
    assert a != [sorted(x) for x in a] or a[:2] != a[2:]  # shuffled
    assert drain(make(1), 4) == a
    assert drain(make(2), 4) != a


@pytest.mark.parametrize("kind", ["tensor", "loader"])
def test_sampler_state_restores_the_same_stream(kind):
    n = 9
    if kind == "tensor":
        make = lambda: TensorSampler(Split(torch.arange(n, dtype=torch.float32).reshape(-1, 1),
                                           torch.zeros(n)), 4, seed=3)
    else:
        make = lambda: LoaderSampler(DatasetSplit(Indexed(n), np.zeros(n)), 4, seed=3,
                                     device=torch.device("cpu"))
    s = make()
    drain(s, 3)
    assert continues_after_restore(make, s, 5)[0]


def test_iter_batches_reads_a_dataset_in_order():
    split = DatasetSplit(Indexed(7), np.array([i % 2 for i in range(7)]))
    xs = torch.cat([x for x, _ in iter_batches(split, 3, torch.device("cpu"))]).ravel().tolist()
    assert xs == list(range(7))
    assert split.label_counts()[0].tolist() == [3]


def test_full_batch_needs_in_memory_data():
    with pytest.raises(ValueError, match="full batch"):
        LoaderSampler(DatasetSplit(Indexed(3), np.zeros(3)), 0, seed=0, device=torch.device("cpu"))


class Augmenting(Indexed):
    """Adds a draw from its own generator to every sample, like the image datasets' augmentation."""

    def __init__(self, n):
        super().__init__(n)
        self.generator = torch.Generator().manual_seed(11)

    def __getitem__(self, i):
        x, y = super().__getitem__(i)
        return x + torch.rand(1, generator=self.generator), y


def test_loader_sampler_state_includes_the_augmentation_generator():
    make = lambda: LoaderSampler(DatasetSplit(Augmenting(9), np.zeros(9)), 4, seed=3,
                                 device=torch.device("cpu"))
    s = make()
    drain(s, 3)
    assert continues_after_restore(make, s, 4)[0]


@pytest.mark.parametrize("workers", [0, 1])
def test_loader_batches_are_full_and_restore_exactly_while_workers_read_ahead(workers):
    make = lambda: LoaderSampler(DatasetSplit(Indexed(9), np.zeros(9), num_workers=workers), 4,
                                 seed=5, device=torch.device("cpu"))
    s = make()
    first = drain(s, 3)
    assert all(len(b) == 4 for b in first)  # 12 samples over an epoch of 9: the third batch spans two
    assert sorted(first[0] + first[1] + first[2][:1]) == list(range(9))
    same, rest = continues_after_restore(make, s, 4)
    assert same
    tensor = TensorSampler(Split(torch.arange(9, dtype=torch.float32).reshape(-1, 1), torch.zeros(9)), 4, seed=5)
    assert drain(tensor, 7) == first + rest  # in memory or read from disk: the same batches
