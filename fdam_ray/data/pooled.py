"""Multi-class datasets binarised by a list of positive classes and split over clients."""

from __future__ import annotations

import abc
import functools

import numpy as np
import torch

from fdam_ray.data.base import DataSource, Shard, Split
from fdam_ray.data.partition import dirichlet_partition, ih_partition


class ClassPoolSource(DataSource):
    """A labelled pool of classes -> binary task, partitioned with ``ih`` or ``dirichlet``.

    Subclasses provide :meth:`load_pool` and the default positive classes. The test
    set keeps every class, untouched.
    """

    default_positive_classes: tuple[int, ...] = ()

    def __init__(self, config) -> None:
        self.num_clients = config.num_clients
        self.partition = config.partition
        self.imratio = config.imratio
        self.concentration = config.dirichlet_concentration
        self.seed = config.seed
        self.positive_classes = tuple(config.positive_classes or self.default_positive_classes)

    @abc.abstractmethod
    def load_pool(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(x_train, classes_train, x_test, classes_test) as numpy arrays."""

    def _binary(self, classes: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.isin(classes, self.positive_classes).astype(np.float32)).reshape(-1, 1)

    @functools.cached_property
    def _pool(self):
        return self.load_pool()

    def client_indices(self) -> list[np.ndarray]:
        """Every client's training indices into the pool (deterministic in the seed)."""
        classes = self._pool[1]
        rng = np.random.default_rng([self.seed, 7919])
        if self.partition == "ih":
            return ih_partition(classes, self.positive_classes, num_clients=self.num_clients,
                                imratio=self.imratio, rng=rng)
        return dirichlet_partition(classes, self.positive_classes, num_clients=self.num_clients,
                                   imratio=self.imratio, concentration=self.concentration, rng=rng)

    def client_shard(self, client_id: int) -> Shard:
        x, classes, _, _ = self._pool
        idx = self.client_indices()[client_id]
        return Shard(train=Split(torch.from_numpy(x[idx]), self._binary(classes[idx])))

    def test_set(self) -> Split:
        _, _, x_test, classes_test = self._pool
        return Split(torch.from_numpy(x_test), self._binary(classes_test))

    def __getstate__(self):
        state = dict(self.__dict__)
        state.pop("_pool", None)  # a spec travels without its data
        return state
