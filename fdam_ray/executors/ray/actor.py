"""The Ray actor that hosts clients: a thin shell around one training replica and its clients.

It receives, calls the clients and returns; it holds no client logic. An
actor hosts ``clients_per_actor`` clients (one by default): one
:class:`~fdam_ray.clients.client.TrainingReplica` (the model, built once) and, per
client, a :class:`~fdam_ray.clients.client.Client` (its shard, sampler position and
control variate). A round runs the actor's sampled clients one after another
and returns their updates folded into one
:class:`~fdam_ray.algorithms.server.PartialSum`. Every error raised in client
code comes back as a :class:`ClientError` carrying the client id, the round,
the action and the original traceback. The actor builds its clients' shards
from the data source spec (the driver never holds training samples), takes
its device from what Ray assigned (a GPU when ``ray.get_gpu_ids()`` is
non-empty, with its CUDA memory capped to the share when GPUs are shared),
tells the data layer the CPUs Ray assigned it (``data_workers: auto``) and
runs ``threads`` torch threads.
"""

from __future__ import annotations

import functools
import os
import traceback
import warnings
from collections.abc import Callable, Sequence
from typing import TypeVar

import numpy as np
import ray
import torch

from fdam_ray.algorithms.server import PartialSum
from fdam_ray.clients.client import (
    Client,
    ClientSection,
    TrainingReplica,
    begin_stage_hosted,
    run_hosted,
)
from fdam_ray.clients.face import NO_FACE, ClientFace
from fdam_ray.clients.late import LateSteps
from fdam_ray.core.state import ClientInfo, ClientState, GlobalState, RoundPlan, ScoreHistogram, Scores, ScoreSums
from fdam_ray.data import AnySplit, DatasetSplit, Split
from fdam_ray.data.base import set_host_cpus
from fdam_ray.executors.errors import client_error
from fdam_ray.executors.ray.session import assigned_cpus
from fdam_ray.executors.ray.transports.collective_actor import CollectiveActor
from fdam_ray.executors.ray.transports.compiled_actor import CompiledActor
from fdam_ray.executors.transfer import Broadcast, CompressedSum, Receiver, attach_residual, compress, residual_of
from fdam_ray.scores.histogram import Binning

T = TypeVar("T")


def actor_device(requested: str, *, gpu_share: float, memory_cap: bool) -> torch.device:
    """The device of an actor, from the GPUs Ray assigned to it.

    Ray sets ``CUDA_VISIBLE_DEVICES`` to the assigned GPU, so it is ``cuda:0``
    here. With a fractional share (``0 < gpu_share < 1``) and ``memory_cap``,
    the process may allocate at most that fraction of the GPU's memory, so
    actors sharing a GPU cannot starve each other.
    """
    if ray.get_gpu_ids() and requested != "cpu":
        device = torch.device("cuda", 0)
        if memory_cap and 0 < gpu_share < 1:
            torch.cuda.set_per_process_memory_fraction(gpu_share, device)
        return device
    if requested == "cuda":
        raise ValueError("device=cuda but Ray assigned this actor no GPU; set gpus_per_actor > 0")
    return torch.device("cpu")


def slice_split(split: AnySplit, start: int, stop: int) -> AnySplit:
    """Samples ``start:stop`` of a split (a view for tensors, a Subset for datasets read from disk)."""
    if isinstance(split, DatasetSplit):
        subset = torch.utils.data.Subset(split.dataset, range(start, stop))
        return DatasetSplit(subset, split.labels[start:stop], split.num_workers)
    return Split(split.x[start:stop], split.y[start:stop])


class ClientShell(CompiledActor, CollectiveActor):
    """The clients of one Ray actor; each transport's actor side is a part it inherits
    (:class:`~fdam_ray.executors.ray.transports.compiled_actor.CompiledActor`,
    :class:`~fdam_ray.executors.ray.transports.collective_actor.CollectiveActor`).

    Args:
        actor: this actor's index.
        client_ids: the clients it hosts.
        threads: torch intra-op threads of this process.
        device: the config's ``device`` (auto, cpu, cuda).
        gpu_share: GPUs Ray reserves for this actor (``gpus_per_actor``).
        gpu_memory_cap: cap CUDA memory to ``gpu_share`` when it is a fraction.
        channel_wait: how the actor's compiled-graph thread waits for a round (``sleep`` or ``spin``; see
            :mod:`fdam_ray.executors.ray.transports.compiled`).
    """

    def __init__(self, actor: int, client_ids: Sequence[int], *, threads: int, device: str, gpu_share: float,
                 gpu_memory_cap: bool, channel_wait: str = "sleep") -> None:
        self.actor = actor
        self.client_ids = tuple(client_ids)
        self.round = 0
        self.replica: TrainingReplica | None = None
        self.clients: dict[int, Client] = {}
        self.test: AnySplit | None = None
        self._partial: PartialSum | None = None
        self._before: tuple[int | None, dict[int, ClientState]] = (None, {})  # a deadline round's states before it
        self._sources: dict = {}  # object ref -> data source spec read here
        self._start_collective()
        self._receiver = Receiver()  # transfer_precision bf16/fp16: the float32 master this actor's rounds run from
        self._residual: dict = {}  # error feedback: the rounding residual of this actor's uploads
        self._residual_before: dict | None = None  # a deadline round's residual before it
        torch.set_num_threads(threads)
        set_host_cpus(assigned_cpus())  # data_workers=auto follows the CPUs Ray gave this actor
        self._start_compiled(channel_wait)
        # states arrive as read-only views into the object store; the clients only copy from them
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        self.device = self._call("start", lambda: actor_device(device, gpu_share=gpu_share,
                                                                memory_cap=gpu_memory_cap))

    def _call(self, action: str, fn: Callable[[], T], client_id: int | None = None) -> T:
        try:
            return fn()
        except LateSteps:  # not an error: the collective's deadline cut the round (collective_actor)
            raise
        except Exception as exc:  # every client error goes back typed, naming the client it happened in
            k = self.client_ids[0] if client_id is None else client_id
            raise client_error(k, self.round, action, exc, traceback.format_exc()) from None

    def _each(self, action: str, ids: Sequence[int], fn: Callable[[Client], T]) -> list[T]:
        out = []
        for k in ids:
            client = self.clients.get(k)
            if client is None:
                raise client_error(k, self.round, action, RuntimeError(f"client {k} is not set up on actor "
                                                                       f"{self.actor}"), "")
            out.append(self._call(action, functools.partial(fn, client), k))
        return out

    # -- life cycle -----------------------------------------------------------------
    def setup(self, client_ids: Sequence[int], config: ClientSection, sources: Sequence,
              with_test_set: bool, face: ClientFace = NO_FACE) -> tuple[list[ClientInfo], int]:
        """Build clients ``client_ids``, each from its data source spec in ``sources`` (object refs are read
        here), on one replica built with the first (with a plug's client ``face``); and, to score slices of it,
        the global test set.

        Returns the clients' infos and the size of the global test set (0 when not loaded or absent).
        """
        infos = []
        for k, source in zip(client_ids, sources, strict=True):
            infos.append(self._call("start", functools.partial(self._add, k, config, source, with_test_set, face),
                                    k))
        return infos, 0 if self.test is None else len(self.test)

    def _add(self, client_id: int, config: ClientSection, source, with_test_set: bool,
             face: ClientFace) -> ClientInfo:
        if isinstance(source, ray.ObjectRef):  # one copy per object: clients of one recipe share its loaded pool
            if source not in self._sources:
                self._sources[source] = ray.get(source)
            source = self._sources[source]
        if self.replica is None:
            self.replica = TrainingReplica(config, source, device=self.device, face=face)
        client = Client(config, source, client_id, device=self.device, replica=self.replica)
        self.clients[client_id] = client
        if with_test_set and self.test is None:
            self.test = source.test_set()
        return client.info()

    def where(self) -> dict:
        """Process id, node and placement of this actor (for tests and diagnostics)."""
        ctx = ray.get_runtime_context()
        fraction = None
        if self.device.type == "cuda" and hasattr(torch.cuda, "get_per_process_memory_fraction"):
            fraction = torch.cuda.get_per_process_memory_fraction(self.device)
        return {"pid": os.getpid(), "node_id": ctx.get_node_id(), "placement_group_id": ctx.get_placement_group_id(),
                "gpu_ids": ray.get_gpu_ids(), "device": str(self.device), "threads": torch.get_num_threads(),
                "cuda_memory_fraction": fraction, "actor": self.actor, "clients": sorted(self.clients)}

    # -- forwarded calls --------------------------------------------------------------
    def configure(self, positive_ratio: np.ndarray) -> None:
        self._each("configure", list(self.clients)[:1], lambda c: c.configure(positive_ratio))  # p is shared

    def begin_stage(self, reference: np.ndarray, reset_control_variate: bool) -> None:
        clients = list(self.clients.values())
        self._call("begin_stage", lambda: begin_stage_hosted(clients, reference, reset_control_variate))

    def local_round(self, state: GlobalState | Broadcast, plan: RoundPlan, client_ids: Sequence[int],
                    adopt_global_c: Sequence[int] = (), undoable: bool = False) -> PartialSum | CompressedSum:
        """Run the round of ``client_ids`` one after another; return their updates folded into one partial sum.

        A replacement client first sets its c^k to the global c (``adopt_global_c``). ``undoable`` (a round with
        a deadline): each client's own state is kept as it was before the round, so :meth:`discard_round` can
        put it back when the round was folded without this actor. A :class:`Broadcast` (``transfer_precision``
        bf16/fp16) updates this actor's master, the round runs from it, and the sum goes back as rounded
        differences (:mod:`fdam_ray.executors.transfer`).
        """
        self.round = plan.round
        self.keep_before(plan.round, client_ids if undoable else (), residual=undoable)
        if isinstance(state, Broadcast):
            message = state
            master = self._call("local_round", lambda: self._receiver.receive(message, ray.get))
            partial = self._local_round(master, plan, client_ids, adopt_global_c)
            residual = self._residual if message.error_feedback else None
            return compress(partial, master, message.precision, sampled=plan.partial, residual=residual)
        return self._local_round(state, plan, client_ids, adopt_global_c)

    def transfer_master(self) -> tuple[int, GlobalState | None]:
        """The version and float32 master of the broadcast this actor holds (for tests and diagnostics)."""
        return self._receiver.version, self._receiver.master

    def _local_round(self, state: GlobalState, plan: RoundPlan, client_ids: Sequence[int],
                     adopt_global_c: Sequence[int], into: PartialSum | None = None,
                     until: float | None = None) -> PartialSum:
        """The clients' updates folded into ``into`` (default: this actor's kept partial sum, reused: Ray
        serialises the returned sum before this actor runs again); ``until``: a step starting after it raises
        :class:`~fdam_ray.clients.late.LateSteps`."""
        if into is None:
            if self._partial is None:
                self._partial = PartialSum.zeros(state, control_variates=state.c_v is not None)
            into = self._partial
        partial = into.reset(lazy=True)  # the first update is written, not added to zeros

        def run(client: Client) -> None:
            if client.client_id in adopt_global_c and state.c_v is not None and state.c_alpha is not None:
                client.set_control_variate(state.c_v, state.c_alpha)
            run_hosted([client], state, plan, partial, until)

        self._each("local_round", client_ids, run)
        return partial.settle()

    def keep_before(self, round_index: int, client_ids: Sequence[int], residual: bool) -> None:
        """Keep ``client_ids``' own states as they are before round ``round_index`` (and, with ``residual``, the
        upload residual), where :meth:`discard_round` and :meth:`round_changes` read them."""
        self._before = (round_index, {k: self.clients[k].get_state() for k in client_ids if k in self.clients})
        self._residual_before = {k: v.copy() for k, v in self._residual.items()} if residual else None

    def discard_round(self, round_index: int) -> list[int]:
        """Round ``round_index`` was folded without this actor (it missed the deadline): its clients' own states
        (c^k, sampler position, moments, loss scale) go back to what they were before it, as those of clients
        that did not take part. Returns the clients put back."""
        kept_round, before = self._before
        if kept_round != round_index:
            return []
        self._each("discard_round", list(before), lambda c: c.set_state(before[c.client_id]))
        if self._residual_before is not None:  # error feedback: the discarded upload's rounding never counted
            self._residual = self._residual_before
        self._before, self._residual_before = (None, {}), None
        return sorted(before)

    def round_changes(self, round_index: int) -> tuple[np.ndarray, ...] | None:
        """The weighted sums over this actor's clients of round ``round_index`` of the change of c^k,
        sum_k w_k (c^k_new - c^k_old) per control vector (their algorithm's drift correction's
        :meth:`~fdam_ray.algorithms.drift.DriftCorrection.host_changes`): what the driver folds instead of the
        sums of c^k when another client missed the deadline of a round that every client was asked to run. None
        without control variates."""
        kept_round, before = self._before
        if kept_round != round_index or not before:
            return None
        hosted = [(self.clients[k], old) for k, old in before.items()]
        drift = hosted[0][0].replica.algorithm.drift  # the clients' algorithm (one per run)
        return drift.host_changes((client.control_variate(), old.control, client.weight) for client, old in hosted)

    def evaluate(self, state: GlobalState, client_ids: Sequence[int], split: str = "test",
                 bins: Binning | None = None) -> list[Scores | None] | list[ScoreHistogram | None]:
        """Each client's scores of ``state`` (None: it has no such part); with ``bins`` its score histogram."""
        if bins is not None:
            return self._each("evaluate", client_ids, lambda c: c.score_histogram(state, split, bins))
        return self._each("evaluate", client_ids, lambda c: c.evaluate(state, split))

    def score_test_slice(self, state: GlobalState, start: int, stop: int) -> Scores:
        """Scores of ``state`` on samples ``start:stop`` of the global test set."""

        def run() -> Scores:
            if self.test is None or self.replica is None:
                raise RuntimeError("this actor was set up without the global test set")
            return self.replica.scores_of(state, slice_split(self.test, start, stop), self.client_ids[0])

        return self._call("evaluate", run)

    def score_sums(self, state: GlobalState, client_ids: Sequence[int]) -> list[ScoreSums]:
        return self._each("score_sums", client_ids, lambda c: c.score_sums(state))

    def get_state(self, client_ids: Sequence[int]) -> list[ClientState]:
        states = self._each("client_states", client_ids, lambda c: c.get_state())
        attach_residual(states, self._residual or None)
        return states

    def set_state(self, states: Sequence[ClientState]) -> None:
        self._residual = residual_of(list(states))
        by_id = {s.client_id: s for s in states}
        self._each("restore_client_states", list(by_id), lambda c: c.set_state(by_id[c.client_id]))
