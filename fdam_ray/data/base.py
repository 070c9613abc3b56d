"""Data sources, client shards and minibatch samplers.

A :class:`DataSource` is a small picklable *spec*: given a client index it
builds that client's shard itself (so under Ray an actor loads its own data and
the driver never holds training samples). Labels are float32 arrays of shape
(n, T), 1 = positive, 0 = negative, NaN = missing for that task.
"""

from __future__ import annotations

import abc
import dataclasses

import numpy as np
import torch


@dataclasses.dataclass
class Split:
    """Labelled samples held as tensors (features (n, ...) float32, labels (n, T) float32)."""

    x: torch.Tensor
    y: torch.Tensor

    def __post_init__(self) -> None:
        if self.y.dim() == 1:
            self.y = self.y.reshape(-1, 1)
        if self.x.shape[0] != self.y.shape[0]:
            raise ValueError(f"features have {self.x.shape[0]} rows but labels {self.y.shape[0]}")

    def __len__(self) -> int:
        return int(self.y.shape[0])

    def to(self, device: torch.device | str) -> Split:
        return Split(self.x.to(device), self.y.to(device))

    def label_counts(self) -> tuple[np.ndarray, np.ndarray]:
        """Per task: number of positives and number of labelled samples."""
        y = self.y.cpu().numpy()
        return (y == 1).sum(0).astype(np.int64), (~np.isnan(y)).sum(0).astype(np.int64)


@dataclasses.dataclass
class Shard:
    """One client's data: its training samples and, where it has one, its own test split."""

    train: Split
    test: Split | None = None


class DataSource(abc.ABC):
    """A recipe for a federation's data; every method is deterministic given the config seed."""

    num_clients: int
    num_tasks: int = 1
    input_shape: tuple[int, ...]
    task_names: tuple[str, ...] = ("positive",)

    @abc.abstractmethod
    def client_shard(self, client_id: int) -> Shard:
        """Build client ``client_id``'s shard (called where that client runs)."""

    @abc.abstractmethod
    def test_set(self) -> Split | None:
        """The global test set, or None when the clients' own test splits together are the test set."""


def as_labels(y: np.ndarray | torch.Tensor, *, what: str) -> torch.Tensor:
    """Check binary labels (0, 1, NaN = missing) and return them as a float32 (n, T) tensor."""
    arr = np.asarray(y.cpu() if isinstance(y, torch.Tensor) else y, dtype=np.float64)
    if arr.ndim == 1:
        arr = arr.reshape(-1, 1)
    if arr.ndim != 2:
        raise ValueError(f"{what}: labels must have shape (n,) or (n, T), got {arr.shape}")
    bad = ~(np.isnan(arr) | (arr == 0) | (arr == 1))
    if bad.any():
        i, t = np.argwhere(bad)[0]
        raise ValueError(f"{what}: label {float(arr[i, t])!r} at row {i}, task {t} is not 0, 1 or NaN (missing)")
    return torch.from_numpy(arr.astype(np.float32))


class TensorSampler:
    """Minibatches from a tensor-backed split: seeded shuffles, one epoch after another.

    ``batch_size`` 0 returns the whole split every time (full-batch gradients).
    """

    def __init__(self, split: Split, batch_size: int, *, seed: int) -> None:
        self.split = split
        self.n = len(split)
        if self.n == 0:
            raise ValueError("a client has no training samples")
        self.batch_size = batch_size
        self.generator = torch.Generator().manual_seed(seed)
        self._order = torch.empty(0, dtype=torch.long)
        self._pos = 0

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.batch_size == 0:
            return self.split.x, self.split.y
        parts, need = [], self.batch_size
        while need > 0:
            if self._pos >= self._order.numel():
                self._order = torch.randperm(self.n, generator=self.generator).to(self.split.x.device)
                self._pos = 0
            take = self._order[self._pos : self._pos + need]
            self._pos += take.numel()
            need -= take.numel()
            parts.append(take)
        idx = parts[0] if len(parts) == 1 else torch.cat(parts)
        return self.split.x[idx], self.split.y[idx]

    def get_state(self) -> dict:
        return {"generator": self.generator.get_state(), "order": self._order.cpu(), "pos": self._pos}

    def set_state(self, state: dict) -> None:
        self.generator.set_state(state["generator"])
        self._order = state["order"].to(self.split.x.device)
        self._pos = int(state["pos"])
