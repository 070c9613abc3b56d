"""Bring-your-own in-memory data: per-client arrays and a test set."""

from __future__ import annotations

import copy
from collections.abc import Sequence

import numpy as np
import torch

from fdam_ray.data.base import DataSource, Shard, Split, as_labels

ArrayPair = tuple[np.ndarray | torch.Tensor, np.ndarray | torch.Tensor]


def _checked(pair: ArrayPair, what: str) -> tuple[np.ndarray, np.ndarray]:
    """(X float32, y float32 (n, T)) as numpy arrays, after checking shapes and label values."""
    if not isinstance(pair, (tuple, list)) or len(pair) != 2:
        raise ValueError(f"{what}: expected a pair (X, y), got {type(pair).__name__}")
    x, y = pair
    x = np.ascontiguousarray(np.asarray(x.cpu() if isinstance(x, torch.Tensor) else x, dtype=np.float32))
    if x.ndim < 2:
        raise ValueError(f"{what}: X must have shape (n, features...), got {x.shape}")
    labels = as_labels(y, what=what).numpy()
    if len(labels) != len(x):
        raise ValueError(f"{what}: X has {len(x)} rows but y has {len(labels)}")
    return x, labels


def _split(arrays: tuple[np.ndarray, np.ndarray]) -> Split:
    return Split(torch.from_numpy(arrays[0]), torch.from_numpy(arrays[1]))


class ArraysSource(DataSource):
    """Clients' training arrays ``[(X_k, y_k), ...]``, a test set, and optional per-client test splits.

    Arrays are kept as numpy (Ray ships them without a copy on one node), and
    :meth:`for_client` narrows the source to one client's arrays plus the test
    set, so under Ray each actor receives its own data only.
    """

    one_class_warned = False  # set by fdam_ray.train_arrays once it has warned about one-class test sets

    def __init__(
        self,
        clients: Sequence[ArrayPair],
        test: ArrayPair | None,
        client_tests: Sequence[ArrayPair] | None = None,
    ) -> None:
        if len(clients) == 0:
            raise ValueError("clients: at least one (X, y) pair is needed")
        self.trains = {k: _checked(c, f"clients[{k}]") for k, c in enumerate(clients)}
        self.tests = None
        if client_tests is not None:
            if len(client_tests) != len(clients):
                raise ValueError(f"client_tests has {len(client_tests)} entries for {len(clients)} clients")
            self.tests = {k: _checked(c, f"client_tests[{k}]") for k, c in enumerate(client_tests)}
        if test is None and self.tests is None:
            raise ValueError("give a test set, per-client test splits, or both")
        self.test = None if test is None else _checked(test, "test")
        self.num_clients = len(clients)
        every = [*self.trains.values(), *([self.test] if self.test else []), *(self.tests or {}).values()]
        shapes = {x.shape[1:] for x, _ in every}
        tasks = {y.shape[1] for _, y in every}
        if len(shapes) != 1:
            raise ValueError(f"X arrays have different sample shapes: {sorted(shapes)}")
        if len(tasks) != 1:
            raise ValueError(f"labels have different numbers of tasks: {sorted(tasks)}")
        self.input_shape = shapes.pop()
        self.num_tasks = tasks.pop()
        self.task_names = tuple(f"task{t}" for t in range(self.num_tasks)) if self.num_tasks > 1 else ("positive",)

    def client_shard(self, client_id: int) -> Shard:
        if client_id not in self.trains:
            raise ValueError(f"this source holds the data of clients {sorted(self.trains)}, not of {client_id}")
        return Shard(_split(self.trains[client_id]), None if self.tests is None else _split(self.tests[client_id]))

    def test_set(self) -> Split | None:
        return None if self.test is None else _split(self.test)

    def for_client(self, client_id: int) -> ArraysSource:
        narrow = copy.copy(self)
        narrow.trains = {client_id: self.trains[client_id]}
        narrow.tests = None if self.tests is None else {client_id: self.tests[client_id]}
        return narrow
