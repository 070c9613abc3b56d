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
from typing import TYPE_CHECKING, TypeVar

import numpy as np
import torch

from fdam_ray.algorithms.server import PartialSum, ServerStep
from fdam_ray.clients.late import LateSteps
from fdam_ray.core.state import GlobalState, RoundPlan, Rule, vector_names
from fdam_ray.executors.ray.transports.collective_deadline import DeadlineSpec, MemberClock, agree, started
from fdam_ray.executors.ray.transports.collective_messages import RoundShare, RunShare, state_key
from fdam_ray.executors.ray.transports.group import GroupMember

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

    def collective_round(self, state: GlobalState | None, plan: RoundPlan, client_ids: Sequence[int],
                         adopt_global_c: Sequence[int], reduce_only: bool, partial_total: float | None,
                         token: str) -> RoundShare:
        """One round under ``transport: collective``: the local round of ``client_ids`` (unless
        ``reduce_only``: the partial sum kept from this round's local round), then the group's all-reduce and
        the server step (:meth:`GroupMember.reduce`). ``state`` None: start from the state this actor holds.

        A client's error is flagged to the group first (so no member waits for this one), then raised.
        """
        member = self._member()
        start = member.state_for(state)
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
        state. Each
        member checks its slice of each new state (:meth:`GroupMember.slice_finite`) and, with ``average``
        (``reference_point: average``), sums its slice of each new v in float64 for the stage's running sum.
        Its clients' states before the run are kept, so a run that does not count can be undone
        (:meth:`undo_run`). With ``deadline`` each round's local steps are cut at it and the members agree on who
        made the round first (:meth:`_cut_round`).
        Returns the share and, from the lowest rank, the state after the last applied round (None from the
        others): two objects (the driver calls this with ``num_returns=2``), so the driver reads the share at
        once and the state when it needs it (:mod:`.pending`).
        """
        member = self._member()
        run = RunShare(rounds=[])
        current = member.state_for(state)
        self._before_run = (token, {k: c.get_state() for k, c in self.clients.items()})  # for undo_run
        start, stop = member.my_slice(current.v.size)
        ref = np.zeros(stop - start, dtype=np.float64) if average else None
        stale = False
        for plan, ids, adopt, partial_total in works:
            failure: BaseException | None = None
            self.round = plan.round
            partial = self._run_partial(current)
            late: tuple[int, ...] = ()
            if deadline is not None:
                failure, late, partial_total, broken = self._cut_round(deadline, current, plan, ids, adopt, partial,
                                                                       partial_total)
                if broken:
                    run.rounds.append(RoundShare([], broken=broken))
                    run.stop = "broken"
                    break
            else:
                try:
                    self._local_round(current, plan, ids, adopt, into=partial)
                except Exception as exc:  # a ClientError naming the client: returned once the group knows
                    failure = exc
            # reduced in place, no check-in (the driver waits for a run as a whole), no sums kept for a re-run
            share = member.reduce(None if failure is not None else partial, current, plan, partial_total, "", stale,
                                  in_place=True)
            share.late = late
            run.rounds.append(share)
            if failure is not None or share.broken:
                run.stop, run.failure = ("failed" if failure is not None else "broken"), failure
                break
            if share.stale or share.diverged:
                run.stop = "stale" if share.stale else "diverged"
                break
            assert member.held is not None
            current, run.done, run.key = member.held, run.done + 1, share.key
            if ref is not None:
                np.add(ref, current.v.reshape(-1)[start:stop], out=ref)
            stale = not member.slice_finite(current)
        run.stale = stale and not run.stop
        if run.stop:
            run.key = None
        run.ref_sum, run.ref_slice = ref, (start, stop)
        return run, (current if run.done and member.rank == 0 else None)

    def _cut_round(self, spec: DeadlineSpec, state: GlobalState, plan: RoundPlan, ids: Sequence[int],
                   adopt: Sequence[int], partial: PartialSum, partial_total: float | None
                   ) -> tuple[BaseException | None, tuple[int, ...], float | None, str]:
        """A round's local steps under the collective's deadline (:mod:`.collective_deadline`): cut at it, the
        members' flags agreed, the round run again without a deadline when too few clients made it, and
        ``partial`` made what this member sends of a cut round (zeros when late, else its clients' changes of
        c^k in a full round with control variates). Returns this member's failure, the late ranks, the round's
        partial total, and why the group broke ('' when it did not)."""
        member = self._member()
        self.keep_before(plan.round, ids, residual=False)  # what discard_round and round_changes read
        failure: BaseException | None = None
        late = False
        for again in (False, True):
            start = started()
            until = None if again else self._clock.until(spec, start)
            late, ends = False, None
            try:
                self._local_round(state, plan, ids, adopt, into=partial, until=until)
            except LateSteps as cut:  # its projected end: what its steps would have taken, at least
                late, ends = True, cut.ends
            except Exception as exc:  # a ClientError naming the client: returned once the group knows
                failure = exc
            if again:  # no deadline: every member made it
                return failure, (), partial_total, ""
            try:
                agreed = agree(member, late=late, step_s=max(started(), ends or 0.0) - start, asked=len(ids),
                               made=0 if late or failure is not None else len(ids))
            except Exception as exc:  # a member died or did not answer: the group is broken
                member.leave()
                return failure, (), partial_total, (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            self._clock.median_s = agreed.median_s
            if not agreed.rerun(spec.min_clients):
                break
            self.discard_round(plan.round)
        if not agreed.late:
            return failure, (), partial_total, ""
        if late:  # this member sits the round out: its clients as they were, its sums zeros
            self.discard_round(plan.round)
            partial.reset()
        elif not plan.partial and partial.control_variates:
            changes = self.round_changes(plan.round)  # in the order the clients were folded
            for name, x in zip(vector_names(Rule.CONTROL), changes or (), strict=False):
                getattr(partial, name).reshape(-1)[:] = x.reshape(-1)
        return failure, agreed.late, spec.total_weight if partial_total is None else partial_total, ""

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
