"""Multi-class datasets binarised by lists of positive (and negative) classes and split over clients."""

from __future__ import annotations

import abc
import functools

import numpy as np
import torch
from sklearn.model_selection import train_test_split

from fdam_ray.data.base import AnySplit, DataSource, Shard, Split
from fdam_ray.data.partition import dirichlet_partition, ih_partition
from fdam_ray.data.sections import DataSection

SPLIT_SEED = 20210101  # a held-out split is the same for every run seed, so runs compare on one test set


class ClassPoolSource(DataSource):
    """A labelled pool of classes -> binary task, partitioned with ``ih`` or ``dirichlet``.

    Subclasses provide :meth:`load_pool` and the default positive classes, and
    may override :meth:`make_split` to read samples lazily (the pool's ``x`` is
    then whatever :meth:`make_split` understands: file names, uint8 images).
    With ``negative_classes`` unset every class that is not positive is
    negative; set, the classes in neither list are left out of training and
    test. The test set keeps every used class, untouched.
    """

    default_positive_classes: tuple[int, ...] = ()

    def __init__(self, section: DataSection) -> None:
        self.num_clients = section.num_clients
        self.partition = section.partition
        self.imratio = section.imratio
        self.concentration = section.dirichlet_concentration
        self.seed = section.seed
        if section.positive_classes is not None and not section.positive_classes:
            raise ValueError("positive_classes: [] names no class; give at least one, or null for the default")
        self.positive_classes = tuple(section.positive_classes or self.default_positive_classes)
        self.negative_classes = None if section.negative_classes is None else tuple(section.negative_classes)
        if self.negative_classes is not None:
            both = sorted(set(self.positive_classes) & set(self.negative_classes))
            if both:
                raise ValueError(f"classes {both} are in both positive_classes and negative_classes")

    @abc.abstractmethod
    def load_pool(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(x_train, classes_train, x_test, classes_test) as numpy arrays."""

    def load_test(self) -> tuple[np.ndarray, np.ndarray]:
        """(x_test, classes_test) alone; sources whose test files are separate read only those."""
        return self.load_pool()[2:]

    def make_split(self, x: np.ndarray, classes: np.ndarray, *, client_id: int | None) -> AnySplit:
        """A split of pool samples ``x`` of original classes ``classes`` (default: tensors in memory).

        ``client_id`` is the client whose training split this is, None for the test set.
        """
        return Split(torch.from_numpy(x), self.binary_labels(classes))

    def binary_labels(self, classes: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.isin(classes, self.positive_classes).astype(np.float32)).reshape(-1, 1)

    def _check_classes(self, classes: np.ndarray, part: str) -> None:
        known = set(np.unique(classes).tolist())
        for name, listed in (("positive_classes", self.positive_classes),
                             ("negative_classes", self.negative_classes or ())):
            unknown = sorted(set(listed) - known)
            if unknown:
                raise ValueError(f"{name}: classes {unknown} are not in the {part} data "
                                 f"(its classes are {min(known)}..{max(known)})")

    @functools.cached_property
    def _pool(self):
        pool = self.load_pool()
        self._check_classes(pool[1], "training")
        return pool

    def _used(self, classes: np.ndarray) -> np.ndarray:
        """Indices of the samples whose class is positive or negative."""
        if self.negative_classes is None:
            return np.arange(len(classes))
        return np.flatnonzero(np.isin(classes, self.positive_classes + self.negative_classes))

    def client_indices(self) -> list[np.ndarray]:
        """Every client's training indices into the pool (deterministic in the seed)."""
        used = self._used(self._pool[1])
        classes = self._pool[1][used]
        rng = np.random.default_rng([self.seed, 7919])
        if self.partition == "ih":
            parts = ih_partition(classes, self.positive_classes, num_clients=self.num_clients,
                                 imratio=self.imratio, rng=rng)
        else:
            parts = dirichlet_partition(classes, self.positive_classes, num_clients=self.num_clients,
                                        imratio=self.imratio, concentration=self.concentration, rng=rng)
        return [used[p] for p in parts]

    def client_shard(self, client_id: int) -> Shard:
        x, classes, _, _ = self._pool
        idx = self.client_indices()[client_id]
        return Shard(train=self.make_split(x[idx], classes[idx], client_id=client_id))

    def test_set(self) -> AnySplit:
        # the training pool only if it is already loaded here (a client); a driver reads the test part alone
        x_test, classes_test = self._pool[2:] if "_pool" in self.__dict__ else self.load_test()
        self._check_classes(classes_test, "test")
        used = self._used(classes_test)
        if len(used) < len(classes_test):
            x_test, classes_test = x_test[used], classes_test[used]
        return self.make_split(x_test, classes_test, client_id=None)

    def __getstate__(self):
        state = dict(self.__dict__)
        state.pop("_pool", None)  # a spec travels without its data
        return state


class HeldOutPoolSource(ClassPoolSource):
    """A pool published without a test split (digits, mnist5k): a stratified ``test_fraction`` of it is held out.

    The split is drawn with a fixed seed, not the run's, so every run seed is
    scored on the same test samples. Subclasses provide :meth:`load_samples`.
    """

    def __init__(self, section: DataSection) -> None:
        super().__init__(section)
        self.test_fraction = section.test_fraction

    @abc.abstractmethod
    def load_samples(self) -> tuple[np.ndarray, np.ndarray]:
        """Every sample and its class (x, classes), before the split."""

    def load_pool(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        x, classes = self.load_samples()
        x_tr, x_te, c_tr, c_te = train_test_split(x, classes, test_size=self.test_fraction, stratify=classes,
                                                  random_state=SPLIT_SEED)
        return x_tr, c_tr, x_te, c_te
