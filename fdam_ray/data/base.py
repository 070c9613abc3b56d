"""Data sources, client shards and minibatch samplers.

A [`DataSource`][fdam_ray.data.base.DataSource] is a small picklable *spec*: given a client index it
builds that client's shard itself (so under Ray an actor loads its own data and
the driver never holds training samples). Labels are float32 arrays of shape
(n, T), 1 = positive, 0 = negative, NaN = missing for that task.
"""

from __future__ import annotations

import abc
import collections
import contextlib
import dataclasses
import os
from collections.abc import Iterator, Sized
from typing import TYPE_CHECKING, Any, Protocol, cast

import numpy as np
import torch

from fdam_ray.data.partition import validation_rows
from fdam_ray.features.interrupts import ignore_stop_signals
from fdam_ray.files.extras import MissingExtraError as MissingExtraError  # raised by the data sources

if TYPE_CHECKING:
    from fdam_ray.data.sections import DataSection


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


MAX_AUTO_WORKERS = 8  # data_workers=auto never starts more DataLoader processes than this per client


_host_cpus: dict[str, float] = {}  # "cpus": what the process hosting clients was given, when it says


def set_host_cpus(cpus: float | None) -> None:
    """Record the CPUs the process that hosts clients was given (a Ray actor: what Ray assigned it; None:
    not known); :func:`client_cpus` answers it. The executor that starts the process says, so this module
    needs no knowledge of Ray."""
    if cpus is None:
        _host_cpus.pop("cpus", None)
    else:
        _host_cpus["cpus"] = float(cpus)


def client_cpus() -> float:
    """The CPUs this client may use: what the process hosting it was given (:func:`set_host_cpus`, e.g. the
    CPUs Ray assigned to its actor), else the CPUs this process may run on (``os.sched_getaffinity``;
    ``os.cpu_count`` where that is missing)."""
    if "cpus" in _host_cpus:
        return _host_cpus["cpus"]
    if hasattr(os, "sched_getaffinity"):
        return float(len(os.sched_getaffinity(0)))
    return float(os.cpu_count() or 1)


def loader_workers(setting: int | str) -> int:
    """``data_workers`` where the client runs: a number as given; ``auto`` = the client's CPUs
    (:func:`client_cpus`, whole ones) less one for the training process, at most :data:`MAX_AUTO_WORKERS`."""
    if setting == "auto":
        return max(0, min(MAX_AUTO_WORKERS, int(client_cpus()) - 1))
    return int(setting)


@dataclasses.dataclass
class DatasetSplit:
    """Samples read lazily from a ``torch.utils.data.Dataset`` (images on disk), labels known up front.

    ``dataset[i]`` returns ``(x, y)`` with ``y`` a float32 tensor of shape (T,)
    equal to ``labels[i]``. Batches are read by a DataLoader (``num_workers``
    processes, or ``"auto"``: see :func:`loader_workers`; pinned memory and
    non-blocking copies when the device is a GPU).
    """

    dataset: torch.utils.data.Dataset
    labels: np.ndarray
    num_workers: int | str = 0

    def __post_init__(self) -> None:
        self.labels = np.asarray(self.labels, dtype=np.float32).reshape(len(self.labels), -1)
        size = len(cast(Sized, self.dataset))  # a map-style dataset, as every client's split is
        if size != len(self.labels):
            raise ValueError(f"dataset has {size} samples but {len(self.labels)} labels")

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


@contextlib.contextmanager
def loader_errors() -> Iterator[None]:
    """An error raised in a DataLoader worker process as one line: the worker's own last line (torch re-raises
    it with the worker's whole traceback in the message). A ``ValueError`` there (a sample a Dataset could
    not read, named by client and index) stays a ValueError; anything else is a RuntimeError."""
    try:
        yield
    except Exception as exc:
        text = str(exc)
        if "in DataLoader worker process" not in text:
            raise
        last = [line.strip() for line in text.splitlines() if line.strip()][-1]
        if last.startswith("ValueError: "):
            raise ValueError(last.removeprefix("ValueError: ")) from None
        raise RuntimeError(f"a DataLoader worker process failed: {last}") from None


def iter_batches(split: AnySplit, batch_size: int, device: torch.device):
    """(x, y) batches of a split in order, on ``device`` (for evaluation)."""
    if isinstance(split, Split):
        for i in range(0, len(split), batch_size):
            yield split.x[i : i + batch_size].to(device), split.y[i : i + batch_size].to(device)
        return
    loader = torch.utils.data.DataLoader(split.dataset, batch_size=batch_size, shuffle=False,
                                         num_workers=loader_workers(split.num_workers),
                                         pin_memory=device.type == "cuda", worker_init_fn=ignore_stop_signals)
    with loader_errors():
        for x, y in loader:
            yield x.to(device, non_blocking=True), y.to(device, non_blocking=True)


@dataclasses.dataclass
class Shard:
    """One client's data: its training samples and, where it has one, its own test split; ``val``: a validation
    split of the dataset's own, if it has one (else `hold_out_validation` makes one when asked)."""

    train: AnySplit
    test: AnySplit | None = None
    val: AnySplit | None = None
    groups: np.ndarray | None = None  # per training row, its group (a patient): held out whole, never split


class RowsOf(torch.utils.data.Dataset):
    """Some rows of a map-style Dataset, in the order given (a client's training or validation part). The
    wrapped Dataset's augmentation generator, if any, stays reachable as ``generator`` (samplers save it)."""

    def __init__(self, dataset: torch.utils.data.Dataset, rows: np.ndarray) -> None:
        self.dataset, self.rows = dataset, np.asarray(rows, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> Any:
        return self.dataset[int(self.rows[index])]

    @property
    def generator(self) -> torch.Generator | None:
        return getattr(self.dataset, "generator", None)


def rows_of(split: AnySplit, rows: np.ndarray) -> AnySplit:
    """The split made of ``rows`` of ``split`` (tensors indexed in memory; a Dataset read through its rows)."""
    if isinstance(split, Split):
        index = torch.from_numpy(np.asarray(rows, dtype=np.int64))
        return Split(split.x[index], split.y[index])
    return DatasetSplit(RowsOf(split.dataset, rows), split.labels[rows], num_workers=split.num_workers)


VALIDATION_STREAM = 0x5A11D  # keeps the validation draw apart from every other seeded draw of a client


def hold_out_validation(shard: Shard, fraction: float, *, seed: int, client_id: int,
                        task_names: tuple[str, ...] | None = None) -> Shard:
    """``shard`` with ``fraction`` of its training samples held out as its validation part (``val``): the same
    rows for the same ``seed`` and client, stratified by label, whole ``groups`` (patients) where the shard has
    them (:func:`fdam_ray.data.partition.validation_rows`).
    ``fraction`` 0 returns the shard without a validation part (a run without validation is unchanged); a
    source that has a validation split of its own sets ``val`` in :meth:`DataSource.client_shard`, and that
    split is then used instead of a held-out part."""
    if fraction == 0:
        return shard if shard.val is None else dataclasses.replace(shard, val=None)
    if shard.val is not None:
        return shard
    labels = shard.train.y.cpu().numpy()
    rng = np.random.default_rng([seed, client_id, VALIDATION_STREAM])
    held = validation_rows(labels, fraction, rng, client_id=client_id, task_names=task_names, groups=shard.groups)
    kept = np.setdiff1d(np.arange(len(labels)), held)
    return dataclasses.replace(shard, train=rows_of(shard.train, kept), val=rows_of(shard.train, held),
                               groups=None if shard.groups is None else shard.groups[kept])


class DataSource(abc.ABC):
    """A recipe for a federation's data; every method is deterministic given the config seed."""

    num_clients: int
    num_tasks: int = 1
    input_shape: tuple[int, ...]
    task_names: tuple[str, ...] = ("positive",)
    @classmethod
    def root_problem(cls, section: DataSection, root: str) -> str | None:
        """What is wrong with ``root`` as one client's data folder, checked on the driver when the folder is
        local (None: nothing found). The default: it must be an existing folder."""
        path = os.path.expanduser(root)
        if not os.path.exists(path):
            return "does not exist"
        return None if os.path.isdir(path) else "is not a folder"

    @classmethod
    def shared_section(cls, section: DataSection, roots: tuple[str, ...]) -> DataSection:
        """The section every client of a federation over ``client_data_roots`` builds its source from: what
        the clients' folders must agree on (e.g. one class numbering) is fixed here, on the driver."""
        return section

    @abc.abstractmethod
    def client_shard(self, client_id: int) -> Shard:
        """Build client ``client_id``'s shard (called where that client runs)."""

    @abc.abstractmethod
    def test_set(self) -> AnySplit | None:
        """The global test set, or None when the clients' own test splits together are the test set."""

    def local_problems(self) -> list[str]:
        """What this source lacks on this machine (missing folders or files, one line each, nothing read), for the
        driver's check before any client starts (`check_data_here`); none by default
        (a source that reads no files, or checks them itself)."""
        return []

    def for_client(self, client_id: int) -> DataSource:
        """What client ``client_id`` needs of this source. A recipe (the default) serves every client as it is;
        a source holding data in memory returns one holding only that client's part."""
        return self


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


class BatchStream(Protocol):
    """What a sampler draws its batches of indices from: an :class:`IndexStream`, or a stream with its
    interface (:class:`fdam_ray.data.balanced.BalancedIndexStream`)."""

    batch_size: int

    def next(self) -> torch.Tensor: ...

    def get_state(self) -> dict: ...

    def set_state(self, state: dict) -> None: ...


class IndexStream:
    """Batches of sample indices: seeded shuffles of the n samples, epoch after epoch, a batch spanning the
    end of one epoch and the start of the next when n is not a multiple of the batch size (so every batch
    has exactly ``batch_size`` samples, in memory or read from disk alike)."""

    def __init__(self, n: int, batch_size: int, seed: int) -> None:
        if n == 0:
            raise ValueError("a client has no training samples")
        self.n, self.batch_size = n, batch_size
        self.generator = torch.Generator().manual_seed(seed)
        self.order = torch.empty(0, dtype=torch.long)
        self.pos = 0

    def next(self) -> torch.Tensor:
        parts, need = [], self.batch_size
        while need > 0:
            if self.pos >= self.order.numel():
                self.order, self.pos = torch.randperm(self.n, generator=self.generator), 0
            take = self.order[self.pos : self.pos + need]
            self.pos += take.numel()
            need -= take.numel()
            parts.append(take)
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def get_state(self) -> dict:
        return {"generator": self.generator.get_state(), "order": self.order.clone(), "pos": self.pos}

    def set_state(self, state: dict) -> None:
        self.generator.set_state(state["generator"])
        self.order, self.pos = state["order"].clone(), int(state["pos"])


class TensorSampler:
    """Minibatches from a tensor-backed split; ``batch_size`` 0 returns the whole split every time."""

    def __init__(self, split: Split, batch_size: int, *, seed: int,
                 stream: BatchStream | None = None) -> None:
        self.split = split
        self.stream = IndexStream(len(split), batch_size, seed) if stream is None else stream

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.stream.batch_size == 0:
            return self.split.x, self.split.y
        idx = self.stream.next().to(self.split.x.device)
        return self.split.x[idx], self.split.y[idx]

    def get_state(self) -> dict:
        return self.stream.get_state()

    def set_state(self, state: dict) -> None:
        self.stream.set_state(state)


class _Batches(torch.utils.data.Sampler):
    """An endless batch sampler over an :class:`IndexStream` that remembers the stream's state before each
    batch it hands to the DataLoader, so the state of the first batch not yet consumed is known even while
    the DataLoader's workers read ahead."""

    def __init__(self, stream: BatchStream) -> None:
        self.stream = stream
        self.ahead: collections.deque[dict] = collections.deque()

    def __iter__(self):
        while True:
            self.ahead.append(self.stream.get_state())
            yield self.stream.next().tolist()


class LoaderSampler:
    """Minibatches of a :class:`DatasetSplit` read by a DataLoader from an :class:`IndexStream`."""

    def __init__(self, split: DatasetSplit, batch_size: int, *, seed: int, device: torch.device,
                 stream: BatchStream | None = None) -> None:
        if batch_size == 0:
            raise ValueError("batch_size=0 (full batch) needs in-memory data; this dataset is read from disk")
        self.split, self.device = split, device
        self.stream = IndexStream(len(split), batch_size, seed) if stream is None else stream
        self._batches: _Batches | None = None
        self._iter: Iterator[Any] | None = None

    def _start(self) -> tuple[_Batches, Iterator[Any]]:
        self._batches = batches = _Batches(self.stream)
        self._iter = loader = iter(torch.utils.data.DataLoader(
            self.split.dataset, batch_sampler=batches, num_workers=loader_workers(self.split.num_workers),
            pin_memory=self.device.type == "cuda", worker_init_fn=ignore_stop_signals))
        return batches, loader

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._iter is None or self._batches is None:
            batches, loader = self._start()
        else:
            batches, loader = self._batches, self._iter
        with loader_errors():
            x, y = next(loader)
        batches.ahead.popleft()
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

    def _augment_generator(self) -> torch.Generator | None:
        # Datasets that augment from a generator of their own expose it as ``generator`` (LazyImages in
        # data/images.py); with data_workers=0 its state follows the batches consumed exactly.
        return getattr(self.split.dataset, "generator", None)

    def get_state(self) -> dict:
        pending = self._batches.ahead if self._batches is not None else None
        augment = self._augment_generator()
        return {"stream": pending[0] if pending else self.stream.get_state(),
                "augment": None if augment is None else augment.get_state()}

    def set_state(self, state: dict) -> None:
        self._iter = self._batches = None  # a fresh DataLoader starts from the restored position
        self.stream.set_state(state["stream"])
        augment = self._augment_generator()
        if augment is not None and state.get("augment") is not None:
            augment.set_state(state["augment"])


