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
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import ray

from fdam_ray.algorithms.server import PartialSum
from fdam_ray.core.state import ClientInfo, GlobalState, RoundPlan
from fdam_ray.executors.base import RoundsRun
from fdam_ray.executors.deadlines import Deadline
from fdam_ray.executors.ray_section import RayExecutorSection
from fdam_ray.features.capabilities import Capabilities

if TYPE_CHECKING:
    from fdam_ray.algorithms import Algorithm
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
        deadline: the round's deadline (:mod:`fdam_ray.executors.deadlines`), or None to wait for every actor.
        late: filled by the transport: actor index -> its call still running when the round was folded without
            it (the executor has the actor roll the round back once that call ends).
    """

    state: GlobalState
    plan: RoundPlan
    fold: Callable[[PartialSum], None]
    targets: list[int]
    work: Callable[[int], tuple[list[int], list[int]]]
    call: Callable[[int, Any], Any]
    deadline: Deadline | None = None
    late: dict[int, Any] = dataclasses.field(default_factory=dict)


class Transport(abc.ABC):
    """How rounds travel between the driver and the actors of a :class:`~fdam_ray.executors.ray.fleet.Fleet`.

    Class attributes:
        capabilities: what the transport runs and supports, its one declaration: its entry of
            :data:`~fdam_ray.features.capabilities.CAPABILITIES` (plain data the config's checks read without Ray).
        serves: the config's ``(transport, reduce)`` pair this transport runs, its name (the registry's key,
            :mod:`fdam_ray.executors.ray.transports`), from ``capabilities``.
    """

    capabilities: ClassVar[Capabilities]
    serves: ClassVar[tuple[str, str]]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.serves = cls.capabilities.serves

    def __init__(self, fleet: Fleet, config: RayExecutorSection) -> None:
        self.fleet = fleet
        self.config = config

    def started(self, algorithm: Algorithm, infos: list[ClientInfo]) -> None:  # noqa: B027 (optional hook)
        """Once the actors are set up: the federation's algorithm and the clients' infos."""

    def takes_transfer(self, precision: str, error_feedback: bool) -> bool:
        """Whether this transport rounds 16-bit transfers itself (then the executor's downlink does not round
        the state going down); the default: no, the executor's :class:`~fdam_ray.executors.transfer.Downlink`
        does."""
        return False

    def takes_deadline(self, deadline: Deadline) -> bool:
        """Whether this transport keeps ``deadline`` inside its runs of rounds (the executor then hands it runs
        of rounds); the default: no, the driver keeps it, one round at a time (:meth:`Round.collect`)."""
        return False

    def rounds_ahead(self) -> int:
        """The most rounds :meth:`run_rounds` takes in one go (1: this transport runs one round at a time)."""
        return 1

    def run_rounds(self, state: GlobalState, plans: Sequence[RoundPlan], chosen: Sequence[set[int]],
                   average: bool, *, read: bool = True) -> RoundsRun:
        """Run ``plans`` back to back (``chosen``: each round's clients), the server step on the actors; see
        :meth:`~fdam_ray.executors.base.RunsOfRounds.run_rounds`."""
        raise NotImplementedError(f"{self.capabilities.label} runs one round at a time")

    @abc.abstractmethod
    def run_round(self, round: Round) -> None:
        """Run ``round`` on its target actors and fold every partial sum (recovering failures)."""

    def recover(self, round: Round, failed: dict[int, BaseException], again: Sequence[int] = ()) -> None:
        """After a broken round: apply the failure policy to the ``failed`` actors and re-run the round's call
        on their replacements and on ``again`` (actors whose part never ran), folding what they return."""
        self.fleet.rerun(failed, round.call, round.fold, again)

    def gather(self, round: Round, refs: dict[int, Any], started: float) -> list[int]:
        """Wait for the actors' round calls ``refs`` (actor -> ref) until the round's deadline, past it until
        ``min_clients`` clients have reported (or until ``ray_timeout_s``); returns the actors whose call ended in
        time, in arrival order, and puts the others in ``round.late``. Nothing is fetched here."""
        deadline = round.deadline
        assert deadline is not None
        clients = {a: len(round.work(a)[0]) for a in refs}
        enough = min(deadline.min_clients, sum(clients.values()))
        pending = {ref: a for a, ref in refs.items()}
        arrived: list[int] = []
        times: list[float] = []
        while pending:
            now = time.monotonic() - started
            due = deadline.due(times, len(refs))
            reported = sum(clients[a] for a in arrived)
            if due is not None and reported >= enough and now >= due:
                break
            wait = self.fleet.timeout - now if due is None or reported < enough else due - now
            if wait <= 0:
                break
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=wait, fetch_local=False)
            for ref in ready:
                arrived.append(pending.pop(ref))
                times.append(time.monotonic() - started)
        round.late.update({a: ref for ref, a in pending.items()})
        return arrived

    def rest(self, took_s: float) -> None:  # noqa: B027 (optional hook)
        """Before work between rounds (scoring, checkpoints) that last took ``took_s``."""

    def close(self, end_actors: Callable[[], None]) -> None:
        """End the transport; ``end_actors`` ends the fleet's actors (called once, where the transport needs)."""
        end_actors()
