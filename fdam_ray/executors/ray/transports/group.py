"""An actor's side of ``transport: collective``: its membership of the actors' group and its share of a round.

Each actor of the round's group holds one :class:`GroupMember`. After the
actor's local round, :meth:`GroupMember.reduce` all-reduces its weighted
partial sum with the other members' (``torch.distributed``: gloo on CPU
actors, NCCL when every member holds a GPU of its own; backend ``shm``, every
member on one node: through a shared-memory block, :mod:`.shared` and
:meth:`GroupMember._reduce_shared`, where each member finishes the server
step on its slice and a run's state is held in the block), applies the server
step itself (the same :class:`~fdam_ray.algorithms.server.RoundReducer` the
driver runs, on the same sums, so the new global state is the driver's bit
for bit) and keeps that state for the next round, so the driver sends the
state only when the members' copy is not the one it holds (see
:func:`~.collective_messages.state_key`; what the driver and the members
exchange is in :mod:`.collective_messages`, the actor's remote methods in
:mod:`.collective_actor`).

Two all-reduces per round, queued back to back in the same order on every
member: a small float64 one in which each member writes its own slot (its
weight, client count, bytes, a failure flag and its integer buffers; sums of
one non-zero term per slot, so exact), and one float32 all-reduce of the
summed vectors (v, alpha, BatchNorm statistics, control variates; every
vector but those combined by max) laid end to end in one buffer (both laid
out by :mod:`.collective_sums`). A round in
which a member flagged a failure is discarded. The member's own partial sum is copied into that buffer rather than
reduced in place: a round whose all-reduce breaks is finished from the kept
partial sums (:meth:`~.collective_actor.CollectiveActor.collective_round`
with ``reduce_only``) without running a client twice. Inside a run of rounds
nothing is re-run that way (a run that breaks is undone and run again round by
round), so there each member reduces its partial sum in the sum's own buffer
and finishes the new state in it (``reduce`` with ``in_place``), folding the
next round into a second partial sum.
"""

from __future__ import annotations

import datetime
import logging
import math
import socket
from typing import Any

import numpy as np
import torch

from fdam_ray.algorithms.server import PartialSum, ServerStep, same_shapes
from fdam_ray.core.state import GlobalState, RoundPlan
from fdam_ray.executors.ray.transports.collective_links import Links
from fdam_ray.executors.ray.transports.collective_messages import RoundShare, state_key
from fdam_ray.executors.ray.transports.collective_sums import (
    finish_slice,
    is_buffer,
    layout,
    member_row,
    pack,
    reduced_sums,
)
from fdam_ray.executors.ray.transports.device_block import DEVICE, DeviceBlock
from fdam_ray.executors.ray.transports.hierarchy import BACKEND, Leaders, NodeLink, Place, parse, slice_of
from fdam_ray.executors.ray.transports.shared import SharedBlock, SharedBroken

log = logging.getLogger(__name__)

class GroupMember:
    """One actor in the collective group: rank, process group, the reduce buffers and the held global state."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.rank = -1
        self.world = 0
        self.backend = ""
        self.store: Any = None
        self.step: ServerStep | None = None
        self.held: GlobalState | None = None
        self.timeout_s = 0.0
        # backend shm (members on one node): the group's shared-memory block, made at the first reduce of a size
        self.shared = False
        self.block: SharedBlock | None = None
        self._blocks = 0  # blocks made in this group (each one's path travels under its own store key)
        self.nodes: NodeLink | None = None  # backend hier (members on several nodes): the member's place in it
        self.device_block: DeviceBlock | None = None  # backend device (members on one GPU): its block
        self._slot_partial: PartialSum | None = None  # a run's partial sum over this member's slot
        self._flat = np.empty(0, dtype=np.float32)
        # the server step's sums, two sets used in turn: the state held from the last round lives in one
        self._sums: list[PartialSum | None] = [None, None]
        self._turn = 0

    # -- the group ------------------------------------------------------------------------
    def open(self, host: str, timeout_s: float) -> int:
        """As the lowest rank of a new group: leave the old one and serve the new group's store on ``host``;
        its port."""
        import torch.distributed as dist

        self.leave()
        # the store listens on ``host`` only (torch's own server would bind every interface): a socket bound here,
        # handed over to the store, which closes it when it ends
        listener = socket.create_server((host, 0), family=socket.AF_INET6 if ":" in host else socket.AF_INET,
                                        backlog=128)
        port = int(listener.getsockname()[1])
        self.store = dist.TCPStore(host, port, None, True, timeout=datetime.timedelta(seconds=timeout_s),
                                   wait_for_workers=False, master_listen_fd=listener.detach())
        return port

    def join(self, host: str, port: int, rank: int, world: int, backend: str, timeout_s: float,
             step: ServerStep | None) -> None:
        """Join the group whose store the lowest rank serves at ``host:port`` (leaving any other first); every
        collective call of the group waits at most ``timeout_s``. Backend ``shm`` (every member on this node):
        the members reduce through a shared-memory block (:mod:`.shared`), over a gloo group that only sets it
        up."""
        import torch.distributed as dist

        if rank != 0:
            self.leave()
            self.store = dist.TCPStore(host, port, None, False, timeout=datetime.timedelta(seconds=timeout_s))
        elif dist.is_initialized():
            dist.destroy_process_group()
        self._drop_block()
        self._drop_nodes()
        self.held = None
        hier = backend.split("/")[0] == BACKEND
        if hier:  # where this member runs, for every member to tell the nodes apart (read once all have joined)
            self.store.set(f"node/{rank}", _where())
        setup_only = backend in ("shm", DEVICE) or hier  # gloo sets the group up; the sums go another way
        dist.init_process_group("gloo" if setup_only else backend, store=self.store, rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=timeout_s))
        self.rank, self.world, self.backend, self.step = rank, world, backend.split("/")[0], step
        self.timeout_s, self.shared, self._blocks = timeout_s, backend == "shm" or hier, 0
        if hier:
            self._join_nodes(backend)

    def _join_nodes(self, backend: str) -> None:
        """Backend hier: this member's place among the nodes; a node's leader joins the leaders' group, its
        sockets on the node's own address (:class:`~.hierarchy.Leaders`)."""
        where = [self.store.get(f"node/{r}").decode().split(" ", 1) for r in range(self.world)]
        place = Place.of(self.rank, [(node, address) for node, address in where])
        leaders = None
        if place.leader and place.nodes > 1:
            leaders = Leaders(self.store, "leaders/", place.node, place.nodes, place.addresses[place.node],
                              self.timeout_s)
        self.nodes = NodeLink(place, leaders, *parse(backend))

    def leave(self) -> None:
        """Leave the group (a broken one too): its process group ended, its store dropped, no state held."""
        import torch.distributed as dist

        self._drop_block()
        self._drop_nodes()
        self._drop_device_block()
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception as exc:  # a group broken by a dead member may not end cleanly; it is gone either way
                log.debug("destroy_process_group: %s", exc)
        self.store, self.rank, self.world, self.held, self.shared = None, -1, 0, None, False

    def _drop_block(self) -> None:
        """Leave the shared-memory block: members still waiting in it are released (its mapping goes with the
        last view of it: a held state may still read from it)."""
        if self.block is not None:
            self.block.mark_broken()
            self.block.close()
        self.block, self._slot_partial = None, None

    def _drop_device_block(self) -> None:  # backend device: peers waiting in the block are released
        if self.device_block is not None:
            self.device_block.mark_broken()
            self.device_block.close()
        self.device_block = None

    def _device_reduce(self, flat: np.ndarray) -> None:
        """Backend ``device``: ``flat`` summed in rank order through the members' device block (made at the first
        reduce of a size; :mod:`.device_block`), in place."""
        block = self.device_block
        if block is None or block.numel != flat.size:
            self._drop_device_block()
            block = self.device_block = DeviceBlock()
            self._blocks += 1
            block.open(self.store, self.rank, self.world, flat.size, self.device, prefix=f"device/{self._blocks}",
                       timeout_s=self.timeout_s)
        flat[:] = block.reduce(torch.from_numpy(flat).to(self.device)).cpu().numpy()

    def _drop_nodes(self) -> None:
        if self.nodes is not None:
            self.nodes.close()
        self.nodes = None

    def state_for(self, given: GlobalState | None) -> GlobalState:
        """The round's starting state: the one sent, else the one this member holds."""
        if given is not None:
            return given
        if self.held is None:
            raise RuntimeError("the driver sent no global state and this actor holds none")
        return self.held

    # -- a round --------------------------------------------------------------------------
    def reduce(self, mine: PartialSum | None, state: GlobalState, plan: RoundPlan, partial_total: float | None,
               token: str, stale: bool = False, in_place: bool = False, links: Links | None = None) -> RoundShare:
        """All-reduce ``mine`` (None: this member failed; it contributes nothing and flags the failure) with the
        group's, apply the server step, keep the new state; a broken all-reduce ends the process group and says
        why in the share. ``token`` names this try of the round in the store (the driver reads who arrived).

        ``in_place`` (a run of rounds): ``mine``, when its vectors are views of one buffer
        (:meth:`PartialSum.zeros` with ``flat``), is reduced and turned into the new state in that buffer (no
        copy kept for a re-run, no sums returned): the held state then lives in ``mine``, so the next round
        must fold into another partial sum.

        Flags every member reads in the share: ``diverged`` (a member's client sent a non-finite update or loss:
        the step is not applied, the lowest rank still returns the sums, whose fold raises on the driver) and
        ``stale`` (a member found its slice of ``state`` not finite, :meth:`slice_finite`; the step is not
        applied). ``links`` (backend hier, a run under a deadline): the nodes in the leaders' exchange; a member
        whose node is out applies nothing (:mod:`.collective_links`)."""

        world, rank = self.world, self.rank
        order = layout(state)
        small = member_row(mine, rank, world, state.counters.size, stale)
        mine_stats = [] if mine is None else list(mine.stats)
        size = sum(n for _, n in order)
        if self.shared:
            return self._reduce_shared(mine, state, plan, partial_total, token, small, order, size, in_place, links)
        mine_flat = mine.flat if in_place and mine is not None else None
        own = mine_flat is not None and mine_flat.size == size
        flat = mine_flat if own and mine_flat is not None else self._buffer(size)
        if mine is not None and not own:
            pack(mine, order, flat)
        try:
            if token:  # a round at a time: the driver reads who arrived when one is late
                self.store.set(f"{token}/{rank}", "1")
            self._all_reduce(small, flat)
            if small[3 * world:4 * world].any():
                return RoundShare(mine_stats, broken="a member failed in its local round")
        except Exception as exc:  # a member died or did not answer: the group is broken
            why = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            log.debug("the all-reduce of round %d broke: %s", plan.round, why)
            self.leave()
            return RoundShare(mine_stats, broken=why)
        total = reduced_sums(flat, order, small, state, world)
        diverged, stale = bool(small[4 * world:5 * world].any()), bool(small[5 * world:6 * world].any())
        share = RoundShare(mine_stats, None, total if rank == 0 and not in_place else None, count=total.count,
                           bytes_up=total.bytes_up, diverged=diverged, stale=stale)
        if self.step is None or diverged or stale:
            return share
        if own:
            self.held = self.step.apply(state, total, plan.steps, partial_total, in_place=True)
        else:
            self.held = self.step.apply(state, total, plan.steps, partial_total, self._server_sums(total))
        share.key = state_key(self.held, plan.stage)
        return share

    def _reduce_shared(self, mine: PartialSum | None, state: GlobalState, plan: RoundPlan,
                       partial_total: float | None, token: str, small: np.ndarray, order: list[tuple[str, int]],
                       size: int, in_place: bool, links: Links | None = None) -> RoundShare:
        """:meth:`reduce` through the group's shared-memory block (backend ``shm``, see :mod:`.shared`): the
        members' sums in rank order, each member's slice finished by it (``in_place``: the new state is then
        held in the block's result buffer, no copy of it anywhere), else the whole sums read from the block and
        the server step applied as under gloo."""
        world, rank = self.world, self.rank
        mine_stats = [] if mine is None else list(mine.stats)
        block: SharedBlock | None = None
        finished: GlobalState | None = None
        try:
            if token:  # a round at a time: the driver reads who arrived when one is late (before any wait)
                self.store.set(f"{token}/{rank}", "1")
            block = self._block_for(size, small.size)
            if block is None:  # no room in /dev/shm: this group reduces over gloo from here on
                return self.reduce(mine, state, plan, partial_total, token, bool(small[5 * world + rank]), in_place)
            if mine is not None and not is_buffer(mine.flat, block.slot):
                pack(mine, order, block.slot)
            block.put_row(small)
            block.barrier()
            small = block.sum_rows()
            summed: np.ndarray | None = None  # backend hier: the sums over every node, in the block
            if self.nodes is not None:
                summed = block.result_for(state.v)
                small = self.nodes.round(block, small, summed, state, order, world, plan.partial,
                                         lambda rows: self._goes_on(rows, in_place), links)
            if small[3 * world:4 * world].any():
                return RoundShare(mine_stats, broken="a member failed in its local round")
            diverged, stale = bool(small[4 * world:5 * world].any()), bool(small[5 * world:6 * world].any())
            sitting = self._sits_out(links)
            apply = self.step is not None and not diverged and not stale and not sitting
            total: PartialSum | None = None
            if apply or not (in_place or sitting):  # in place with no step, or a node out: nothing to sum
                out = block.result_for(state.v)
                start, stop = self.my_slice(size) if self.nodes is None else self.nodes.my_slice(size)
                if summed is None:
                    block.reduce_slice(out, start, stop)
                total = reduced_sums(out, order, small, state, world)
                if in_place:
                    finished = self._finish_slice(state, total, order, start, stop, plan.steps, partial_total)
                block.barrier()
        except (SharedBroken, OSError, RuntimeError) as exc:  # a member died, left or is late (gloo's set-up
            # barriers raise RuntimeError on a timeout): the group is broken
            why = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            log.debug("the shared-memory reduce of round %d broke: %s", plan.round, why)
            self.leave()
            return RoundShare(mine_stats, broken=why)
        share = RoundShare(mine_stats, None, total if rank == 0 and not in_place else None,
                           count=int(small[world:2 * world].sum()), bytes_up=int(small[2 * world:3 * world].sum()),
                           diverged=diverged, stale=stale)
        if not apply or self.step is None or total is None:
            return share
        if finished is not None:
            self.held = finished
        else:
            self.held = self.step.apply(state, total, plan.steps, partial_total, self._server_sums(total))
        share.key = state_key(self.held, plan.stage)
        return share

    def _sits_out(self, links: Links | None) -> bool:
        """Whether this member's node is out of the round's leaders' exchange (:mod:`.collective_links`)."""
        return links is not None and self.nodes is not None and self.nodes.place.node not in links.active

    def _goes_on(self, small: np.ndarray, in_place: bool) -> bool:
        """Whether a round whose members' rows sum to ``small`` needs its summed vectors (no member failed, and
        the sums are returned or the step is applied)."""
        world = self.world
        if small[3 * world:4 * world].any():
            return False
        return not in_place or (self.step is not None and not small[4 * world:6 * world].any())

    def _block_for(self, n: int, small: int) -> SharedBlock | None:
        """The group's shared-memory block for states of ``n`` summed floats (made, all members together, when
        there is none of that size yet; backend hier: one block per node, made by its leader); None when a block
        could not be made (the group then reduces over gloo)."""
        import torch.distributed as dist

        block = self.block
        if block is not None and block.n == n and block.small_len == small:
            return block
        self._drop_block()
        self._blocks += 1
        place = None if self.nodes is None else self.nodes.place
        node, rank, world, nodes = (0, self.rank, self.world, 1) if place is None else \
            (place.node, place.rank, place.size, place.nodes)
        key = f"shm-block/{self._blocks}"
        made = ""  # the node's block, unlinked whatever happens next (the others map it or the group broke)
        if rank == 0:
            try:
                made = SharedBlock.create(world, small, n)
            except OSError as exc:
                log.warning("no shared-memory block of %d floats for the collective group (%s): it reduces over "
                            "gloo", n, exc)
            self.store.set(f"{key}/{node}", made)
        try:
            dist.barrier()
            paths = [self.store.get(f"{key}/{i}").decode() for i in range(nodes)]
            if not all(paths):  # every member falls back together
                self.shared = False
                return None
            block = SharedBlock(paths[node], rank, world, small, n, self.timeout_s)
            dist.barrier()  # every member has mapped it and opened its FIFO
            block.connect()
            dist.barrier()  # every member has opened the others' FIFOs: the names can go
        finally:
            if made:
                SharedBlock.unlink(made, world)
        self.block = block
        return block

    def run_partial(self, state: GlobalState) -> PartialSum | None:
        """Backend ``shm``, inside a run of rounds: a flat partial sum over this member's slot of the block, so
        the member's fold writes where the others read (None: no block for states like ``state`` yet)."""
        block = self.block
        if block is None or sum(n for _, n in layout(state)) != block.n:
            return None
        kept = self._slot_partial
        if kept is None or not kept.fits(state):
            kept = self._slot_partial = PartialSum.zeros(state, control_variates=state.c_v is not None, flat=True,
                                                         buffer=block.slot)
        return kept

    def _finish_slice(self, state: GlobalState, total: PartialSum, order: list[tuple[str, int]], start: int,
                      stop: int, steps: int, partial_total: float | None) -> GlobalState:
        """The server step on this member's slice ``start:stop`` of the round's sums, in ``total``'s buffers
        (:func:`~.collective_sums.finish_slice`)."""
        assert self.step is not None
        return finish_slice(self.step, state, total, order, start, stop, steps, partial_total)

    def my_slice(self, n: int, rank: int | None = None) -> tuple[int, int]:
        """This member's share (or ``rank``'s) of an ``n``-long vector: contiguous, in rank order (the last ones
        one shorter)."""
        return slice_of(n, self.rank if rank is None else rank, self.world)

    def slice_finite(self, state: GlobalState, share: tuple[int, int] | None = None, lowest: bool | None = None
                     ) -> bool:
        """Whether this member's slice of v (``share``, else :meth:`my_slice`) and, on the lowest rank (or where
        ``lowest``), alpha and the float buffers are finite: each member checks its share of the state once, not
        the whole state on every member (a dot product first, exact only where that is not finite)."""
        start, stop = share if share is not None else self.my_slice(state.v.size)
        parts = [state.v.reshape(-1)[start:stop]]
        if self.rank == 0 if lowest is None else lowest:
            parts += [state.alpha.reshape(-1), state.buffers.reshape(-1)]
        for x in parts:
            if x.size and not math.isfinite(float(np.dot(x, x))) and not np.isfinite(x).all():
                return False
        return True

    def _server_sums(self, like: PartialSum) -> PartialSum:
        """The next of the two sets of server-step sums (made again when shapes change); never the one whose
        buffers the held state uses."""
        self._turn ^= 1
        sums = self._sums[self._turn]
        if sums is None or not same_shapes(sums, like):
            sums = self._sums[self._turn] = PartialSum.from_vectors(
                {k: None if x is None else np.empty_like(x) for k, x in like.vectors().items()})
        return sums

    def all_reduce_flags(self, flags: np.ndarray) -> None:
        """Sum a small float64 row over the group in place (a deadline's flags, :mod:`.collective_deadline`)."""
        self._all_reduce(flags)

    def _buffer(self, n: int) -> np.ndarray:
        if self._flat.size != n:
            self._flat = np.empty(n, dtype=np.float32)
        return self._flat

    def _all_reduce(self, *bufs: np.ndarray) -> None:
        """Sum each of ``bufs`` over the group, in place (through the GPU under NCCL); the calls are queued
        back to back and waited for together (one hand-over between Python and the backend)."""
        import torch.distributed as dist

        if self.backend == DEVICE:  # the small float64 row over gloo (exact), the float32 sums on the device
            dist.all_reduce(torch.from_numpy(bufs[0]))
            for b in bufs[1:]:
                self._device_reduce(b)
            return
        if self.backend == "nccl":
            tensors = [torch.from_numpy(b).to(self.device, non_blocking=True) for b in bufs]
        else:
            tensors = [torch.from_numpy(b) for b in bufs]
        for work in [dist.all_reduce(t, async_op=True) for t in tensors]:
            work.wait()
        if self.backend == "nccl":
            for b, t in zip(bufs, tensors, strict=True):
                b[:] = t.cpu().numpy()


def _where() -> str:
    """This process's node id and the node's address (``id address``)."""
    import ray

    return f"{ray.get_runtime_context().get_node_id()} {ray.util.get_node_ip_address()}"
