"""The state after a run of collective rounds, fetched when it is used, not when the run ends.

Under ``transport: collective`` every member of the group holds the global
state after a run of rounds; the driver needs it only to write a checkpoint,
at a stage end and at the end (an evaluation is scored by the actors from
the object below, :func:`held_ref`). So the lowest rank returns it as
an object of its own (the driver owns it; it sits in that member's node's
object store), and the driver gets a :class:`PendingState`: a
:class:`~fdam_ray.core.state.GlobalState` whose round, iteration and
:func:`~.collective_messages.state_key` are known at once and whose vectors
are read from the object store the first time one is read. When the run ends
where the driver may read the state (an evaluation, a checkpoint, a stage end,
the end), the pull to the driver's node starts then (``ray.wait`` with
``fetch_local``, which the raylet keeps serving after it returns), so it runs
while the next run's rounds do, instead of before them: the driver's link is
off the rounds' critical path. A run that ends where nothing reads the state
(a run of ``collective_rounds`` in the middle of an evaluation interval, a
round under a deadline) pulls nothing: a state through the lowest rank's link
would slow the next run's exchange for nothing; it hands the next run a
:class:`PendingState` whose key says the members hold it, so no state goes
down either.

If the object is lost before it is read (the lowest rank's node gone), the
state is taken from any live member that still holds a state with that key
(every member holds the same state, bit for bit); if none does, the read
raises one line naming the round.

Once read, a :class:`PendingState` becomes the plain :class:`GlobalState` it
stands for (its class is changed in place: a checkpoint or a state sent again
pickles it as one). Reading happens before any vector is used or changed, so
the members' key is only used while nothing has been read.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import ray

from fdam_ray.core.state import GlobalState, vector_names
from fdam_ray.executors.ray.transports.collective_messages import state_key

_VECTORS = frozenset(vector_names())
_OWN = ("_ref", "_key", "_fallback", "_nbytes")  # what a PendingState holds until it is read


class PendingState(GlobalState):
    """A global state whose vectors are read from the object store when first used; then a plain
    :class:`GlobalState` (the same object).

    Made by :meth:`waiting`, not by the constructor.
    """

    @classmethod
    def waiting(cls, ref: Any, key: tuple, fallback: Callable[[tuple], GlobalState | None] | None = None,
                nbytes: int | None = None, pull: bool = True) -> PendingState:
        """The state of object ``ref`` (key ``key``, from a member: round, iteration, stage, shapes, CRC); with
        ``pull``, its pull to this node starts now. ``fallback(key)``: the state from a member that holds it, or
        None; ``nbytes``: its vectors' bytes (those of the state the run started from: the same vectors), so that
        counting what a round sends reads nothing."""
        out = cls.__new__(cls)
        for name, value in zip(_OWN, (ref, key, fallback, nbytes), strict=True):
            object.__setattr__(out, name, value)
        object.__setattr__(out, "round", int(key[0]))
        object.__setattr__(out, "iteration", int(key[1]))
        if pull:
            ray.wait([ref], num_returns=1, timeout=0, fetch_local=True)  # the pull starts; the raylet keeps it going
        return out

    def __getattribute__(self, name: str) -> Any:
        if name in _VECTORS:
            object.__getattribute__(self, "_read")()
        return object.__getattribute__(self, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _VECTORS:
            self._read()  # a changed vector: the key no longer says what the members hold
        object.__setattr__(self, name, value)

    @property
    def nbytes(self) -> int:
        known = self.__dict__.get("_nbytes")
        return int(known) if known is not None else super().nbytes

    def held_key(self, stage: int) -> tuple:
        """The members' :func:`~.collective_messages.state_key` of this (unread) state at ``stage``."""
        key = self.__dict__["_key"]
        return (self.round, self.iteration, stage, *key[3:])

    def _read(self) -> None:
        """The vectors read from the object store; this object becomes a plain :class:`GlobalState`."""
        if type(self) is not PendingState:
            return
        mine = self.__dict__
        state = self._fetch(mine["_ref"])
        for name in _OWN:
            mine.pop(name, None)
        for name in _VECTORS:
            mine[name] = getattr(state, name)
        object.__setattr__(self, "__class__", GlobalState)

    def _fetch(self, ref: Any) -> GlobalState:
        try:
            state = ray.get(ref)
        except (ray.exceptions.ObjectLostError, ray.exceptions.OwnerDiedError, ray.exceptions.RayActorError) as exc:
            fallback = self.__dict__["_fallback"]
            state = fallback(self.__dict__["_key"]) if fallback is not None else None
            if state is None:
                raise RuntimeError(f"the global state after round {self.round} was lost with the node that held "
                                   f"it and no live actor holds it ({type(exc).__name__})") from exc
        if not isinstance(state, GlobalState) or (state.round, state.iteration) != (self.round, self.iteration):
            raise RuntimeError(f"the collective group's state object is not the state after round {self.round}")
        return state

    def __reduce_ex__(self, protocol: Any) -> Any:
        self._read()  # now a plain GlobalState: pickled as one
        return self.__reduce_ex__(protocol)

    def __repr__(self) -> str:
        return f"PendingState(round={self.round}, iteration={self.iteration}, unread)"


def held_ref(state: GlobalState) -> Any:
    """The object ``state`` is read from when it is an unread :class:`PendingState` (to hand to tasks and actors
    as it is), else None."""
    return state.__dict__["_ref"] if isinstance(state, PendingState) else None


def key_of(state: GlobalState, stage: int) -> tuple:
    """The :func:`~.collective_messages.state_key` of ``state`` at ``stage``: the members' own for an unread
    :class:`PendingState` (nothing is read to compute it)."""
    return state.held_key(stage) if isinstance(state, PendingState) else state_key(state, stage)


def held_by(fleet: Any) -> Callable[[tuple], GlobalState | None]:
    """A fallback for :meth:`PendingState.waiting`: the state of a key from the first of ``fleet``'s live
    actors that holds it (:meth:`~.collective_actor.CollectiveActor.held_state`), or None."""

    def find(key: tuple) -> GlobalState | None:
        for a in sorted(fleet.actors):
            try:
                found = ray.get(fleet.actors[a].held_state.remote(key), timeout=fleet.timeout)
            except ray.exceptions.RayError:
                continue
            if found is not None:
                return found
        return None

    return find
