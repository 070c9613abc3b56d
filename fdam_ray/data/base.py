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
class DatasetSplit:
    """Samples read lazily from a ``torch.utils.data.Dataset`` (images on disk), labels known up front.

    ``dataset[i]`` returns ``(x, y)`` with ``y`` a float32 tensor of shape (T,)
    equal to ``labels[i]``. Batches are read by a DataLoader (``num_workers``
    processes; pinned memory and non-blocking copies when the device is a GPU).
    """

    dataset: torch.utils.data.Dataset
    labels: np.ndarray
    num_workers: int = 0

    def __post_init__(self) -> None:
        self.labels = np.asarray(self.labels, dtype=np.float32).reshape(len(self.labels), -1)
        if len(self.dataset) != len(self.labels):
            raise ValueError(f"dataset has {len(self.dataset)} samples but {len(self.labels)} labels")

    def __len__(self) -> int:
        return len(self.labels)

    @property
    def y(self) -> torch.Tensor:
        return torch.from_numpy(self.labels)

    def to(self, device: torch.device | str) -> DatasetSplit:
        return self  # batches move to the device as they are read

    def label_counts(self) -> tuple[np.ndarray, np.ndarray]:
        return (self.labels == 1).sum(0).astype(np.int64), (~np.isnan(self.labels)).sum(0).astype(np.int64)


AnySplit = Split | DatasetSplit


def _loader(split: DatasetSplit, batch_size: int, device: torch.device, sampler=None):
    return torch.utils.data.DataLoader(
        split.dataset, batch_size=batch_size, sampler=sampler, shuffle=False, num_workers=split.num_workers,
        pin_memory=device.type == "cuda", persistent_workers=False,
    )


def iter_batches(split: AnySplit, batch_size: int, device: torch.device):
    """(x, y) batches of a split in order, on ``device`` (for evaluation)."""
    if isinstance(split, Split):
        for i in range(0, len(split), batch_size):
            yield split.x[i : i + batch_size].to(device), split.y[i : i + batch_size].to(device)
        return
    for x, y in _loader(split, batch_size, device):
        yield x.to(device, non_blocking=True), y.to(device, non_blocking=True)


@dataclasses.dataclass
class Shard:
    """One client's data: its training samples and, where it has one, its own test split."""

    train: AnySplit
    test: AnySplit | None = None


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
    def test_set(self) -> AnySplit | None:
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


class _FromPosition(torch.utils.data.Sampler):
    def __init__(self, order: torch.Tensor, start: int) -> None:
        self.order, self.start = order, start

    def __iter__(self):
        return iter(self.order[self.start :].tolist())

    def __len__(self) -> int:
        return len(self.order) - self.start


class LoaderSampler:
    """Minibatches of a :class:`DatasetSplit` through a DataLoader: seeded shuffles, epoch after epoch."""

    def __init__(self, split: DatasetSplit, batch_size: int, *, seed: int, device: torch.device) -> None:
        if batch_size == 0:
            raise ValueError("batch_size=0 (full batch) needs in-memory data; this dataset is read from disk")
        if len(split) == 0:
            raise ValueError("a client has no training samples")
        self.split, self.batch_size, self.device = split, batch_size, device
        self.generator = torch.Generator().manual_seed(seed)
        self._epoch_state = self.generator.get_state()
        self._consumed = 0
        self._iter = None

    def _new_epoch(self, start: int = 0) -> None:
        self._epoch_state = self.generator.get_state()
        order = torch.randperm(len(self.split), generator=self.generator)
        self._consumed = start
        self._iter = iter(_loader(self.split, self.batch_size, self.device, _FromPosition(order, start)))

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._iter is None:
            self._new_epoch()
        try:
            x, y = next(self._iter)
        except StopIteration:
            self._new_epoch()
            x, y = next(self._iter)
        self._consumed += x.shape[0]
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

    def _augment_generator(self) -> torch.Generator | None:
        # Datasets that augment from a generator of their own expose it as ``generator`` (data/images.py,
        # data/chestxray.py); with data_workers=0 its state follows the batches consumed exactly.
        return getattr(self.split.dataset, "generator", None)

    def get_state(self) -> dict:
        augment = self._augment_generator()
        return {"epoch_generator": self._epoch_state, "consumed": self._consumed, "started": self._iter is not None,
                "augment": None if augment is None else augment.get_state()}

    def set_state(self, state: dict) -> None:
        self._iter = None
        augment = self._augment_generator()
        if augment is not None and state.get("augment") is not None:
            augment.set_state(state["augment"])
        if state["started"]:
            self.generator.set_state(state["epoch_generator"])
            self._new_epoch(start=int(state["consumed"]))


def make_sampler(split: AnySplit, batch_size: int, *, seed: int, device: torch.device):
    """The sampler that fits the split: tensors in memory, or a DataLoader over a dataset."""
    if isinstance(split, DatasetSplit):
        return LoaderSampler(split, batch_size, seed=seed, device=device)
    return TensorSampler(split, batch_size, seed=seed)
