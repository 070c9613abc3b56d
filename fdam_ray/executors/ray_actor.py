"""The Ray actor of one client: a thin shell around :class:`fdam_ray.client.Client`.

It receives, calls the client and returns; it holds no client logic. Every
error raised in client code comes back as a :class:`ClientError` carrying the
client id, the round, the action and the original traceback. The actor builds
its own shard from the data source spec (the driver never holds training
samples), takes its device from what Ray assigned (a GPU when
``ray.get_gpu_ids()`` is non-empty, with its CUDA memory capped to the share
when GPUs are shared) and runs ``threads`` torch threads.
"""

from __future__ import annotations

import os
import traceback
import warnings
from collections.abc import Callable
from typing import TypeVar

import numpy as np
import ray
import torch

from fdam_ray.client import Client, ClientSection
from fdam_ray.data import AnySplit, DatasetSplit, DataSource, Split
from fdam_ray.executors.errors import client_error
from fdam_ray.state import ClientInfo, ClientUpdate, GlobalState, Moments, RoundPlan, Scores

T = TypeVar("T")


def actor_device(requested: str, *, gpu_share: float, memory_cap: bool) -> torch.device:
    """The device of a client actor, from the GPUs Ray assigned to it.

    Ray sets ``CUDA_VISIBLE_DEVICES`` to the assigned GPU, so it is ``cuda:0``
    here. With a fractional share (``0 < gpu_share < 1``) and ``memory_cap``,
    the process may allocate at most that fraction of the GPU's memory, so
    clients sharing a GPU cannot starve each other.
    """
    if ray.get_gpu_ids() and requested != "cpu":
        device = torch.device("cuda", 0)
        if memory_cap and 0 < gpu_share < 1:
            torch.cuda.set_per_process_memory_fraction(gpu_share, device)
        return device
    if requested == "cuda":
        raise ValueError("device=cuda but Ray assigned this client no GPU; set gpus_per_client > 0")
    return torch.device("cpu")


def slice_split(split: AnySplit, start: int, stop: int) -> AnySplit:
    """Samples ``start:stop`` of a split (a view for tensors, a Subset for datasets read from disk)."""
    if isinstance(split, DatasetSplit):
        subset = torch.utils.data.Subset(split.dataset, range(start, stop))
        return DatasetSplit(subset, split.labels[start:stop], split.num_workers)
    return Split(split.x[start:stop], split.y[start:stop])


class ClientShell:
    """One client in a Ray actor.

    Args:
        client_id: k in 0..K-1.
        threads: torch intra-op threads of this process.
        device: the config's ``device`` (auto, cpu, cuda).
        gpu_share: GPUs Ray reserves for this actor (``gpus_per_client``).
        gpu_memory_cap: cap CUDA memory to ``gpu_share`` when it is a fraction.
    """

    def __init__(self, client_id: int, *, threads: int, device: str, gpu_share: float, gpu_memory_cap: bool) -> None:
        self.client_id = client_id
        self.round = 0
        self.client: Client | None = None
        self.test: AnySplit | None = None
        torch.set_num_threads(threads)
        # states arrive as read-only views into the object store; the client only copies from them
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        self.device = self._call("start", lambda: actor_device(device, gpu_share=gpu_share,
                                                                memory_cap=gpu_memory_cap))

    def _call(self, action: str, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except Exception as exc:  # every client error goes back typed
            raise client_error(self.client_id, self.round, action, exc, traceback.format_exc()) from None

    def _client(self) -> Client:
        if self.client is None:
            raise RuntimeError("the client was not set up")
        return self.client

    # -- life cycle -----------------------------------------------------------------
    def setup(self, config: ClientSection, source: DataSource, with_test_set: bool) -> tuple[ClientInfo, int]:
        """Build the client (its shard from ``source``) and, to score slices of it, the global test set.

        Returns the client's info and the size of the global test set (0 when not loaded or absent).
        """

        def build() -> tuple[ClientInfo, int]:
            self.client = Client(config, source, self.client_id, device=self.device)
            if with_test_set:
                self.test = source.test_set()
            return self.client.info(), 0 if self.test is None else len(self.test)

        return self._call("start", build)

    def where(self) -> dict:
        """Process id, node and placement of this actor (for tests and diagnostics)."""
        ctx = ray.get_runtime_context()
        fraction = None
        if self.device.type == "cuda" and hasattr(torch.cuda, "get_per_process_memory_fraction"):
            fraction = torch.cuda.get_per_process_memory_fraction(self.device)
        return {"pid": os.getpid(), "node_id": ctx.get_node_id(), "placement_group_id": ctx.get_placement_group_id(),
                "gpu_ids": ray.get_gpu_ids(), "device": str(self.device), "threads": torch.get_num_threads(),
                "cuda_memory_fraction": fraction}

    # -- forwarded calls --------------------------------------------------------------
    def configure(self, positive_ratio: np.ndarray) -> None:
        self._call("configure", lambda: self._client().configure(positive_ratio))

    def begin_stage(self, reference: np.ndarray, reset_control_variate: bool) -> None:
        self._call("begin_stage", lambda: self._client().begin_stage(reference, reset_control_variate))

    def local_round(self, state: GlobalState, plan: RoundPlan, adopt_global_c: bool) -> ClientUpdate:
        """Run the client's round; a replacement first sets its c^k to the global c (``adopt_global_c``)."""
        self.round = plan.round

        def run() -> ClientUpdate:
            client = self._client()
            if adopt_global_c and state.c_v is not None:
                client.set_control_variate(state.c_v, state.c_alpha)
            # views, not copies: Ray serialises the returned update before this actor runs anything else
            return client.local_round(state, plan, copy=False)

        return self._call("local_round", run)

    def evaluate(self, state: GlobalState) -> Scores | None:
        return self._call("evaluate", lambda: self._client().evaluate(state))

    def score_test_slice(self, state: GlobalState, start: int, stop: int) -> Scores:
        """Scores of ``state`` on samples ``start:stop`` of the global test set."""

        def run() -> Scores:
            if self.test is None:
                raise RuntimeError("this client was set up without the global test set")
            return self._client().scores_of(state, slice_split(self.test, start, stop), self.client_id)

        return self._call("evaluate", run)

    def score_moments(self, state: GlobalState) -> Moments:
        return self._call("score_moments", lambda: self._client().score_moments(state))

    def get_state(self) -> dict:
        return self._call("client_states", lambda: self._client().get_state())

    def set_state(self, state: dict) -> None:
        self._call("restore_client_states", lambda: self._client().set_state(state))
