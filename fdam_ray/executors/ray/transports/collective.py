"""``transport: collective``: the actors all-reduce their partial sums among themselves, as the paper's code does.

The fleet's actors form one collective group (``torch.distributed``: NCCL when every actor holds a GPU of its own,
NCCL taking one rank per GPU; else, with ``collective_backend: auto`` and every actor on one node, backend ``shm``:
a shared-memory block, :mod:`.shared`; with the actors on several nodes, backend ``hier``: a block per node and one
leader per node reducing with the other nodes' leaders, :mod:`.hierarchy`; else gloo), built once per set of actors
and built again when that set changes (a replacement, a dropped actor, a lost node). A round is one call per actor:
its local round, then :meth:`~fdam_ray.executors.ray.transports.group.GroupMember.reduce`: the all-reduce of the
weighted partial sums (every vector with its rule: sums for v, alpha, BatchNorm statistics and control variates, max
for integer buffers), then the server step on every actor. The driver receives each actor's step statistics and,
from the lowest rank only, the round's reduced sums, which it folds once (its reducer then computes the state every
actor already holds, bit for bit). The driver sends the global state only when the actors' copy is not the one it
holds (the first round, a new stage, a rebuilt group, a resume;
:func:`~fdam_ray.executors.ray.transports.collective_messages.state_key`), so a round moves one state up and none
down instead of K up and K down.

Runs of rounds (``collective_rounds`` > 1, the default): the federation hands the transport the rounds up to the
next point where it needs the global state (an evaluation, a checkpoint, a stage end, the last round; at most
``collective_rounds``), and one call per actor runs them all back to back (:meth:`run_rounds`): no Ray call, no sum
to the driver and no fold there between them. The driver receives each round's step statistics at once, and the
state after the run from the lowest rank when it reads it (:mod:`.pending`; after a run that ends where the driver
reads it, pulled while the next run's rounds run). What the loop does on the driver every round, the members do:
each checks its slice of every new state for NaN or infinity (a non-finite update or state stops the run at once, on
every member, with the driver's error for that round), and with ``reference_point: average`` each sums its slice of
every new v in float64 for the stage's running sum. A run that an actor's failure breaks does not count: the live
actors put their clients back to their states before it, the failure policy runs, and its rounds run again one at a
time (recovered as in the run's first round).

Sampled-out actors are in the group and contribute zeros: the group is the fleet's actors, not the round's (a
rendezvous costs far more than an all-reduce of zeros, and every actor then holds the new state). Hosted clients
(``clients_per_actor`` > 1) are folded into their actor's partial sum first. With ``round_deadline`` the members cut
their own late local steps in each run of rounds (:mod:`.collective_deadline`), and under backend ``hier`` a node
whose link is slow sits out of the leaders' exchange while it stays slow (:mod:`.collective_links`).

Backend ``shm`` sums in rank order, the driver's order of folding the actors' sums, so a run equals a classic
``fold_order: client`` run bit for bit; backend ``hier`` sums each node's actors in rank order, then the nodes in
node order, so a run equals a classic ``reduce: node, fold_order: client`` run bit for bit (and, with
``transfer_precision`` bf16/fp16, rounds what crosses between nodes, :mod:`.hierarchy`); gloo and NCCL sum in their
own order (equal to float32 rounding, about 1e-7 relative). ``reduce: node`` is refused: the actors reduce among
themselves, so there is nothing left for a node's reducer to fold.

Failures. Every wait is bounded by ``ray_timeout_s``: the driver's wait for a round, and every collective call
inside the group (the group's timeout). An actor whose client raised flags it in the first (small) all-reduce, so
every member stops before the large one and the group stays sound; an actor that dies breaks its peers' all-reduce
at once (gloo sees the connection close; a shared-memory wait looks at the peers' processes every 50 ms), and they
return. An actor that does not answer in time is told from the peers it blocks by the group's store, where each
member checks in before its all-reduce: the late one is ended (which releases the others) and counts as failed.
Then, as under the other transports, the failure policy (``on_client_failure``) applies to the failed actors, the
group is built again over the actors now live, and the round is finished: the actors whose local round is done
all-reduce the partial sums they kept, the replacements run theirs first, and the state is sent again.
"""

from __future__ import annotations

import datetime
import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import ray

from fdam_ray.algorithms.server import ServerStep
from fdam_ray.core.state import ClientInfo, GlobalState, RoundPlan
from fdam_ray.executors.base import RoundsRun
from fdam_ray.executors.errors import ClientError
from fdam_ray.executors.ray import compat
from fdam_ray.executors.ray.transports.base import Round, Transport
from fdam_ray.executors.ray.transports.collective_backend import choose_backend, store_host
from fdam_ray.executors.ray.transports.collective_deadline import DeadlineSpec
from fdam_ray.executors.ray.transports.collective_links import note_sitting
from fdam_ray.executors.ray.transports.collective_messages import RoundShare, RunShare, member_works
from fdam_ray.executors.ray.transports.hierarchy import BACKEND as HIERARCHICAL
from fdam_ray.executors.ray.transports.hierarchy import spec as hierarchical_spec
from fdam_ray.executors.ray.transports.pending import PendingState, held_by, key_of
from fdam_ray.features.capabilities import CAPABILITIES

if TYPE_CHECKING:
    from fdam_ray.algorithms import Algorithm
    from fdam_ray.executors.deadlines import Deadline

log = logging.getLogger(__name__)

JOIN_TIMEOUT_S = 120.0  # at most this (and ray_timeout_s) for the members to meet when a group is built
BUILD_TRIES = 3  # builds of one group that fail with every member alive before the run stops
BROKEN_GRACE_S = 30.0  # after a member failed or the all-reduce broke, the longest wait for the other members

_FAILURES = (ray.exceptions.RayError, ClientError)


class CollectiveTransport(Transport):
    """The actors all-reduce their partial sums and apply the server step; one call per actor per round, or per
    run of rounds.

    Attributes:
        builds: groups built (the first, and one per change of the set of actors or broken round).
        rounds_sent: rounds (or runs of rounds) that sent the global state to the actors (the others used the
            actors' copy).
        runs: the rounds of each run of rounds (``collective_rounds``), in order.
        backend: the group's backend (``shm``, ``hier``, ``gloo`` or ``nccl``; '' before the first build).
        transfer: ``(transfer_precision, error_feedback)``: what the nodes' leaders send each other under backend
            ``hier`` (set by the executor; the other backends sum float32).
    """

    capabilities = CAPABILITIES["collective", "star"]

    def __init__(self, fleet, config) -> None:
        super().__init__(fleet, config)
        self.key: tuple = ()
        self.held_key: tuple | None = None
        self.builds = 0
        self.rounds_sent = 0
        self.runs: list[list[int]] = []  # the rounds of each run of rounds (one call per actor for all of them)
        self.backend = ""
        self.transfer: tuple[str, bool] = ("fp32", False)
        self.step: ServerStep | None = None
        self.total_weight = 0.0
        self.deadline: DeadlineSpec | None = None  # round_deadline, kept by the members (takes_deadline)
        self.behind: set[int] = set()  # members whose node sat out a round since they were last sent the state
        self.rejoin: set[int] = set()  # those of them whose link a probe found fast again
        self._store: Any = None
        self._tries = 0

    def started(self, algorithm: Algorithm, infos: list[ClientInfo]) -> None:
        """The server step the actors apply (:meth:`~fdam_ray.algorithms.base.Algorithm.server_step`), and the
        clients' total weight (the denominator of a sampled round's control variate). An algorithm with a reducer
        of its own keeps the server step on the driver: the state is then sent every round."""
        weights = algorithm.weights([i.num_train for i in infos])
        self.total_weight = float(len(infos) if weights is None else weights.sum())
        self.step = algorithm.server_step()

    # -- a round ---------------------------------------------------------------------------
    def takes_deadline(self, deadline: Deadline) -> bool:
        """Yes: the members cut their late local steps in each run of rounds (:mod:`.collective_deadline`); an
        algorithm whose server step runs on the driver (the members then run one round a call) is refused."""
        if self.step is None:
            raise ValueError("config field 'round_deadline': null with transport=collective for this algorithm (its "
                             "server step runs on the driver, so no member is left out); use transport=classic")
        self.deadline = DeadlineSpec.of(deadline, self.total_weight)
        return True

    def rounds_ahead(self) -> int:
        """``collective_rounds`` when the actors apply the server step, else 1."""
        return self.config.collective_rounds if self.step is not None else 1

    def run_round(self, round: Round) -> None:
        fleet = self.fleet
        kept: set[int] = set()  # actors whose local round is done, its partial sum kept on the actor
        attempts: dict[int, int] = {}
        for _ in range(BUILD_TRIES * (1 + self.config.max_client_retries) * max(1, len(fleet.actors))):
            self._ensure_group(attempts)
            members = sorted(fleet.actors)
            send = self.held_key is None or self.held_key != key_of(round.state, round.plan.stage) or self.behind
            shares, failed = self._attempt(round, members, kept, bool(send))
            if not failed and all(not shares[a].broken for a in members):
                self._fold(round, members, shares)
                return
            kept = {a for a in shares if a not in failed}
            self._forget()
            for a, exc in sorted(failed.items()):
                attempts.setdefault(a, 0)
                fleet.failed(a, "local_round", exc, attempts)  # raises when the policy stops the run
        raise RuntimeError(f"round {round.plan.round}: the collective all-reduce kept breaking, every actor alive")

    # -- a run of rounds -------------------------------------------------------------------
    def run_rounds(self, state: GlobalState, plans: Sequence[RoundPlan], chosen: Sequence[set[int]],
                   average: bool, *, read: bool = True) -> RoundsRun:
        """One call per actor for all of ``plans``: the actors run them back to back
        (:meth:`~.collective_actor.CollectiveActor.collective_rounds`); the driver receives each round's step
        statistics and the state after the run (:meth:`_run_result`).

        A run in which an actor fails does not count: the live actors put their clients back to their states
        before it (:meth:`~.collective_actor.CollectiveActor.undo_run`), the failure policy runs for the failed
        actors, and the run's rounds are left to :meth:`run_round`, one at a time (a failure inside a run is
        recovered as one in its first round would be under ``collective_rounds: 1``)."""
        attempts: dict[int, int] = {}
        members, token, state_ref, sent = self._start_run(state, plans, attempts)
        works = member_works(self.fleet, members, plans, chosen, self.total_weight)
        refs, helds = {}, {}  # each member's share; its state (from the holder alone), an object of its own
        for a in members:
            refs[a], helds[a] = self.fleet.actors[a].collective_rounds.options(num_returns=2).remote(
                state_ref if a in sent else None, works[a], token, average, self.deadline)
        runs, failed = self._collect_runs(refs, len(plans))
        alive = [a for a in members if a in runs and a not in failed]
        stops = {runs[a].stop for a in alive}
        if failed or not stops <= {"", "diverged", "stale"}:
            self._undo(token, alive, failed, attempts)
            return RoundsRun(stats=[], counts=[], bytes_up=[], state=None, stop="failed")
        shares = [runs[a] for a in members]
        holder = shares[0].holder  # the lowest rank whose node took part in the last round
        out = self._run_result(state, shares, average, helds[members[holder]], read)
        for plan, rnd in zip(plans, out.stats, strict=False):
            self.fleet.adopted(plan.round, [st.client_id for st in rnd])
        self._note_run(runs, members, sent, plans)
        if stops == {"diverged"}:  # the driver's check names the client; the round is not applied
            out.stop = "diverged"
            out.stats.append([st for share in shares for st in share.rounds[shares[0].done].stats])
        elif stops == {"stale"} or any(share.stale for share in shares):
            out.stop = "stale"
        return out

    def _note_run(self, runs: dict[int, RunShare], members: list[int], sent: set[int],
                  plans: Sequence[RoundPlan]) -> None:
        """After a run that counts: who is behind (:mod:`.collective_links`), and the state the others hold."""
        behind, self.behind = self.behind, {a for a in members if runs[a].behind}
        note_sitting(behind, self.behind, sent, self.fleet.hosted, [plan.round for plan in plans])
        self.rejoin = {a for a in members if runs[a].rejoin}
        keys = {runs[a].key for a in members if a not in self.behind}
        self.held_key = keys.pop() if len(keys) == 1 else None

    def _start_run(self, state: GlobalState, plans: Sequence[RoundPlan], attempts: dict[int, int]
                   ) -> tuple[list[int], str, Any, set[int]]:
        """A run's start: the group (built when the actors changed), the state put in the object store when the
        members' copy is stale (to every member but those behind, :mod:`.collective_links`, which sit out), and
        for the members behind whose link is fast again (every member behind when the run has no deadline), the
        run's try named and its rounds recorded; the members in rank order, the try's token, the state's ref and
        the members sent it."""
        self._ensure_group(attempts)
        members = sorted(self.fleet.actors)
        send = self.held_key is None or self.held_key != key_of(state, plans[0].stage)
        if self.deadline is not None:  # the members behind sit out unless their link is fast again
            sent = (set(members) - self.behind if send else set()) | (self.rejoin & set(members))
        else:
            sent = set(members) if send else self.behind & set(members)
        state_ref = ray.put(state) if sent else None
        self.rounds_sent += send
        token = f"{plans[0].round}.{self._tries}"
        self._tries += 1
        self.runs.append([plan.round for plan in plans])
        return members, token, state_ref, sent

    def _run_result(self, state: GlobalState, shares: list[RunShare], average: bool, held: Any, read: bool
                    ) -> RoundsRun:
        """What a run that counts hands the loop, from the members' ``shares`` in rank order: each applied round's
        statistics (actor order), client counts and bytes, the state after the run (the lowest rank's object ``held``,
        read when used, :mod:`.pending`, pulled from now on if ``read``; at once after a run that stopped early)
        and, with ``average``, the float64 sum of v over the applied rounds."""
        first = shares[shares[0].holder]  # the member that returned the state
        applied = first.done
        after: GlobalState | None = None
        if applied:
            after = (PendingState.waiting(held, first.key, held_by(self.fleet), state.nbytes, pull=read)
                     if first.key is not None else ray.get(held, timeout=self.fleet.timeout))
        out = RoundsRun(stats=[[st for share in shares for st in share.rounds[i].stats] for i in range(applied)],
                        counts=[r.count for r in first.rounds[:applied]],
                        bytes_up=[r.bytes_up for r in first.rounds[:applied]], state=after)
        if average and applied:
            assert after is not None
            shape = after.v.shape if first.key is None else first.key[3][0]  # v's, from the key: nothing read
            ref_sum = np.zeros(int(np.prod(shape)), dtype=np.float64)
            for share in shares:  # one slice a member; more where nodes sat out (:mod:`.collective_links`)
                for lo, hi, part in share.ref_sums:
                    ref_sum[lo:hi] += part
            out.ref_sum = ref_sum.reshape(shape)
        return out

    def _collect_runs(self, refs: dict[int, Any], rounds: int) -> tuple[dict[int, RunShare], dict[int, BaseException]]:
        """Every member's share of a run, or its failure: a member that has not answered ``ray_timeout_s``
        after another one did (the members end a run together), or :data:`BROKEN_GRACE_S` after another one's
        failure or broken all-reduce, is ended as late."""
        fleet = self.fleet
        deadline = time.monotonic() + fleet.timeout * (rounds + 1)
        fleet.in_flight = {ref: (a, deadline) for a, ref in refs.items()}
        runs: dict[int, RunShare] = {}
        failed: dict[int, BaseException] = {}
        try:
            for a in self._collect(refs, deadline, runs, failed, settle_s=fleet.timeout):
                failed[a] = fleet.late(a, "local_round")
                fleet.kill(a)  # ends its connections, which releases the members waiting for it
        finally:
            fleet.in_flight = {}
        for a, r in runs.items():
            if r.failure is not None:
                failed[a] = r.failure
        return runs, failed

    def _undo(self, token: str, alive: list[int], failed: dict[int, BaseException], attempts: dict[int, int]) -> None:
        """A run that does not count: the live actors undo it, the group is dropped, and the failure policy runs
        for the ``failed`` actors (it raises when it stops the run)."""
        fleet = self.fleet
        self._forget()
        refs = {a: fleet.actors[a].undo_run.remote(token) for a in alive if a in fleet.actors}
        for a, ref in refs.items():
            try:
                ray.get(ref, timeout=fleet.timeout)
            except _FAILURES as exc:
                failed[a] = exc
        for a, error in sorted(failed.items()):
            attempts.setdefault(a, 0)
            fleet.failed(a, "local_round", error, attempts)

    def _attempt(self, round: Round, members: list[int], kept: set[int], send: bool
                 ) -> tuple[dict[int, RoundShare], dict[int, BaseException]]:
        """One try of the round on the group: every member's share, and the members that failed."""
        fleet = self.fleet
        token = f"{round.plan.round}.{self._tries}"
        self._tries += 1
        state_ref = ray.put(round.state) if send else None
        self.rounds_sent += send
        partial_total = self.total_weight if round.plan.partial else None
        refs = {}
        for a in members:
            ids, adopt = round.work(a)
            refs[a] = fleet.actors[a].collective_round.remote(state_ref, round.plan, ids, adopt, a in kept,
                                                              partial_total, token)
        deadline = time.monotonic() + fleet.timeout
        fleet.in_flight = {ref: (a, deadline) for a, ref in refs.items()}
        shares: dict[int, RoundShare] = {}
        failed: dict[int, BaseException] = {}
        try:
            pending = self._collect(refs, deadline, shares, failed)
            if pending:
                arrived = self._arrived(token, members, pending)
                late = [a for a in pending if a not in arrived] or list(pending)
                for a in late:
                    failed[a] = fleet.late(a, "local_round")
                    fleet.kill(a)  # ends its connections, which releases the members waiting for it
                    del pending[a]
                for a in self._collect(pending, time.monotonic() + fleet.timeout, shares, failed):
                    failed[a] = fleet.late(a, "local_round")
                    fleet.kill(a)
        finally:
            fleet.in_flight = {}
        return shares, failed

    def _collect(self, refs: dict[int, Any], deadline: float, answers: dict[int, Any],
                 failed: dict[int, BaseException], settle_s: float | None = None) -> dict[int, Any]:
        """Fetch the answers that arrive before ``deadline`` (errors into ``failed``); those still pending. Once
        a member failed or its all-reduce broke, the others have :data:`BROKEN_GRACE_S` more (a member can hang
        ending a broken process group; it is then ended as late, not waited for until ``ray_timeout_s``), and
        with ``settle_s`` at most that long after any answer (the members of a run end it together)."""
        pending = dict(refs)
        while pending:
            done, _ = ray.wait(list(pending.values()), num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not done:
                break
            for a in [a for a, ref in pending.items() if ref in done]:
                try:
                    answers[a] = ray.get(pending.pop(a), timeout=self.fleet.timeout)
                except _FAILURES as exc:
                    failed[a] = exc
                if a in failed or _broken(answers.get(a)):
                    deadline = min(deadline, time.monotonic() + min(self.fleet.timeout, BROKEN_GRACE_S))
                elif settle_s is not None:
                    deadline = min(deadline, time.monotonic() + settle_s)
            if time.monotonic() >= deadline:
                break
        return pending

    def _arrived(self, token: str, members: list[int], pending: dict[int, Any]) -> set[int]:
        """The pending members that checked in for the all-reduce of try ``token`` (waiting for the others)."""
        if self._store is None:
            return set()
        out = set()
        for a in pending:
            try:
                if self._store.check([f"{token}/{members.index(a)}"]):
                    out.add(a)
            except Exception as exc:  # the store lives in the lowest rank: gone with it
                log.debug("the group's store did not answer: %s", exc)
                return set()
        return out

    def _fold(self, round: Round, members: list[int], shares: dict[int, RoundShare]) -> None:
        """Hand the round's reduced sums to the driver's fold once, with every client's statistics in actor
        order; remember which state the actors now hold."""
        total = shares[members[0]].total
        if total is None:
            raise RuntimeError("the lowest rank of the collective group returned no sums")
        total.stats = [s for a in members for s in shares[a].stats]
        keys = {shares[a].key for a in members}
        self.held_key, self.behind, self.rejoin = (keys.pop() if len(keys) == 1 else None), set(), set()
        self.fleet.folded(total, round.fold)

    # -- the group ---------------------------------------------------------------------------
    def _ensure_group(self, attempts: dict[int, int]) -> None:
        """A group over exactly the fleet's live actors (built again when they changed); members that die while
        it is built go through the failure policy."""
        fleet = self.fleet
        for _ in range(BUILD_TRIES):
            key = tuple((a, compat.actor_id(fleet.actors[a])) for a in sorted(fleet.actors))
            if key == self.key:
                return
            self._forget()
            failed = self._build(sorted(fleet.actors))
            if not failed:
                self.key = key
                return
            for a, exc in sorted(failed.items()):
                if isinstance(exc, ray.exceptions.RayActorError):
                    attempts.setdefault(a, 0)
                    fleet.failed(a, "local_round", exc, attempts)
        raise RuntimeError(f"the collective group of actors {', '.join(map(str, sorted(fleet.actors)))} could "
                           f"not be formed in {BUILD_TRIES} tries (ray_timeout_s={fleet.timeout:g})")

    def _build(self, members: list[int]) -> dict[int, BaseException]:
        """Build the group over ``members`` (rank = position); the members that failed to join."""
        import torch.distributed as dist

        fleet = self.fleet
        host, backend = self._host(members), self._backend(members)
        wait_s = min(fleet.timeout, JOIN_TIMEOUT_S)
        try:
            port = ray.get(fleet.actors[members[0]].open_group.remote(host, wait_s), timeout=fleet.timeout)
        except _FAILURES as exc:
            return {members[0]: exc}
        named = hierarchical_spec(*self.transfer) if backend == HIERARCHICAL else backend
        refs = {a: fleet.actors[a].join_group.remote(host, port, rank, len(members), named, fleet.timeout,
                                                      self.step) for rank, a in enumerate(members)}
        shares: dict[int, Any] = {}
        failed: dict[int, BaseException] = {}
        for a in self._collect(refs, time.monotonic() + wait_s + 5.0, shares, failed):
            failed[a] = fleet.late(a, "local_round")
        if failed:
            return failed
        self._store = dist.TCPStore(host, port, None, False, timeout=datetime.timedelta(seconds=wait_s))
        self.backend = backend
        self.builds += 1
        log.debug("collective group %d over actors %s (%s, store %s:%d)", self.builds,
                  ", ".join(map(str, members)), backend, host, port)
        return {}

    def takes_transfer(self, precision: str, error_feedback: bool) -> bool:
        """Yes: the members hold the exact state (nothing rounded going down); the nodes' leaders round what
        they send each other (:mod:`.hierarchy`)."""
        self.transfer = (precision, error_feedback)
        return True

    def _backend(self, members: list[int]) -> str:
        return choose_backend([self.fleet.where_of.get(a, {}) for a in members], self.config.collective_backend)

    def _host(self, members: list[int]) -> str:
        return store_host([self.fleet.where_of.get(a, {}) for a in members])

    def _forget(self) -> None:
        """Drop the group on the driver's side (the members leave it when they join the next one, or end)."""
        self.key, self.held_key, self._store, self.behind, self.rejoin = (), None, None, set(), set()

    def close(self, end_actors) -> None:
        end_actors()
        self._forget()


def _broken(answer: Any) -> bool:
    """Whether a member's answer says the group broke: a round's all-reduce broke, or a run stopped because it
    broke or a member failed (a join answers None)."""
    if isinstance(answer, RoundShare):
        return bool(answer.broken)
    return isinstance(answer, RunShare) and answer.stop in ("broken", "failed")
