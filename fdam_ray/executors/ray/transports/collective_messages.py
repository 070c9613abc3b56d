"""What the driver and the members of a collective group exchange (``transport: collective``).

The server step the members apply is the driver's
(:class:`~fdam_ray.algorithms.server.ServerStep`); the key that tells whether the members hold the
driver's state (:func:`state_key`), and what a member returns from a round
(:class:`RoundShare`) and from a run of rounds (:class:`RunShare`). The
driver's side is :mod:`.collective`, a member's :mod:`.group` and
:mod:`.collective_actor`.
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from fdam_ray.algorithms.server import PartialSum
from fdam_ray.core.state import GlobalState, RoundPlan, StepStats, vector_fields

KEY_STRIDE = 997  # every this-many-th value of the long vectors enters a state's key (the short ones whole)


def state_key(state: GlobalState, stage: int) -> tuple:
    """What identifies a global state between the driver and the members: its round, iteration and stage,
    its shapes, and a CRC of its short vectors and of a strided sample of its long ones.

    The driver changes a state it got from a round only at a stage end (a new alpha, a reset c), which the
    stage in the key catches; the CRC catches a state the members never computed (a resume, a state built
    elsewhere). Equal keys: the members' copy is the driver's, and the state is not sent.
    """
    crc = 0
    shapes = []
    for f in vector_fields():
        x = getattr(state, f.name)
        shapes.append(None if x is None else x.shape)
        if x is not None:
            sample = x if x.size <= 4 * KEY_STRIDE else x[::KEY_STRIDE]
            crc = zlib.crc32(np.ascontiguousarray(sample).tobytes(), crc)
    return state.round, state.iteration, stage, tuple(shapes), crc


@dataclasses.dataclass
class RoundShare:
    """What a member returns from a round.

    Attributes:
        stats: the member's clients' step statistics (in client order).
        key: :func:`state_key` of the global state the member holds after the round (None: none held).
        total: the round's reduced sums (the lowest rank only; None on the others and on a broken round).
        broken: why the all-reduce did not complete ('' when it did).
        late: the ranks whose local steps a deadline cut (:mod:`.collective_deadline`).
    """

    stats: list[StepStats]
    key: tuple | None = None
    total: PartialSum | None = None
    broken: str = ""
    count: int = 0
    bytes_up: int = 0
    diverged: bool = False
    stale: bool = False
    late: tuple[int, ...] = ()


@dataclasses.dataclass
class RunShare:
    """What a member returns from a run of rounds (:meth:`~.collective_actor.CollectiveActor.collective_rounds`).

    Attributes:
        rounds: one share per round this member took part in (its clients' statistics, the round's client count
            and bytes); the run's first ``done`` rounds were applied, a further one is the round the run stopped in.
        done: rounds whose server step every member applied.
        stop: why the run ended before its last round: '' (it did not), ``broken`` (the all-reduce broke),
            ``failed`` (a member's local round raised), ``diverged`` (a client's update or loss was not finite:
            the round is not applied) or ``stale`` (the state after round ``done - 1`` is not finite).
        failure: this member's own error when its local round raised.
        stale: this member's slice of the state after the run's last round is not finite.
        key: :func:`state_key` of the state held after the run (None: none held, or the run stopped).
        ref_sums: with the ``average`` reference point, this member's slices of the float64 sum of v over the
            applied rounds, ``(start, stop, sum)`` (one slice, unless nodes sat out: the members in a round share v
            among themselves), else none.
        holder: the lowest rank whose node took part in the run's last round (it returns the state).
        behind: this member's node sat out a round and was not sent the state since
            (:mod:`.collective_links`); ``rejoin``: and its last probe found its link fast again.
    """

    rounds: list[RoundShare]
    done: int = 0
    stop: str = ""
    failure: BaseException | None = None
    stale: bool = False
    key: tuple | None = None
    ref_sums: list[tuple[int, int, np.ndarray]] = dataclasses.field(default_factory=list)
    holder: int = 0
    behind: bool = False
    rejoin: bool = False


def member_works(fleet: Any, members: list[int], plans: Sequence[RoundPlan], chosen: Sequence[set[int]],
                 total_weight: float) -> dict[int, list[tuple[RoundPlan, list[int], list[int], float | None]]]:
    """Each member's part of every round of a run (what the driver sends it): the plan, the member's clients in
    the round, those of them that first adopt the global c (a replacement client adopts it in its first round
    only) and a sampled round's total weight (None in a full round)."""
    works: dict[int, list[tuple[RoundPlan, list[int], list[int], float | None]]] = {a: [] for a in members}
    adopted: set[int] = set()
    for plan, clients in zip(plans, chosen, strict=True):
        for a in members:
            ids = [k for k in fleet.hosted.get(a, ()) if k in clients]
            adopt = [k for k in ids if k in fleet.adopt_global_c and k not in adopted]
            works[a].append((plan, ids, adopt, total_weight if plan.partial else None))
        adopted.update(clients)
    return works
