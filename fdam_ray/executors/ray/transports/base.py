"""The interface every transport implements: how a round's state reaches the actors and their sums come back.

A transport runs a round over the fleet's actors (:meth:`Transport.run_round`),
recovers a round that broke (:meth:`Transport.recover`: the failure policy on
the failed actors, then their calls re-run on the replacements), rests between
rounds (:meth:`Transport.rest`, before scoring or checkpoints) and ends with
the actors (:meth:`Transport.close`). Transports differ in how the state goes
out and the partial sums come back; what a round computes and the order sums
are folded in are theirs to keep equal (see each transport's docstring).
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from fdam_ray.algorithms.server import PartialSum
from fdam_ray.executors.ray_section import RayExecutorSection
from fdam_ray.state import ClientInfo, GlobalState, RoundPlan

if TYPE_CHECKING:
    from fdam_ray.executors.ray.fleet import Fleet


@dataclasses.dataclass
class Round:
    """One round as the executor hands it to a transport.

    Attributes:
        state: the global state the round starts from.
        plan: the round's plan.
        fold: the driver's fold, called once per partial sum.
        targets: the actors that host a client of the round (an actor with none is not called).
        work: actor index -> its clients in this round and those of them that first adopt the global c (asked
            at call time, so a replacement adopts it).
        call: the round as a classic call on one actor (the first such call puts the state in the object store).
    """

    state: GlobalState
    plan: RoundPlan
    fold: Callable[[PartialSum], None]
    targets: list[int]
    work: Callable[[int], tuple[list[int], list[int]]]
    call: Callable[[int, Any], Any]


class Transport(abc.ABC):
    """How rounds travel between the driver and the actors of a :class:`~fdam_ray.executors.ray.fleet.Fleet`.

    Class attributes:
        name: the transport's name in the registry (:mod:`fdam_ray.executors.ray.transports`).
        serves: the config's ``(transport, reduce)`` pair this transport runs.
    """

    name: ClassVar[str]
    serves: ClassVar[tuple[str, str]]

    def __init__(self, fleet: Fleet, config: RayExecutorSection) -> None:
        self.fleet = fleet
        self.config = config

    def started(self, config: Any, infos: list[ClientInfo]) -> None:  # noqa: B027 (optional hook)
        """Once the actors are set up: the run's whole ``config`` and the clients' infos."""

    @abc.abstractmethod
    def run_round(self, round: Round) -> None:
        """Run ``round`` on its target actors and fold every partial sum (recovering failures)."""

    def recover(self, round: Round, failed: dict[int, BaseException], again: Sequence[int] = ()) -> None:
        """After a broken round: apply the failure policy to the ``failed`` actors and re-run the round's call
        on their replacements and on ``again`` (actors whose part never ran), folding what they return."""
        self.fleet.rerun(failed, round.call, round.fold, again)

    def rest(self, took_s: float) -> None:  # noqa: B027 (optional hook)
        """Before work between rounds (scoring, checkpoints) that last took ``took_s``."""

    def close(self, end_actors: Callable[[], None]) -> None:
        """End the transport; ``end_actors`` ends the fleet's actors (called once, where the transport needs)."""
        end_actors()
