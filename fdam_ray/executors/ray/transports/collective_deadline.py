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
class Agreement:
    """What every member reads from the round's flags (:func:`agree`).

    Attributes:
        late: the ranks whose local steps ran past the deadline.
        made: clients whose round ended in time.
        median_s: the lower median of the local-step times of the members that had clients (None: none had).
    """

    late: tuple[int, ...]
    made: int
    median_s: float | None

    def rerun(self, min_clients: int) -> bool:
        """Whether the round runs again without a deadline: someone was late and fewer than ``min_clients``
        clients made it."""
        return bool(self.late) and self.made < min_clients


def agree(member: GroupMember, *, late: bool, step_s: float, asked: int, made: int) -> Agreement:
    """The members' flags summed over the group (one float64 all-reduce of 4 numbers a member, each in its own
    slot: exact): whether this member was ``late``, its local-step time, the clients it was ``asked`` to run and
    those of them that ``made`` it. Raises when the group is broken."""
    world, rank = member.world, member.rank
    flags = np.zeros(4 * world, dtype=np.float64)
    flags[rank], flags[world + rank], flags[2 * world + rank], flags[3 * world + rank] = late, step_s, asked, made
    member.all_reduce_flags(flags)
    times = sorted(float(flags[world + r]) for r in range(world) if flags[2 * world + r] > 0)
    return Agreement(late=tuple(r for r in range(world) if flags[r] > 0), made=int(flags[3 * world:].sum()),
                     median_s=times[(len(times) + 1) // 2 - 1] if times else None)


def started() -> float:
    """The clock a member's round is timed on."""
    return time.monotonic()
