"""What the driver and the members of a collective group exchange (``transport: collective``).

The server step the members apply (:class:`ServerStep`, the driver's
reducer's settings), the key that tells whether the members hold the
driver's state (:func:`state_key`), and what a member returns from a round
(:class:`RoundShare`) and from a run of rounds (:class:`RunShare`). The
driver's side is :mod:`.collective`, a member's :mod:`.group` and
:mod:`.collective_actor`.
"""

from __future__ import annotations

import dataclasses
import zlib

import numpy as np

from fdam_ray.algorithms.server import PartialSum, RoundReducer
from fdam_ray.state import GlobalState, Rule, StepStats, vector_fields

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


@dataclasses.dataclass(frozen=True)
class ServerStep:
    """The server step the members apply after the all-reduce: the driver's reducer's settings."""

    global_lr: float
    alpha_nonnegative: bool
    control_variates: bool

    def apply(self, previous: GlobalState, total: PartialSum, steps: int, partial_total: float | None,
              into: PartialSum | None = None, in_place: bool = False) -> GlobalState:
        """The new global state from the round's reduced sums, as the driver's reducer computes it (which folds
        them into zeros: ``0 + x``, written here into ``into``'s buffers when their shapes match, so a round
        allocates no state-sized buffer; the returned state's vectors are then those buffers).

        ``in_place``: the state is finished in ``total``'s own buffers, with no ``0 + x`` pass. The same bits:
        the sums hold no -0.0 (each member's partial sum starts from +0.0 and +0.0 + -0.0 is +0.0; a sum of
        terms none of which is -0.0 is never -0.0), the one value ``0 + x`` changes."""
        def reducer(sums: PartialSum | None = None) -> RoundReducer:
            return RoundReducer(previous, global_lr=self.global_lr, alpha_nonnegative=self.alpha_nonnegative,
                                control_variates=self.control_variates, partial_total=partial_total, sums=sums)

        if in_place:
            return reducer(total).finish(steps=steps)
        if into is None or not same_shapes(into, total):
            folding = reducer()
            folding.fold(total)
            return folding.finish(steps=steps)
        for f in vector_fields():
            x, out = getattr(total, f.name), getattr(into, f.name)
            if x is not None:
                (np.maximum if f.metadata["rule"] is Rule.MAX else np.add)(x, x.dtype.type(0), out=out)
        into.weight, into.count, into.bytes_up, into.stats = 0.0 + total.weight, total.count, total.bytes_up, []
        return reducer(into).finish(steps=steps)  # no zeros made to fold into


def same_shapes(a: PartialSum, b: PartialSum) -> bool:
    return all((x is None and y is None) or (x is not None and y is not None and x.shape == y.shape
                                             and x.dtype == y.dtype)
               for x, y in zip(a.vectors().values(), b.vectors().values(), strict=True))


@dataclasses.dataclass
class RoundShare:
    """What a member returns from a round.

    Attributes:
        stats: the member's clients' step statistics (in client order).
        key: :func:`state_key` of the global state the member holds after the round (None: none held).
        total: the round's reduced sums (the lowest rank only; None on the others and on a broken round).
        broken: why the all-reduce did not complete ('' when it did).
    """

    stats: list[StepStats]
    key: tuple | None = None
    total: PartialSum | None = None
    broken: str = ""
    count: int = 0
    bytes_up: int = 0
    diverged: bool = False
    stale: bool = False


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
        key: :func:`state_key` of the state held after the run (None: none held).
        state: that state (the lowest rank only).
        ref_sum: with the ``average`` reference point, this member's slice of the float64 sum of v over the
            applied rounds, else None.
        ref_slice: (start, stop) of that slice in v.
    """

    rounds: list[RoundShare]
    done: int = 0
    stop: str = ""
    failure: BaseException | None = None
    stale: bool = False
    key: tuple | None = None
    state: GlobalState | None = None
    ref_sum: np.ndarray | None = None
    ref_slice: tuple[int, int] = (0, 0)
