"""Ray helpers for tests: one local session per module (CPUs pinned), and data that misbehaves on purpose.

Ray workers get this folder and every folder of test modules on ``PYTHONPATH`` (:data:`TEST_PATH`), so classes
and functions defined here or in test modules can run inside actors and tasks.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from pathlib import Path

import numpy as np
import ray
import torch
from testpath import TEST_PATH

from fdam_ray.data import DatasetSplit, DataSource, Shard
from fdam_ray.executors.ray.compat import start_loopback_ray
from fdam_ray.executors.ray.executor import RayExecutor

NUM_CPUS = 4  # logical CPUs; clients run one torch thread each, so 4 of them share the 2 cores


def first_state(executor, config, source):
    """Ready a started executor's clients for round 1 (p = 0.3, a first stage) and return the initial global
    state, with zero control variates."""
    from fdam_ray.clients.client import Replica

    state = Replica(config, source, device=torch.device("cpu")).flat.initial_state()
    state.c_v, state.c_alpha = np.zeros_like(state.v), np.zeros_like(state.alpha)
    executor.configure(np.array([0.3]))
    executor.begin_stage(state.v, True)
    return state


@contextlib.contextmanager
def ray_session(num_cpus: int = NUM_CPUS):
    """Start Ray unless this process already runs it; shut it down (and undo its env changes) at the end."""
    if ray.is_initialized():
        yield
        return
    saved = dict(os.environ)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (TEST_PATH, saved.get("PYTHONPATH")) if p)
    start_loopback_ray(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)  # listens on 127.0.0.1
    try:
        yield
    finally:
        ray.shutdown()
        os.environ.clear()
        os.environ.update(saved)  # ray.init sets RAY_AUTH_MODE=token for this process


class SleepyDataset(torch.utils.data.Dataset):
    """Samples that take ``delay_s`` each to read: a client whose round does not finish in time."""

    def __init__(self, x: np.ndarray, y: np.ndarray, delay_s: float) -> None:
        self.x, self.y, self.delay_s = x, y, delay_s

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        time.sleep(self.delay_s)
        return torch.from_numpy(self.x[i]), torch.from_numpy(self.y[i])


class OneClientWrapped(DataSource):
    """Wraps a source; client ``client`` reads its training samples through the dataset :meth:`dataset` makes
    of them (the others read theirs as ``inner`` gives them)."""

    def __init__(self, inner: DataSource, client: int) -> None:
        self.inner, self.client = inner, client
        self.num_clients, self.num_tasks = inner.num_clients, inner.num_tasks
        self.input_shape, self.task_names = inner.input_shape, inner.task_names

    def dataset(self, x: np.ndarray, y: np.ndarray) -> torch.utils.data.Dataset:
        raise NotImplementedError

    def client_shard(self, client_id: int) -> Shard:
        shard = self.inner.client_shard(client_id)
        if client_id != self.client:
            return shard
        x, y = shard.train.x.numpy(), shard.train.y.numpy()
        return Shard(DatasetSplit(self.dataset(x, y), y), shard.test)

    def test_set(self):
        return self.inner.test_set()


class SlowClientSource(OneClientWrapped):
    """Wraps a source; client ``slow`` reads its training samples through a :class:`SleepyDataset`."""

    def __init__(self, inner: DataSource, slow: int, delay_s: float) -> None:
        super().__init__(inner, slow)
        self.delay_s = delay_s

    @property
    def slow(self) -> int:
        """The slow client (the wrapped one; subclasses set it per shard to slow every client)."""
        return self.client

    @slow.setter
    def slow(self, client_id: int) -> None:
        self.client = client_id

    def dataset(self, x: np.ndarray, y: np.ndarray) -> torch.utils.data.Dataset:
        return SleepyDataset(x, y, self.delay_s)


class SlowLinkSource(OneClientWrapped):
    """Wraps a source; the actor process that loads client ``client`` (alone on its node, so its node's leader in
    the hierarchical collective) sends its first ``exchanges`` reduce-scatters ``delay_s`` late and finds its
    first ``probes`` probes ``delay_s`` slower, as a leader behind a slow link would (the hierarchy's leaders
    are patched in that process only; the data are the inner source's)."""

    def __init__(self, inner: DataSource, client: int, delay_s: float, exchanges: int, probes: int) -> None:
        super().__init__(inner, client)
        self.delay_s, self.exchanges, self.probes = delay_s, exchanges, probes

    def client_shard(self, client_id: int) -> Shard:
        if client_id == self.client:
            _slow_leader(self.delay_s, self.exchanges, self.probes)
        return self.inner.client_shard(client_id)


def _slow_leader(delay_s: float, exchanges: int, probes: int) -> None:
    from fdam_ray.executors.ray.transports import hierarchy

    leaders = hierarchy.Leaders
    if getattr(leaders, "slowed", False):
        return
    exchange, receive = leaders._exchange, leaders.receive_probe
    seen = {"exchanges": 0, "probes": 0}

    def late_exchange(self, rows, active):
        seen["exchanges"] += 1
        if seen["exchanges"] <= exchanges:
            time.sleep(delay_s)
        return exchange(self, rows, active)

    def slow_probe(self, source, nbytes):
        receive(self, source, nbytes)
        seen["probes"] += 1
        if seen["probes"] <= probes:
            time.sleep(delay_s)
            self.probe_s += delay_s

    leaders._exchange, leaders.receive_probe, leaders.slowed = late_exchange, slow_probe, True


class DamagedDataset(torch.utils.data.Dataset):
    """Samples of which every read after the first ``good`` fails, as a damaged image file does mid-run."""

    def __init__(self, x: np.ndarray, y: np.ndarray, good: int, name: str) -> None:
        self.x, self.y, self.good, self.name, self.reads = x, y, good, name, 0

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        self.reads += 1
        if self.reads > self.good:
            raise ValueError(f"cannot decode {self.name}/img{i}.png: the file is truncated")
        return torch.from_numpy(self.x[i]), torch.from_numpy(self.y[i])


class DamagedSource(DataSource):
    """Wraps a source; every client's training files turn out damaged after a few batches (client k later)."""

    def __init__(self, inner: DataSource, good: int = 40) -> None:
        self.inner, self.good = inner, good
        self.num_clients, self.num_tasks = inner.num_clients, inner.num_tasks
        self.input_shape, self.task_names = inner.input_shape, inner.task_names

    def client_shard(self, client_id: int) -> Shard:
        shard = self.inner.client_shard(client_id)
        x, y = shard.train.x.numpy(), shard.train.y.numpy()
        damaged = DamagedDataset(x, y, self.good + 5 * client_id, f"site{client_id}")
        return Shard(DatasetSplit(damaged, y), shard.test)

    def test_set(self):
        return self.inner.test_set()


def pids_using(folder: str) -> list[int]:
    """The processes (but this one) whose command line names ``folder``: what a Ray node started there left."""
    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and int(proc.name) != os.getpid():
            try:
                if folder in (proc / "cmdline").read_bytes().decode(errors="replace"):
                    pids.append(int(proc.name))
            except OSError:
                continue
    return pids


class FoldCounting(RayExecutor):
    """Counts the partial sums the driver folds in each round."""

    def __init__(self) -> None:
        super().__init__()
        self.folds: list[int] = []

    def run_round(self, state, plan, fold, clients=None):
        count = [0]

        def counted(partial):
            count[0] += 1
            fold(partial)

        super().run_round(state, plan, counted, clients)
        self.folds.append(count[0])


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports free on 127.0.0.1 now (held open together while chosen: one at a time, the kernel
    may hand the same port out twice)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
