"""``transport: compiled``: the round as one Ray Compiled Graph.

The graph is ``message -> every actor's compiled_round -> one output per
actor``, where ``message = (state, plan, calls)``: the global state, the
round's plan and, per actor, the clients it runs this round (client sampling
and stage changes are inputs, so they never recompile). Ray compiles it once
into pre-allocated shared-memory channels between the driver and the actors
(one input channel read by every actor on a node, one output channel per
actor), which removes the per-call launch and object-store work of classic
Ray calls. The channels are sized for the state at build time.

With ``reduce: node`` (:class:`CompiledNodeTransport`) the actors of a node
with several actors send their outputs, inside the graph, to a reducer actor
on that node, which folds them; the driver reads one sum per such node.

Waiting on a channel (``channel_wait``). Ray's channel reads poll: while a
graph waits for its next input, each actor's graph thread keeps a core busy,
and so does the driver while it waits for the outputs, so actors that share
cores slow down the ones still computing, and an idle graph (during scoring
or a checkpoint) burns a core per actor. With ``channel_wait: sleep`` (the
default) a read of the graph's channels, by an actor, a node reducer or the driver, polls
as Ray does for its first ``SPIN_S`` only (the gaps inside a loop of rounds
are shorter) and then sleeps between checks, with pauses that grow with the
time already waited (:func:`patient_read`): at most ``PAUSE_CAP_S`` while the
wait is short, at most ``PAUSE_OF_WAIT`` of the time waited after that, so a
long wait ends at most a few percent later than its data arrived and an idle
graph costs almost no CPU. With ``channel_wait: spin`` Ray's own polling is
left as it is; the executor then ends the graph before work that is not a
round (scoring, checkpoints) when such work last took several times longer
than a build. Either way the driver sleeps through half the shortest of the
last rounds before it reads a round's outputs.

The graph is built for one set of actor handles; :class:`CompiledRounds`
rebuilds it when that set changes (an actor replaced or ended). Compiled
tasks run on a background thread of each actor, so the classic calls the
executor makes between rounds (evaluation, checkpoints, set-up) run on the
actor's main thread while the graph waits for its next input: the driver
never overlaps the two.

When the graph breaks (an actor raised, died or did not answer), the round is
recovered from the actors themselves (:meth:`CompiledTransport.run_round`):
each is asked how its part ended; what finished is folded, the failure policy
applies to the rest, and their calls are re-run as classic calls. The graph
is rebuilt next round.
"""

from __future__ import annotations

import collections
import functools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import ray

from fdam_ray.executors.ray import compat
from fdam_ray.executors.ray.transports.base import Round, Transport
from fdam_ray.executors.ray.transports.node import end_reducer, start_reducer
from fdam_ray.executors.ray.transports.patience import patient_reads
from fdam_ray.features.capabilities import CAPABILITIES
from fdam_ray.features.interrupts import interruptible

log = logging.getLogger(__name__)

# Ray logs every compile and teardown, and a traceback for each actor that is already dead when a broken graph
# is torn down (from a monitor thread, at any time); the executor reports every failure it meets itself, once,
# with the client and the round.
logging.getLogger("ray.dag.compiled_dag_node").setLevel(logging.CRITICAL)

NAP_FRACTION = 0.5  # of the shortest of the last 8 rounds, slept before reading a round's outputs
REST_RATIO = 4.0  # channel_wait=spin: end the graph before work between rounds that last took this x a build
STUCK_AFTER_S = 10.0  # reduce=node: a teardown still waiting after this ends the node reducers
READY_TIMEOUT_S = 60.0  # reduce=node: longest wait for the reducers to answer after a broken round
_CHANNEL_SLACK = 1 << 20  # bytes beyond the state: plan, client lists, pickling headers, step statistics

def _sources(actors: dict[int, Any], merges: Sequence[tuple[Any, list[int]]]) -> list[tuple[Any, list[int]]]:
    """Where each of the graph's outputs comes from, in output order: ``(reducer, its actors)`` for a node's
    merge (at its first actor's position), ``(None, [actor])`` for an actor whose output is its own."""
    merged_by_first = {group[0]: (reducer, list(group)) for reducer, group in merges}
    merged = {a for _, group in merges for a in group}
    sources: list[tuple[Any, list[int]]] = []
    for a in sorted(actors):
        if a in merged_by_first:
            sources.append(merged_by_first[a])
        elif a not in merged:
            sources.append((None, [a]))
    return sources


def _outputs(message: Any, actors: dict[int, Any], sources: list[tuple[Any, list[int]]]) -> list[Any]:
    """The graph's outputs over ``message`` (:func:`_sources`): a reducer's merge of its actors' rounds, or an
    actor's round."""
    return [reducer.merge_parts.bind(*[actors[b].compiled_round.bind(message) for b in group])
            if reducer is not None else actors[group[0]].compiled_round.bind(message)
            for reducer, group in sources]


class CompiledRounds:
    """The compiled round graph of one federation: built on demand, rebuilt when the actors change."""

    def __init__(self, channel_wait: str = "sleep") -> None:
        self.channel_wait = channel_wait
        self.graph: Any = None
        self.key: tuple = ()
        self.builds = 0
        self.actor_sets = 0  # builds over a set of actors other than the previous build's (a replacement)
        self._last_key: tuple = ()
        self._recent: collections.deque[float] = collections.deque(maxlen=8)  # the last rounds' durations, s
        self.busy = False  # an execution was sent and its outputs not all read
        self.build_s = 0.0  # how long the last build took
        self.groups: list[list[int]] = []  # the actors behind each output of the graph, in output order
        self.on_stuck: Callable[[], None] | None = None  # ends what a teardown waits on forever (see teardown)

    def _key(self, actors: dict[int, Any], merges: Sequence[tuple[Any, list[int]]]) -> tuple:
        return (tuple((a, compat.actor_id(actors[a])) for a in sorted(actors)),
                tuple((compat.actor_id(reducer), tuple(group)) for reducer, group in merges))

    def ensure(self, actors: dict[int, Any], state_bytes: int, timeout_s: float,
               merges: Sequence[tuple[Any, list[int]]] = ()) -> None:
        """Have a graph over exactly ``actors`` (index -> handle), with channels for ``state_bytes``;
        ``timeout_s`` (``ray_timeout_s``) bounds the wait for a free input channel. ``merges`` (``reduce:
        node``): per node reducer, its handle and its node's actors (ascending): their outputs go to the
        reducer's :meth:`~fdam_ray.executors.ray.transports.node.NodeReducer.merge_parts`, whose one output
        takes the place of theirs (at its first actor's position)."""
        key = self._key(actors, merges)
        if self.graph is not None and key == self.key:
            return
        self.teardown()
        started = time.monotonic()
        sources = _sources(actors, merges)
        self.graph = compat.compile_graph(lambda message: _outputs(message, actors, sources),
                                          submit_timeout_s=timeout_s, buffer_bytes=int(state_bytes) + _CHANNEL_SLACK)
        self.groups = [group for _, group in sources]
        self.build_s = time.monotonic() - started
        self.key = key
        self.builds += 1
        self.actor_sets += key != self._last_key
        self._last_key = key
        if self.builds > 1:
            log.debug("the round's compiled graph was built again over actors %s",
                      ", ".join(str(a) for a, _ in key[0]))

    def run(self, message: tuple, timeout_s: float) -> list[Any]:
        """Execute one round; the outputs in actor order (partial sums, or None for actors without clients;
        a node's merged sum in place of its actors').

        Raises what Ray raises when an actor raised, died or did not answer within ``timeout_s``: the caller
        then tears the graph down and recovers the round from the actors (:meth:`ClientShell.round_status`).
        """
        self.busy = True
        started = time.monotonic()
        patient = patient_reads(self.channel_wait == "sleep")
        try:
            refs = self.graph.execute(message)
            if self._recent:
                # reading polls a core at first: sleep through half the shortest recent round, leaving that
                # core to the clients where they share the driver's cores
                time.sleep(NAP_FRACTION * min(self._recent))
            outputs = [ref.get(timeout=timeout_s) for ref in refs]
        finally:
            if patient:
                patient_reads(False)  # the driver's other compiled graphs, if any, read as Ray does
        self._recent.append(time.monotonic() - started)
        self.busy = False
        return outputs

    def rest(self, took_s: float) -> None:
        """Before work that is not a round (scoring, checkpoints) whose last run took ``took_s``: with
        ``channel_wait: spin``, end an idle graph when that work took more than ``REST_RATIO`` builds. Its
        waiting threads poll a core each, which slows long work, while for short work a rebuild costs more
        than the polling; the next round builds it again. Sleeping waits cost no core: the graph stays."""
        if (self.channel_wait == "spin" and self.graph is not None and not self.busy
                and took_s > REST_RATIO * self.build_s):
            self.teardown()

    def teardown(self) -> None:
        """End the graph (the actors stay alive and take classic calls and a new graph). Ray waits for the
        actors' loops to end; a stop signal ends that wait (:func:`fdam_ray.features.interrupts.interruptible`).

        With ``on_stuck`` set (``reduce: node``: it ends the node reducers, which the next graph starts again),
        a loop still running ``STUCK_AFTER_S`` after the teardown began is ended by it: a reducer's read of an
        actor's channel was seen to miss the close (large states, Ray 2.60) and Ray would wait for it forever.
        """
        graph, self.graph, self.key, self.busy = self.graph, None, (), False
        if graph is None:
            return
        ended: list[BaseException | None] = []

        def end() -> None:
            try:
                graph.teardown()
                ended.append(None)
            except Exception as exc:  # a graph broken by a dead actor may fail to end cleanly; it is gone anyway
                ended.append(exc)

        with interruptible():
            if self.on_stuck is None:
                end()
            else:
                waiter = threading.Thread(target=end, name="fdam-graph-teardown", daemon=True)
                waiter.start()
                waiter.join(STUCK_AFTER_S)
                if waiter.is_alive():
                    log.debug("the compiled graph's loops did not end within %.0f s; ending its reducers",
                              STUCK_AFTER_S)
                    self.on_stuck()
                    waiter.join()
        if ended and ended[0] is not None:
            log.debug("teardown of the compiled graph: %s", ended[0])



class CompiledTransport(Transport):
    """The round as one execution of the compiled graph, its outputs folded in actor order (so a compiled run
    equals a classic ``fold_order: client`` run bit for bit)."""

    capabilities = CAPABILITIES["compiled", "star"]

    def __init__(self, fleet, config) -> None:
        super().__init__(fleet, config)
        self.graph = CompiledRounds(config.channel_wait)

    def run_round(self, round: Round) -> None:
        started = time.monotonic()
        calls = {a: round.work(a) for a in round.targets}
        try:
            self.graph.ensure(self.fleet.actors, round.state.nbytes, self.fleet.timeout, self.merges())
            outputs = self.graph.run((round.state, round.plan, calls), self.fleet.timeout)
        except Exception as exc:  # Ray's task, channel and timeout errors: the actors say what happened
            log.debug("the compiled round %d broke: %s: %s", round.plan.round, type(exc).__name__, exc)
        else:
            for partial in self._in_fold_order(outputs, round.targets):
                self.fleet.folded(partial, round.fold)
            return
        self._recover_broken(round, sorted(calls), started)

    def _in_fold_order(self, outputs: list[Any], targets: list[int]) -> list[Any]:
        """The round's partial sums by the lowest target actor behind each: actor order, and with node merges
        the order a classic ``reduce: node, fold_order: client`` round folds its nodes' sums in."""
        chosen = set(targets)
        keyed = [(min(chosen.intersection(group), default=-1), i, out)
                 for i, (group, out) in enumerate(zip(self.graph.groups, outputs, strict=True)) if out is not None]
        return [out for *_, out in sorted(keyed, key=lambda k: k[:2])]

    def merges(self) -> list[tuple[Any, list[int]]]:
        """The node merges of the graph (none: every actor's sum goes to the driver)."""
        return []

    def _recover_broken(self, round: Round, targets: list[int], started: float) -> None:
        """Ask every actor of a broken compiled round how its part ended (a classic call, answered while the
        graph's thread still runs), waiting at most ``ray_timeout_s`` from the round's start for those still
        running; fold what finished, apply the failure policy to what raised, died or is late (ended first,
        so the graph can be torn down), and re-run the rest with classic calls. The graph is rebuilt next
        round."""
        status = self._statuses(round.plan.round, targets, started + self.fleet.timeout)
        failed: dict[int, BaseException] = {}
        again: list[int] = []
        for a in targets:
            what, value = status[a]
            if what == "running":
                failed[a] = self.fleet.late(a, "local_round")
                self.fleet.kill(a)  # before the teardown, which would otherwise wait for it
            elif what in ("failed", "dead"):
                failed[a] = value
            elif what == "not started":
                again.append(a)
        self.graph.teardown()
        for a in targets:
            what, partial = status[a]
            if what == "done" and partial is not None:
                self.fleet.folded(partial, round.fold)
        self.recover(round, failed, again)

    def _statuses(self, round_index: int, targets: list[int], deadline: float) -> dict[int, tuple[str, Any]]:
        """How each actor's part of round ``round_index`` ended (:meth:`ClientShell.round_status`, or
        ``("dead", error)``), asking again those still running until ``deadline``."""
        status: dict[int, tuple[str, Any]] = {}
        waiting = list(targets)
        while waiting:
            asked = {a: self.fleet.actors[a].round_status.remote(round_index) for a in waiting}
            waiting = []
            for a, ref in asked.items():
                try:
                    status[a] = ray.get(ref, timeout=max(1.0, deadline - time.monotonic()))
                except ray.exceptions.GetTimeoutError:
                    status[a] = ("running", None)
                except ray.exceptions.RayError as exc:
                    status[a] = ("dead", exc)
                    continue
                if status[a][0] == "running" and time.monotonic() < deadline:
                    waiting.append(a)
            if waiting:
                time.sleep(0.02)
        return status

    def rest(self, took_s: float) -> None:
        self.graph.rest(took_s)

    def close(self, end_actors) -> None:
        if not self.graph.busy:  # idle: its actors leave their loops at once
            self.graph.teardown()
        end_actors()
        self.graph.teardown()  # a round cut short: the actors it waited on are gone, so it ends at once


class CompiledNodeTransport(CompiledTransport):
    """``transport: compiled, reduce: node``: the actors of a node send their sums, inside the graph, to that
    node's reducer (:class:`~fdam_ray.executors.ray.transports.node.NodeReducer`, an actor pinned there with
    no CPU reserved, so its merge never waits behind a client's step), which folds them in actor order; one
    sum per node reaches the driver, folded in the order of a classic ``reduce: node, fold_order: client``
    round, so the two runs are equal bit for bit. An actor alone on its node, or on a node known to be lost,
    sends its own sum. A broken round is recovered from the actors as under ``reduce: star`` (what finished is
    folded per actor at the driver, as the classic node transport does when a reducer fails); a reducer that
    no longer answers then is dropped and, its node being alive, started again with the next graph."""

    capabilities = CAPABILITIES["compiled", "node"]

    def __init__(self, fleet, config) -> None:
        super().__init__(fleet, config)
        self.reducers: dict[str, Any] = {}
        fleet.on_node_lost.append(self.drop_reducer)
        self.graph.on_stuck = self.drop_reducers

    def drop_reducers(self) -> None:
        """End every node reducer (the next graph starts them again)."""
        for node in list(self.reducers):
            self.drop_reducer(node)

    def merges(self) -> list[tuple[Any, list[int]]]:
        lost = {e["node_id"] for e in self.fleet.lost_nodes}
        by_node: dict[str, list[int]] = {}
        for a in sorted(self.fleet.actors):
            node = self.fleet.where_of.get(a, {}).get("node_id")
            if node is not None and node not in lost:
                by_node.setdefault(node, []).append(a)
        out = []
        for node, group in by_node.items():
            if len(group) > 1:
                if node not in self.reducers:
                    patient = self.graph.channel_wait == "sleep"
                    self.reducers[node] = start_reducer(node, functools.partial(patient_reads, patient))
                out.append((self.reducers[node], group))
        return out

    def _recover_broken(self, round: Round, targets: list[int], started: float) -> None:
        asked = {node: reducer.ready.remote() for node, reducer in self.reducers.items()}
        deadline = time.monotonic() + min(self.fleet.timeout, READY_TIMEOUT_S)
        for node, ref in asked.items():
            try:
                ray.get(ref, timeout=max(1.0, deadline - time.monotonic()))
            except ray.exceptions.RayError as exc:
                log.warning("the reducer of node %s failed in round %d (%s); folding its actors' sums directly",
                            node, round.plan.round, type(exc).__name__)
                self.drop_reducer(node)
        super()._recover_broken(round, targets, started)

    def drop_reducer(self, node: str) -> None:
        end_reducer(node, self.reducers.pop(node, None))

    def close(self, end_actors) -> None:
        super().close(end_actors)
        self.drop_reducers()
