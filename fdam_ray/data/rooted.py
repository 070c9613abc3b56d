"""Per-client data folders (``client_data_roots``): client k reads its training data from its own folder only.

Cross-silo federations keep each site's data where the site is: client k's
folder exists on the node it runs on (pinned there with ``client_resources``),
not on the driver. :class:`PerClientRoots` is the driver's recipe: it reads
``data_root`` (the global test set and the data's shape) and hands client k a
:class:`ClientRoot`, which builds the dataset's source from client k's folder
only when the client builds its shard, where the client runs. Client k's shard
is all of its folder's training data (the source built for one client), and
its own test split, if the dataset has one, comes from the same folder.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Callable, Sequence

from fdam_ray.data.base import AnySplit, DataSource, Shard
from fdam_ray.data.sections import DataSection


class ClientRoot(DataSource):
    """Client ``client_id``'s data, read from ``root`` (its shard) and from the driver's source (test set)."""

    def __init__(self, build: Callable[[DataSection], DataSource], section: DataSection, root: str, client_id: int,
                 num_clients: int, shape_of: DataSource) -> None:
        self.build, self.section, self.root, self.client_id = build, section, root, client_id
        self.num_clients = num_clients
        self.num_tasks, self.input_shape, self.task_names = shape_of.num_tasks, shape_of.input_shape, \
            shape_of.task_names
        self._global = section  # the driver's section: data_root holds the global test set

    def _own(self) -> DataSource:
        if "_own_source" not in self.__dict__:
            if not os.path.exists(os.path.expanduser(self.root)):
                raise ValueError(f"client {self.client_id}: its data folder client_data_roots[{self.client_id}] = "
                                 f"'{self.root}' does not exist on this node ({os.uname().nodename})")
            own = dataclasses.replace(self.section, data_root=self.root, num_clients=1)
            self.__dict__["_own_source"] = self.build(own)
        return self.__dict__["_own_source"]

    def client_shard(self, client_id: int) -> Shard:
        if client_id != self.client_id:
            raise ValueError(f"the data of client {self.client_id} was asked for client {client_id}'s shard")
        try:
            return self._own().client_shard(0)
        except ValueError as exc:  # the folder's data is refused: say whose folder it is
            if str(exc).startswith(f"client {self.client_id}:"):
                raise
            raise ValueError(f"client {self.client_id} (client_data_roots[{self.client_id}] = '{self.root}'): "
                             f"{exc}") from None

    def test_set(self) -> AnySplit | None:
        if "_test_source" not in self.__dict__:
            self.__dict__["_test_source"] = self.build(self._global)
        return self.__dict__["_test_source"].test_set()

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k not in ("_own_source", "_test_source")}


class PerClientRoots(DataSource):
    """The driver's view of a federation whose client k reads ``roots[k]`` (see the module docstring)."""

    def __init__(self, build: Callable[[DataSection], DataSource], section: DataSection, roots: Sequence[str]) -> None:
        if len(roots) != section.num_clients:
            raise ValueError(f"client_data_roots has {len(roots)} folders for num_clients={section.num_clients}")
        self.build, self.section, self.roots = build, section, tuple(roots)
        self.inner = build(section)  # data_root: the global test set, read on the driver (or by the clients)
        self.num_clients = section.num_clients
        self.num_tasks, self.input_shape, self.task_names = (self.inner.num_tasks, self.inner.input_shape,
                                                             self.inner.task_names)

    def for_client(self, client_id: int) -> ClientRoot:
        return ClientRoot(self.build, self.section, self.roots[client_id], client_id, self.num_clients, self.inner)

    def client_shard(self, client_id: int) -> Shard:
        return self.for_client(client_id).client_shard(client_id)

    def test_set(self) -> AnySplit | None:
        return self.inner.test_set()


def check_roots(cls: type[DataSource], section: DataSection, roots: Sequence[str]) -> None:
    """Check every client's folder on the driver (the clients run on this machine); every bad one is named in
    one error, not only the first client's."""
    problems = [f"client {k}: '{root}' {problem}" for k, root in enumerate(roots)
                if (problem := cls.root_problem(section, root)) is not None]
    if problems:
        shown = problems[:8] + ([f"... ({len(problems)} bad folders in all)"] if len(problems) > 8 else [])
        raise ValueError(f"client_data_roots: {'; '.join(shown)} (checked on this machine, where the clients "
                         "run; for a cluster whose nodes hold the folders, give its address)")


def check_data_here(source: DataSource, dataset: str, *, executor: str, address: str | None) -> None:
    """Where the clients run on this machine (:func:`clients_run_here`), check the folders and
    files a source reads before any client (or Ray) starts, and name every one that is missing in one error:
    a wrong ``data_root`` is then found in seconds, not after the actors started and the first client failed
    (and every missing source at once, not one per try). A source says what it lacks through
    :meth:`~fdam_ray.data.base.DataSource.local_problems` (nothing read). ``dataset`` names the source in the
    error; ``executor`` and ``address`` are the run's."""

    if not clients_run_here(executor, address):
        return
    problems = source.local_problems()
    if problems:
        shown = problems[:8] + ([f"... ({len(problems)} in all)"] if len(problems) > 8 else [])
        raise ValueError(f"dataset={dataset}: {'; '.join(shown)} (checked on this machine, "
                         "where the clients run, before starting them)")


def clients_run_here(executor: str, address: str | None) -> bool:
    """Whether the clients of a run on ``executor`` (at Ray ``address``) run on this machine (so their folders are
    this machine's): the inline executor, or Ray without a cluster address (no ``address``, no ``RAY_ADDRESS``)
    and, when this process already runs Ray (a test session, a Tune trial), one of a single node."""
    if executor == "inline":
        return True
    if executor != "ray" or address not in (None, "", "local") or os.environ.get("RAY_ADDRESS"):
        return False
    ray = sys.modules.get("ray")  # never imported here: only a Ray this process already runs is asked
    if ray is not None and ray.is_initialized():
        return len([node for node in ray.nodes() if node.get("Alive")]) == 1
    return True
