"""The Ray actor that hosts clients: a thin shell around one training replica and its clients.

It receives, calls the clients and returns; it holds no client logic. An
actor hosts ``clients_per_actor`` clients (one by default): one
:class:`~fdam_ray.client.TrainingReplica` (the model, built once) and, per
client, a :class:`~fdam_ray.client.Client` (its shard, sampler position and
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
import threading
import traceback
import warnings
from collections.abc import Callable, Sequence
from typing import TypeVar, cast

import numpy as np
import ray
import torch

from fdam_ray.algorithms.server import PartialSum
from fdam_ray.client import Client, ClientSection, TrainingReplica, begin_stage_hosted, run_hosted
from fdam_ray.data import AnySplit, DatasetSplit, Split
from fdam_ray.data.base import set_host_cpus
from fdam_ray.executors.errors import client_error
from fdam_ray.executors.ray.session import assigned_cpus
from fdam_ray.executors.ray.transports.compiled import patient_reads
from fdam_ray.executors.ray.transports.group import GroupMember, RoundShare, RunShare, ServerStep
from fdam_ray.state import ClientInfo, GlobalState, Moments, RoundPlan, Scores
from fdam_ray.transfer import Broadcast, CompressedSum, Receiver, attach_residual, compress, residual_of

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


class ClientShell:
    """The clients of one Ray actor.

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
        self._before: tuple[int | None, dict[int, dict]] = (None, {})  # a deadline round's states before it
        # how the last compiled round went, (round, "running" | "done" | "failed" | "withdrawn", value); set on
        # the graph's thread, read on the main thread
        self._status: tuple[int, str, object] | None = None
        self._status_lock = threading.Lock()
        self._sources: dict = {}  # object ref -> data source spec read here
        self._group: GroupMember | None = None  # transport=collective: this actor's place in the group
        self._partial_round = -1  # the round self._partial holds (transport=collective keeps it for a re-run)
        # transport=collective, runs of rounds: two flat partial sums used in turn (each round's state lives in one)
        self._run_partials: list[PartialSum | None] = [None, None]
        self._before_run: tuple[str, dict] = ("", {})  # transport=collective: clients' states before a run of rounds
        self._receiver = Receiver()  # transfer_precision bf16/fp16: the float32 master this actor's rounds run from
        self._residual: dict = {}  # error feedback: the rounding residual of this actor's uploads
        self._residual_before: dict | None = None  # a deadline round's residual before it
        torch.set_num_threads(threads)
        set_host_cpus(assigned_cpus())  # data_workers=auto follows the CPUs Ray gave this actor
        patient_reads(channel_wait == "sleep")  # only the compiled graph's thread reads channels here
        # states arrive as read-only views into the object store; the clients only copy from them
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        self.device = self._call("start", lambda: actor_device(device, gpu_share=gpu_share,
                                                                memory_cap=gpu_memory_cap))

    def _call(self, action: str, fn: Callable[[], T], client_id: int | None = None) -> T:
        try:
            return fn()
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
              with_test_set: bool) -> tuple[list[ClientInfo], int]:
        """Build clients ``client_ids``, each from its data source spec in ``sources`` (object refs are read
        here), on one replica built with the first; and, to score slices of it, the global test set.

        Returns the clients' infos and the size of the global test set (0 when not loaded or absent).
        """
        infos = []
        for k, source in zip(client_ids, sources, strict=True):
            infos.append(self._call("start", functools.partial(self._add, k, config, source, with_test_set), k))
        return infos, 0 if self.test is None else len(self.test)

    def _add(self, client_id: int, config: ClientSection, source, with_test_set: bool) -> ClientInfo:
        if isinstance(source, ray.ObjectRef):  # one copy per object: clients of one recipe share its loaded pool
            if source not in self._sources:
                self._sources[source] = ray.get(source)
            source = self._sources[source]
        if self.replica is None:
            self.replica = TrainingReplica(config, source, device=self.device)
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
        differences (:mod:`fdam_ray.transfer`).
        """
        self.round = plan.round
        self._before = (plan.round, {k: self.clients[k].get_state() for k in client_ids if k in self.clients}
                        if undoable else {})
        self._residual_before = {k: v.copy() for k, v in self._residual.items()} if undoable else None
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
                     adopt_global_c: Sequence[int], into: PartialSum | None = None) -> PartialSum:
        """The clients' updates folded into ``into`` (default: this actor's kept partial sum, reused: Ray
        serialises the returned sum before this actor runs again)."""
        if into is None:
            if self._partial is None:
                self._partial = PartialSum.zeros(state, control_variates=state.c_v is not None)
            into = self._partial
        partial = into.reset(lazy=True)  # the first update is written, not added to zeros

        def run(client: Client) -> None:
            if client.client_id in adopt_global_c and state.c_v is not None and state.c_alpha is not None:
                client.set_control_variate(state.c_v, state.c_alpha)
            run_hosted([client], state, plan, partial)

        self._each("local_round", client_ids, run)
        return partial.settle()

    def _run_partial(self, state: GlobalState) -> PartialSum:
        """Where a round of a run of rounds folds its clients' updates: one of two flat partial sums, the one
        whose buffer does not hold ``state`` (each round's new state is finished in its own partial sum's
        buffer, :meth:`GroupMember.reduce` with ``in_place``); under backend ``shm``, the member's slot of the
        group's block (the new state is then held in the block)."""
        slot = self._member().run_partial(state)
        if slot is not None:
            return slot
        for i, kept in enumerate(self._run_partials):
            if kept is not None and not kept.fits(state):
                self._run_partials[i] = None
        for i, kept in enumerate(self._run_partials):
            if kept is None:
                kept = self._run_partials[i] = PartialSum.zeros(state, control_variates=state.c_v is not None,
                                                                flat=True)
            if not np.may_share_memory(kept.v, state.v):
                return kept
        raise AssertionError("both run partial sums hold the state")  # two buffers, one state: unreachable

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

    def round_changes(self, round_index: int) -> tuple[np.ndarray, np.ndarray] | None:
        """The weighted sums over this actor's clients of round ``round_index`` of the change of c^k,
        sum_k w_k (c^k_new - c^k_old) for (c_v, c_alpha), folded in the order and the arithmetic of the partial
        sum such a round sends when it is sampled: what the driver folds instead of the sums of c^k when another
        client missed the deadline of a round that every client was asked to run. None without control
        variates."""
        kept_round, before = self._before
        if kept_round != round_index or not before:
            return None
        totals: tuple[np.ndarray, np.ndarray] | None = None
        for k, old in before.items():
            client = self.clients[k]
            new = client.control_variate()
            if new is None or old["c_v"] is None:
                return None
            changes = [np.subtract(n, o, dtype=np.float32) for n, o in zip(new, (old["c_v"], old["c_alpha"]),
                                                                            strict=True)]
            if client.weight is not None:
                changes = [np.multiply(x, np.float32(client.weight)) for x in changes]
            if totals is None:
                totals = (np.zeros_like(changes[0]), np.zeros_like(changes[1]))
            for total, x in zip(totals, changes, strict=True):
                np.add(total, x, out=total)
        return totals

    def compiled_round(self, message: tuple) -> PartialSum | None:
        """One round under ``transport: compiled`` (on the graph's thread): ``message`` is
        ``(state, plan, calls)`` with ``calls`` mapping an actor index to its ``(client_ids, adopt_global_c)``;
        an actor with no client in the round returns None.

        How it ended stays readable by :meth:`round_status` (a classic call, answered on the actor's main
        thread even while this runs), so the driver can recover the round when the graph breaks.
        """
        state, plan, calls = message
        ids, adopt = calls.get(self.actor, ((), ()))
        with self._status_lock:
            if self._status is not None and self._status[:2] == (plan.round, "withdrawn"):
                return None  # the driver was told "not started" and runs this round with a classic call
            self._status = (plan.round, "running", None)
        if not ids:
            self._status = (plan.round, "done", None)
            return None
        try:
            # a compiled round carries a float32 state (transfer_precision bf16/fp16 refuses transport=compiled)
            partial = cast(PartialSum, self.local_round(state, plan, ids, adopt))
        except BaseException as exc:
            self._status = (plan.round, "failed", exc)
            raise
        self._status = (plan.round, "done", partial)
        return partial

    def round_status(self, round_index: int) -> tuple[str, PartialSum | BaseException | None]:
        """How this actor's compiled round ``round_index`` went: ``("done", partial sum or None)``,
        ``("failed", error)``, ``("running", None)`` or ``("not started", None)``.

        "not started" withdraws the round from the graph: should its input still reach this actor, the graph's
        thread does not run it (the driver re-runs it with a classic call, and it must not run twice).
        """
        with self._status_lock:
            status = self._status
            if status is None or status[0] != round_index or status[1] == "withdrawn":
                self._status = (round_index, "withdrawn", None)
                return "not started", None
            return status[1], cast(PartialSum | BaseException | None, status[2])

    # -- transport: collective (fdam_ray.executors.ray.transports.collective) ------------------------
    def _member(self) -> GroupMember:
        if self._group is None:
            self._group = GroupMember(self.device)
        return self._group

    def open_group(self, host: str, timeout_s: float) -> int:
        """As the lowest rank of a new collective group: serve its store on ``host``; the port."""
        return self._member().open(host, timeout_s)

    def join_group(self, host: str, port: int, rank: int, world: int, backend: str, timeout_s: float,
                   step: ServerStep | None) -> None:
        """Join the collective group whose store is at ``host:port`` as ``rank`` of ``world``."""
        self._member().join(host, port, rank, world, backend, timeout_s, step)

    def collective_round(self, state: GlobalState | None, plan: RoundPlan, client_ids: Sequence[int],
                         adopt_global_c: Sequence[int], reduce_only: bool, partial_total: float | None,
                         token: str) -> RoundShare:
        """One round under ``transport: collective``: the local round of ``client_ids`` (unless
        ``reduce_only``: the partial sum kept from this round's local round), then the group's all-reduce and
        the server step (:meth:`GroupMember.reduce`). ``state`` None: start from the state this actor holds.

        A client's error is flagged to the group first (so no member waits for this one), then raised.
        """
        member = self._member()
        start = member.state_for(state)
        failure: BaseException | None = None
        if not reduce_only:
            try:
                self.local_round(start, plan, client_ids, adopt_global_c)
                self._partial_round = plan.round
            except Exception as exc:  # a ClientError naming the client: raised after the group knows
                failure = exc
        elif self._partial_round != plan.round or self._partial is None:
            failure = RuntimeError(f"actor {self.actor} holds no partial sum of round {plan.round} to reduce")
        share = member.reduce(None if failure is not None else self._partial, start, plan, partial_total, token)
        if failure is not None:
            raise failure
        return share

    def collective_rounds(self, state: GlobalState | None,
                          works: Sequence[tuple[RoundPlan, Sequence[int], Sequence[int], float | None]], token: str,
                          average: bool) -> RunShare:
        """A run of rounds under ``transport: collective`` with no call between them: for each of ``works``
        (plan, this actor's clients in the round, those of them that first adopt the global c, a sampled round's
        total weight or None) the local round, the group's all-reduce and the server step, as
        :meth:`collective_round` does for one round. ``state`` None: start from the state this actor holds.

        The run stops at the first round that does not go through, on every member at the same round (the
        reasons travel in the all-reduce): a failed local round (its error is in the share, not raised; the
        driver then has the run undone), a broken all-reduce, a client's non-finite update, or a non-finite
        state. Each
        member checks its slice of each new state (:meth:`GroupMember.slice_finite`) and, with ``average``
        (``reference_point: average``), sums its slice of each new v in float64 for the stage's running sum.
        Its clients' states before the run are kept, so a run that does not count can be undone
        (:meth:`undo_run`).
        The lowest rank returns the state after the last applied round.
        """
        member = self._member()
        run = RunShare(rounds=[])
        current = member.state_for(state)
        self._before_run = (token, {k: c.get_state() for k, c in self.clients.items()})  # for undo_run
        start, stop = member.my_slice(current.v.size)
        ref = np.zeros(stop - start, dtype=np.float64) if average else None
        stale = False
        for plan, ids, adopt, partial_total in works:
            failure: BaseException | None = None
            self.round = plan.round
            partial = self._run_partial(current)
            try:
                self._local_round(current, plan, ids, adopt, into=partial)
            except Exception as exc:  # a ClientError naming the client: returned once the group knows
                failure = exc
            # reduced in place, no check-in (the driver waits for a run as a whole), no sums kept for a re-run
            share = member.reduce(None if failure is not None else partial, current, plan, partial_total, "", stale,
                                  in_place=True)
            run.rounds.append(share)
            if failure is not None or share.broken:
                run.stop, run.failure = ("failed" if failure is not None else "broken"), failure
                break
            if share.stale or share.diverged:
                run.stop = "stale" if share.stale else "diverged"
                break
            assert member.held is not None
            current, run.done, run.key = member.held, run.done + 1, share.key
            if ref is not None:
                np.add(ref, current.v.reshape(-1)[start:stop], out=ref)
            stale = not member.slice_finite(current)
        run.stale = stale and not run.stop
        if run.done and member.rank == 0:
            run.state = current
        if run.stop:
            run.key = None
        run.ref_sum, run.ref_slice = ref, (start, stop)
        return run

    def undo_run(self, token: str) -> list[int]:
        """The run of rounds ``token`` does not count (a member failed in it): this actor's clients go back to
        their states before it (c^k, sampler position, moments, loss scale), as if it had not run. Returns the
        clients put back."""
        kept_token, before = self._before_run
        if kept_token != token:
            return []
        self._each("undo_run", list(before), lambda c: c.set_state(before[c.client_id]))
        self._before_run = ("", {})
        return sorted(before)

    def evaluate(self, state: GlobalState, client_ids: Sequence[int], split: str = "test") -> list[Scores | None]:
        return self._each("evaluate", client_ids, lambda c: c.evaluate(state, split))

    def score_test_slice(self, state: GlobalState, start: int, stop: int) -> Scores:
        """Scores of ``state`` on samples ``start:stop`` of the global test set."""

        def run() -> Scores:
            if self.test is None or self.replica is None:
                raise RuntimeError("this actor was set up without the global test set")
            return self.replica.scores_of(state, slice_split(self.test, start, stop), self.client_ids[0])

        return self._call("evaluate", run)

    def score_moments(self, state: GlobalState, client_ids: Sequence[int]) -> list[Moments]:
        return self._each("score_moments", client_ids, lambda c: c.score_moments(state))

    def get_state(self, client_ids: Sequence[int]) -> list[dict]:
        states = self._each("client_states", client_ids, lambda c: c.get_state())
        attach_residual(states, self._residual or None)
        return states

    def set_state(self, states: Sequence[dict]) -> None:
        self._residual = residual_of(list(states))
        by_id = {s["client_id"]: s for s in states}
        self._each("restore_client_states", list(by_id), lambda c: c.set_state(by_id[c.client_id]))
