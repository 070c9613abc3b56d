"""What the members of ``transport: collective`` reduce each round, and the server step on a member's slice of it.

Two buffers per round (:mod:`.group`): a small float64 row (:func:`member_row`)
in which each member writes its own slots (its weight, client count, bytes, a
failure flag, a divergence flag, a stale-state flag, then its integer buffers;
sums of one non-zero term per slot, so exact), and the summed vectors (v,
alpha, BatchNorm statistics, control variates; every vector but those
combined by max) laid end to end in one float32 buffer (:func:`layout`,
:func:`pack`). :func:`reduced_sums` reads both back as the round's
:class:`~fdam_ray.algorithms.server.PartialSum`; :func:`finish_slice` applies
the server step to one member's slice of it (backend ``shm``).
"""

from __future__ import annotations

import math

import numpy as np

from fdam_ray.algorithms.server import PartialSum, ServerStep
from fdam_ray.core.state import GlobalState, Rule, vector_fields

SLOTS = 6  # float64 slots per member before its integer buffers: weight, count, bytes, failed, diverged
# (a client's update or loss not finite), stale (the state this round started from is not finite)


def layout(state: GlobalState) -> list[tuple[str, int]]:
    """The summed vectors of a round from ``state`` (name, length), in the flat buffer's order."""
    out = []
    for f in vector_fields():
        rule = f.metadata["rule"]
        if rule is Rule.MAX:
            continue
        like = getattr(state, f.metadata["corrects"]) if rule is Rule.CONTROL else getattr(state, f.name)
        if rule is Rule.CONTROL and state.c_v is None:
            continue
        out.append((f.name, int(like.size)))
    return out


def pack(mine: PartialSum, order: list[tuple[str, int]], into: np.ndarray) -> None:
    """Copy ``mine``'s summed vectors end to end into ``into``, in ``order`` (a :func:`layout`)."""
    at = 0
    for name, n in order:
        into[at:at + n] = getattr(mine, name).reshape(-1)
        at += n


def is_buffer(x: np.ndarray | None, buffer: np.ndarray) -> bool:
    """Whether ``x`` is exactly ``buffer`` (same start, same length)."""
    return x is not None and x.size == buffer.size and x.ctypes.data == buffer.ctypes.data


def member_row(mine: PartialSum | None, rank: int, world: int, counters: int, stale: bool) -> np.ndarray:
    """The small row with member ``rank``'s slots filled in (``mine`` None: this member failed, it flags that
    and contributes nothing)."""
    small = np.zeros(world * (SLOTS + counters), dtype=np.float64)
    if mine is None:
        small[3 * world + rank] = 1.0
    else:
        small[rank], small[world + rank], small[2 * world + rank] = mine.weight, mine.count, mine.bytes_up
        small[4 * world + rank] = not all(s.finite and math.isfinite(s.loss) for s in mine.stats)
        small[SLOTS * world + rank * counters:SLOTS * world + (rank + 1) * counters] = mine.counters
    small[5 * world + rank] = stale
    return small


def reduced_sums(flat: np.ndarray, order: list[tuple[str, int]], small: np.ndarray, state: GlobalState,
                 world: int) -> PartialSum:
    """The reduced sums as a partial sum (views of ``flat``), weights added in rank order (the driver's order of
    folding the actors' sums)."""
    counters = state.counters.size
    vectors: dict[str, np.ndarray | None] = dict.fromkeys(f.name for f in vector_fields())
    shaped_as = {f.name: f.metadata["corrects"] or f.name for f in vector_fields()}  # c: as what it corrects
    at = 0
    for name, n in order:
        like = getattr(state, shaped_as[name])
        vectors[name] = flat[at:at + n].reshape(like.shape)
        at += n
    rows = small[SLOTS * world:].reshape(world, counters)
    vectors["counters"] = np.maximum(rows.max(axis=0), 0).astype(np.int64).reshape(state.counters.shape) \
        if counters else np.zeros_like(state.counters, dtype=np.int64)
    weight = 0.0
    for r in range(world):
        weight += float(small[r])
    return PartialSum.from_vectors(vectors, weight=weight, count=int(small[world:2 * world].sum()),
                                   bytes_up=int(small[2 * world:3 * world].sum()), stats=[])


def finish_slice(step: ServerStep, state: GlobalState, total: PartialSum, order: list[tuple[str, int]], start: int,
                 stop: int, steps: int, partial_total: float | None) -> GlobalState:
    """The server step on a member's slice ``start:stop`` of the summed vectors, in ``total``'s buffers (the step
    is elementwise; its scalars come from the whole round's weights); the new global state: views of ``total``'s
    buffers, whole once every member has finished its slice."""
    spans, at = {}, 0
    for name, n in order:
        spans[name] = (min(max(start - at, 0), n), min(max(stop - at, 0), n))
        at += n
    sums: dict[str, np.ndarray | None] = {}
    prev: dict[str, np.ndarray | None] = {}
    for f in vector_fields():
        x, p = getattr(total, f.name), getattr(state, f.name)
        if f.name in spans and x is not None:
            lo, hi = spans[f.name]
            sums[f.name] = x.reshape(-1)[lo:hi]
            prev[f.name] = None if p is None else p.reshape(-1)[lo:hi]
        else:
            sums[f.name], prev[f.name] = x, p
    part = PartialSum.from_vectors(sums, weight=total.weight, count=total.count, bytes_up=total.bytes_up)
    done = step.apply(GlobalState.from_vectors(prev, round=state.round, iteration=state.iteration), part,
                      steps, partial_total, in_place=True)
    whole = {f.name: None if getattr(done, f.name) is None else getattr(total, f.name) for f in vector_fields()}
    return GlobalState.from_vectors(whole, round=done.round, iteration=done.iteration)
