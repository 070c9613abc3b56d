"""Your own torch Datasets as a federation's data.

Two ways in:

* :func:`fdam_ray.train_datasets` takes one entry per client, each either a
  ``torch.utils.data.Dataset`` or a picklable callable ``() -> Dataset`` that
  builds the client's Dataset where the client runs (under Ray: on its own
  actor, so a site's data never passes through the driver), plus a test set (a
  Dataset, a callable, or None) and, optionally, per-client test splits.
* ``dataset: my_pkg.data:client_dataset`` in a config names a factory
  ``(client_id, num_clients, split) -> Dataset`` (``split`` is ``"train"`` or
  ``"test"``; a client without a test split returns None), called on each
  client's process; the clients' test splits together are the test set.

Items are ``(x, y)``: ``x`` a tensor or array (floating ``x`` reaches the model
as float32), ``y`` in {0, 1, NaN (missing)}, of shape () for one task or (T,)
for T tasks. Each client reads its labels in one pass over its Dataset, on its
own process, checking every item (values, shape, the same T and sample shape as
the federation's); its positive counts then give the global positive ratio, as
for every other source.

The network is built from the sample shape and T before any client starts:
they are read from the first item of a Dataset the driver was given (the test
set or a client's), else from client 0's first item, read where client 0 runs
(:func:`describe_client`, called by :mod:`fdam_ray.assembly.recipe`).
"""

from __future__ import annotations

import copy
import socket
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from fdam_ray.data.base import DatasetSplit, DataSource, Shard, loader_errors, loader_workers
from fdam_ray.features.interrupts import ignore_stop_signals
from fdam_ray.settings.factories import describe_error, raised_at, resolve

Entry = Any  # a torch Dataset, or a callable returning one (or None, for a test split)


def _is_dataset(obj: object) -> bool:
    """A torch Dataset, or any other sequence of items (not a mapping or text)."""
    if isinstance(obj, (Mapping, str, bytes)):
        return False
    return isinstance(obj, torch.utils.data.Dataset) or (hasattr(obj, "__getitem__") and hasattr(obj, "__len__"))


def _identity(item):
    return item


class FactorySplit:
    """A picklable recipe for one client's split: calls ``factory(client_id, num_clients, split)`` where it runs."""

    def __init__(self, path: str, client_id: int, num_clients: int, split: str) -> None:
        self.path, self.client_id, self.num_clients, self.split = path, client_id, num_clients, split

    def __call__(self):
        factory = resolve(self.path, field="dataset", here=f"on host {socket.gethostname()}")
        return factory(self.client_id, self.num_clients, self.split)

    def __repr__(self) -> str:
        return f"{self.path}({self.client_id}, {self.num_clients}, {self.split!r})"


class Items(torch.utils.data.Dataset):
    """A user's Dataset with each item as the samplers expect it: floating ``x`` as float32, ``y`` float32 (T,).

    An error its ``__getitem__`` raises becomes one line naming ``what`` (the client) and the sample.
    """

    def __init__(self, dataset, num_tasks: int, what: str = "a Dataset") -> None:
        self.dataset, self.num_tasks, self.what = dataset, num_tasks, what

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int):
        x, y = read_item(self.dataset, index, self.what)
        x = torch.as_tensor(x)
        if x.is_floating_point() and x.dtype != torch.float32:
            x = x.to(torch.float32)
        return x, torch.as_tensor(y, dtype=torch.float32).reshape(self.num_tasks)

    @property
    def generator(self) -> torch.Generator | None:
        """The wrapped Dataset's own augmentation generator, if it has one (samplers save and restore it)."""
        gen = getattr(self.dataset, "generator", None)
        return gen if isinstance(gen, torch.Generator) else None


def _first_item(dataset, what: str) -> tuple[tuple[int, ...], int]:
    """(sample shape, T) of a Dataset's first item."""
    if len(dataset) == 0:
        raise ValueError(f"{what} has no samples")
    x, y = _pair(read_item(dataset, 0, what), what, 0)
    label = np.asarray(y, dtype=np.float64) if _numeric(y) else None
    if label is None or label.ndim > 1:
        raise ValueError(f"{what}, sample 0: the label must be a number or a vector of T numbers (0, 1 or NaN), got "
                         f"{_describe(y)}")
    return tuple(x.shape), 1 if label.ndim == 0 else int(label.shape[0])


def _numeric(y: object) -> bool:
    try:
        np.asarray(y, dtype=np.float64)
    except (TypeError, ValueError):
        return False
    return True


def _describe(v: object) -> str:
    shape = getattr(v, "shape", None)
    return f"a {type(v).__name__}" + (f" of shape {tuple(shape)}" if shape is not None else "")


def _pair(item: object, what: str, index: int) -> tuple[Any, Any]:
    if not isinstance(item, (tuple, list)) or len(item) != 2:
        raise ValueError(f"{what}, sample {index}: items must be (x, y) pairs, got {_describe(item)}")
    x, y = item
    if not isinstance(x, (torch.Tensor, np.ndarray)):
        raise ValueError(f"{what}, sample {index}: x is {_describe(x)}; it must be a torch tensor or numpy array "
                         "(convert it in the Dataset, e.g. with a ToTensor transform)")
    return x, y


def read_item(dataset, index: int, what: str) -> Any:
    """``dataset[index]``; an error its ``__getitem__`` raises is one line naming ``what`` and the sample."""
    try:
        return dataset[index]
    except Exception as exc:  # the Dataset's own code failed
        raise ValueError(f"{what}, sample {index}: the Dataset's __getitem__ raised {describe_error(exc)}"
                         f"{raised_at(exc)}; fix the Dataset (or leave that sample out)") from None


def _items(dataset, what: str, n: int, workers: int) -> Iterator[Any]:
    """The items of ``dataset`` in order: read here, or by ``workers`` DataLoader processes (whose errors are
    shortened to the worker's last line, the item's own message)."""
    if workers == 0:
        yield from (read_item(dataset, i, what) for i in range(n))
        return
    loader = torch.utils.data.DataLoader(Reads(dataset, what), batch_size=None, num_workers=workers,
                                         collate_fn=_identity, worker_init_fn=ignore_stop_signals)
    with loader_errors():
        yield from loader


class Reads(torch.utils.data.Dataset):
    """``dataset`` read through :func:`read_item` (in DataLoader workers: errors name the client and sample)."""

    def __init__(self, dataset, what: str) -> None:
        self.dataset, self.what = dataset, what

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int):
        return read_item(self.dataset, index, self.what)


def _check_finite(x: Any, what: str, index: int) -> None:
    """Refuse a sample whose features hold NaN or infinity (they would later show only as a divergence)."""
    t = torch.as_tensor(x)
    if (t.is_floating_point() or t.is_complex()) and not bool(torch.isfinite(t).all()):
        column = int((~torch.isfinite(t.reshape(-1))).nonzero()[0])
        raise ValueError(f"{what}, sample {index}: x holds NaN or infinite values (first at flat feature "
                         f"{column}): the data itself holds them; clean or impute it in the Dataset")


def read_labels(dataset, what: str, *, input_shape: tuple[int, ...], num_tasks: int,
                workers: int = 0) -> np.ndarray:
    """Every label of ``dataset`` as float32 (n, T), in one pass, each item checked (pair, shape, finite
    features, label values); errors name ``what`` and the sample."""
    n = len(dataset)
    labels = np.empty((n, num_tasks), dtype=np.float32)
    expected = "()" if num_tasks == 1 else f"({num_tasks},)"
    count = 0
    for i, item in enumerate(_items(dataset, what, n, workers)):
        x, y = _pair(item, what, i)
        if tuple(x.shape) != input_shape:
            raise ValueError(f"{what}, sample {i}: x has shape {tuple(x.shape)}, the federation's samples "
                             f"{input_shape}")
        _check_finite(x, what, i)
        if not _numeric(y):
            raise ValueError(f"{what}, sample {i}: the label is {_describe(y)}, not 0, 1 or NaN")
        label = np.asarray(y, dtype=np.float64)
        if label.shape not in ((num_tasks,), () if num_tasks == 1 else None):
            raise ValueError(f"{what}, sample {i}: the label has shape {label.shape}, the federation's labels "
                             f"{expected} ({num_tasks} task{'s' if num_tasks > 1 else ''}, the same on every "
                             "client)")
        label = label.reshape(num_tasks)
        bad = ~(np.isnan(label) | (label == 0) | (label == 1))
        if bad.any():
            t = int(np.argmax(bad))
            task = f" (task {t})" if num_tasks > 1 else ""
            raise ValueError(f"{what}, sample {i}: label {float(label[t])!r}{task} is not 0, 1 or NaN (missing)")
        labels[i] = label
        count += 1
    if count != n:
        raise ValueError(f"{what}: len() says {n} samples but {count} were read")
    return labels


class DatasetsSource(DataSource):
    """Clients' Datasets (or callables building them), a test set, and optional per-client test splits.

    Args:
        clients: one entry per client: a Dataset, or a picklable callable ``() -> Dataset``.
        test: the global test set (a Dataset, a callable, or None when the clients' test splits are the test set).
        client_tests: one entry per client (a Dataset, a callable returning one or None, or None), or None.
        data_workers: DataLoader worker processes per client for reading batches (and the label pass); ``auto``:
            see :func:`~fdam_ray.data.base.loader_workers`.
        names: how errors name client k's training data and test split, and the test set.
    """

    def __init__(self, clients: Sequence[Entry], test: Entry | None, client_tests: Sequence[Entry] | None = None,
                 *, data_workers: int | str = 0, names: Callable[[int, str], str] | None = None) -> None:
        if len(clients) == 0:
            raise ValueError("clients: at least one Dataset (or callable building one) is needed")
        self.names = names or _default_names
        self.trains = {k: _entry(c, self.names(k, "train"), optional=False) for k, c in enumerate(clients)}
        self.tests = None
        if client_tests is not None:
            if len(client_tests) != len(clients):
                raise ValueError(f"client_tests has {len(client_tests)} entries for {len(clients)} clients")
            self.tests = {k: _entry(c, self.names(k, "test"), optional=True) for k, c in enumerate(client_tests)}
        if test is None and self.tests is None:
            raise ValueError("give a test set, per-client test splits, or both")
        self.test = None if test is None else _entry(test, self.names(-1, "test"), optional=False)
        self.num_clients = len(clients)
        self.data_workers = data_workers
        # None until described (see described): the one source that learns the shape from the data, lazily
        self.input_shape = None  # type: ignore[assignment]
        self.num_tasks = 1
        self._built: dict[tuple[int, str], Any] = {}
        held = [(e, self.names(-1, "test")) for e in [self.test] if _is_dataset(e)]
        held += [(e, self.names(k, "train")) for k, e in self.trains.items() if _is_dataset(e)]
        held += [(e, self.names(k, "test")) for k, e in (self.tests or {}).items() if _is_dataset(e)]
        if held:  # the driver holds this Dataset anyway: its first item gives the shapes
            self.set_shapes(*_first_item(*held[0]))

    # -- shapes -----------------------------------------------------------------------
    @property
    def described(self) -> bool:
        return self.input_shape is not None

    def set_shapes(self, input_shape: tuple[int, ...], num_tasks: int) -> None:
        self.input_shape, self.num_tasks = tuple(input_shape), int(num_tasks)
        self.task_names = tuple(f"task{t}" for t in range(num_tasks)) if num_tasks > 1 else ("positive",)

    def describe_here(self) -> tuple[tuple[int, ...], int]:
        """Read the sample shape and T from client 0's first training item, in this process."""
        if not self.described:
            self.set_shapes(*_first_item(self._dataset(0, "train"), self.names(0, "train")))
        return self.input_shape, self.num_tasks

    # -- building splits where the client runs ------------------------------------------
    def _dataset(self, client_id: int, split: str):
        key = (client_id, split)
        if key not in self._built:
            if client_id >= 0 and client_id not in self.trains:
                raise ValueError(f"this source holds the data of clients {sorted(self.trains)}, not of {client_id}")
            if client_id < 0:
                entry = self.test
            else:
                entry = (self.trains if split == "train" else self.tests or {}).get(client_id)
            what = self.names(client_id, split)
            ds = entry
            if entry is not None and not _is_dataset(entry):
                ds = entry()
                if ds is None and split == "train":
                    raise ValueError(f"{what}: the callable returned None, not a Dataset")
                if ds is not None and not _is_dataset(ds):
                    raise ValueError(f"{what}: the callable returned {_describe(ds)}, not a torch Dataset "
                                     "(an object with __len__ and __getitem__)")
            self._built[key] = ds
        return self._built[key]

    def _split(self, client_id: int, split: str) -> DatasetSplit | None:
        ds = self._dataset(client_id, split)
        if ds is None:
            return None
        if not self.described:
            self.describe_here()
        what = self.names(client_id, split)
        if len(ds) == 0:
            raise ValueError(f"{what} has no samples")
        labels = read_labels(ds, what, input_shape=self.input_shape, num_tasks=self.num_tasks,
                             workers=loader_workers(self.data_workers))
        return DatasetSplit(Items(ds, self.num_tasks, what), labels, self.data_workers)

    def client_shard(self, client_id: int) -> Shard:
        train = self._split(client_id, "train")
        if train is None:  # _dataset refuses a missing training Dataset
            raise ValueError(f"{self.names(client_id, 'train')}: no training Dataset")
        return Shard(train, None if self.tests is None else self._split(client_id, "test"))

    def test_set(self) -> DatasetSplit | None:
        return None if self.test is None else self._split(-1, "test")

    def for_client(self, client_id: int) -> DatasetsSource:
        narrow = copy.copy(self)
        narrow.trains = {client_id: self.trains[client_id]}
        narrow.tests = None if self.tests is None else {client_id: self.tests[client_id]}
        narrow._built = {}
        return narrow

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_built": {}}  # what was built here stays here


def _default_names(client_id: int, split: str) -> str:
    if client_id < 0:
        return "the test set"
    return f"client {client_id}" + ("'s test split" if split == "test" else "")


def _entry(entry: Entry, what: str, *, optional: bool) -> Entry:
    if entry is None and optional:
        return None
    if _is_dataset(entry) or callable(entry):
        return entry
    raise ValueError(f"{what}: expected a torch Dataset or a callable that builds one, got {_describe(entry)}")


class FactorySource(DatasetsSource):
    """``dataset: module:attr``: client k's splits are ``factory(k, num_clients, "train" / "test")``, built on
    client k's process; the clients' test splits together are the test set."""

    def __init__(self, section) -> None:
        path, num_clients = section.dataset, section.num_clients
        super().__init__([FactorySplit(path, k, num_clients, "train") for k in range(num_clients)], None,
                         [FactorySplit(path, k, num_clients, "test") for k in range(num_clients)],
                         data_workers=section.data_workers, names=_FactoryNames(path))


class _FactoryNames:
    """Picklable naming of a factory's splits in errors."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __call__(self, client_id: int, split: str) -> str:
        return f"dataset '{self.path}', client {client_id} (split '{split}')"


def check_shippable(model: object, source: DataSource, unpicklable: Callable[[object], str | None]) -> None:
    """Refuse, in one line before Ray starts, a model factory or client entry that cannot be sent to the
    processes that run the clients (one holding an open file for writing, a lock, a connection, a generator),
    naming each such part; Ray's own error is a page of serialization details. ``unpicklable`` says why an
    object cannot travel (None if it can): :func:`fdam_ray.executors.ray.shipping.unpicklable`, Ray's pickler."""
    parts: list[tuple[str, object]] = []
    if callable(model):
        from fdam_ray.models import model_name

        parts.append((f"model {model_name(model)!r}", model))
    if isinstance(source, DatasetsSource):
        if source.test is not None:
            parts.append((source.names(-1, "test"), source.test))
        parts += [(source.names(k, "train"), e) for k, e in sorted(source.trains.items())]
        parts += [(source.names(k, "test"), e) for k, e in sorted((source.tests or {}).items()) if e is not None]
    bad = [(what, why) for what, why in ((what, unpicklable(obj)) for what, obj in parts) if why is not None]
    if bad:
        names = ", ".join(what for what, _ in bad)
        raise ValueError(f"{names}: cannot be sent to the Ray processes that run the clients ({bad[0][1]}); under "
                         "executor=ray a model factory and each Dataset or callable given for a client must be "
                         "picklable: a module-level function or class (or functools.partial of one) that opens "
                         "files, connections and locks when called instead of holding them; or use "
                         "executor=inline")


def describe_client(source: DatasetsSource) -> tuple[tuple[int, ...], int] | str:
    """Client 0's sample shape and T, read where it runs; an error comes back as its one-line message."""
    try:
        return source.describe_here()
    except ValueError as exc:
        return str(exc)
