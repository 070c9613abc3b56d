"""``transport: collective`` across nodes: a hierarchical all-reduce (backend ``hier``).

When the group's members run on several nodes (``collective_backend: auto``,
no NCCL), a round's sums move in three steps:

1. inside each node, the members reduce through the node's shared-memory
   block (:mod:`.shared`): each sums its slice of the node's slots in rank
   order, so the node's block holds the node's sum S_n;
2. one member per node, its lowest rank (the node's leader), exchanges S_n
   with the other nodes' leaders over a gloo group of its own whose sockets
   sit on the node's own address: a reduce-scatter (S_n cut into p equal
   chunks, p the number of nodes; leader j receives chunk j of every node, one
   direct message each, and sums them in node order) and an all-gather (every
   leader receives every summed chunk), both as point-to-point messages, each
   receive timed (:class:`Leaders`). Each node's link carries (p-1)/p of a
   state out and (p-1)/p in per step, 2(p-1)/p of a state each way a round,
   whatever the number of members on the node. Under a deadline a node whose
   link is slow sits out (:mod:`.collective_links`): the others' leaders
   exchange among themselves, p then their number;
3. the leader writes the all-node sum into the node's block, and the node's
   members read it there.

Order of the sums: the members of a node in rank order, then the nodes in
node order (a node's place is that of its lowest rank). Ranks are the actors
in order, so this is the order of ``transport: classic, reduce: node,
fold_order: client`` (a node's reducer sums its actors in actor order, the
driver the nodes' sums in that order): the two runs are equal bit for bit,
and equal a ``reduce: star`` rank-order fold to float32 rounding. The
weights, counts and flags travel as a float64 row with one slot per member
(sums of one non-zero term: exact in any order).

With ``transfer_precision`` bf16 or fp16 the leaders send 16-bit values
(half the bytes on every link between nodes), following the rule of the
classic transfers (docs/algorithms.md s.8 R11) with the node as the host and
the state the members hold (the one the round ran from) as the master M: a
leader sends q_n = round16(fl(S_n - W_n M)) (with ``error_feedback`` the
node's residual is added first and kept: one residual per node, held by its
leader); the owner of a chunk sums the decoded differences in node order in
float32 and rounds the sum once more, without a residual, as a classic node
reducer does; every member then holds fl(decode(q) + W M), W the round's
total weight (nothing is subtracted or added for the control variates' part
of a sampled round, a difference already). Inside a node nothing is
rounded: shared memory is not a wire.
"""

from __future__ import annotations

import dataclasses
import datetime
import re
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from fdam_ray.core.state import GlobalState, Rule, vector_fields
from fdam_ray.executors.ray.transports.collective_links import Links
from fdam_ray.executors.ray.transports.shared import SharedBlock, SharedBroken
from fdam_ray.executors.transfer import decode, encode

BACKEND = "hier"  # the backend's name (the driver's and the members')


# -- who is where ------------------------------------------------------------------------------------------------


def node_groups(nodes: Sequence[str]) -> list[list[int]]:
    """The ranks of each node (``nodes[r]``: rank r's node), in rank order, the nodes in order of their lowest
    rank (the node order of the sums)."""
    groups: dict[str, list[int]] = {}
    for rank, node in enumerate(nodes):
        groups.setdefault(node, []).append(rank)
    return list(groups.values())


@dataclasses.dataclass(frozen=True)
class Place:
    """A member's place in the hierarchy.

    Attributes:
        node: its node's index (in node order).
        rank: its rank inside the node (0: the node's leader).
        size: the node's number of members.
        nodes: the number of nodes.
        addresses: each node's address (in node order), for messages.
        node_of: each rank's node index.
    """

    node: int
    rank: int
    size: int
    nodes: int
    addresses: tuple[str, ...]
    node_of: tuple[int, ...] = ()

    @property
    def leader(self) -> bool:
        return self.rank == 0

    @classmethod
    def of(cls, rank: int, where: Sequence[tuple[str, str]]) -> Place:
        """Rank ``rank``'s place; ``where[r]``: rank r's (node id, node address)."""
        groups = node_groups([node for node, _ in where])
        node = next(i for i, g in enumerate(groups) if rank in g)
        node_of = {r: i for i, g in enumerate(groups) for r in g}
        return cls(node, groups[node].index(rank), len(groups[node]), len(groups),
                   tuple(where[g[0]][1] for g in groups), tuple(node_of[r] for r in range(len(where))))


def spec(precision: str, error_feedback: bool) -> str:
    """The backend as the driver names it to the members: ``hier``, ``hier/bf16`` or ``hier/bf16/ef``."""
    if precision == "fp32":
        return BACKEND
    return f"{BACKEND}/{precision}" + ("/ef" if error_feedback else "")


def parse(backend: str) -> tuple[str, bool]:
    """``(precision, error_feedback)`` of a :func:`spec`."""
    parts = backend.split("/")
    return (parts[1] if len(parts) > 1 else "fp32"), "ef" in parts[2:]


# -- the arithmetic ---------------------------------------------------------------------------------------------


def chunk_length(n: int, parts: int) -> int:
    """The length of each of ``parts`` equal chunks covering ``n`` values (the last padded with zeros)."""
    return max(1, -(-n // parts))


def padded(x: np.ndarray, parts: int) -> np.ndarray:
    """``x`` laid out as ``parts`` rows of :func:`chunk_length` (zeros after its end)."""
    c = chunk_length(x.size, parts)
    out = np.zeros(parts * c, dtype=x.dtype)
    out[:x.size] = x
    return out.reshape(parts, c)


def fold_rows(rows: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """The rows of ``rows`` summed in row order, in float32: fl(fl(r0 + r1) + r2) ... (one row: itself)."""
    if out is None:
        out = np.empty(rows.shape[1:], dtype=rows.dtype)
    if len(rows) == 1:
        out[...] = rows[0]
        return out
    np.add(rows[0], rows[1], out=out)
    for r in rows[2:]:
        np.add(out, r, out=out)
    return out


def master_times(state: GlobalState, layout: Sequence[tuple[str, int]], weight: float, sampled: bool) -> np.ndarray:
    """W M laid out as a round's flat sums (``layout``): fl(M * float32(W)) per vector, M itself when W = 1, and
    zeros for the control variates' part of a sampled round (sent as differences already)."""
    rules = {f.name: f.metadata["rule"] for f in vector_fields()}
    w = np.float32(weight)
    out = np.zeros(sum(n for _, n in layout), dtype=np.float32)
    at = 0
    for name, n in layout:
        m = getattr(state, name)
        if m is not None and not (rules[name] is Rule.CONTROL and sampled):
            out[at:at + n] = m.reshape(-1) if w == 1 else m.reshape(-1) * w
        at += n
    return out


def node_difference(node_sum: np.ndarray, reference: np.ndarray, precision: str,
                    residual: np.ndarray | None) -> np.ndarray:
    """A leader's upload: round16(fl(S_n - W_n M) (+ e)); ``residual`` (error feedback) is added and updated in
    place."""
    d = node_sum - reference
    if residual is not None:
        np.add(d, residual, out=d)
    bits = encode(d, precision)
    if residual is not None:
        np.subtract(d, decode(bits, precision), out=residual)
    return bits


def owner_sum(rows: np.ndarray, precision: str) -> np.ndarray:
    """A chunk's owner: the nodes' decoded differences (``rows``, 16-bit patterns, node order) summed in float32
    in node order, rounded once more (no residual); the patterns every leader receives."""
    return encode(fold_rows(np.stack([decode(r, precision) for r in rows])), precision)


def simulate(node_sums: Sequence[np.ndarray], precision: str = "fp32",
             references: Sequence[np.ndarray] | None = None, total_reference: np.ndarray | None = None,
             residuals: Sequence[np.ndarray | None] | None = None) -> np.ndarray:
    """The all-node sum every member ends with, computed in one process as the leaders' exchange computes it
    (:class:`Leaders`; for checks and measurements): ``node_sums`` in node order; 16 bits: their references
    W_n M, the round's W M and the nodes' residuals (updated)."""
    p, n = len(node_sums), node_sums[0].size
    if precision == "fp32":
        rows = np.stack([padded(s, p) for s in node_sums])  # [node, chunk, c]
        return np.concatenate([fold_rows(rows[:, j]) for j in range(p)])[:n]
    assert references is not None and total_reference is not None
    res = residuals if residuals is not None else [None] * p
    sent = np.stack([padded(node_difference(s, r, precision, e), p)
                     for s, r, e in zip(node_sums, references, res, strict=True)])
    gathered = np.concatenate([owner_sum(sent[:, j], precision) for j in range(p)])[:n]
    return decode(gathered, precision) + total_reference


# -- the leaders' group -----------------------------------------------------------------------------------------


class Leaders:
    """The gloo group of the nodes' leaders (one member per node), its sockets on this node's ``host``.

    The reduce-scatter and the all-gather are point-to-point messages among the round's active leaders (a node
    whose link is slow may sit a round out, :mod:`.collective_links`), each receive timed: after an exchange,
    :attr:`rates` holds the bytes a second at which this leader received each active peer's chunk of the
    reduce-scatter (counted from the exchange's start, which the round's flags all-reduce lines up on every
    leader; NaN for itself and for nodes out of the exchange).

    Args:
        store: the collective group's store (the leaders meet under ``prefix`` there).
        index: this leader's node index; ``count``: the number of nodes.
        host: this node's address (the gloo device listens and sends there).
        timeout_s: the longest wait of any exchange.
    """

    SCATTER, GATHER, PROBE = 1, 2, 3  # message tags (gloo's collectives use slots of their own)

    def __init__(self, store: Any, prefix: str, index: int, count: int, host: str, timeout_s: float) -> None:
        import torch.distributed as dist

        self.index, self.count = index, count
        opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # the options that take a device
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
        opts._timeout = datetime.timedelta(seconds=timeout_s)
        self.group: Any = dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), index, count, opts)
        self.rates = np.full(count, np.nan)
        self.chunk_bytes = 0  # the bytes of each chunk of the last reduce-scatter
        self.probe_s = np.nan  # seconds the last probe this leader received took (NaN: none)
        self._sending: list[tuple[Any, torch.Tensor | None]] = []  # probes sent, not yet waited for

    def add_rows(self, small: np.ndarray) -> np.ndarray:
        """``small`` (float64, one slot per member) summed over the nodes, in place."""
        self.group.allreduce([torch.from_numpy(small)]).wait()
        return small

    def _exchange(self, rows: np.ndarray, active: Sequence[int]) -> np.ndarray:
        """Reduce-scatter's transfer among the ``active`` nodes (in node order): ``rows[k]`` (this node's chunk k)
        goes to the k-th active leader; the chunk this leader owns, one row per active node in node order. Each
        receive is timed into :attr:`rates`."""
        self.finish_sends()
        me = active.index(self.index)
        got = np.empty_like(rows)
        got[me] = rows[me]
        start = time.monotonic()
        sends = [self.group.send([_bytes(rows[k])], node, self.SCATTER) for k, node in enumerate(active)
                 if node != self.index]
        self.rates[:], self.chunk_bytes = np.nan, rows[0].nbytes
        self._receive(got, active, start)
        for work in sends:
            work.wait()
        return got

    def _receive(self, into: np.ndarray, active: Sequence[int], start: float) -> None:
        """One equal-sized message from every other active leader into ``into``'s row of its node, in the order
        they arrive (each wait returns the next arrival, so each is timed into :attr:`rates` when it lands)."""
        spare = [np.empty_like(into[0]) for _ in range(len(active) - 1)]
        works = [self.group.recv_anysource([_bytes(b)], self.SCATTER) for b in spare]
        for work, buf in zip(works, spare, strict=True):
            work.wait()
            node = int(work._source_rank())
            into[active.index(node)] = buf
            self.rates[node] = buf.nbytes / max(time.monotonic() - start, 1e-9)

    def _gather(self, mine: np.ndarray, active: Sequence[int]) -> np.ndarray:
        """All-gather among the ``active`` nodes: every active leader's owned chunk, in node order."""
        out = np.empty((len(active), mine.size), dtype=mine.dtype)
        out[active.index(self.index)] = mine
        sends = [self.group.send([_bytes(mine)], node, self.GATHER) for node in active if node != self.index]
        for work in [self.group.recv([_bytes(out[k])], node, self.GATHER) for k, node in enumerate(active)
                     if node != self.index]:  # untimed: straight into each node's row
            work.wait()
        for work in sends:
            work.wait()
        return out.reshape(-1)

    def all_reduce(self, flat: np.ndarray, active: Sequence[int] | None = None) -> None:
        """``flat`` (float32: this node's sum) becomes the sum over the ``active`` nodes (None: all), in node
        order, in place."""
        active = list(range(self.count)) if active is None else list(active)
        mine = fold_rows(self._exchange(padded(flat, len(active)), active))
        flat[:] = self._gather(mine, active)[:flat.size]

    def all_reduce16(self, bits: np.ndarray, precision: str, active: Sequence[int] | None = None) -> np.ndarray:
        """This node's 16-bit difference ``bits`` exchanged for the ``active`` nodes' (None: all) summed,
        rounded differences (16-bit patterns, :func:`owner_sum`)."""
        active = list(range(self.count)) if active is None else list(active)
        mine = owner_sum(self._exchange(padded(bits, len(active)), active), precision)
        return self._gather(mine, active)[:bits.size]

    def send_probe(self, targets: Sequence[int], nbytes: int) -> None:
        """From the lowest active leader, after its exchange: a probe (a header, then ``nbytes``) to each of
        ``targets`` (the nodes out and one active node, the control). Waited for at the next exchange."""
        payload = torch.zeros(nbytes, dtype=torch.uint8)
        for node in targets:
            self._sending += [(self.group.send([torch.zeros(8, dtype=torch.uint8)], node, self.PROBE), None),
                              (self.group.send([payload], node, self.PROBE), payload)]

    def receive_probe(self, source: int, nbytes: int) -> None:
        """A probe from ``source`` (:meth:`send_probe`): the time from its header's arrival to its end into
        :attr:`probe_s` (so neither the sender's exchange nor the header's latency is counted)."""
        header, buf = torch.empty(8, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
        self.group.recv([header], source, self.PROBE).wait()
        start = time.monotonic()
        self.group.recv([buf], source, self.PROBE).wait()
        self.probe_s = time.monotonic() - start

    def finish_sends(self) -> None:
        """Wait for the probes this leader sent (their buffers are kept until then)."""
        for work, _ in self._sending:
            work.wait()
        self._sending = []

    def close(self) -> None:
        self._sending = []
        self.group = None  # its sockets close with it


def _bytes(x: np.ndarray) -> torch.Tensor:
    """``x``'s memory as a flat uint8 tensor (the exchanges only copy)."""
    return torch.from_numpy(np.ascontiguousarray(x).reshape(-1).view(np.uint8))


def named_peer(why: str, place: Place) -> str:
    """A broken exchange's message, naming the node the connection to was lost when its address tells it."""
    found = re.search(r"peer \[?([0-9a-fA-F.:]+?)\]?:\d+", why)
    addresses = place.addresses
    if found and addresses.count(found.group(1)) == 1:
        return f"the exchange with node {found.group(1)} broke: {why}"
    return f"the exchange between the nodes {', '.join(addresses)} broke: {why}"


def slice_of(n: int, rank: int, world: int) -> tuple[int, int]:
    """Member ``rank``'s share of an ``n``-long vector among ``world``: contiguous, in rank order (the last ones
    one shorter)."""
    per, extra = divmod(n, world)
    start = rank * per + min(rank, extra)
    return start, start + per + (rank < extra)


def _weight(small: np.ndarray, world: int) -> float:
    """The members' weights of a float64 row (their first ``world`` slots) added in rank order."""
    weight = 0.0
    for r in range(world):
        weight += float(small[r])
    return weight


class NodeLink:
    """A member's part in the hierarchy: its place, and on a node's leader the leaders' group and the node's
    upload residual (``error_feedback``)."""

    def __init__(self, place: Place, leaders: Leaders | None, precision: str, error_feedback: bool) -> None:
        self.place, self.leaders = place, leaders
        self.precision, self.error_feedback = precision, error_feedback
        self.residual: np.ndarray | None = None

    def my_slice(self, n: int) -> tuple[int, int]:
        """This member's slice of the node's block."""
        return slice_of(n, self.place.rank, self.place.size)

    def round(self, block: SharedBlock, small: np.ndarray, out: np.ndarray, state: GlobalState,
              layout: Sequence[tuple[str, int]], world: int, sampled: bool,
              needs_sums: Callable[[np.ndarray], bool], links: Links | None = None) -> np.ndarray:
        """One round's reduce after the members' rows and slots are in the node's ``block`` (its rows, ``small``,
        summed): the node's sum into ``out`` (each member its slice, in rank order), the leaders' exchange (the
        rows over every node; the sums, among the nodes ``links`` keeps in the round, when ``needs_sums`` of those
        rows says the round goes on), the all-node rows and sums written into the block; the all-node rows. A
        node out of the round's exchange gets the rows and, in a probe round, its leader times the probe; the sums
        in its block are then not the round's. A broken exchange marks the block broken (its members stop too)
        and raises :class:`SharedBroken` naming the node when it can."""
        start, stop = self.my_slice(out.size)
        block.reduce_slice(out, start, stop)
        block.barrier()  # the node's sum is whole
        if self.leaders is not None:
            active = list(range(self.place.nodes)) if links is None else list(links.active)
            try:
                node_weight = _weight(small, world)
                small = self.leaders.add_rows(small.copy())
                if self.place.node not in active:
                    if links is not None and links.probe and needs_sums(small):
                        self.leaders.receive_probe(active[0], links.probe)
                elif needs_sums(small):
                    self._sums(out, state, layout, node_weight, _weight(small, world), sampled, active)
                    if links is not None and links.probe:  # after the exchange: the control's link is quiet
                        if self.place.node == active[0]:
                            self.leaders.send_probe([*links.out, active[1]], links.probe)
                        elif self.place.node == active[1]:
                            self.leaders.receive_probe(active[0], links.probe)
            except Exception as exc:  # a leader died or did not answer: every node's members stop
                block.mark_broken()
                why = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
                raise SharedBroken(named_peer(why, self.place)) from exc
            block.rows[0] = small
            block.rows[1:] = 0
        block.barrier()  # the all-node sums are in the block
        return block.sum_rows()

    def _sums(self, out: np.ndarray, state: GlobalState, layout: Sequence[tuple[str, int]], node_weight: float,
              weight: float, sampled: bool, active: Sequence[int]) -> None:
        """The leaders' exchange of the node's sum ``out`` (float32, or 16-bit differences from W M) among the
        ``active`` nodes."""
        assert self.leaders is not None
        if self.precision == "fp32":
            self.leaders.all_reduce(out, active)
            return
        residual = None
        if self.error_feedback:
            if self.residual is None or self.residual.size != out.size:
                self.residual = np.zeros(out.size, dtype=np.float32)
            residual = self.residual
        bits = node_difference(out, master_times(state, layout, node_weight, sampled), self.precision, residual)
        got = self.leaders.all_reduce16(bits, self.precision, active)
        np.add(decode(got, self.precision), master_times(state, layout, weight, sampled), out=out)

    def close(self) -> None:
        if self.leaders is not None:
            self.leaders.close()
        self.leaders = None


def wire_bytes(n: int, nodes: int, precision: str = "fp32") -> int:
    """Bytes a node's link carries each way in one round's exchange of ``n`` summed values: 2 (p-1) chunks."""
    if nodes <= 1:
        return 0
    return 2 * (nodes - 1) * chunk_length(n, nodes) * (4 if precision == "fp32" else 2)

