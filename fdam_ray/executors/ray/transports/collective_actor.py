"""The actor's side of ``transport: collective``: its place in the actors' group and its rounds in it.

A part of the actor shell (:class:`~fdam_ray.executors.ray.actor.ClientShell`
inherits it). The driver's side is :mod:`.collective`; the group's
all-reduce and server step are the actor's :class:`~.group.GroupMember`.
Remote methods: :meth:`CollectiveActor.open_group` and
:meth:`CollectiveActor.join_group` (build the group),
:meth:`CollectiveActor.collective_round` (one round a call),
:meth:`CollectiveActor.collective_rounds` (a run of rounds a call),
:meth:`CollectiveActor.undo_run` (a run that does not count) and
:meth:`CollectiveActor.held_state` (the held state, when the copy a run
returned was lost).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import torch

from fdam_ray.algorithms.server import PartialSum, ServerStep
from fdam_ray.clients.late import LateSteps
from fdam_ray.core.state import GlobalState, RoundPlan, Rule, vector_names
from fdam_ray.executors.ray.transports.collective_deadline import (
    Agreement,
    DeadlineSpec,
    LinkReport,
    MemberClock,
    agree,
    started,
)
from fdam_ray.executors.ray.transports.collective_links import Links, link_factor
from fdam_ray.executors.ray.transports.collective_messages import RoundShare, RunShare, state_key
from fdam_ray.executors.ray.transports.group import GroupMember
from fdam_ray.executors.ray.transports.hierarchy import Place, slice_of

if TYPE_CHECKING:
    from fdam_ray.clients.client import Client
    from fdam_ray.executors.transfer import Broadcast, CompressedSum

T = TypeVar("T")


class CollectiveActor:
    """The collective transport's part of an actor: its group member, its kept partial sums, and its clients'
    states before a run of rounds."""

    actor: int
    round: int
    device: torch.device
    clients: dict[int, Client]
    _partial: PartialSum | None

    if TYPE_CHECKING:  # the shell's, which this part calls
        def local_round(self, state: GlobalState | Broadcast, plan: RoundPlan, client_ids: Sequence[int],
                        adopt_global_c: Sequence[int] = (), undoable: bool = False) -> PartialSum | CompressedSum:
            ...

        def _local_round(self, state: GlobalState, plan: RoundPlan, client_ids: Sequence[int],
                         adopt_global_c: Sequence[int], into: PartialSum | None = None,
                         until: float | None = None) -> PartialSum:
            ...

        def _each(self, action: str, ids: Sequence[int], fn: Callable[[Client], T]) -> list[T]:
            ...

        def keep_before(self, round_index: int, client_ids: Sequence[int], residual: bool) -> None:
            ...

        def discard_round(self, round_index: int) -> list[int]:
            ...

        def round_changes(self, round_index: int) -> tuple[np.ndarray, ...] | None:
            ...

    def _start_collective(self) -> None:
        """Set up this part (from the shell's ``__init__``)."""
        self._group: GroupMember | None = None  # this actor's place in the group
        self._partial_round = -1  # the round self._partial holds (kept for a re-run)
        # runs of rounds: two flat partial sums used in turn (each round's state lives in one)
        self._run_partials: list[PartialSum | None] = [None, None]
        self._before_run: tuple[str, dict] = ("", {})  # clients' states before a run of rounds
        self._clock = MemberClock()  # round_deadline: the members' last median step time
        # backend hier under a deadline (:mod:`.collective_links`): this member's node sat out a round since it was
        # last sent the state (its held state is behind); its node's last probe found the link fast again
        self._behind, self._fast = False, False

    def _member(self) -> GroupMember:
        if self._group is None:
            self._group = GroupMember(self.device)
        return self._group

    def _run_partial(self, state: GlobalState) -> PartialSum:
        """Where a round of a run of rounds folds its clients' updates: one of two flat partial sums, the one
        whose buffer does not hold ``state`` (each round's new state is finished in its own partial sum's
        buffer, :meth:`GroupMember.reduce` with ``in_place``); under backend ``shm``, the member's slot of the
        group's block (the new state is then held in the block)."""
        slot = self._member().run_partial(state)
        if slot is not None:
            return slot
        for i, kept in enumerate(self._run_partials):
            if kept is not None and not kept.fits(state):
                self._run_partials[i] = None
        for i, kept in enumerate(self._run_partials):
            if kept is None:
                kept = self._run_partials[i] = PartialSum.zeros(state, control_variates=state.c_v is not None,
                                                                flat=True)
            if not np.may_share_memory(kept.v, state.v):
                return kept
        raise AssertionError("both run partial sums hold the state")  # two buffers, one state: unreachable

    def open_group(self, host: str, timeout_s: float) -> int:
        """As the lowest rank of a new collective group: serve its store on ``host``; the port."""
        return self._member().open(host, timeout_s)

    def join_group(self, host: str, port: int, rank: int, world: int, backend: str, timeout_s: float,
                   step: ServerStep | None) -> None:
        """Join the collective group whose store is at ``host:port`` as ``rank`` of ``world``."""
        self._member().join(host, port, rank, world, backend, timeout_s, step)
        self._behind, self._fast = False, False

    def collective_round(self, state: GlobalState | None, plan: RoundPlan, client_ids: Sequence[int],
                         adopt_global_c: Sequence[int], reduce_only: bool, partial_total: float | None,
                         token: str) -> RoundShare:
        """One round under ``transport: collective``: the local round of ``client_ids`` (unless
        ``reduce_only``: the partial sum kept from this round's local round), then the group's all-reduce and
        the server step (:meth:`GroupMember.reduce`). ``state`` None: start from the state this actor holds.

        A client's error is flagged to the group first (so no member waits for this one), then raised.
        """
        member = self._member()
        start = self._start_state(state)
        failure: BaseException | None = None
        if not reduce_only:
            try:
                self.local_round(start, plan, client_ids, adopt_global_c)
                self._partial_round = plan.round
            except Exception as exc:  # a ClientError naming the client: raised after the group knows
                failure = exc
        elif self._partial_round != plan.round or self._partial is None:
            failure = RuntimeError(f"actor {self.actor} holds no partial sum of round {plan.round} to reduce")
        share = member.reduce(None if failure is not None else self._partial, start, plan, partial_total, token)
        if failure is not None:
            raise failure
        return share

    def collective_rounds(self, state: GlobalState | None,
                          works: Sequence[tuple[RoundPlan, Sequence[int], Sequence[int], float | None]], token: str,
                          average: bool, deadline: DeadlineSpec | None = None) -> tuple[RunShare, GlobalState | None]:
        """A run of rounds under ``transport: collective`` with no call between them: for each of ``works``
        (plan, this actor's clients in the round, those of them that first adopt the global c, a sampled round's
        total weight or None) the local round, the group's all-reduce and the server step, as
        :meth:`collective_round` does for one round. ``state`` None: start from the state this actor holds.

        The run stops at the first round that does not go through, on every member at the same round (the
        reasons travel in the all-reduce): a failed local round (its error is in the share, not raised; the
        driver then has the run undone), a broken all-reduce, a client's non-finite update, or a non-finite
        state. Each member checks its slice of each new state (:meth:`GroupMember.slice_finite`) and, with
        ``average`` (``reference_point: average``), sums its slice of each new v in float64 for the stage's
        running sum; in a round with a node out (:mod:`.collective_links`) the members of the nodes in it share v
        among themselves (the share returns one sum per slice).
        Its clients' states before the run are kept, so a run that does not count can be undone
        (:meth:`undo_run`). With ``deadline`` each round's local steps are cut at it and the members agree on who
        made the round first (:meth:`_cut_round`).
        Returns the share and, from the lowest rank, the state after the last applied round (None from the
        others): two objects (the driver calls this with ``num_returns=2``), so the driver reads the share at
        once and the state when it needs it (:mod:`.pending`).
        """
        member = self._member()
        run = RunShare(rounds=[])
        current = self._start_state(state, deadline is not None)
        links = self._links_on(deadline)
        self._before_run = (token, {k: c.get_state() for k, c in self.clients.items()})  # for undo_run
        ref: dict[tuple[int, int], np.ndarray] | None = {} if average else None  # (start, stop) -> float64 sum
        stale = False
        for plan, ids, adopt, partial_total in works:
            failure: BaseException | None = None
            self.round = plan.round
            partial = self._run_partial(current)
            late: tuple[int, ...] = ()
            round_links: Links | None = None
            if deadline is not None:
                failure, late, partial_total, broken, round_links = self._cut_round(
                    deadline, current, plan, ids, adopt, partial, partial_total, links)
                if broken:
                    run.rounds.append(RoundShare([], broken=broken))
                    run.stop = "broken"
                    break
            else:
                failure = self._steps(current, plan, ids, adopt, partial, None)[2]
            # reduced in place, no check-in (the driver waits for a run as a whole), no sums kept for a re-run
            share = member.reduce(None if failure is not None else partial, current, plan, partial_total, "", stale,
                                  in_place=True, links=round_links)
            share.late = late
            run.rounds.append(share)
            if failure is not None or share.broken:
                run.stop, run.failure = ("failed" if failure is not None else "broken"), failure
                break
            if share.stale or share.diverged:
                run.stop = "stale" if share.stale else "diverged"
                break
            ins = self._holding(round_links)
            run.holder = ins[0]
            assert member.held is not None
            current, run.done, run.key = member.held, run.done + 1, share.key
            stale = self._check_and_sum(current, ins, ref)
        run.stale = stale and not run.stop
        run.behind, run.rejoin = self._behind, self._behind and self._fast
        if run.stop:
            run.key = None
        run.ref_sums = [] if ref is None else [(a, b, x) for (a, b), x in ref.items()]
        return run, (current if run.done and member.rank == run.holder else None)

    def _holding(self, links: Links | None) -> list[int]:
        """The ranks holding a round's new state, in rank order: those of the nodes in ``links`` (all without)."""
        member = self._member()
        place = member.nodes.place if member.nodes is not None else None
        if links is None or place is None:
            return list(range(member.world))
        return [r for r, n in enumerate(place.node_of) if n in links.active]

    def _check_and_sum(self, state: GlobalState, ins: list[int], ref: dict[tuple[int, int], np.ndarray] | None
                       ) -> bool:
        """After an applied round: this member's share of v among the members holding ``state`` (``ins``) checked
        (:meth:`GroupMember.slice_finite`; alpha and the buffers on the first of them) and, with ``ref``, added to
        its float64 running sum of that slice; whether the share is not finite (False: none held)."""
        member = self._member()
        if member.rank not in ins:
            return False
        start, stop = slice_of(state.v.size, ins.index(member.rank), len(ins))
        if ref is not None and stop > start:
            kept = ref.setdefault((start, stop), np.zeros(stop - start, dtype=np.float64))
            np.add(kept, state.v.reshape(-1)[start:stop], out=kept)
        return not member.slice_finite(state, (start, stop), member.rank == ins[0])

    def _steps(self, state: GlobalState, plan: RoundPlan, ids: Sequence[int], adopt: Sequence[int],
               partial: PartialSum, until: float | None) -> tuple[bool, float | None, BaseException | None]:
        """A round's local steps into ``partial`` (stopped at ``until``): whether a deadline cut them, their
        projected end then, and a client's error (returned, raised once the group knows)."""
        try:
            self._local_round(state, plan, ids, adopt, into=partial, until=until)
        except LateSteps as stopped:  # its projected end: what its steps would have taken, at least
            return True, stopped.ends, None
        except Exception as exc:  # a ClientError naming the client
            return False, None, exc
        return False, None, None

    def _start_state(self, given: GlobalState | None, may_sit_out: bool = False) -> GlobalState:
        """A call's starting state: the one sent (this member is then current again), else the one held; a
        member behind (:mod:`.collective_links`) that was sent none goes on sitting out, in a run under a
        deadline only."""
        if given is not None:
            self._behind, self._fast = False, False
        elif self._behind and not may_sit_out:
            raise RuntimeError(f"actor {self.actor} holds a state behind the group's and was sent none")
        return self._member().state_for(given)

    def _links_on(self, deadline: DeadlineSpec | None) -> Place | None:
        """This member's place when its node may sit out for a slow link in this run (backend hier over three
        nodes or more, a deadline, no 16-bit residuals), else None."""
        nodes = self._member().nodes
        if deadline is None or nodes is None or nodes.place.nodes < 3 or nodes.error_feedback:
            return None
        return nodes.place

    def _link_report(self, place: Place | None, spec: DeadlineSpec) -> LinkReport | None:
        """What this member writes of the links into the round's flags; its leader's measures are then cleared."""
        if place is None:
            return None
        nodes = self._member().nodes
        leaders = nodes.leaders if nodes is not None else None
        report = LinkReport(place.node_of, place.nodes, None if leaders is None else leaders.rates.copy(),
                            0 if leaders is None else leaders.chunk_bytes,
                            float("nan") if leaders is None else leaders.probe_s, self._behind,
                            link_factor(spec.factor))
        if leaders is not None:
            leaders.rates[:], leaders.probe_s = np.nan, float("nan")
        return report

    def _cut_round(self, spec: DeadlineSpec, state: GlobalState, plan: RoundPlan, ids: Sequence[int],
                   adopt: Sequence[int], partial: PartialSum, partial_total: float | None, place: Place | None
                   ) -> tuple[BaseException | None, tuple[int, ...], float | None, str, Links | None]:
        """A round's local steps under the collective's deadline (:mod:`.collective_deadline`): cut at it, the
        members' flags agreed, the round run again without a deadline when too few clients made it, and
        ``partial`` made what this member sends of a cut round (zeros when late or its node is out, else its
        clients' changes of c^k in a full round with control variates). A member behind runs no steps
        (:mod:`.collective_links`, with ``place``). Returns this member's failure, the ranks that sit the round
        out, the round's partial total, why the group broke ('' when it did not) and the round's leaders'
        exchange (None: every node, no link measured)."""
        member = self._member()
        failure: BaseException | None = None
        late, ran = False, not self._behind
        self._keep_before(plan.round, ids)
        for again in (False, True):
            start = started()
            until = None if again else self._clock.until(spec, start)
            late, ends = False, None
            if ran:
                late, ends, failure = self._steps(state, plan, ids, adopt, partial, until)
            if again:  # no deadline: every member of a node in the round made it
                break
            made = 0 if late or failure is not None or not ran else len(ids)
            agreed, broken = self._agree(spec, place, plan.round, late=late,
                                         step_s=max(started(), ends or 0.0) - start, asked=len(ids), made=made)
            if broken:
                return failure, (), partial_total, broken, None
            if not agreed.rerun(spec.min_clients):
                break
            if ran:
                self.discard_round(plan.round)
        links = None if place is None else self._note_links(agreed, place, plan.round)
        cut = agreed.late
        if again:  # a rerun: every member of a node in the round made it
            cut = tuple(r for r, n in enumerate(place.node_of) if n in agreed.out) if place is not None else ()
        if not cut:
            return failure, (), partial_total, "", links
        if member.rank in cut:  # this member sits the round out: its clients as they were, its sums zeros
            if ran:
                self.discard_round(plan.round)
            partial.reset()
        elif not plan.partial and partial.control_variates:
            changes = self.round_changes(plan.round)  # in the order the clients were folded
            for name, x in zip(vector_names(Rule.CONTROL), changes or (), strict=False):
                getattr(partial, name).reshape(-1)[:] = x.reshape(-1)
        return failure, cut, spec.total_weight if partial_total is None else partial_total, "", links

    def _keep_before(self, round_index: int, ids: Sequence[int]) -> None:
        """Keep the clients' states before the round, which discard_round and round_changes read (not on a member
        behind: it runs no steps, so nothing is put back)."""
        if not self._behind:
            self.keep_before(round_index, ids, residual=False)

    def _agree(self, spec: DeadlineSpec, place: Place | None, round_index: int, **flags: Any
               ) -> tuple[Agreement, str]:
        """The round's flags agreed (:func:`~.collective_deadline.agree`, ``flags``: this member's), the clock's
        median kept; and why the group broke ('' when it did not: a member died or did not answer, or a rerun
        needs more clients than the nodes holding the state have)."""
        member = self._member()
        try:
            agreed = agree(member, **flags, links=self._link_report(place, spec), min_clients=spec.min_clients)
        except Exception as exc:  # a member died or did not answer: the group is broken
            member.leave()
            return Agreement((), 0, None), (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        self._clock.median_s = agreed.median_s
        if agreed.rerun(spec.min_clients) and agreed.out and agreed.asked < spec.min_clients:
            member.leave()
            return agreed, (f"round {round_index}: {agreed.asked} clients on the nodes holding the state, fewer "
                            f"than min_clients={spec.min_clients}")
        return agreed, ""

    def _note_links(self, agreed: Agreement, place: Place, round_index: int) -> Links:
        """This member's node out of the round (it is then behind) or probed fast again, from the agreement;
        the round's leaders' exchange."""
        if place.node in agreed.probed:
            self._fast = place.node in agreed.fast
        if place.node in agreed.out:
            self._behind = True
        return Links.of(place.nodes, agreed.out, round_index)

    def held_state(self, key: tuple) -> GlobalState | None:
        """The global state this actor holds when its :func:`~.collective_messages.state_key` is ``key`` (the
        state after a run whose returned copy was lost), else None."""
        held = self._group.held if self._group is not None else None
        if held is None or state_key(held, key[2]) != key:
            return None
        return held

    def undo_run(self, token: str) -> list[int]:
        """The run of rounds ``token`` does not count (a member failed in it): this actor's clients go back to
        their states before it (c^k, sampler position, moments, loss scale), as if it had not run. Returns the
        clients put back."""
        kept_token, before = self._before_run
        if kept_token != token:
            return []
        self._each("undo_run", list(before), lambda c: c.set_state(before[c.client_id]))
        self._before_run = ("", {})
        return sorted(before)
