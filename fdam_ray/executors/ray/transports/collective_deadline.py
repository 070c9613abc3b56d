"""Round deadlines inside ``transport: collective``: each member cuts its own late local steps, and the members
agree on who made the round before they all-reduce.

Under the collective transport no driver waits on the round: the members reduce among themselves, so the
deadline is kept where the steps run. Each member starts its local round with a time after which no step of it
starts (:meth:`MemberClock.until`): ``round_deadline`` seconds after the member's round began, or, for a factor
``'<f>x'``, f times the lower median of the members' local-step times in the group's previous round (the first
round of a group has no deadline: nothing is known of its members yet). A member's client stops as soon as
its fastest pace says its steps cannot end by then (:mod:`fdam_ray.clients.late`: before each step after its
first), or when a step would start past it; the member then abandons its round
(:class:`~fdam_ray.clients.late.LateSteps`): its clients are put back to their states
before the round, as clients that did not take part (c^k, sampler position, moments, loss scale), and it
contributes zeros. The times are the members' local steps alone, measured by each member on its own clock; the
exchange is not part of them, so a deadline acts on slow compute, not on a slow link (where a member's steps
end in time and its link is slow, the round waits for the link).

Then every member writes a few numbers into one small float64 all-reduce (:func:`agree`): whether it was late,
its step time (a late member's projected end, at least the time it ran), how many clients it was asked to run
and how many made it. Every member reads the same sums,
so all take the same decision:

- nobody late: the round goes on as without a deadline (bit for bit: a deadline no member misses changes
  nothing);
- fewer clients made it than ``min_clients``: every member puts its clients back and runs the round again
  without a deadline (rare; the round is then a full one);
- else the round folds as a sampled round of the clients that made it (s.3b): the late members' sums are zeros,
  the means of v, alpha and BatchNorm statistics renormalise over the weight that made it, and, with control
  variates in a round every client was asked to run, each member that made it sends the weighted sum of its
  clients' changes of c^k instead of their c^k (:meth:`~fdam_ray.algorithms.drift.DriftCorrection.host_changes`,
  in its clients' order: the arithmetic of a sampled round's fold) and c moves by them over the total weight
  of all clients.

The driver records the round's participants from the clients whose statistics came back, as for the other
transports, so a run is replayed from its participation record: the collective replay runs those rounds as
sampled rounds of the recorded sets (the same folds, member by member, then the same all-reduce), which equals
the run bit for bit; a classic replay folds client by client (equal to float32 rounding).
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING

import numpy as np

from fdam_ray.executors.ray.transports.collective_links import probe_fast, slow_nodes

if TYPE_CHECKING:
    from fdam_ray.executors.deadlines import Deadline
    from fdam_ray.executors.ray.transports.group import GroupMember


@dataclasses.dataclass(frozen=True)
class DeadlineSpec:
    """What the driver sends the members with a run of rounds: the deadline (``seconds`` or ``factor``), the
    fewest clients a round needs, and the total weight of all clients (a cut full round's T)."""

    seconds: float | None
    factor: float | None
    min_clients: int
    total_weight: float

    @classmethod
    def of(cls, deadline: Deadline | None, total_weight: float) -> DeadlineSpec | None:
        if deadline is None:
            return None
        return cls(deadline.seconds, deadline.factor, deadline.min_clients, total_weight)


class MemberClock:
    """A member's side of the deadline across its group's rounds: the lower median of the members' local-step
    times in the last round (the unit of a factor deadline)."""

    def __init__(self) -> None:
        self.median_s: float | None = None

    def until(self, spec: DeadlineSpec, start: float) -> float | None:
        """The ``time.monotonic()`` time after which no local step of a round begun at ``start`` starts (None:
        no deadline this round)."""
        if spec.seconds is not None:
            return start + spec.seconds
        if spec.factor is None or self.median_s is None:
            return None
        return start + spec.factor * self.median_s


@dataclasses.dataclass(frozen=True)
class LinkReport:
    """What a member adds to a round's flags under backend ``hier`` (:mod:`.collective_links`): every rank's node,
    the number of nodes, its leader's receive rates of the last exchange and the bytes of each chunk in it (None
    and 0 on the other members), the seconds of the last probe its leader received (NaN: none), whether the member
    is behind, and the link factor."""

    node_of: tuple[int, ...]
    nodes: int
    rates: np.ndarray | None
    chunk_bytes: int
    probe_s: float
    behind: bool
    factor: float


@dataclasses.dataclass(frozen=True)
class Agreement:
    """What every member reads from the round's flags (:func:`agree`).

    Attributes:
        late: the ranks that sit the round out: their local steps ran past the deadline, or their node is out.
        made: clients whose round ended in time, on the nodes in the round.
        median_s: the lower median of the local-step times of the members in the round that had clients (None:
            none had).
        out: the nodes out of the round's exchange (:mod:`.collective_links`): behind, or their link found slow.
        probed: the nodes out whose probe of the last round is in the flags; ``fast``: those of them whose probe
            found their link fast again.
        asked: clients asked to run on the nodes in the round.
    """

    late: tuple[int, ...]
    made: int
    median_s: float | None
    out: tuple[int, ...] = ()
    probed: tuple[int, ...] = ()
    fast: tuple[int, ...] = ()
    asked: int = 0

    def rerun(self, min_clients: int) -> bool:
        """Whether the round runs again without a deadline: someone was late and fewer than ``min_clients``
        clients made it."""
        return bool(self.late) and self.made < min_clients


def agree(member: GroupMember, *, late: bool, step_s: float, asked: int, made: int,
          links: LinkReport | None = None, min_clients: int = 1) -> Agreement:
    """The members' flags summed over the group (one float64 all-reduce of 4 numbers a member, each in its own
    slot: exact): whether this member was ``late``, its local-step time, the clients it was ``asked`` to run and
    those of them that ``made`` it; with ``links``, whether it is behind, and its leader's receive rates and
    probe time (a node's leader alone writes its node's slots), from which every member reads the same nodes
    out and fast again (:func:`_links_read`). Raises when the group is broken."""
    world, rank = member.world, member.rank
    p = links.nodes if links is not None else 0
    flags = np.zeros(4 * world + (world + p * p + 2 * p if links is not None else 0), dtype=np.float64)
    flags[rank], flags[world + rank], flags[2 * world + rank], flags[3 * world + rank] = late, step_s, asked, made
    if links is not None:
        _links_write(flags, links, world, rank)
    member.all_reduce_flags(flags)
    out: set[int] = set()
    probed: tuple[int, ...] = ()
    fast: tuple[int, ...] = ()
    if links is not None:
        out, probed, fast = _links_read(flags, links, world, min_clients)
    ins = [r for r in range(world) if links is None or links.node_of[r] not in out]
    times = sorted(float(flags[world + r]) for r in ins if flags[2 * world + r] > 0)
    return Agreement(late=tuple(r for r in range(world) if flags[r] > 0 or r not in ins),
                     made=int(sum(flags[3 * world + r] for r in ins)),
                     median_s=times[(len(times) + 1) // 2 - 1] if times else None, out=tuple(sorted(out)),
                     probed=probed, fast=fast, asked=int(sum(flags[2 * world + r] for r in ins)))


def _links_write(flags: np.ndarray, links: LinkReport, world: int, rank: int) -> None:
    """A member's link slots: its behind flag; on a node's leader, the node's rates row, probe time and chunk
    bytes (after the 5 slots a member: p x p rates, p probe times, p chunk sizes)."""
    p, node = links.nodes, links.node_of[rank]
    flags[4 * world + rank] = links.behind
    if links.rates is not None:
        flags[5 * world + node * p:5 * world + (node + 1) * p] = np.nan_to_num(links.rates, nan=0.0)
        flags[5 * world + p * p + node] = 0.0 if np.isnan(links.probe_s) else links.probe_s
        flags[5 * world + p * p + p + node] = links.chunk_bytes


def _links_read(flags: np.ndarray, links: LinkReport, world: int, min_clients: int
                ) -> tuple[set[int], tuple[int, ...], tuple[int, ...]]:
    """From the summed flags: the nodes out (behind, or found slow by
    :func:`~.collective_links.slow_nodes` while ``min_clients`` clients made it without them), those of them
    probed, and those whose probe found them fast (:func:`~.collective_links.probe_fast`)."""
    p = links.nodes
    out = {links.node_of[r] for r in range(world) if flags[4 * world + r] > 0}
    rates = flags[5 * world:5 * world + p * p].reshape(p, p)
    made_on = [0.0] * p
    for r in range(world):
        made_on[links.node_of[r]] += flags[3 * world + r]
    made_in = sum(made_on[n] for n in range(p) if n not in out)
    chunk = float(flags[5 * world + p * p + p:].max())
    for n in slow_nodes(rates, [n for n in range(p) if n not in out], links.factor, chunk):
        if made_in - made_on[n] >= min_clients:
            out.add(n)
            made_in -= made_on[n]
    probes = flags[5 * world + p * p:5 * world + p * p + p]
    probed = tuple(n for n in sorted(out) if probes[n] > 0)
    control = min((float(probes[n]) for n in range(p) if n not in out and probes[n] > 0), default=float("nan"))
    return out, probed, tuple(n for n in probed if probe_fast(float(probes[n]), control, links.factor))


def started() -> float:
    """The clock a member's round is timed on."""
    return time.monotonic()
