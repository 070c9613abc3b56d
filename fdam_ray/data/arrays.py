"""Bring-your-own in-memory data: per-client arrays and a test set."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from fdam_ray.data.base import DataSource, Shard, Split, as_labels

ArrayPair = tuple[np.ndarray | torch.Tensor, np.ndarray | torch.Tensor]


def _split(pair: ArrayPair, what: str) -> Split:
    if not isinstance(pair, (tuple, list)) or len(pair) != 2:
        raise ValueError(f"{what}: expected a pair (X, y), got {type(pair).__name__}")
    x, y = pair
    x = torch.as_tensor(np.asarray(x, dtype=np.float32))
    if x.dim() < 2:
        raise ValueError(f"{what}: X must have shape (n, features...) , got {tuple(x.shape)}")
    return Split(x, as_labels(y, what=what))


class ArraysSource(DataSource):
    """Clients' training arrays ``[(X_k, y_k), ...]``, a test set, and optional per-client test splits."""

    def __init__(
        self,
        clients: Sequence[ArrayPair],
        test: ArrayPair | None,
        client_tests: Sequence[ArrayPair] | None = None,
    ) -> None:
        if len(clients) == 0:
            raise ValueError("clients: at least one (X, y) pair is needed")
        self.trains = [_split(c, f"clients[{k}]") for k, c in enumerate(clients)]
        self.tests = None
        if client_tests is not None:
            if len(client_tests) != len(clients):
                raise ValueError(f"client_tests has {len(client_tests)} entries for {len(clients)} clients")
            self.tests = [_split(c, f"client_tests[{k}]") for k, c in enumerate(client_tests)]
        if test is None and self.tests is None:
            raise ValueError("give a test set, per-client test splits, or both")
        self.test = None if test is None else _split(test, "test")
        self.num_clients = len(clients)
        shapes = {tuple(s.x.shape[1:]) for s in self.trains}
        tasks = {s.y.shape[1] for s in self.trains + ([self.test] if self.test else []) + (self.tests or [])}
        if len(shapes) != 1:
            raise ValueError(f"clients' X have different sample shapes: {sorted(shapes)}")
        if len(tasks) != 1:
            raise ValueError(f"labels have different numbers of tasks: {sorted(tasks)}")
        self.input_shape = shapes.pop()
        self.num_tasks = tasks.pop()
        self.task_names = tuple(f"task{t}" for t in range(self.num_tasks)) if self.num_tasks > 1 else ("positive",)

    def client_shard(self, client_id: int) -> Shard:
        return Shard(self.trains[client_id], None if self.tests is None else self.tests[client_id])

    def test_set(self) -> Split | None:
        return self.test
