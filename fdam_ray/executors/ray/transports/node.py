"""``transport: classic, reduce: node``: the partial sums of the actors on one node are folded on that node.

Each node with several actors of the round gets a :class:`NodeReducer` (an
actor pinned to the node, no CPU reserved) that fetches its actors' partial
sums there (node-local reads) and folds them into one; the driver folds one
partial sum per node as each arrives (an actor alone on its node, or on a
node known to be lost, is folded directly). A reducer that fails (its node
lost, or killed) is never reused: its actors' sums are fetched by the driver.
Failed actors are replaced and their calls re-run after the round
(:meth:`~fdam_ray.executors.ray.transports.base.Transport.recover`).

With a round deadline (:mod:`fdam_ray.executors.deadlines`) the driver first waits for
the actors' calls until the deadline, then has the nodes merge those that
ended in time (a merge then starts once the deadline is known, not while the
node's last client still steps).
"""

from __future__ import annotations

import logging
import pickle
import time
from collections.abc import Callable, Iterator
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from fdam_ray.algorithms.server import PartialSum
from fdam_ray.executors.errors import ClientError
from fdam_ray.executors.ray.transports.base import Round, Transport
from fdam_ray.executors.ray_section import RayExecutorSection
from fdam_ray.executors.transfer import CompressedSum, compress_differences, differences
from fdam_ray.features.capabilities import CAPABILITIES

log = logging.getLogger(__name__)


class NodeReducer:
    """Folds the partial sums of the actors on one node into one, on that node (``reduce: node``).

    It receives the actors' result refs inside a list, so it fetches them
    itself (node-local reads) and folds each as it arrives (in actor order with
    ``ordered``), the first two in one pass into float32 sums it keeps from
    round to round, so a round neither allocates a state nor copies one before
    adding it. An actor that failed is reported back by index with its error,
    and the driver replaces it and folds its re-run directly.
    """

    def __init__(self, on_start: Callable[[], Any] | None = None) -> None:
        self._kept: PartialSum | None = None
        if on_start is not None:  # transport=compiled: how its graph thread waits on channels (channel_wait)
            on_start()

    def merge(self, refs: list, actors: list[int], ordered: bool = False
              ) -> tuple[PartialSum | CompressedSum | None, list[tuple[int, BaseException]]]:
        held: PartialSum | None = None  # the first part to arrive, a read-only view until a second one comes
        total: PartialSum | None = None
        failed: list[tuple[int, BaseException]] = []
        rounded: str | None = None  # transfer_precision of sums sent as rounded differences
        for a, ref in _arrivals(dict(zip(refs, actors, strict=True)), ordered):
            try:
                part = ray.get(ref)
            except Exception as exc:  # the driver applies the failure policy
                failed.append((a, _portable(exc)))
                continue
            if isinstance(part, CompressedSum):  # differences add up like the sums they stand for
                rounded, part = part.precision, differences(part)
            held, total = self._fold_in(held, total, part)
            del part
        merged = held if total is None else total
        if rounded is not None and merged is not None:  # rounded once more for the trip to the driver
            return compress_differences(merged, rounded), failed
        return merged, failed

    def merge_parts(self, *parts: PartialSum | None) -> PartialSum | None:
        """Under ``transport: compiled``: the outputs of the node's actors in the round's graph, in actor order
        (None from an actor without clients this round), folded as :meth:`merge` folds them in actor order; one
        part alone is passed on as it came. Runs on the reducer's own thread, never behind a client's step."""
        held: PartialSum | None = None
        total: PartialSum | None = None
        for part in parts:
            if part is not None:
                held, total = self._fold_in(held, total, part)
        return held if total is None else total

    def ready(self) -> bool:
        """Answers while the reducer lives (the driver asks after a compiled round broke)."""
        return True

    def _fold_in(self, held: PartialSum | None, total: PartialSum | None, part: PartialSum
                 ) -> tuple[PartialSum | None, PartialSum | None]:
        """``(held, total)`` after adding ``part``: the first part is held as it is, the second makes the sum."""
        if total is None and held is None:
            return part, None
        if total is None and held is not None:
            return None, self._sum_of(held, part)
        assert total is not None
        total.merge(part)
        return held, total

    def _sum_of(self, first: PartialSum, second: PartialSum) -> PartialSum:
        """``first + second`` written into the sums kept on this reducer (made again only when shapes change)."""
        self._kept = PartialSum.sum_of(first, second, into=self._kept)
        return self._kept


def _arrivals(pending: dict, ordered: bool, timeout: float | None = None) -> Iterator[tuple[Any, Any]]:
    """``(value, ref)`` for each ref of ``pending`` (ref -> value) as it is ready, or in the dict's order with
    ``ordered``; stops early (leaving the rest in ``pending``) when none is ready within ``timeout`` s."""
    pending_refs = list(pending)
    while pending_refs:
        if ordered:
            ref = pending_refs[0]
            ready, _ = ray.wait([ref], timeout=timeout)
        else:
            ready, _ = ray.wait(pending_refs, num_returns=1, timeout=timeout)
        if not ready:
            return
        for ref in ready:
            pending_refs.remove(ref)
            yield pending.pop(ref), ref


def _portable(exc: BaseException) -> BaseException:
    """An error that pickles back to the driver: a client's own error, else the Ray error, else its text."""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, ClientError):
        return cause
    try:
        pickle.dumps(exc)
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}")
    return exc


_RemoteReducer = ray.remote(NodeReducer)


def start_reducer(node: str, on_start: Callable[[], Any] | None = None) -> Any:
    """A :class:`NodeReducer` actor pinned to ``node``, with no CPU reserved (its merges take no client's
    slot and never wait behind a client's step); ``on_start`` (picklable) runs in the reducer's process as it
    starts (the compiled transport makes its channel reads sleep there, as the actors' do)."""
    return _RemoteReducer.options(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(
        node, soft=False)).remote(on_start)


def end_reducer(node: str, reducer: Any) -> None:
    """Kill ``reducer`` (the reducer of ``node``; None: nothing to end)."""
    if reducer is not None:
        try:
            ray.kill(reducer, no_restart=True)
        except Exception as exc:  # already gone with its node
            log.debug("kill of the reducer of node %s: %s", node, exc)

_FAILURES = (ray.exceptions.RayError, ClientError)


class NodeTransport(Transport):
    """Classic calls; the actors of a node merged there by its :class:`NodeReducer`, one sum per node to the
    driver (in arrival order, or in node and actor order with ``fold_order: client``)."""

    capabilities = CAPABILITIES["classic", "node"]

    def __init__(self, fleet, config: RayExecutorSection) -> None:
        super().__init__(fleet, config)
        self.reducers: dict[str, Any] = {}
        fleet.on_node_lost.append(self.drop_reducer)

    def run_round(self, round: Round) -> None:
        fleet = self.fleet
        started = time.monotonic()
        refs = {a: round.call(a, fleet.actors[a]) for a in sorted(round.targets)}
        if round.deadline is not None:  # the nodes merge what made the deadline, once it is known
            fleet.in_flight = dict.fromkeys(refs.values(), (0, 0.0))
            refs = {a: refs[a] for a in sorted(self.gather(round, refs, started))}
        waiting = self._merges(refs)  # a merge (node, its actors) or an actor's sum (None, [a])
        fleet.in_flight = dict.fromkeys([*refs.values(), *waiting], (0, 0.0))
        failed: dict[int, BaseException] = {}
        for (node, actors), ref in _arrivals(waiting, self.config.fold_order == "client", timeout=fleet.timeout):
            self._fold_arrival(node, actors, ref, refs, round.fold, failed)
        for _, actors in waiting.values():  # no answer within ray_timeout_s
            for a in actors:
                failed[a] = fleet.late(a, "local_round")
        fleet.in_flight = {}
        self.recover(round, failed)

    def _merges(self, refs: dict[int, Any]) -> dict[Any, tuple[str | None, list[int]]]:
        """Per node with several actors of the round, its reducer's merge of their sums (ref -> (node, its
        actors)); an actor alone on its node, or on a node known to be lost, goes straight to the driver."""
        lost = {e["node_id"] for e in self.fleet.lost_nodes}
        by_node: dict[Any, list[int]] = {}
        for a in refs:
            by_node.setdefault(self.fleet.where_of.get(a, {}).get("node_id"), []).append(a)
        waiting: dict[Any, tuple[str | None, list[int]]] = {}
        for node, actors in by_node.items():
            if node is None or node in lost or len(actors) == 1:
                waiting.update({refs[a]: (None, [a]) for a in actors})
            else:
                merged = self._reducer(node).merge.remote([refs[a] for a in actors], actors,
                                                          self.config.fold_order == "client")
                waiting[merged] = (node, actors)
        return waiting

    def _fold_arrival(self, node: str | None, actors: list[int], ref: Any, refs: dict[int, Any],
                      fold: Callable[[PartialSum], None], failed: dict[int, BaseException]) -> None:
        """Fold what arrived at ``ref``: an actor's sum (``node`` None) or a node's merge and its failures."""
        fleet = self.fleet
        try:
            got = ray.get(ref, timeout=fleet.timeout)
        except _FAILURES as exc:
            if node is None:
                failed[actors[0]] = exc
                return
            # the reducer is gone (with its node, or killed): never reused; its actors' sums are fetched here
            log.warning("the reducer of node %s failed in round %d (%s); folding its actors' sums directly",
                        node, fleet.round, type(exc).__name__)
            self.drop_reducer(node)
            for a in actors:
                try:
                    fleet.folded(ray.get(refs[a], timeout=fleet.timeout), fold)
                except _FAILURES as exc_a:
                    failed[a] = exc_a
            return
        if node is None:
            fleet.folded(got, fold)
            return
        partial, errors = got
        failed.update(errors)
        if partial is not None:
            fleet.folded(partial, fold)
        del partial, got

    def _reducer(self, node: str) -> Any:
        if node not in self.reducers:
            self.reducers[node] = start_reducer(node)
        return self.reducers[node]

    def drop_reducer(self, node: str) -> None:
        end_reducer(node, self.reducers.pop(node, None))

    def close(self, end_actors: Callable[[], None]) -> None:
        end_actors()
        for node in list(self.reducers):
            self.drop_reducer(node)
